"""llama.cpp itself (through llama-cpp-python's low-level API and its eval callback) against the cells
backend on the real SmolLM2-135M GGUF: the graph inputs llama.cpp builds must equal ours exactly,
and its next-token distributions must agree within the measured noise floor.

Needs llama-cpp-python (``make test`` installs it); without it every test here fails by name
(the ``llama_cpp`` fixture), it never skips.

Near-tie rule for a top-1 disagreement (teacher-forced): each side's choice is in the other's
top 5 (vLLM ``check_logprobs_close``) and within 0.5 nats of the other's top log-probability,
in both distributions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.engine.engine import EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.runner import PromptSpec

pytestmark = pytest.mark.model

THREE = ["The capital of France is", "def add(a, b):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def one(smol, llama_cpp):
    from infertrace.compare.llamacpp import compare_with_llamacpp

    specs = [PromptSpec("The capital of France is", SamplingParams(max_new_tokens=32, ignore_eos=True))]
    return _dump("one", compare_with_llamacpp(smol, specs, EngineOptions(), layer=0))


@pytest.fixture(scope="module")
def three(smol, llama_cpp):
    from infertrace.compare.llamacpp import compare_with_llamacpp

    p = SamplingParams(max_new_tokens=32, ignore_eos=True)
    specs = [PromptSpec(t, p, a) for t, a in zip(THREE, (0, 1, 3))]
    return _dump("three", compare_with_llamacpp(smol, specs, EngineOptions(prefill_chunk=3), layer=5))


def _dump(name: str, rep: dict) -> dict:
    """With INFERTRACE_LLAMACPP_REPORT=DIR, keep the measured numbers (for the README / a PR note)."""
    d = os.environ.get("INFERTRACE_LLAMACPP_REPORT")
    if d:
        keep = {k: rep[k] for k in ("max_abs", "floor", "first_exceeding", "structural")}
        keep["next_token"] = rep["next_token"]
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / f"{name}.json").write_text(json.dumps(keep, default=sorted, indent=1))
    return rep


@pytest.mark.parametrize("case", ["one", "three"])
def test_structure_equal_exactly(case, request) -> None:
    rep = request.getfixturevalue(case)
    st = rep["structural"]
    assert st["mismatches"] == []
    assert st["checked"] > 100
    assert st["placement"].startswith("identical")  # same cell for every token: raw kq_mask compared cell for cell


def test_three_requests_really_batched_and_chunked(three) -> None:
    steps = three["per_step"]
    assert len(steps) >= 34
    assert three["next_token"]["rows"] == 96  # 3 requests x 32 tokens, each row compared


@pytest.mark.parametrize("case", ["one", "three"])
def test_top1_agreement_and_near_ties(case, request) -> None:
    nt = request.getfixturevalue(case)["next_token"]
    assert nt["same_top_rate"] >= 0.90, nt
    assert nt["all_near_ties"], nt["disagreements"]


@pytest.mark.parametrize("case", ["one", "three"])
def test_floats_within_measured_floor(case, request) -> None:
    rep = request.getfixturevalue(case)
    assert rep["first_exceeding"] is None, rep["first_exceeding"]
    assert rep["max_abs"]["hidden"] == 0.0  # same dequantised embedding rows (get_rows)
    f = rep["floor"]["factor"]
    for v in ("k", "v", "logits"):  # llama.cpp really differs (quantised activations, F16 cache), within tolerance
        assert 0.0 < rep["max_abs"][v] <= f * rep["floor"]["max_abs"][v]
    assert rep["next_token"]["kl_mean"] <= f * rep["floor"]["next_token"]["kl_mean"]


@pytest.fixture(scope="module")
def worked(smol, llama_cpp):
    from infertrace.runtimes.llamacpp.engine import run_requests_llamacpp

    specs = [PromptSpec("The capital of", SamplingParams(max_new_tokens=3))]
    return run_requests_llamacpp(smol, specs, EngineOptions(), layer=0)


def test_worked_example_from_llamacpp_tensors(worked) -> None:
    """The study's table (prefill [a, b, c] -> decode d -> decode e), every value read from llama.cpp."""
    t = worked
    assert t.engine == "llama.cpp"
    s0, s1, s2 = t.steps[:3]
    assert s0.positions.inp_pos == [0, 1, 2] and s1.positions.inp_pos == [3] and s2.positions.inp_pos == [4]
    # llama.cpp's attn_inp_kq_mask: ne = [n_kv, n_tokens, 1, 1], n_kv padded to 256, one row per token
    km = s0.mask.kq_mask
    assert km["ne"] == [256, 3, 1, 1] and km["n_kv"] == 256
    assert [r[:4] for r in km["rows"]] == [["0", "-inf", "-inf", "-inf"], ["0", "0", "-inf", "-inf"], ["0", "0", "0", "-inf"]]
    assert all(x == "-inf" for r in km["rows"] for x in r[3:])
    assert [q["keys"] for q in s0.mask.visible[0]["queries"]] == ["0", "0..1", "0..2"]
    assert s1.mask.visible[0]["queries"][0]["keys"] == "0..3" and s2.mask.visible[0]["queries"][0]["keys"] == "0..4"
    assert s1.mask.kq_mask["rows"][0][:5] == ["0", "0", "0", "0", "-inf"]
    # cells: prefill writes cells 0..2 (attn_inp_k_idxs), each decode the next cell
    assert [s.kv.per_request[0]["cells"] for s in (s0, s1, s2)] == ["0..2", "3", "4"]
    assert [s.batch[0].cache_after for s in (s0, s1, s2)] == ["0..2", "0..3", "0..4"]
    # only the last prompt row produces logits (llama.cpp's out_ids = [2]), then the one decode row
    assert s0.decode.logits_rows == [2] and s0.batch[0].logits_row == 0 and s0.decode.logits_shape[0] == 1
    assert s1.decode.logits_rows == [0] and s2.decode.logits_rows == [0]
    assert s0.batch[0].sampled == t.requests[0]["output_ids"][0]


