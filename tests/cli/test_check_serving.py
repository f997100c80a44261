"""``infertrace check`` on serving traces (case X3): a prefix-cache hit (the chunk starts where the hit
ends), a context shift (positions continue from the shifted cache), a finished sequence the cells
cache retains for reuse and prefix blocks shared by two block tables all pass; a tampered trace of
each kind is caught. And every sample command of the docs pages (docs/**/*.md) that saves a trace (or
prints a serving sample) produces a trace that passes ``check``, run as the page prints it (the default
model). The README's own tour is run by tests/cli/test_docs.py, which checks its traces too.

Kept under tests/cli/ (collected before tests/runtimes/vllm/): its docs samples start vLLM in this process, and a
vLLM engine built after that folder's engines (tensor-parallel ones among them) in the same pytest process failed
here with `AttributeError: '_lib_fn_wrapper' object has no attribute 'get'` inside vLLM's start-up."""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.trace.check import check_trace
from tests.helpers.tiny import make_weights, write_gguf

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    w, s = make_weights(seed=5)
    return str(write_gguf(tmp_path_factory.mktemp("tiny") / "m.gguf", w, s))


def _run(*args: str) -> str:
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 0, r.output
    return r.output


def _save(gguf: str, d: Path, *args: str) -> dict:
    _run("run", "-m", gguf, "--ignore-eos", "--save", str(d), *args)
    return json.loads((d / "trace.json").read_text(encoding="utf-8"))


def _check_cli(d: Path, m: dict) -> tuple[int, str]:
    """``infertrace check`` on a copy of the saved trace ``d`` whose trace.json is ``m``."""
    t = d.parent / (d.name + "-tampered")
    shutil.rmtree(t, ignore_errors=True)
    shutil.copytree(d, t)
    (t / "trace.json").write_text(json.dumps(m), encoding="utf-8")
    r = CliRunner().invoke(app, ["check", str(t)])
    return r.exit_code, r.output.strip()


def _step(m: dict, n: int) -> dict:
    return next(s for s in m["steps"] if s["step"] == n)


def _row(st: dict, sid: int) -> dict:
    return next(r for r in st["batch"] if r["seq_id"] == sid)


def _hit_step(m: dict) -> tuple[dict, dict]:
    for st in m["steps"]:
        for r in st["batch"]:
            if (r.get("prefix") or {}).get("hit"):
                return st, r
    raise AssertionError("no prefix hit in the trace")


# "HelloWorld" twice, the second arriving at step 3: 10 tokens each (byte-level tiny vocabulary), the
# second request's lookup hits 9 of them (the last prompt token is computed for its logits)
PREFIX = ("-p", "HelloWorld", "-p", "HelloWorld", "--arrival", "0", "--arrival", "3", "-n", "3", "--prefix-cache", "on")


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_prefix_hit_trace_passes_and_a_chunk_before_the_hit_end_is_caught(gguf, tmp_path, backend):
    d = tmp_path / "t"
    m = _save(gguf, d, *PREFIX, "--backend", backend, "--tokens-per-block", "4")
    st, r = _hit_step(m)
    assert (r["seq_id"], r["prefix"]["hit"], r["C"], r["T"]) == (1, 9, 9, 1)  # hit 0..8, the last token computed
    assert _run("check", str(d)).startswith("ok: ")  # main: "chunk starts at position 9, ... ended at -1"
    bad = copy.deepcopy(m)  # the hit's chunk starts 2 positions before the hit ends
    r = _row(_step(bad, st["step"]), 1)
    r["C"] -= 2
    r["T"] += 2
    r["positions"] = list(range(r["C"], r["C"] + r["T"]))
    code, out = _check_cli(d, bad)
    assert code == 1 and out.startswith(f"violation: step {st['step']} seq 1 positions: chunk starts where the prefix hit "
                                        "ends: chunk starts at position 7, the prefix-cache hit of this sequence covers 0..8"), out
    bad = copy.deepcopy(m)  # a hit that claims the whole prompt (nothing left to compute the logits from)
    _row(_step(bad, st["step"]), 1)["prefix"]["hit"] = 10
    assert check_trace(bad)[0].rule == "prefix hit inside the prompt"


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_context_shift_trace_passes_and_skipping_positions_are_caught(gguf, tmp_path, backend):
    d = tmp_path / "t"
    # "abcde" = 5 tokens, ctx 12, n_keep 1: after 11 positions the cache is full, positions 1..5 are
    # dropped, 6..10 move to 1..5 and decoding continues at position 6
    m = _save(gguf, d, "-p", "abcde", "--ctx-size", "12", "-n", "10", "--context-shift", "--n-keep", "1",
              "--backend", backend, "--tokens-per-block", "4")
    st = next(s for s in m["steps"] if any(r.get("shift") for r in s["batch"]))
    r = _row(st, 0)
    sh = r["shift"]
    assert (sh["n_past"], sh["n_keep"], sh["n_discard"], sh["n_past_after"], r["C"]) == (11, 1, 5, 6, 6)
    assert _run("check", str(d)).startswith("ok: ")  # main: "chunk starts at position 6, ... ended at 10"
    bad = copy.deepcopy(m)  # positions skip one past the shifted cache
    r = _row(_step(bad, st["step"]), 0)
    r["C"] += 1
    r["positions"] = [p + 1 for p in r["positions"]]
    code, out = _check_cli(d, bad)
    assert code == 1 and out.startswith(f"violation: step {st['step']} seq 0 positions: contiguous across chunks: chunk "
                                        "starts at position 7, after the context shift the sequence holds 0..5"), out
    bad = copy.deepcopy(m)  # the shift record says it dropped 4 but the positions moved by 5
    for op in _step(bad, st["step"])["serving"]["ops_before_step"]:
        op["n_discard"] = 4
    _row(_step(bad, st["step"]), 0)["shift"]["n_discard"] = 4
    v = check_trace(bad)[0]
    assert (v.step, v.seq_id, v.rule) == (st["step"], 0, "context shift of the cached positions")


