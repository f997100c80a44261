"""Hostile traces and model files (issue 13; cases X1, X2, L1 of ../shared/cases.md).

X1: every string and number field of a golden trace.json replaced by a script payload:
``report`` refuses (exit 2, one line) or writes a page with no event handler, no extra script,
no loader element (parsed here, always) and, in headless Chromium (when installed), no script
of the payload runs. X2: the same with terminal control sequences: ``show``/``diff``/``dump-kv``
print no ESC/BEL/C1/bidi character and no Rich markup is interpreted; a GGUF whose
``general.name`` holds OSC 52 and a screen clear prints them escaped in ``inspect``.
Plus the trace boundary (deep nesting, long integers, FIFO, /dev/zero, safetensors header
mismatches, crafted sizes that would hang) and exclusive, atomic writes (two saves into one
directory, a planted symlink, the trace's own file by inode).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.helpers import hostile as H
from infertrace.cli.app import app
from infertrace.present.report_assets import BODY_JS, HEAD_JS

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_line_or_ok(res, ok=(0,)):
    """Exit in ``ok`` with no error text, or exit 2 with exactly one ``error:`` line; never a traceback."""
    assert res.exit_code in (*ok, 2), (res.exit_code, res.stderr[-800:], res.exception)
    if res.exit_code == 2:
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "internal error" not in lines[0], res.stderr
    assert "Traceback" not in res.stderr
    return res.exit_code


# ----------------------------------------------------------------------------- X1: HTML


def check_inert(html: str) -> None:
    a = H.active_content(html)
    assert not a.handlers, a.handlers[:3]
    assert not a.loaders, a.loaders[:3]
    assert [s.strip() for s in a.scripts] == [HEAD_JS.strip(), BODY_JS.strip()], [s[:80] for s in a.scripts]
    assert "data-xss" not in html  # the attribute name is only assembled by a running payload


@pytest.mark.parametrize("name", ["worked-example-cells", "batching-paged"])
def test_report_of_hostile_trace_is_inert_or_refused(tmp_path, name):
    outcomes = {0: 0, 2: 0}
    for i, (label, d) in enumerate(H.variants(name, H.HTML_PAYLOAD, H.ATTR_PAYLOAD)):
        t = H.write_trace(d, tmp_path / f"t{i}")
        out = tmp_path / f"r{i}.html"
        code = one_line_or_ok(invoke("report", t, "-o", out))
        outcomes[code] += 1
        if code == 0:
            check_inert(out.read_text(encoding="utf-8"))
            out.unlink()
        shutil.rmtree(t)
    # both outcomes happen: numbers turned into strings are refused, free-text strings render inertly
    assert outcomes[0] > 20 and outcomes[2] > 20, outcomes


def _all_strings_hostile(name: str, tmp_path: Path) -> Path:
    """One trace with every string field that the schema lets be free text set to the payload."""
    d = H.load(name)
    for pat, kind in H.patterns(d):
        if kind != "str":
            continue
        trial = H.replace_all(d, pat, lambda _v: H.HTML_PAYLOAD)
        t = H.write_trace(trial, tmp_path / "trial")
        if invoke("report", t, "-o", tmp_path / "trial.html", "--force").exit_code == 0:
            d = trial  # accepted: keep it, so the final trace carries every accepted payload at once
    out = H.write_trace(d, tmp_path / "all")
    return out


def test_check_inert_catches_live_markup():
    """The non-browser check is not vacuous: an unescaped payload is caught."""
    page = f"<html><head><script>{HEAD_JS}</script></head><body><p>{H.HTML_PAYLOAD}</p><script>{BODY_JS}</script></body></html>"
    with pytest.raises(AssertionError):
        check_inert(page)


def chromium_dom(tmp_path: Path, page: Path) -> str:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
           "--virtual-time-budget=3000", "--dump-dom", page.as_uri()]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-1500:]
    return res.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not on PATH (apt-get install -y chromium); the HTML parse checks above still run")
@pytest.mark.parametrize("name", ["worked-example-cells", "batching-paged"])
def test_no_payload_script_runs_in_chromium(tmp_path, name):
    t = _all_strings_hostile(name, tmp_path)
    page = tmp_path / "page.html"
    assert invoke("report", t, "-o", page).exit_code == 0
    html = page.read_text(encoding="utf-8")
    assert html.count(H.HTML_PAYLOAD[:20].replace('"', "&#34;").replace("'", "&#39;").replace(">", "&gt;").replace("<", "&lt;")) > 10
    check_inert(html)
    dom = chromium_dom(tmp_path, page)
    assert 'data-report="infertrace"' in dom and 'data-state="ok"' in dom, dom[-1500:]
    assert 'data-xss="1"' not in dom
    # positive control: the same payload unescaped does run in this browser
    live = tmp_path / "live.html"
    live.write_text(f"<html><body><p>{H.HTML_PAYLOAD}</p></body></html>", encoding="utf-8")
    assert 'data-xss="1"' in chromium_dom(tmp_path, live)


# ----------------------------------------------------------------------------- X2: terminal


def no_control(text: str) -> None:
    bad = H.BAD_TERMINAL.search(text)
    assert bad is None, repr(text[max(0, bad.start() - 60): bad.start() + 20])


def test_show_diff_dump_kv_of_hostile_trace_print_no_control_bytes(tmp_path):
    name = "worked-example-cells"
    ref = H.GOLDEN / name
    seen = {"show": {0: 0, 2: 0}, "markup_literal": 0}
    for i, (label, d) in enumerate(H.variants(name, H.TERM_PAYLOAD, H.TERM_PAYLOAD)):
        t = H.write_trace(d, tmp_path / f"t{i}")
        res = invoke("show", t)
        seen["show"][one_line_or_ok(res)] += 1
        no_control(res.stdout + res.stderr)
        if "[bold red]markup[/bold red]" in res.stdout:
            seen["markup_literal"] += 1
        if res.exit_code == 0:
            for args, ok in ((("diff", ref, t), (0, 1)), (("dump-kv", "--step", "1", t), (0,))):
                r = invoke(*args)
                one_line_or_ok(r, ok)
                no_control(r.stdout + r.stderr)
        shutil.rmtree(t)
    assert seen["show"][0] > 10 and seen["show"][2] > 10 and seen["markup_literal"] > 5, seen


def test_inspect_escapes_control_characters_from_gguf(tmp_path, monkeypatch):
    import gguf
    from tests.helpers import tiny

    evil = "evil\x1b]52;c;SGVsbG8=\x07\x1b[2J\x9b2J[bold]x[/bold]\u202e"

    class EvilWriter(gguf.GGUFWriter):
        def write_header_to_file(self, *a, **k):
            self.add_name(evil)
            self.add_string("general.description", evil)
            return super().write_header_to_file(*a, **k)

    monkeypatch.setattr(tiny.gguf, "GGUFWriter", EvilWriter)
    w, s = tiny.make_weights()
    path = tiny.write_gguf(tmp_path / "evil\x1b[2J.gguf", w, s)
    res = invoke("inspect", path)
    assert res.exit_code == 0, (res.stderr, res.exception)
    no_control(res.stdout + res.stderr)
    assert "\\x1b]52;c;SGVsbG8=\\x07" in res.stdout and "[bold]x[/bold]" in res.stdout
    res = invoke("inspect", path, "--json")  # JSON escapes control characters itself
    assert res.exit_code == 0
    no_control(res.stdout)
    assert json.loads(res.stdout)["name"] == evil


def test_error_lines_are_terminal_safe(tmp_path):
    d = H.load("worked-example-cells")
    d["steps"][0]["batch"][0]["\x1b]0;title\x07"] = 1
    t = H.write_trace(d, tmp_path / "t")
    res = invoke("show", t)
    one_line_or_ok(res)
    assert res.exit_code == 2 and "\\x1b]0;title\\x07" in res.stderr
    no_control(res.stderr)


# ----------------------------------------------------------------------------- the trace boundary


def _golden_copy(tmp_path: Path, name: str = "worked-example-cells") -> Path:
    t = tmp_path / "t"
    shutil.copytree(H.GOLDEN / name, t)
    return t


def _edit(t: Path, fn) -> Path:
    d = json.loads((t / "trace.json").read_text())
    fn(d)
    (t / "trace.json").write_text(json.dumps(d))
    return t


def _step(i):
    return lambda d: d["steps"][i]


BAD = {
    "deep nesting": (lambda t: (t / "trace.json").write_text('{"schema_version": 1, "model": ' + "[" * 100000 + "]" * 100000 + "}"),
                     "nested too deeply"),
    "long integer": (lambda t: (t / "trace.json").write_text('{"schema_version": ' + "9" * 5000 + "}"), "invalid JSON value"),
    "C huge": (lambda t: _edit(t, lambda d: d["steps"][1]["batch"][0].update(C=10 ** 12)), "outside"),
    "T inconsistent": (lambda t: _edit(t, lambda d: d["steps"][0]["batch"][0].update(T=10 ** 6)), "items but T"),
    "N inconsistent": (lambda t: _edit(t, lambda d: d["steps"][0].update(N=7)), "batch holds"),
    "positions not C..C+T-1": (lambda t: _edit(t, lambda d: d["steps"][1]["batch"][0].update(positions=[9])), "C..C+T-1"),
    "n_kv beyond size": (lambda t: _edit(t, lambda d: d["steps"][1]["kv"]["physical"].update(n_kv=10 ** 6)), "must not exceed size"),
    "ctx_size huge": (lambda t: _edit(t, lambda d: d["options"]["settings"].update(ctx_size=2 ** 40)), "MAX_CTX"),
    "range text huge": (lambda t: _edit(t, lambda d: d["steps"][1]["kv"]["per_request"][0].update(cells="0..999999999")),
                        "range text"),
    "string as step": (lambda t: _edit(t, lambda d: d["steps"][0].update(step='0" onmouseover="x')), "expected an integer"),
    "bool as int": (lambda t: _edit(t, lambda d: d["steps"][0]["batch"][0].update(C=True)), "expected an integer"),
    "list too long": (lambda t: _edit(t, lambda d: d["steps"][1]["batch"][0].update(token_ids=[0] * 5)), "items but T"),
    "steps out of order": (lambda t: _edit(t, lambda d: d["steps"][1].update(step=0)), "must increase"),
    "logical wrong shape": (lambda t: _edit(t, lambda d: d["steps"][1]["mask"].update(logical=[[[1]]])), "must be [T="),
    "physical_shape wrong rank": (lambda t: _edit(t, lambda d: d["steps"][1]["kv"].update(physical_shape=[2048, 3])),
                                  "does not match the cells storage"),  # found by tests/fuzz (dump-kv IndexError)
    "trace.json is a FIFO": (lambda t: ((t / "trace.json").unlink(), os.mkfifo(t / "trace.json")), "not a regular file"),
    "trace.json is /dev/zero": (lambda t: ((t / "trace.json").unlink(), os.symlink("/dev/zero", t / "trace.json")),
                                "not a regular file"),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("command", ["show", "report", "diff", "dump-kv"])
def test_bad_trace_is_one_line_exit_2_quickly(tmp_path, case, command):
    make, expect = BAD[case]
    t = _golden_copy(tmp_path)
    make(t)
    args = {"show": ["show", t], "report": ["report", t, "-o", tmp_path / "r.html"], "diff": ["diff", H.GOLDEN / "worked-example-cells", t],
            "dump-kv": ["dump-kv", "--step", "0", t]}[command]
    t0 = time.monotonic()
    res = invoke(*args)
    assert time.monotonic() - t0 < 10
    assert one_line_or_ok(res, ()) == 2
    assert expect in res.stderr, res.stderr


def test_fifo_as_trace_dir_argument_does_not_hang(tmp_path):
    fifo = tmp_path / "trace.json"
    os.mkfifo(fifo)
    res = invoke("show", fifo)
    assert res.exit_code == 2 and "not a regular file" in res.stderr


def _tensors_trace(tmp_path: Path) -> Path:
    """A keep-tensors trace made from a golden: one small tensor, indexed in trace.json."""
    import torch
    from safetensors.torch import save_file

    t = _golden_copy(tmp_path)
    save_file({"step0/hidden": torch.zeros(2, 3)}, t / "tensors.safetensors", metadata={"format": "pt"})
    _edit(t, lambda d: d.update(store={"keep": "tensors", "tensor_layers": [0],
                                       "tensors": {"step0/hidden": {"dtype": "float32", "shape": [2, 3]}}}))
    return t


def test_safetensors_header_must_agree_with_trace(tmp_path):
    t = _tensors_trace(tmp_path)
    assert invoke("show", t).exit_code == 0
    _edit(t, lambda d: d["store"]["tensors"]["step0/hidden"].update(shape=[3, 2]))
    res = invoke("show", t)
    assert res.exit_code == 2 and "do not belong together" in res.stderr
    _edit(t, lambda d: d["store"]["tensors"]["step0/hidden"].update(shape=[2, 3], dtype="int64"))
    assert "do not belong together" in invoke("show", t).stderr


@pytest.mark.parametrize("header, expect", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, "outside the file"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
     "overlap"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
     "overlap"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "bytes for shape"),
    ({"a": {"dtype": "XX", "shape": [2], "data_offsets": [0, 8]}}, "malformed"),
])
def test_crafted_safetensors_header(tmp_path, header, expect):
    from infertrace.errors import InfertraceError
    from infertrace.safe_io import safetensors_header

    raw = json.dumps(header).encode()
    p = tmp_path / "x.safetensors"
    p.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 8)
    with pytest.raises(InfertraceError, match=expect):
        safetensors_header(p)
    p.write_bytes((2 ** 62).to_bytes(8, "little") + raw)
    with pytest.raises(InfertraceError, match="runs past the file"):
        safetensors_header(p)


def test_report_of_huge_ctx_trace_stays_small(tmp_path):
    """A legal run with a huge context: the replayed views cost O(used), the page stays small."""
    t = _golden_copy(tmp_path, "batching-paged")
    _edit(t, lambda d: d["options"]["settings"].update(ctx_size=1 << 24, num_blocks=None))
    t0 = time.monotonic()
    res = invoke("report", t, "-o", tmp_path / "r.html")
    assert res.exit_code == 0, res.stderr
    assert time.monotonic() - t0 < 20 and (tmp_path / "r.html").stat().st_size < 400_000


# ----------------------------------------------------------------------------- L1: writes


def test_report_does_not_follow_planted_symlinks(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    t = _golden_copy(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "r.html").symlink_to(victim)
    res = invoke("report", t, "-o", out / "r.html")
    assert res.exit_code == 2 and "exists" in res.stderr and victim.read_text() == "precious"
    res = invoke("report", t, "-o", out / "r.html", "--force")
    assert res.exit_code == 0 and victim.read_text() == "precious"
    assert not (out / "r.html").is_symlink() and "<!DOCTYPE html>" in (out / "r.html").read_text()


def test_atomic_write_never_follows_a_planted_temp_name(tmp_path, monkeypatch):
    from infertrace import safe_io

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    fixed = iter([bytes.fromhex("000000000000"), bytes.fromhex("111111111111")])
    monkeypatch.setattr(safe_io.os, "urandom", lambda n: next(fixed))
    (tmp_path / ".r.html.000000000000.tmp").symlink_to(victim)  # the attacker guessed the first temp name
    safe_io.write_file_atomic(tmp_path / "r.html", b"new")
    assert victim.read_text() == "precious" and (tmp_path / "r.html").read_bytes() == b"new"
    assert (tmp_path / ".r.html.000000000000.tmp").is_symlink()  # left alone, not reused


def test_report_refuses_the_traces_own_file_by_inode(tmp_path):
    t = _golden_copy(tmp_path)
    alias = tmp_path / "alias.json"
    os.link(t / "trace.json", alias)
    before = (t / "trace.json").read_bytes()
    for target in (alias, t / "." / "trace.json"):
        res = invoke("report", t, "-o", target, "--force")
        assert res.exit_code == 2 and "a file of the trace itself" in res.stderr
    assert (t / "trace.json").read_bytes() == before


def test_two_saves_into_one_new_directory(tmp_path):
    """Two library saves started together into one new directory: exactly one wins, the other is
    told the directory is taken; the winner's trace is complete (threads, a barrier)."""
    from infertrace.errors import InfertraceError
    from infertrace.trace.store import load_trace, read_manifest, save_trace

    a = load_trace(H.GOLDEN / "worked-example-cells")
    b = load_trace(H.GOLDEN / "worked-example-paged")
    for round_ in range(5):
        target = tmp_path / f"D{round_}"
        barrier = threading.Barrier(2)
        results: dict[str, object] = {}

        def go(key, tr):
            barrier.wait()
            try:
                save_trace(tr, target, replace=False)
                results[key] = "saved"
            except InfertraceError as e:
                results[key] = e.message

        ts = [threading.Thread(target=go, args=(k, tr)) for k, tr in (("a", a), ("b", b))]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        assert sorted(v == "saved" for v in results.values()) == [False, True], results
        loser = next(v for v in results.values() if v != "saved")
        assert "is taken" in loser
        winner = "a" if results["a"] == "saved" else "b"
        m = read_manifest(target)
        assert m["options"]["backend"] == ("cells" if winner == "a" else "paged")
        assert sorted(p.name for p in target.iterdir()) == ["timing.json", "trace.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_force_replaces_atomically_but_not_foreign_files(tmp_path):
    from infertrace.errors import InfertraceError
    from infertrace.trace.store import load_trace, read_manifest, save_trace

    a = load_trace(H.GOLDEN / "worked-example-cells")
    b = load_trace(H.GOLDEN / "worked-example-paged")
    d = tmp_path / "D"
    save_trace(a, d, replace=False)
    save_trace(b, d, replace=True)
    assert read_manifest(d)["options"]["backend"] == "paged"
    (d / "notes.txt").write_text("mine")
    with pytest.raises(InfertraceError, match="not part of a saved trace"):
        save_trace(a, d, replace=True)
    assert (d / "notes.txt").read_text() == "mine" and read_manifest(d)["options"]["backend"] == "paged"


CONCURRENT_SAVE = """
import sys, time
from infertrace.trace.store import load_trace, save_trace
from infertrace.errors import InfertraceError
tr = load_trace(sys.argv[1])
while time.time() < float(sys.argv[3]):
    pass
try:
    save_trace(tr, sys.argv[2], replace=False)
    print("saved")
except InfertraceError as e:
    print("error: " + e.message)
    sys.exit(2)
"""


def test_two_save_processes_started_together(tmp_path):
    """The same race between two processes (as two `run --save D` would end)."""
    target = tmp_path / "D"
    start = time.time() + 3
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT_SAVE, str(H.GOLDEN / g), str(target), str(start)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for g in ("worked-example-cells", "worked-example-paged")]
    outs = [(p.wait(timeout=120), p.stdout.read(), p.stderr.read()) for p in procs]
    codes = sorted(o[0] for o in outs)
    assert codes == [0, 2], outs
    assert sum(o[1].count("saved") for o in outs) == 1 and any("is taken" in o[1] for o in outs)


