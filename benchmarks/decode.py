"""Decode tokens/s on the default model: engine (tracing off), engine (default trace), and HF
transformers on the same GGUF, in one run, printed with ratios.

    python benchmarks/decode.py [--model smollm2-135m|gemma3-270m|PATH] [--tokens 64] [--repeats 3] [--dtype float32] [--skip-hf]

Decode speed = generated tokens after the first / time spent after prefill. Each figure is the
median of ``--repeats`` runs. Nothing here is asserted: speed is measured, not tested.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.model.decoder import NULL_TRACER
from infertrace.model.registry import resolve_model
from infertrace.runner import load_model
from infertrace.trace.recorder import Recorder

PROMPT = "The capital of France is"


def engine_decode_tps(loaded, n: int, trace: bool, backend: str) -> float:
    tok = loaded.tokenizer
    tracer = Recorder(tok, loaded.config) if trace else NULL_TRACER
    e = Engine(loaded.model, tok, EngineOptions(backend=backend), tracer)
    e.add_request(tok.encode(PROMPT), SamplingParams(max_new_tokens=n + 1, ignore_eos=True))
    e.step()  # prefill + first token
    t0 = time.perf_counter()
    steps = 0
    while e.step() is not None:
        steps += 1
    return steps / (time.perf_counter() - t0)


def hf_decode_tps(n: int, p) -> float:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids

    def gen(k: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=tok.eos_token_id)
        return time.perf_counter() - t0

    gen(2)
    t_prefill = gen(1)
    t_all = gen(n + 1)
    return n / max(1e-9, t_all - t_prefill)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", help="engine weight dtype (float32, float16, bfloat16)")
    ap.add_argument("--backend", default="cells")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--model", default=None, help="model name (smollm2-135m, gemma3-270m) or path; default smollm2-135m")
    ap.add_argument("--skip-fp16", action="store_true", help="do not also measure the engine in float16")
    a = ap.parse_args()
    path = resolve_model(a.model)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, model {path.name}")
    rows = []
    for dtype in dict.fromkeys([a.dtype] + ([] if a.skip_fp16 else ["float16"])):
        loaded = load_model(path, dtype=dtype)
        engine_decode_tps(loaded, 4, False, a.backend)  # warm-up
        for trace in (False, True):
            v = statistics.median(engine_decode_tps(loaded, a.tokens, trace, a.backend) for _ in range(a.repeats))
            rows.append((f"infertrace {a.backend} {dtype}, trace {'default' if trace else 'off'}", v))
    hf = None
    if not a.skip_hf:
        hf = statistics.median(hf_decode_tps(a.tokens, path) for _ in range(a.repeats))
        rows.append(("HF transformers float32 (same GGUF)", hf))
    w = max(len(r[0]) for r in rows)
    print(f"{'decode tokens/s':<{w}}  {'tok/s':>7}  {'vs HF':>6}")
    for name, v in rows:
        ratio = f"{v / hf:5.2f}x" if hf else "   -  "
        print(f"{name:<{w}}  {v:7.1f}  {ratio:>6}")
    base = {n.split(", trace")[0]: v for n, v in rows if n.endswith("off")}
    for n, v in rows:
        if n.endswith("default"):
            off = base[n.split(", trace")[0]]
            print(f"tracing overhead ({n.split(', trace')[0]}): {100 * (1 - v / off):.1f}% slower with the default trace")


if __name__ == "__main__":
    main()
