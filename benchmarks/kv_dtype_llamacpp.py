"""Does ``--kv-dtype f16`` bring the cells backend closer to llama.cpp, whose default cache type is F16?

    python benchmarks/kv_dtype_llamacpp.py    # SmolLM2-135M Q4_1, needs llama-cpp-python; ~5 min on 2 busy cores

Runs ours float32 (f32 cache, then an f16 cache, teacher-forced to the same tokens), llama.cpp itself
(``run_llamacpp``, forced likewise), and the noise-floor emulation of ``compare/llamacpp.py`` with and
without its F16 cache part (``F16CacheKV``, and a cache stored in float16 in its place), then prints each
one's distance from llama.cpp: logits of every row (max and mean |Δ| over the vocabulary), layer-29 K/V
as llama.cpp computed them (before the cache), top-1 agreement.
"""
import time
from dataclasses import replace
import torch
from infertrace.runner import PromptSpec, load_model
from infertrace.engine.engine import EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.engine.drive import drive, encode_requests
from infertrace.compare import llamacpp as C
from infertrace.runtimes.llamacpp.engine import run_llamacpp

LAYER = 29
loaded = load_model(None)
params = SamplingParams(max_new_tokens=16, ignore_eos=True)
prompts = [PromptSpec(p, params) for p in ["The capital of France is", "Once upon a time there was a little"]]
o = EngineOptions(backend="cells", attention="torch")
eng, ours32 = C._run_ours(loaded.model, loaded.tokenizer, prompts, o, LAYER, None)
forced = {sid: list(r.output_ids) for sid, r in eng.requests.items()}
_, ours16 = C._run_ours(loaded.model, loaded.tokenizer, prompts, replace(o, kv_dtype="f16"), LAYER, forced)
ltap = C.StepTap(LAYER)
leng, notes = run_llamacpp(loaded, prompts, o, ltap, LAYER, forced, flash_attn="auto")
st = leng.lctx.settings(); leng.close()
print("llama.cpp", st["flash_attn"], st["type_k"], st["type_v"], st["n_threads"])
fa_on = st["flash_attn"] == "on"

def emulated(f16_cache: bool, kv_dtype=None):
    tap = C.StepTap(LAYER)
    e = C.forced_engine(loaded.model.with_ops(C.Q8ActivationOps()), loaded.tokenizer, o, tap, forced,
                        memory=C.GgmlNumericsCache(fa_on, st["n_threads"], f16_cache, kv_dtype))
    drive(e, encode_requests(loaded.tokenizer, prompts))
    return tap

emu = emulated(True)
emu_nof16 = emulated(False)
emu_kvdtype = emulated(False, torch.float16)  # the F16CacheKV mixin replaced by an f16 cache (--kv-dtype f16)
L, _ = C._logit_rows(ltap.steps)
def stats(name, tap):
    R, _ = C._logit_rows(tap.steps)
    d = (R - L).abs()
    sp = C.float_spread(tap.steps, ltap.steps)
    k = max(x.get("k", 0) for x in sp); v = max(x.get("v", 0) for x in sp)
    print(f"{name:48s} logits max|Δ| {d.max():.4f} mean|Δ| {d.mean():.5f}  layer{LAYER} K max|Δ| {k:.4f} V {v:.4f}  top1 agree {(R.argmax(1)==L.argmax(1)).float().mean():.3f}")
    return R
stats("ours f32 cache (default)", ours32)
stats("ours --kv-dtype f16", ours16)
stats("emulation without F16 cache", emu_nof16)
stats("emulation with F16CacheKV (as shipped)", emu)
R1 = stats("emulation with --kv-dtype f16 cache", emu_kvdtype)
R0, _ = C._logit_rows(emu.steps)
print("emulation F16CacheKV vs f16-cache storage: logits identical:", torch.equal(R0, R1))
