"""Logit and greedy-token agreement with HF transformers on the same GGUF (fp32), per prompt.

    python benchmarks/agreement.py [--model gemma3-270m] [--tokens 32]

Prints, per prompt: its length in tokens, the last-prompt-token logit max |Δ| against HF, and how
many of the first ``--tokens`` greedy tokens equal HF's. The prompts are those of
``tests/real_models/test_gemma3_real.py`` (one longer than 600 tokens). Measured, not asserted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infertrace.engine.engine import Engine, EngineOptions  # noqa: E402
from infertrace.engine.sampler import SamplingParams  # noqa: E402
from infertrace.loading.registry import resolve_model  # noqa: E402
from infertrace.runner import load_model  # noqa: E402
from tests.test_gemma3_real import PROMPTS, _greedy_hf, _prefill_logits  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    import transformers

    path = resolve_model(a.model)
    ours = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    print(f"model {path.name}, transformers {transformers.__version__}, torch {torch.__version__}")
    print(f"{'prompt':<32} {'tokens':>6} {'max|Δ| logits':>14} {'greedy equal':>13}")
    for p in PROMPTS:
        ids = ours.tokenizer.encode(p)
        want, ref = _greedy_hf(hf, ids, a.tokens)
        d = (_prefill_logits(ours, ids, "cells", len(ids)) - ref).abs().max().item()
        e = Engine(ours.model, ours.tokenizer, EngineOptions(ctx_size=2048))
        r = e.add_request(ids, SamplingParams(max_new_tokens=a.tokens, ignore_eos=True))
        e.run()
        same = next((i for i, (x, y) in enumerate(zip(r.output_ids, want)) if x != y), a.tokens)
        print(f"{p[:30]!r:<32} {len(ids):>6} {d:>14.2e} {same:>6}/{a.tokens}")


if __name__ == "__main__":
    main()