def test_cli_saved_llamacpp_and_cells_traces_diff_clean(tmp_path: Path, llama_cpp) -> None:
    """run --engine llama.cpp --save A (teacher-forced with B's tokens) and run --save B (cells):
    diff A B finds zero structural differences; show, check, report and dump-kv read A."""
    r = CliRunner()
    args = ["--prompt", THREE[0], "--prompt", THREE[1], "--arrival", "0", "--arrival", "1", "--prefill-chunk", "3",
            "-n", "6", "--ignore-eos"]
    b, a = tmp_path / "cells", tmp_path / "llamacpp"
    res = r.invoke(app, ["run", *args, "--save", str(b), "--keep", "summary", "--json"])
    assert res.exit_code == 0, res.output
    res = r.invoke(app, ["run", *args, "--engine", "llama.cpp", "--teacher-force", str(b), "--save", str(a), "--json"])
    assert res.exit_code == 0, res.output
    m = json.loads((a / "trace.json").read_text())
    assert m["engine"] == "llama.cpp" and m["options"]["llama_cpp"]["teacher_forced"]
    # llama_memory_seq_pos_min/max after step 0 (seq 0's first chunk, positions 0..2) and step 1
    assert m["steps"][0]["kv"]["physical"]["llama_memory_seq_pos"] == {"0": [0, 2]}
    assert m["steps"][1]["kv"]["physical"]["llama_memory_seq_pos"] == {"0": [0, 4], "1": [0, 2]}
    res = r.invoke(app, ["diff", str(a), str(b)])
    assert res.exit_code == 0, res.output
    assert "engines differ (A: llama.cpp, B: infertrace)" in res.output and "structure: identical" in res.output
    assert "kq_mask dtype A ['float16'] B ['float32']" in res.output
    for cmd in (["check", str(a)], ["show", str(a)], ["dump-kv", str(a), "--step", "2"],
                ["report", str(a), "-o", str(tmp_path / "r.html")]):
        res = r.invoke(app, cmd)
        assert res.exit_code == 0, (cmd, res.output)
    show = r.invoke(app, ["show", str(a), "--steps", "0"]).output
    assert "computed by llama.cpp itself" in show and "llama.cpp kq_mask float16 ne = [n_kv=256, n_tokens_pad=3" in show


def test_diff_backends_against_llamacpp_cli(llama_cpp) -> None:
    res = CliRunner().invoke(app, ["diff-backends", "--against", "llama.cpp", "--prompt", "The capital of France is",
                                   "-n", "4", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["structural"]["mismatches"] == [] and rep["identical"]
    assert rep["floor"]["how"].startswith("ours float32 vs ours with llama.cpp's numerics emulated")
    assert rep["first_exceeding"] is None and rep["next_token"]["rows"] == 4
