"""``--kv-dtype f32|f16|bf16`` (issue 20, item 3): the K/V cache stored in another type than the
model computes in, both backends, the budget, the trace header and the CLI's refusals.

Reference values are computed independently: the f16 cache must hold exactly the float32 run's
K/V rounded to float16 (``torch.Tensor.half``, IEEE round-to-nearest-even, as ggml's
``GGML_FP32_TO_FP16``) wherever they do not depend on the cache itself (layer 0), and the sizes are
worked by hand from SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64).
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.engine.drive import drive, encode_requests
from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.kv.budget import check_kv_budget, run_cost_warnings
from infertrace.runner import PromptSpec, run_requests
from infertrace.trace.schema import validate_trace

PROMPTS = ["The capital of France is", "Once upon a time there was a little"]


_ENGINES: dict = {}


def _engine(smol, backend: str, kv_dtype: str | None, prefix_cache: bool = False) -> Engine:
    """Run both prompts greedily for 3 steps (the requests still hold their cache) and return the engine
    (one per settings for the module: the runs are deterministic)."""
    key = (backend, kv_dtype, prefix_cache)
    if key not in _ENGINES:
        _ENGINES[key] = _run_engine(smol, backend, kv_dtype, prefix_cache)
    return _ENGINES[key]


def _run_engine(smol, backend: str, kv_dtype: str | None, prefix_cache: bool) -> Engine:
    opts = EngineOptions(backend=backend, ctx_size=256, kv_dtype=kv_dtype, prefix_cache=prefix_cache)
    eng = Engine(smol.model, smol.tokenizer, opts)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    drive(eng, encode_requests(smol.tokenizer, [PromptSpec(p, params) for p in PROMPTS]), last_step=3)
    return eng


@pytest.mark.parametrize("backend", ["cells", "paged"])
@pytest.mark.parametrize("kv_dtype,torch_dtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_cache_holds_the_float32_values_rounded(smol, backend, kv_dtype, torch_dtype) -> None:
    """Layer 0's K/V depend only on the tokens and positions, so the low-precision cache must equal the
    float32 run's cache rounded to that type bit for bit; deeper layers read the rounded cache, so
    they only come close (measured: f16 max |Δ| over all layers ≈ 1e-2 on K of magnitude ~10-20)."""
    ref, low = _engine(smol, backend, None), _engine(smol, backend, kv_dtype)
    for sid in (0, 1):
        assert ref.requests[sid].all_ids == low.requests[sid].all_ids  # same tokens, so the same positions
        k32, v32 = ref.kv.read(0, sid)  # [L, n_kv_heads, hd]
        klo, vlo = low.kv.read(0, sid)
        assert k32.dtype == torch.float32 and klo.dtype == torch_dtype and klo.shape == k32.shape
        assert k32.shape[0] == len(ref.requests[sid].all_ids) - 1  # the last sampled token is not in the cache yet
        assert torch.equal(klo, k32.to(torch_dtype)) and torch.equal(vlo, v32.to(torch_dtype))
        assert not torch.equal(klo.float(), k32)  # the rounding is real: float16/bfloat16 lose bits
        for layer in (1, 29):
            kd = (low.kv.read(layer, sid)[0].float() - ref.kv.read(layer, sid)[0]).abs().max().item()
            assert kd < (0.1 if kv_dtype == "f16" else 1.0), (layer, kd)
    assert low.kv.describe()["dtype"] == str(torch_dtype).replace("torch.", "")


def test_prefix_cache_shares_the_rounded_entries(smol) -> None:
    """--prefix-cache on with an f16 cache: the pool is f16 and a hit reads the same rounded entries."""
    eng = _engine(smol, "paged", "f16", prefix_cache=True)
    assert eng.kv.describe()["dtype"] == "float16"
    ref = _engine(smol, "paged", None)
    k32 = ref.kv.read(0, 0)[0]
    assert torch.equal(eng.kv.read(0, 0)[0], k32.half())


def test_logits_within_measured_tolerance(smol) -> None:
    """Whole run, both backends: the same greedy tokens and top-5 ids as the float32 cache, the top
    logits within the measured difference (SmolLM2, 2 prompts x 6 tokens, measured 2026-12-01: f16
    max |Δ| 4.0e-3 cells / 4.3e-3 paged, bf16 4.3e-2 / 4.0e-2, on logits of ~15-30; bounds ~2.3x that)."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    specs = [PromptSpec(p, params) for p in PROMPTS]
    for backend in ("cells", "paged"):
        base = run_requests(smol, specs, EngineOptions(backend=backend))
        for kv_dtype, tol in (("f16", 1e-2), ("bf16", 0.1)):
            t = run_requests(smol, specs, EngineOptions(backend=backend, kv_dtype=kv_dtype))
            assert [r["output_ids"] for r in t.requests] == [r["output_ids"] for r in base.requests]
            worst = 0.0
            for sa, sb in zip(base.steps, t.steps):
                for ra, rb in zip(sa.decode.per_request, sb.decode.per_request):
                    assert [x["id"] for x in ra["top"][:5]] == [x["id"] for x in rb["top"][:5]]
                    worst = max(worst, max(abs(x["logit"] - y["logit"]) for x, y in zip(ra["top"][:5], rb["top"][:5])))
            assert 0 < worst < tol, (backend, kv_dtype, worst)
            assert t.options["settings"]["kv_dtype"] == kv_dtype
            assert t.steps[0].kv.dtype == {"f16": "float16", "bf16": "bfloat16"}[kv_dtype]
        assert "kv_dtype" not in base.options["settings"]  # the default records nothing: goldens unchanged


