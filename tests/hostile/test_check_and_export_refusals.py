"""Refusals found by attacking the new commands: export must not overwrite the trace it reads, the dense check holds HF masks and layouts to their shape, check refuses a preemption of a sequence that never ran.

Each test once demonstrated one real bug (all fixed); the reference behaviour is the contract
in the module docstrings / docs pages named in each test (never infertrace's own output).
"""

from __future__ import annotations

import shutil

from typer.testing import CliRunner

from infertrace.cli.app import app
from tests.helpers import hostile as H


def invoke(*args, width=200):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": str(width)})


def _copy_golden(tmp_path, name="batching-paged"):
    d = tmp_path / name
    shutil.copytree(H.GOLDEN / name, d)
    return d


def test_export_given_trace_json_path_refuses_to_overwrite_the_trace_itself(tmp_path):
    """export DIR/trace.json -o DIR/trace.json --force replaces the saved trace (the inside-trace guard compares with the file, not its directory)."""
    d = _copy_golden(tmp_path)
    before = (d / "trace.json").read_bytes()
    res = invoke("export", d / "trace.json", "-o", d / "trace.json", "--force")
    assert res.exit_code == 2, res.output
    assert (d / "trace.json").read_bytes() == before


# ----------------------------------------------------------------------------- dense (--runtime hf) check holes

import copy  # noqa: E402

import pytest  # noqa: E402

from infertrace.engine.options import SamplingParams  # noqa: E402
from infertrace.trace.check import check_trace  # noqa: E402
from tests.helpers.runtime_drive import record  # noqa: E402


@pytest.fixture(scope="module")
def right_padded(smol, hf_smol):
    """Right padding, a 5- and a 1-token prompt: HF's full_attention mask is bool [2, 1, 5, 5] at the prefill."""
    ids = [smol.tokenizer.encode("The capital of France is"), smol.tokenizer.encode("Hi")[:1]]
    tr = record("hf", smol, ids, native={"padding": "right"}, model=hf_smol[1],
                params=[SamplingParams(max_new_tokens=2), SamplingParams(max_new_tokens=2)])
    d = tr.to_dict()
    v, _ = check_trace(copy.deepcopy(d))
    assert v is None, v.line()
    m = d["steps"][0]["hf"]["masks"]["full_attention"]
    assert m["shape"] == [2, 1, 5, 5] and m["rows"][0][4] == "11111"  # query 4 of row 0 sees keys 0..4 (hand-worked)
    return d


def test_dense_check_catches_a_mask_row_shorter_than_the_keys(right_padded):
    """check passes a dense mask row that lists fewer key columns than L (trace/check/dense.py _masks only checks the characters present)."""
    d = copy.deepcopy(right_padded)
    d["steps"][0]["hf"]["masks"]["full_attention"]["rows"][0][4] = "1"  # keys 1..4 of a real query silently gone
    v, _ = check_trace(d)
    assert v is not None and v.variable == "mask"


def test_dense_check_does_not_skip_a_small_mask_marked_truncated(right_padded):
    """A 5x5 mask marked truncated: true skips the pad-column rule entirely, so a query seeing a later column passes check."""
    d = copy.deepcopy(right_padded)
    m = d["steps"][0]["hf"]["masks"]["full_attention"]
    m["truncated"] = True  # the runtime sets it only when q > MAX_Q or kv > MAX_KV (runtimes/hf/record.py)
    m["rows"][0][2] = "11111"  # query 2 keeps keys 3 and 4: not causal
    v, _ = check_trace(d)
    assert v is not None and v.variable == "mask"


# ----------------------------------------------------------------------------- lanes / check: phantom preemption


def test_check_refuses_a_preemption_of_a_sequence_the_trace_never_ran():
    """check passes a step that preempts seq 77, which no request and no batch row ever names; show/export then draw a phantom 'preempted' lane (trace/check/checker.py step())."""
    d = copy.deepcopy(H.load("batching-paged"))
    known = {r["seq_id"] for r in d["requests"]} | {r["seq_id"] for st in d["steps"] for r in st["batch"]}
    assert 77 not in known
    v0, _ = check_trace(copy.deepcopy(d))
    assert v0 is None, v0.line()
    d["steps"][1]["preempted"] = [77]
    v, _ = check_trace(d)
    assert v is not None


def test_dense_layout_violation_names_the_ragged_attention_mask(right_padded):
    """A ragged attention_mask row is reported as "input_ids are [2, 5] but ... gives [B, T] = [2, 5]": a self-contradicting line that never names the mask (check/dense.py _layout)."""
    d = copy.deepcopy(right_padded)
    d["steps"][0]["hf"]["attention_mask"][1] = [1, 0]  # row 1 is 2 wide, T = 5
    v, _ = check_trace(d)
    assert v is not None and v.rule == "dense layout [B, T]"
    assert "attention_mask" in v.detail, v.detail


