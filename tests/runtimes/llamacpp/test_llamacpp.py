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
    assert t.runtime == "llama.cpp"
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
    """run --runtime llama.cpp --save A (teacher-forced with B's tokens) and run --save B (cells):
    diff A B finds zero structural differences; show, check, report and dump-kv read A."""
    r = CliRunner()
    args = ["--prompt", THREE[0], "--prompt", THREE[1], "--arrival", "0", "--arrival", "1", "--prefill-chunk", "3",
            "-n", "6", "--ignore-eos"]
    b, a = tmp_path / "cells", tmp_path / "llamacpp"
    res = r.invoke(app, ["run", *args, "--save", str(b), "--keep", "summary", "--json"])
    assert res.exit_code == 0, res.output
    res = r.invoke(app, ["run", *args, "--runtime", "llama.cpp", "--teacher-force", str(b), "--save", str(a), "--json"])
    assert res.exit_code == 0, res.output
    m = json.loads((a / "trace.json").read_text())
    assert m["runtime"] == "llama.cpp" and m["options"]["llama_cpp"]["teacher_forced"]
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


def _strip_times(x):  # a trace's JSON without its wall-clock fields
    if isinstance(x, dict):
        return {k: _strip_times(v) for k, v in x.items() if k != "time_ms"}
    return [_strip_times(v) for v in x] if isinstance(x, list) else x


def test_cli_llamacpp_reads_no_tensor_data_and_trace_unchanged(monkeypatch, llama_cpp) -> None:
    """Issue 20 "load only what is used": run --runtime llama.cpp builds no infertrace weights (the
    GGUF tensor reader and the quantised loader raise if called), and its trace equals the one made
    when the whole model was loaded first (timings aside)."""
    import infertrace.cli.common as common
    import infertrace.cli.run as run_mod
    import infertrace.loading.weights as weights_mod
    from infertrace.loading.model import HeaderOnlyModel

    args = ["run", "--runtime", "llama.cpp", "--prompt", "The capital of France is", "-n", "4", "--json"]
    seen: list = []
    real = common.load_with_progress

    def spy(*a, **k):
        loaded = real(*a, **k)
        seen.append(loaded)
        return loaded

    monkeypatch.setattr(common, "_LOADED", {})  # no memoised model from another test
    monkeypatch.setattr(run_mod, "load_with_progress", lambda *a, **k: spy(*a, **{**k, "tensors": True}))  # before the fix
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    before = json.loads(res.output)
    assert seen[-1].ckpt.weights  # the full load really read tensors

    def no_tensors(*_a, **_k):
        raise AssertionError("tensor data read for --runtime llama.cpp")

    monkeypatch.setattr(weights_mod, "_gguf_tensors", no_tensors)
    monkeypatch.setattr("infertrace.quant.source.quant_weights", no_tensors)
    monkeypatch.setattr(run_mod, "load_with_progress", spy)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    after = json.loads(res.output)
    assert isinstance(seen[-1].model, HeaderOnlyModel) and seen[-1].ckpt.weights == {}
    assert _strip_times(after) == _strip_times(before)
    assert after["requests"][0]["output_ids"] and len(after["steps"]) == 4