def test_budget_counts_the_cache_type(smol) -> None:
    """SmolLM2-135M, ctx 2048, cells: K/V = 2 x 2048 x 3 x 64 x itemsize per layer x 30 layers, plus
    2048 x (8 + 64) bytes of cell bookkeeping; f16 / bf16 halve the K/V part. The engine allocates
    exactly what the budget counted."""
    cfg = smol.config
    book = 2048 * (8 + 64)
    f32 = check_kv_budget(cfg, EngineOptions(), torch.float32)
    assert f32 == 2 * 2048 * 3 * 64 * 4 * 30 + book == 94_519_296
    for kd in ("f16", "bf16"):
        half = check_kv_budget(cfg, EngineOptions(kv_dtype=kd), torch.float32)
        assert half - book == (f32 - book) // 2 == 47_185_920
    assert check_kv_budget(cfg, EngineOptions(kv_dtype="f32"), torch.bfloat16) == f32  # the cache type wins over --dtype
    assert check_kv_budget(cfg, EngineOptions(), torch.bfloat16) - book == (f32 - book) // 2  # default: the model dtype
    eng = Engine(smol.model, smol.tokenizer, EngineOptions(kv_dtype="f16"))
    held = sum(t.numel() * t.element_size() for t in eng.kv.k + eng.kv.v)
    assert held == 47_185_920
    w = run_cost_warnings(cfg, EngineOptions(ctx_size=16384, kv_dtype="f16"), [1], torch.float32)
    assert "= 360.0 MiB at float16" in w[0]  # 2 x 16384 x 3 x 64 x 2 x 30 bytes


def test_draft_model_cache_follows_kv_dtype(smol) -> None:
    """--speculative draft: the draft model's own cache is stored in --kv-dtype too (no cache left in
    another type than the one the trace states)."""
    eng = Engine(smol.model, smol.tokenizer, EngineOptions(kv_dtype="bf16", speculative="draft", draft_layers=2, ctx_size=64))
    assert eng.kv.k[0].dtype == torch.bfloat16 and eng.spec.drafter.kv.k[0].dtype == torch.bfloat16
    eng = Engine(smol.model, smol.tokenizer, EngineOptions(speculative="draft", draft_layers=2, ctx_size=64))
    assert eng.spec.drafter.kv.k[0].dtype == torch.float32


def test_cli_kv_dtype_trace_and_refusals(tmp_path) -> None:
    r = CliRunner()
    res = r.invoke(app, ["run", "-p", "Hi", "-n", "2", "--kv-dtype", "F16", "--backend", "paged", "--save", str(tmp_path / "t"),
                         "--keep", "summary", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads((tmp_path / "t" / "trace.json").read_text())
    assert d["options"]["settings"]["kv_dtype"] == "f16" and d["steps"][0]["kv"]["dtype"] == "float16"
    validate_trace(d, "trace.json")
    res = r.invoke(app, ["show", str(tmp_path / "t"), "--steps", "0"])
    assert res.exit_code == 0 and "K/V cache f16" in res.output
    d["options"]["settings"]["kv_dtype"] = "q8_0"
    with pytest.raises(Exception, match="kv_dtype"):
        validate_trace(d, "trace.json")
    del d["options"]["settings"]["kv_dtype"]  # a trace from before the option
    validate_trace(d, "trace.json")
    for args, msg in ((["--kv-dtype", "f8"], "--kv-dtype must be one of f32, f16, bf16 (got 'f8')"),
                      (["--kv-dtype", "f16", "--runtime", "llama.cpp"], "llama.cpp keeps its own cache type"),
                      (["--kv-dtype", "bf16", "--backend", "paged", "--replay", str(tmp_path / "none")], "drop --kv-dtype")):
        res = r.invoke(app, ["run", "-p", "Hi", "-n", "1", *args])
        assert res.exit_code == 2, res.output
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], res.output
