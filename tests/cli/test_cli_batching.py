"""Continuous batching through the CLI on the real SmolLM2-135M GGUF: the packed batch per step,
idle steps, and ``dump-kv --step N`` on both backends against hand-worked cache states.

Each CLI scenario runs once (module-scoped fixtures); the model is loaded once per process
(``infertrace.cli.run`` memoises it).

Hand-worked dump case: prompts A = "The capital of France is" (5 tokens) and
B = "def add(a, b):" (7 tokens), both at step 0, no chunking, greedy, ignore_eos,
ctx 64 cells / 16 blocks of B = 4. Step 0 prefills A (pos 0..4) and B (pos 0..6); steps 1
and 2 decode one token each. After step 2:

* cells: A in cells 0..4, 12, 14 (pos 0..6); B in cells 5..11, 13, 15 (pos 0..8);
  head 14 → 16, used 16, n_kv 64 (min(size, 256)); step 2 wrote A pos 6 → cell 14, B pos 8 → cell 15.
* paged: A table [0, 1] (block 0: 0..3, block 1: 4..6); B table [2, 3, 4] (2: 0..3,
  3: 4..7, 4: 8); 5 of 16 blocks used, free list [5, 6, ...]; step 2 slot mapping
  A pos 6 → 1·4 + 2 = 6, B pos 8 → 4·4 + 0 = 16.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.trace.records import RunTrace
from infertrace.present.render import render_run
from infertrace.present.render_kv import render_kv_dump

pytestmark = pytest.mark.model

ENV = {"COLUMNS": "120"}
THREE = ["--prompt", "The capital of France is", "--prompt", "def add(a, b):", "--prompt", "Water boils at",
         "--arrival", "0", "--arrival", "2", "--arrival", "4", "--prefill-chunk", "3"]
A, B = "The capital of France is", "def add(a, b):"
DUMP = ["--prompt", A, "--prompt", B, "--ctx-size", "64", "--tokens-per-block", "4", "--max-new-tokens", "4", "--ignore-eos"]


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env=ENV)


def _ok(res):
    assert res.exit_code == 0, (res.output, res.exception)
    return res


def _flat(text: str) -> str:
    return " ".join(text.split())


# ----------------------------------------------------------------------------- run: packed batch, phases, C/T


@pytest.fixture(scope="module", params=["cells", "paged"])
def three_run(request):
    res = _ok(invoke("run", *THREE, "--backend", request.param, "--max-new-tokens", "4", "--show", "mask,kv"))
    return request.param, res.output


def test_run_shows_packed_batch_per_step(three_run):
    backend, out = three_run
    flat = _flat(out)
    # step 0: seq 0's first chunk; step 2: seq 0 decodes while seq 1 starts; step 4: three requests packed
    assert "packed batch N=3 rows 0..2 → seq 0, pos 0..2 prefill C=0 T=3" in flat
    assert "packed batch N=4 row 0 → seq 0, pos 5 decode C=5 T=1 rows 1..3 → seq 1, pos 0..2 prefill C=0 T=3" in flat
    assert ("packed batch N=5 row 0 → seq 0, pos 7 decode C=7 T=1 row 1 → seq 1, pos 6 prefill C=6 T=1 "
            "rows 2..4 → seq 2, pos 0..2 prefill C=0 T=3") in flat
    assert f"step 4 · decode+prefill · seq 0, 1, 2 · N=5 tokens · {backend}/torch · admitted [2]" in out
    for panel in ("mask · step 4", "kv · step 4"):
        assert panel in out
    assert "hidden · step 4" not in out  # --show mask,kv


def test_run_three_requests_isolated_in_mask_panel(three_run):
    backend, out = three_run
    flat = _flat(out)
    assert "seq 2 visible keys: q0→0 q1→0..1 q2→0..2" in flat
    if backend == "paged":
        assert "request_ids [0, 1, 2]" in flat and "kv_lens [8, 7, 3] (C+T)" in flat
    else:
        assert "s2 q0" in out  # kq_mask grid row of seq 2's first query


@pytest.fixture(scope="module")
def idle_run():
    res = _ok(invoke("run", "--prompt", "Hi", "--prompt", "Water boils at", "--arrival", "1", "--arrival", "5",
                     "--max-new-tokens", "2", "--ignore-eos", "--show", "kv", "--json"))
    return json.loads(res.stdout)


def test_idle_steps_are_recorded_and_shown(idle_run):
    d = idle_run
    steps = d["steps"]
    assert [s["step"] for s in steps] == list(range(len(steps)))  # no gaps
    idle = [s["step"] for s in steps if s["N"] == 0]
    assert idle == [0, 3, 4]  # before seq 0 arrives; after it finished, before seq 1 arrives
    assert all(steps[i]["batch"] == [] for i in idle)
    assert steps[3]["kv"]["physical"]["used"] == 0  # nothing cached while idle
    buf = io.StringIO()
    render_run(Console(file=buf, width=120, highlight=False), RunTrace.from_dict(d), show=("kv",))
    out = buf.getvalue()
    assert "step 0 · idle · N=0 · nothing scheduled (waiting for arrivals)" in out
    assert "step 3 · idle" in out and "step 4 · idle" in out
    rows = [ln for ln in out.splitlines() if "│ idle" in ln and "nothing scheduled" in ln and "waiting for arrivals" in ln]
    assert len(rows) == 3  # worked-example table rows


# ----------------------------------------------------------------------------- dump-kv


@pytest.fixture(scope="module")
def dump_cells():
    text = _ok(invoke("dump-kv", "--step", "2", *DUMP)).stdout
    d = json.loads(_ok(invoke("dump-kv", "--step", "2", *DUMP, "--layer", "3", "--head", "1", "--positions", "0,5..6",
                              "--json")).stdout)
    return text, d


@pytest.fixture(scope="module")
def dump_paged():
    d = json.loads(_ok(invoke("dump-kv", "--step", "2", *DUMP, "--backend", "paged", "--layer", "29", "--head", "2",
                              "--full", "--json")).stdout)
    return d


def test_dump_kv_cells_hand_worked(dump_cells):
    text, d = dump_cells
    ph, lay = d["physical"], d["layout"]
    assert (d["step"], d["backend"], d["idle"]) == (2, "cells", False)
    assert (ph["size"], ph["used"], ph["head_before"], ph["head_after"], ph["n_kv"]) == (64, 16, 14, 16, 64)
    assert ph["seqs"] == {"0": {"cells": "0..4,12,14", "pos": "0..6"}, "1": {"cells": "5..11,13,15", "pos": "0..8"}}
    assert [(s["cells"], s["seq_ids"], s["pos"]) for s in lay["stretches"]] == [
        ("0..4", [0], "0..4"), ("5..11", [1], "0..6"), ("12", [0], "5"), ("13", [1], "7"), ("14", [0], "6"),
        ("15", [1], "8"), ("16..63", [], None)]
    assert lay["map"] == "0000011111110101" + "." * 48  # the n_kv = 64 cells the graph reads
    assert d["writes"] == [{"seq_id": 0, "pos": [6], "cells": [14]}, {"seq_id": 1, "pos": [8], "cells": [15]}]
    assert d["physical_shape"] == [64, 3, 64]
    flat = _flat(text)
    assert "head 14 → 16" in flat and "used 16" in flat and "n_kv 64" in flat
    assert "0..4 0 0..4" in flat and "5..11 1 0..6" in flat and "16..63 empty - (48 cells)" in flat
    assert "00000111 11110101 ........ ........" in text
    # the renderer is a pure function of the dict: the JSON renders like the live text
    buf = io.StringIO()
    no_values = dict(d, values=None)
    render_kv_dump(Console(file=buf, width=120, highlight=False), no_values)
    assert buf.getvalue() == text


def test_dump_kv_paged_hand_worked(dump_paged):
    d = dump_paged
    ph = d["physical"]
    assert (ph["num_blocks"], ph["tokens_per_block"], ph["used_blocks"], ph["free_blocks"]) == (16, 4, 5, 11)
    assert ph["free_list_head"] == [5, 6, 7, 8, 9, 10, 11, 12]
    assert ph["requests"]["0"]["block_table"] == [0, 1] and ph["requests"]["1"]["block_table"] == [2, 3, 4]
    assert [b["pos"] for b in ph["requests"]["0"]["blocks"]] == ["0..3", "4..6"]
    assert [b["pos"] for b in ph["requests"]["1"]["blocks"]] == ["0..3", "4..7", "8"]
    assert d["writes"] == [{"seq_id": 0, "pos": [6], "slots": [6]}, {"seq_id": 1, "pos": [8], "slots": [16]}]
    assert d["physical_shape"] == [16, 2, 3, 4, 64]


def _engine_at_step(backend: str, step: int):
    from infertrace.cli.run import load_with_progress, progress_display
    from infertrace.engine.engine import Engine, EngineOptions
    from infertrace.engine.sampler import SamplingParams

    loaded = load_with_progress(None, "float32", "cpu", progress_display(False))  # the CLI's memoised model
    e = Engine(loaded.model, loaded.tokenizer, EngineOptions(backend=backend, ctx_size=64, tokens_per_block=4))
    for p in (A, B):
        e.add_request(loaded.tokenizer.encode(p), SamplingParams(max_new_tokens=4, ignore_eos=True))
    for _ in range(step + 1):
        e.step()
    return e


def test_dump_kv_values_equal_backend_read(dump_cells, dump_paged):
    _, dc = dump_cells
    e = _engine_at_step("cells", 2)
    v = dc["values"]
    assert (v["layer"], v["head"], v["full"], v["n_values"]) == (3, 1, False, 4)
    assert [[r["pos"] for r in q["rows"]] for q in v["requests"]] == [[0, 5, 6], [0, 5, 6]]
    assert [r["cell"] for r in v["requests"][0]["rows"]] == [0, 12, 14]
    for q in v["requests"]:
        k, vv = e.kv.read(3, q["seq_id"])  # [L, n_kv_heads, hd]
        for r in q["rows"]:
            assert torch.equal(torch.tensor(r["k"]), k[r["pos"], 1, :4])
            assert torch.equal(torch.tensor(r["v"]), vv[r["pos"], 1, :4])
    ep = _engine_at_step("paged", 2)
    vp = dump_paged["values"]
    assert vp["n_values"] == 64 and [len(q["rows"]) for q in vp["requests"]] == [7, 9]
    for q in vp["requests"]:
        k, vv = ep.kv.read(29, q["seq_id"])
        assert torch.equal(torch.tensor([r["k"] for r in q["rows"]]), k[:, 2, :])
        assert torch.equal(torch.tensor([r["v"] for r in q["rows"]]), vv[:, 2, :])
        assert all(r["slot"] == r["block"] * 4 + r["offset"] for r in q["rows"])
    # both backends hold the same logical K/V (float tolerance: attention sums in another order)
    kc, _ = e.kv.read(29, 1)
    assert torch.allclose(kc[:, 2, :], torch.tensor([r["k"] for r in vp["requests"][1]["rows"]]), atol=1e-4)


def test_dump_from_saved_trace_matches_live(dump_cells):
    """A recorded run gives the same cache state at step 2 as the live dump (for ``show``/saved traces)."""
    from infertrace.trace.kv_dump import dump_from_step

    _, live = dump_cells
    d = json.loads(_ok(invoke("run", *DUMP, "--show", "kv", "--json")).stdout)
    saved = dump_from_step(RunTrace.from_dict(d).steps[2])
    for key in ("physical", "layout", "writes", "batch", "physical_shape", "n_layer", "idle"):
        assert saved[key] == live[key], key
    assert saved["source"] == "trace" and saved["values"]["requests"][0]["rows"][0]["pos"] == 6


def _one_error_line(res, code: int = 2) -> str:
    assert res.exit_code == code, (res.output, res.exception)
    assert "Traceback" not in res.output and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


def test_dump_kv_step_out_of_range():
    line = _one_error_line(invoke("dump-kv", "--step", "12", "--prompt", A, "--max-new-tokens", "3"))
    assert line == "error: step 12 out of range: the run has steps 0..2"
    assert _one_error_line(invoke("dump-kv", "--step", "-1", "--prompt", A)) == \
        "error: step -1 out of range: steps are numbered from 0"


@pytest.mark.parametrize("args, expect", [
    (["--layer", "30"], "--layer: 30 out of range: the model has layers 0..29"),
    (["--head", "3"], "--head 3 out of range: the cache holds kv heads 0..2"),
    (["--positions", "5..2", "--layer", "0"], "is empty or negative"),
    (["--positions", "0"], "add --layer L and/or --head H"),
    (["--layer", "0", "--positions", "40"], "no request has those positions cached"),
])
def test_dump_kv_bad_options(args, expect):
    assert expect in _one_error_line(invoke("dump-kv", "--step", "0", "--prompt", A, *args))