def test_retained_sequence_passes_and_a_read_without_a_hit_is_caught(gguf, tmp_path):
    d = tmp_path / "t"
    # seq 0 ("Hello", 2 generated tokens) finishes at step 1 and stays in cells 0..6 (retained); seq 1
    # ("xyz": no common first token, no hit) arrives at step 4 and is computed in fresh cells
    m = _save(gguf, d, "-p", "Hello", "-p", "xyz", "--arrival", "0", "--arrival", "4", "-n", "2", "--prefix-cache", "on",
              "--backend", "cells")
    st = next(s for s in m["steps"] if any(r["seq_id"] == 1 for r in s["batch"]))
    phys = st["kv"]["physical"]
    assert phys["retained"] == [0] and _row(st, 1)["prefix"]["hit"] == 0
    assert _run("check", str(d)).startswith("ok: ")  # main: "cell 0 still holds the finished sequence"
    retained = [c["cell"] for c in phys["cells"] if c["seq_ids"] == [0]]
    assert retained
    bad = copy.deepcopy(m)  # seq 1's first query reads a retained cell of seq 0: no seq_cp, no hit
    km = _step(bad, st["step"])["mask"]["kq_mask"]
    km["rows"][0][retained[0]] = "0"
    code, out = _check_cli(d, bad)
    assert code == 1 and out.startswith(f"violation: step {st['step']} seq 1 mask: no cross-sequence visibility: "
                                        f"kq_mask row 0 (pos 0) keeps cell {retained[0]}, owned by seq [0]"), out
    bad = copy.deepcopy(m)  # seq 1 put into a retained cell's set (as seq_cp would) with no hit recorded
    last = max(retained)
    for c in _step(bad, st["step"])["kv"]["physical"]["cells"]:
        if c["cell"] == last:
            c["seq_ids"] = [0, 1]
    v = check_trace(bad)[0]
    assert (v.step, v.seq_id, v.rule) == (st["step"], 1, "cells joined by a write or a prefix hit"), v
    bad = copy.deepcopy(m)  # without a prefix cache a finished sequence holds no cell
    for s in bad["steps"]:
        if isinstance(s.get("kv"), dict):
            s["kv"]["physical"]["retained"] = []
    v = check_trace(bad)[0]
    assert (v.seq_id, v.rule) == (0, "freed when finished"), v


def test_shared_prefix_blocks_need_a_hit(gguf, tmp_path):
    d = tmp_path / "t"
    # seq 1 arrives while seq 0 still runs: both tables hold blocks 0 and 1
    m = _save(gguf, d, "-p", "HelloWorld", "-p", "HelloWorld", "--arrival", "0", "--arrival", "1", "-n", "4",
              "--prefix-cache", "on", "--backend", "paged", "--tokens-per-block", "4")
    st, r = _hit_step(m)
    assert r["prefix"]["shared_blocks"] == [0, 1] and r["prefix"]["ref_cnt"] == [2, 2]  # 2 full blocks (positions 0..7) shared, ref_cnt 2
    assert check_trace(m)[0] is None
    bad = copy.deepcopy(m)  # the blocks are shared but the hit record names none
    _row(_step(bad, st["step"]), 1)["prefix"]["shared_blocks"] = []
    bad["steps"][st["step"]]["serving"]["prefix"]["1"]["shared_blocks"] = []
    v = check_trace(bad)[0]
    assert (v.step, v.seq_id, v.rule) == (st["step"], 1, "one owner per block"), v