def test_report_title_shows_control_and_bidi_characters_of_the_model_file(tmp_path):
    """A model file name with ESC, BEL and U+202E (right-to-left override) reached the report's <title> and <h1> raw."""
    import json

    d = _copy_golden(tmp_path)
    m = json.loads((d / "trace.json").read_text())
    m["model"]["file"] = "evil\u202egguf.\x1b[31m\x07.gguf"
    (d / "trace.json").write_text(json.dumps(m))
    out = tmp_path / "r.html"
    res = invoke("report", d, "-o", out)
    assert res.exit_code == 0, res.output
    html = out.read_text(encoding="utf-8")
    head = html[html.index("<title>"):html.index("</h1>")]
    assert "\u202e" not in head and "\x1b" not in head and "\x07" not in head
    assert "\\u202e" in head


# ----------------------------------------------------------------------------- second breaker round: message hygiene

import json  # noqa: E402


def test_export_unknown_format_is_named_without_doubled_backslashes(tmp_path):
    """``--format 'a\\b'`` was echoed through repr(): the user saw ``'a\\\\b'``, a name they never typed."""
    res = invoke("export", _copy_golden(tmp_path), "--format", "a\\b")
    assert res.exit_code == 2
    assert "'a\\b'" in res.output and "\\\\" not in res.output, res.output


def test_export_clips_a_huge_output_path_in_its_messages(tmp_path):
    """A 5,000-character ``-o`` was echoed whole in the error line: messages name a path in at most 200 characters."""
    long = tmp_path / ("x" * 200) / ("y" * 200) / ("z" * 4600)
    res = invoke("export", _copy_golden(tmp_path), "-o", long)
    assert res.exit_code == 2
    line = res.output.strip().splitlines()
    assert len(line) == 1 and len(line[0]) < 400 and "…" in line[0], res.output


def test_export_says_when_the_time_axis_is_one_ms_per_step(tmp_path):
    """A trace saved without step times gets 1 ms per step (perfetto.py's rule); the user is told, not only otherData."""
    d = _copy_golden(tmp_path)
    (d / "timing.json").unlink(missing_ok=True)
    out = tmp_path / "out.json"
    res = invoke("export", d, "-o", out)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["otherData"]["time_axis"] == "step"
    assert "1 ms per step" in res.output


def test_duplicate_seq_ids_in_requests_are_refused(tmp_path):
    """Two requests with one seq_id made every per-request view pick one of them silently."""
    d = _copy_golden(tmp_path)
    m = json.loads((d / "trace.json").read_text())
    assert len(m["requests"]) >= 2
    m["requests"][1]["seq_id"] = m["requests"][0]["seq_id"]
    (d / "trace.json").write_text(json.dumps(m))
    res = invoke("show", d)
    assert res.exit_code == 2 and "appears twice" in res.output, res.output
    assert invoke("check", d).exit_code != 0


def test_floor_from_errors_name_the_option(tmp_path):
    """A broken C or D of ``--floor-from`` was reported as if A or B were broken."""
    d = _copy_golden(tmp_path, "worked-example-cells")
    res = invoke("bisect", d, d, "--floor-from", tmp_path / "missing", d)
    assert res.exit_code == 2
    assert res.output.startswith("error: --floor-from C D:"), res.output


@pytest.mark.parametrize("field, value", [
    ("tap_sources", ["not", "an", "object"]),
    ("tap_sources", {"attn_out": "x" * 5000}),
    ("tap_sources", {f"t{i}": "x" for i in range(100)}),
    ("teacher_force", {"trace": 5, "trace_sha256": "ab"}),
    ("teacher_force", {"trace": "d"}),
])
def test_new_option_fields_are_validated_by_the_loader(tmp_path, field, value):
    """options.tap_sources (saved tap -> one line, at most 64 keys of 400 characters) and options.teacher_force
    (the followed trace and its SHA-256) come from untrusted files: the wrong type or size is refused in one line."""
    d = _copy_golden(tmp_path)
    m = json.loads((d / "trace.json").read_text())
    m["options"][field] = value
    (d / "trace.json").write_text(json.dumps(m))
    res = invoke("show", d)
    assert res.exit_code == 2 and f"options.{field}" in res.output and res.output.count("\n") == 1, res.output


def test_bisect_prints_a_hostile_teacher_force_path_escaped(tmp_path, smol):
    """The followed trace's path is named in bisect's note: terminal-safe."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert invoke("run", "-p", "Hi", "-n", "1", "--save", a).exit_code == 0
    shutil.copytree(a, b)
    m = json.loads((b / "trace.json").read_text())
    m["options"]["teacher_force"] = {"trace": "\x1b]52;c;AAAA\x07evil", "trace_sha256": "0" * 64}
    (b / "trace.json").write_text(json.dumps(m))
    res = invoke("bisect", a, b)
    assert res.exit_code == 0, res.output
    assert "teacher-forced on another trace" in res.output and "evil" in res.output
    assert "\x1b" not in res.output and "\x07" not in res.output