def test_diff_backends_against_llamacpp_cli(llama_cpp) -> None:
    res = CliRunner().invoke(app, ["diff-runtimes", "llama.cpp", "--prompt", "The capital of France is",
                                   "-n", "4", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["structural"]["mismatches"] == [] and rep["identical"]
    assert rep["floor"]["how"].startswith("ours float32 vs ours with llama.cpp's numerics emulated")
    assert rep["first_exceeding"] is None and rep["next_token"]["rows"] == 4


# ----------------------------------------------------------------------------- flash attention (case L2)


def test_ggml_cpu_attention_hand_example() -> None:
    """One head, hd 1, two cells with scores 0 and 0 (q·k = 0), V = [1, 2^-11].
    Flash attention (fewer than 64 queries): the F16 accumulator holds 1, then 1 + 2^-11, a tie between
    1 and 1 + 2^-10 that rounds to even = 1; S = 2 -> 0.5 exactly.
    Without it: softmax [0.5, 0.5] (F16-exact), then 0.5 * 1 + 0.5 * 2^-11 = 0.500244140625 in F32."""
    import torch

    from infertrace.compare.llamacpp import ggml_cpu_attention

    q = torch.zeros(1, 1, 1)
    k = torch.ones(2, 1, 1)
    v = torch.tensor([[[1.0]], [[2.0 ** -11]]])
    mask = torch.zeros(1, 2)
    assert ggml_cpu_attention(q, k, v, mask, 1.0, flash_attn=True).item() == 0.5
    assert ggml_cpu_attention(q, k, v, mask, 1.0, flash_attn=False).item() == 0.500244140625
    # a masked cell is skipped; 64 queries or more take the tiled F32 path (the plain F32 value)
    assert ggml_cpu_attention(q, k, v, torch.tensor([[0.0, float("-inf")]]), 1.0, flash_attn=True).item() == 1.0
    q64 = torch.zeros(64, 1, 1)
    out = ggml_cpu_attention(q64, k, v, torch.zeros(64, 2), 1.0, flash_attn=True)
    assert out.flatten().tolist() == [0.500244140625] * 64


def _llamacpp_direct_logits(llama_cpp, path, tokens: list[int], flash: bool) -> tuple:  # (ctx, model, logits [V])
    """llama.cpp run directly through the binding (no eval callback, no batch of ours): the prompt as
    one llama_batch_get_one, then each next token; logits of the last position each time, with the
    context settings run --runtime llama.cpp uses (n_ctx 2048, n_batch = n_ubatch 2048, 2 threads,
    unified KV cache)."""
    import numpy as np

    L = llama_cpp
    model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 2048, 2048, 2048, 1
    cp.n_threads = cp.n_threads_batch = 2
    cp.kv_unified = True
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    try:
        arr = (L.llama_token * len(tokens))(*tokens)
        assert L.llama_decode(ctx, L.llama_batch_get_one(arr, len(tokens))) == 0
        return ctx, model, np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
    except Exception:
        L.llama_free(ctx)
        L.llama_model_free(model)
        raise


def _continue(llama_cpp, ctx, token: int, n_vocab: int):
    import numpy as np

    L = llama_cpp
    arr = (L.llama_token * 1)(token)
    assert L.llama_decode(ctx, L.llama_batch_get_one(arr, 1)) == 0
    return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()


def test_flash_attn_setting_recorded_and_equals_llamacpp(smol, llama_cpp) -> None:
    """run --runtime llama.cpp with flash attention on and off: different numbers, each equal to
    llama.cpp's own logits through the binding with that setting, and the header says which ran."""
    from infertrace.runtimes.llamacpp.engine import run_requests_llamacpp

    specs = [PromptSpec("The capital of France is", SamplingParams(max_new_tokens=3))]
    top1 = {}
    for fa in ("on", "off"):
        t = run_requests_llamacpp(smol, specs, EngineOptions(), layer=0, flash_attn=fa)
        lc = t.options["llama_cpp"]
        assert lc["flash_attn"] == fa and lc["flash_attn_type"] == fa
        assert (lc["type_k"], lc["type_v"], lc["n_ubatch"], lc["n_batch"], lc["n_threads"]) == ("f16", "f16", 2048, 2048, 2)
        assert lc["n_ctx"] == 2048 and lc["kv_unified"] and lc["system_info"]
        assert t.steps[0].mask.kq_mask["dtype"] == ("float16" if fa == "on" else "float32")
        ids = t.requests[0]["prompt_ids"]
        ctx, model, ref = _llamacpp_direct_logits(llama_cpp, smol.ckpt.path, ids, fa == "on")
        try:
            refs = [ref]
            for tok in t.requests[0]["output_ids"][:-1]:
                refs.append(_continue(llama_cpp, ctx, tok, ref.shape[0]))
        finally:
            llama_cpp.llama_free(ctx)
            llama_cpp.llama_model_free(model)
        for st, r in zip(t.steps, refs):
            top = st.decode.per_request[0]["top"]
            for c in top:
                assert c["logit"] == pytest.approx(float(r[c["id"]]), abs=1e-5), (fa, st.step, c)
            assert top[0]["id"] == int(r.argmax())
        top1[fa] = t.steps[0].decode.per_request[0]["top"][0]["logit"]
    assert abs(top1["on"] - top1["off"]) > 1e-3, top1  # the setting changes llama.cpp's numbers


def test_flash_attn_cli_recorded_and_named_by_diff(tmp_path: Path, llama_cpp) -> None:
    r = CliRunner()
    args = ["run", "--runtime", "llama.cpp", "--prompt", THREE[0], "-n", "2", "--keep", "summary"]
    a, b = tmp_path / "fa_off", tmp_path / "fa_on"
    for d, fa in ((a, "off"), (b, "on")):
        res = r.invoke(app, [*args, "--llamacpp-flash-attn", fa, "--save", str(d)])
        assert res.exit_code == 0, res.output
        assert json.loads((d / "trace.json").read_text())["options"]["llama_cpp"]["flash_attn"] == fa
        assert r.invoke(app, ["check", str(d)]).exit_code == 0
    res = r.invoke(app, ["diff", str(a), str(b)])
    assert res.exit_code == 1
    assert "llama.cpp settings differ" in res.output and "flash_attn: A off vs B on" in res.output, res.output
    res = r.invoke(app, ["diff", str(a), str(b), "--json"])
    assert {"setting": "flash_attn", "a": "off", "b": "on"} in json.loads(res.output)["llama_cpp_settings_differ"]
    show = r.invoke(app, ["show", str(a), "--steps", "0"]).output
    assert "flash attention off" in show
    res = r.invoke(app, ["run", "--prompt", "hi", "-n", "1", "--llamacpp-flash-attn", "on"])
    assert res.exit_code == 2 and "needs --runtime llama.cpp" in res.output
    res = r.invoke(app, ["run", "--runtime", "llama.cpp", "--prompt", "hi", "-n", "1", "--llamacpp-flash-attn", "maybe"])
    assert res.exit_code == 2 and "--llamacpp-flash-attn must be one of auto, on, off" in res.output


def test_diff_backends_floor_follows_flash_attn(llama_cpp) -> None:
    """diff-runtimes llama.cpp with flash attention off: the report names the setting, the emulated floor
    follows it, and llama.cpp stays within it."""
    res = CliRunner().invoke(app, ["diff-runtimes", "llama.cpp", "--prompt", "The capital of France is",
                                   "-n", "4", "--llamacpp-flash-attn", "off", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["llama_cpp"]["flash_attn"] == "off" and "flash attention off" in rep["floor"]["how"]
    assert rep["structural"]["mismatches"] == [] and rep["identical"]
    assert rep["structural"]["mask_dtype"]["llama.cpp"] == ["f32"]  # the F32 kq_mask of the path without flash attention


@pytest.mark.parametrize("unified", [True, False])
def test_step_data_through_the_wire_records_the_same_llamacpp_step(smol, llama_cpp, unified) -> None:
    """llama.cpp's steps (read back through LlamaCppKV / LlamaCppStreamsKV) recorded from the live step and from
    its StepData sent through JSON + safetensors are equal, tensors included (three requests, late arrivals,
    chunked prefill; with ``kv_unified`` off one stream per sequence, equal prompt lengths: split_equal)."""
    from infertrace.capture.recorder import VARIABLES
    from infertrace.engine.drive import drive_bounded, encode_requests
    from infertrace.runtimes.llamacpp.engine import LlamaCppEngine
    from tests.helpers.step_wire import TwinRecorder, same_steps

    p = SamplingParams(max_new_tokens=4, ignore_eos=True)
    specs = ([PromptSpec(t, p, a) for t, a in zip(THREE, (0, 1, 3))] if unified else
             [PromptSpec("The capital of", p), PromptSpec("Hello, my name", p)])
    opts = EngineOptions(prefill_chunk=3, kv_unified=unified, **({} if unified else {"ctx_size": 512, "n_seq_max": 2}))
    rec = TwinRecorder(smol.tokenizer, smol.config, layer=2, show=VARIABLES, layers=[2], tensors={})
    eng = LlamaCppEngine(smol, opts, rec, layer=2, n_seq_max=len(specs))
    try:
        drive_bounded(eng, encode_requests(smol.tokenizer, specs))
    finally:
        eng.close()
    same_steps(rec)
    assert len(rec.steps) >= 4 and any(c.placement for d in rec.data for c in d.chunks)
