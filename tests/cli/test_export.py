"""``infertrace export DIR --format perfetto [-o FILE]`` as a command: the file it writes opens as trace-event
JSON, it never overwrites without ``--force``, never writes through a planted symlink, refuses bad input in one
line (exit 2), and imports no torch.

Reference: the golden batching trace (fixtures/golden/batching-paged, 3 requests, 8 steps, no timing.json):
its step records, read directly from trace.json, give each request's steps and token counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from infertrace.cli.app import app
from tests.helpers.trace_events import check_trace_events

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "fixtures" / "golden" / "batching-paged"


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_line(res, *needles):
    assert res.exit_code == 2, (res.exit_code, res.output[-800:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.stderr, res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_export_writes_one_track_per_request_with_the_trace_steps(tmp_path):
    out = tmp_path / "p.json"
    res = invoke("export", GOLDEN, "--format", "perfetto", "-o", out)
    assert res.exit_code == 0 and "ui.perfetto.dev" in res.output
    doc = json.loads(out.read_text())
    tracks = check_trace_events(doc)
    names = {e["args"]["name"]: e["tid"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    m = json.loads((GOLDEN / "trace.json").read_text())
    for r in m["requests"]:
        want = [(s["step"], b["T"], b["C"]) for s in m["steps"] for b in s["batch"] if b["seq_id"] == r["seq_id"]]
        got = [(e["args"]["step"], e["args"]["tokens"], e["args"]["num_computed_tokens"]) for _, _, e in tracks[names[f"seq {r['seq_id']}"]]]
        assert got == want
    assert doc["otherData"]["time_axis"] == "step"  # the golden trace keeps no timing.json
    assert [ts for ts, _, _ in tracks[names["steps (whole batch)"]]] == [1000.0 * s["step"] for s in m["steps"]]


def test_existing_output_needs_force_and_is_replaced_atomically(tmp_path):
    out = tmp_path / "p.json"
    out.write_text("keep me")
    one_line(invoke("export", GOLDEN, "-o", out), "exists", "--force")
    assert out.read_text() == "keep me"
    assert invoke("export", GOLDEN, "-o", out, "--force").exit_code == 0
    check_trace_events(json.loads(out.read_text()))
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temporary file left beside it


def test_a_planted_symlink_is_not_written_through(tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("precious")
    link = tmp_path / "p.json"
    link.symlink_to(target)
    one_line(invoke("export", GOLDEN, "-o", link), "exists")
    assert invoke("export", GOLDEN, "-o", link, "--force").exit_code == 0
    assert target.read_text() == "precious"  # the link was replaced, its target never written


def test_bad_input_is_one_line_exit_2(tmp_path):
    one_line(invoke("export", tmp_path / "nope", "-o", tmp_path / "x.json"), "does not exist")
    one_line(invoke("export", tmp_path, "-o", tmp_path / "x.json"), "no trace.json")
    one_line(invoke("export", GOLDEN, "--format", "chrome<script>", "-o", tmp_path / "x.json"), "--format", "perfetto")
    one_line(invoke("export", GOLDEN, "-o", tmp_path), "is a directory")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "trace.json").write_text('{"schema_version": 1, "steps": [')
    one_line(invoke("export", broken, "-o", tmp_path / "x.json"), "truncated JSON")
    assert not (tmp_path / "x.json").exists()


def test_output_inside_the_trace_directory_is_refused(tmp_path):
    import shutil

    d = tmp_path / "t"
    shutil.copytree(GOLDEN, d)
    one_line(invoke("export", d, "-o", d / "trace.json", "--force"), "inside the trace directory")
    assert json.loads((d / "trace.json").read_text())["schema_version"] == 2


def test_export_imports_no_torch(tmp_path):
    code = "import sys\nfrom infertrace.cli.app import main\ntry:\n    main()\nfinally:\n    print('torch' in sys.modules, file=sys.stderr)\n"
    p = subprocess.run([sys.executable, "-c", code, "export", str(GOLDEN), "-o", str(tmp_path / "p.json")], cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-1500:]
    assert p.stderr.strip().splitlines()[-1] == "False"