# ----------------------------------------------------------------------------- pipes


def test_show_into_head_exits_quietly(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = f"{sys.executable} -m infertrace.cli.app show {H.GOLDEN / 'batching-paged'} | head -1"
    res = subprocess.run(["bash", "-c", cmd + "; echo \"status ${PIPESTATUS[0]}\""], capture_output=True, text=True,
                         env=env, timeout=120)
    assert res.stderr == "", res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 2 and "infertrace run" in lines[0] and lines[1] in ("status 0", "status 141"), res.stdout


# ----------------------------------------------------------------------------- speculative traces


@pytest.fixture(scope="module", params=["cells", "paged"])
def spec_trace(request, tmp_path_factory):
    """A real speculative trace (tiny model, n-gram tree draft, accepted and rejected nodes)."""
    from tests.helpers import tiny

    d = tmp_path_factory.mktemp("spec")
    w, s = tiny.make_weights(seed=5, n_layer=3)
    model = tiny.write_gguf(d / "m.gguf", w, s)
    res = invoke("run", "--model", model, "--prompt", "abcabcabcab", "--prompt", "xyz", "-n", "6", "--ignore-eos",
                 "--backend", request.param, "--tokens-per-block", "4", "--speculative", "ngram", "--spec-tree=-1,-1,0,1",
                 "--save", d / "t", "--keep", "summary")
    assert res.exit_code == 0, res.output
    return d / "t", json.loads((d / "t" / "trace.json").read_text(encoding="utf-8"))


def test_hostile_speculative_trace(tmp_path, spec_trace):
    """Every spec field attacked (terminal payload, numbers, containers, inconsistent tree / mask /
    counts): show, report, check, diff, dump-kv exit 0/1/2 with one line, print no control byte,
    write an inert page, in bounded time; load refuses what the schema forbids and ``check``
    reports every inconsistency the schema cannot see."""
    ref, d = spec_trace
    seen = {"any": set(), "refuse": 0, "violation": 0}
    for i, (label, e, expect) in enumerate(H.spec_variants(d, H.TERM_PAYLOAD + H.HTML_PAYLOAD)):
        t = H.write_trace(e, tmp_path / f"t{i}")
        t0 = time.monotonic()
        res = invoke("check", t)
        code = one_line_or_ok(res, (0, 1))
        no_control(res.stdout + res.stderr)
        if expect == "refuse":
            assert code == 2, (label, res.stdout)
        elif expect == "violation":
            assert code == 1 and "violation:" in res.stdout, (label, res.stdout)
        if expect == "any":
            seen["any"].add(code)
        else:
            seen[expect] += 1
        for args, ok in ((("show", t, "--show", "mask,kv"), (0,)), (("report", t, "-o", tmp_path / "r.html"), (0,)),
                         (("diff", ref, t), (0, 1)), (("dump-kv", "--step", "2", t), (0,))):
            r = invoke(*args)
            assert one_line_or_ok(r, ok) == 2 or code != 2, (label, args[0])  # what load refuses, every command refuses
            no_control(r.stdout + r.stderr)
            if args[0] == "report" and r.exit_code == 0:
                check_inert((tmp_path / "r.html").read_text(encoding="utf-8"))
                (tmp_path / "r.html").unlink()
        assert time.monotonic() - t0 < 30, label
        shutil.rmtree(t)
    assert seen["any"] == {0, 1, 2} and seen["refuse"] >= 8 and seen["violation"] >= 18, seen