# --------------------------------------------------------------------------------------- docs samples

def doc_samples() -> list[list[str]]:
    """The ``infertrace run`` commands of the docs pages that save a trace (```bash blocks) or show a
    serving sample (``$ infertrace run ...`` with its continuation lines), as argument lists after
    ``infertrace run``; a command printed on two pages is run once. A command on a model the page builds
    itself (an absolute ``--model`` path, e.g. the planted-defect copies of docs/bisect.md) is left to that
    page's own test (tests/real_models/test_bisect.py runs the same flow), and so is a command reading a
    ``--prompts FILE`` the page shows beside it (docs/bisect.md's batch-invariance run:
    tests/runtimes/vllm/test_batch_invariance.py)."""
    lines = [ln for page in sorted(DOCS.rglob("*.md")) for ln in page.read_text(encoding="utf-8").splitlines()]
    out, i = [], 0
    while i < len(lines):
        ln = lines[i]
        cmd = None
        if ln.startswith("$ infertrace run "):
            cmd = ln[2:]
            while cmd.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
        elif ln.startswith("infertrace run ") and " --save " in ln:
            cmd = ln
        if cmd is not None:
            cmd = re.split(r"\s+#\s", cmd)[0]  # drop the comment
            args = shlex.split(cmd)[2:]
            model = next((args[j + 1] for j, a in enumerate(args[:-1]) if a in ("--model", "-m")), "")
            if args not in out and not model.startswith("/") and "--prompts" not in args:
                out.append(args)
        i += 1
    return out


def test_doc_samples_are_found():
    cmds = doc_samples()
    assert sum("--prefix-cache" in c for c in cmds) >= 2 and any("--context-shift" in c for c in cmds)
    assert sum("--save" in c for c in cmds) >= 3


def _prepared(cmds: list[list[str]], tmp: Path) -> list[tuple[list[str], Path]]:
    """Each sample with its ``--save`` (and ``--teacher-force`` / ``--replay``) paths under ``tmp``, saving ones added
    where the sample only prints; the samples that save a trace others read run first."""
    runs = []
    for k, c in enumerate(cmds):
        c = list(c)
        for flag in ("--save", "--teacher-force", "--replay"):
            if flag in c:
                j = c.index(flag) + 1
                c[j] = str(tmp / c[j].replace("/", "_"))
        if "--save" not in c:
            c += ["--save", str(tmp / f"sample{k}")]
        c = [x for x in c if x not in ("--json",)]
        runs.append((c, Path(c[c.index("--save") + 1])))
    return sorted(runs, key=lambda cr: "--teacher-force" in cr[0] or "--replay" in cr[0])


def test_doc_samples_pass_check(tmp_path, smol_path):
    """Every docs sample run on the default model (as the page prints it) saves a trace that passes
    ``check``; the llama.cpp ones need llama-cpp-python and are skipped without it."""
    try:
        import llama_cpp  # noqa: F401
        have_llamacpp = True
    except ImportError:
        have_llamacpp = False
    ran = []
    for cmd, d in _prepared(doc_samples(), tmp_path):
        if "llama.cpp" in cmd and not have_llamacpp:
            continue
        if d.exists():  # two samples save to the same docs path (runs/lc): keep both
            cmd[cmd.index("--save") + 1] = str(d) + "-2"
            d = Path(str(d) + "-2")
        _run("run", *cmd)
        out = _run("check", str(d))
        assert out.startswith("ok: ") and "no violation" in out, (cmd, out)
        ran.append(cmd)
    assert sum("--prefix-cache" in c for c in ran) >= 2 and any("--context-shift" in c for c in ran)


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_preemption_with_prefix_cache_passes_and_outputs_equal_no_cache(gguf, tmp_path, backend):
    """Three requests sharing "Hello world" in a pool too small for all: seq 2 is preempted, and an
    admission that does not fit is undone. With the undo retaining the attachment (main), the cells
    trace showed seq 2 in cells 0..10 at step 11 with no hit recorded; the undo now frees them. Greedy
    outputs equal a run without the prefix cache."""
    args = ("-p", "Hello world, this is", "-p", "Hello world, this was", "-p", "Hello world", "--arrival", "0",
            "--arrival", "1", "--arrival", "2", "-n", "12", "--backend", backend, "--tokens-per-block", "4",
            "--num-blocks", "12", "--ctx-size", "48")
    m = _save(gguf, tmp_path / "pc", *args, "--prefix-cache", "on")
    assert any(s.get("preempted") for s in m["steps"])
    assert _run("check", str(tmp_path / "pc")).startswith("ok: ")
    ref = _save(gguf, tmp_path / "plain", *args)
    assert [r["output_ids"] for r in m["requests"]] == [r["output_ids"] for r in ref["requests"]]
