"""Numerics of the quantised path on the real models (issue 20 item 6): SmolLM2-135M Q4_1 and Gemma 3
270M Q4_K_M, logits of every position of teacher-forced sequences, against HF transformers (fp32, its own
GGUF dequantisation) and against llama.cpp (llama-cpp-python on the same file, its default CPU path).

    python benchmarks/quant_parity.py [--models smollm2-135m,gemma3-270m] [--new 16] [--threads 2]

Sequences: three prompts, each followed by HF's 16 greedy tokens (every path sees the same ids).
Paths: ``quant-bf16`` (``--weights quant --dtype bfloat16``, the default for a GGUF), ``float-bf16`` (the
float path in bfloat16: the size of a bf16 rounding alone), ``float-fp32`` (the reference of the goldens).
Per path and reference: top-1 / top-5 agreement over all positions (top-5 as an ordered list and as a
set), the largest KL(ref || ours) of a position (nats) and the largest |Δ| of a logit.
Prints a markdown table (the one in benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Day 3: the lighthouse keeper counted 16 ships, wrote the number in the blue ledger, and walked"]


def hf_model(path: Path):
    import transformers

    with contextlib.redirect_stderr(io.StringIO()):
        m = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return m.eval()


@torch.no_grad()
def hf_sequences(m, tok, n_new: int) -> list[list[int]]:
    """Each prompt's ids followed by HF's ``n_new`` greedy tokens."""
    out = []
    for p in PROMPTS:
        ids = tok.encode(p)
        for _ in range(n_new):
            ids.append(int(m(torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(ids)
    return out


@torch.no_grad()
def hf_logits(m, ids: list[int]) -> torch.Tensor:
    return m(torch.tensor([ids])).logits[0].float()  # [T, V]


def ours_logits(loaded, ids: list[int]) -> torch.Tensor:
    """Every position's logits ``[T, V]`` (float32) of one prefill of ``ids`` through our model."""
    from infertrace.engine.engine import EngineOptions, make_kv
    from infertrace.kv.base import ChunkSpec

    kv = make_kv(loaded.model, EngineOptions(backend="cells", ctx_size=256), "torch")
    inp = kv.prepare([ChunkSpec(0, 0, len(ids))])
    return loaded.model.forward(torch.tensor(ids), inp, kv, torch.arange(len(ids))).float()  # [T, V]


def llamacpp_logits(path: Path, seqs: list[list[int]], threads: int) -> list[torch.Tensor]:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=256, n_batch=256, logits_all=True, n_threads=threads, verbose=False)
    out = []
    for ids in seqs:
        llm.reset()
        llm.eval(ids)
        out.append(torch.tensor(llm.scores[: len(ids)], dtype=torch.float32))  # [T, V]
    llm.close()
    return out


def stats(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, float]:
    """Top-1 / top-5 agreement (fraction of positions), max KL(ref || ours) and max |Δ| over all positions."""
    n = t1 = t5 = t5s = 0
    kl = dmax = 0.0
    for a, b in zip(ours, ref):
        v = min(a.shape[-1], b.shape[-1])
        a, b = a[:, :v].double(), b[:, :v].double()
        ia, ib = a.topk(5).indices, b.topk(5).indices  # [T, 5]
        n += a.shape[0]
        t1 += int((ia[:, 0] == ib[:, 0]).sum())
        t5 += int((ia == ib).all(-1).sum())
        t5s += sum(set(x.tolist()) == set(y.tolist()) for x, y in zip(ia, ib))
        lp, lq = b.log_softmax(-1), a.log_softmax(-1)
        kl = max(kl, float((lp.exp() * (lp - lq)).sum(-1).max()))
        dmax = max(dmax, float((a - b).abs().max()))
    return {"top1": t1 / n, "top5": t5 / n, "top5set": t5s / n, "kl": kl, "max_abs": dmax, "positions": n}


def measure(name: str, n_new: int, threads: int) -> list[tuple[str, str, dict]]:
    from infertrace.loading.model import load_model
    from infertrace.loading.registry import resolve_model

    path = resolve_model(name)
    paths = {"quant-bf16": dict(dtype="bfloat16", weights="quant"), "float-bf16": dict(dtype="bfloat16", weights="float"),
             "float-fp32": dict(dtype="float32", weights="float")}
    m = hf_model(path)
    loaded = load_model(path, **paths["float-fp32"])
    seqs = hf_sequences(m, loaded.tokenizer, n_new)
    refs = {"hf": [hf_logits(m, s) for s in seqs]}
    del m
    refs["llama.cpp"] = llamacpp_logits(path, seqs, threads)
    rows = []
    for p, kw in paths.items():
        lo = loaded if p == "float-fp32" else load_model(path, **kw)
        ours = [ours_logits(lo, s) for s in seqs]
        for r, ref in refs.items():
            rows.append((p, r, stats(ours, ref)))
    rows.append(("float-fp32 (HF)", "llama.cpp", stats(refs["hf"], refs["llama.cpp"])))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print("| model | ours | against | positions | top-1 equal | top-5 equal (ordered / as a set) | max KL (nats) | max abs Δ logit |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name in a.models.split(","):
        for p, r, s in measure(name, a.new, a.threads):
            print(f"| {name} | {p} | {r} | {s['positions']} | {s['top1']:.3f} | {s['top5']:.3f} / {s['top5set']:.3f} "
                  f"| {s['kl']:.2e} | {s['max_abs']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
