"""Aggregate decode tokens/s with 1, 4, 8 and 16 concurrent requests, per KV backend, on the default
model (tracing off), printed as a table with the speedup over one request.

    python benchmarks/batching.py [--concurrency 1 4 8 16] [--tokens 32] [--backends cells paged] [--repeats 3] [--threads N]

Method: all requests are added at step 0 and prefilled together in the first step (greedy,
ignore_eos, ``--tokens`` + 1 new tokens each); then every step decodes one token for every
request, and only those steps are timed: tokens/s = requests × decode steps / seconds.
The issue's goal: 8 concurrent requests reach >= 5x the tokens/s of one. Nothing is asserted
(the numbers depend on the machine and its load). The machine's speed drifts within minutes, so
contenders alternate run by run: each repeat runs every (backend, concurrency) once, figures are
medians over ``--repeats``, and speedups/backend ratios are medians of same-repeat ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.loading.registry import default_model_path
from infertrace.runner import load_model
from infertrace.threads import apply_threads, choose_threads

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at",
    "The three primary colors are",
    "import numpy as np",
    "In 1492, Columbus",
    "The quick brown fox",
]


def decode_tps(loaded, backend: str, n: int, tokens: int) -> tuple[float, int]:
    """Aggregate decode tokens/s of ``n`` concurrent requests; returns (tokens/s, timed steps)."""
    tok = loaded.tokenizer
    e = Engine(loaded.model, tok, EngineOptions(backend=backend, ctx_size=2048, tokens_per_block=16))
    for i in range(n):
        e.add_request(tok.encode(PROMPTS[i % len(PROMPTS)]), SamplingParams(max_new_tokens=tokens + 1, ignore_eos=True))
    b = e.step()  # prefill of all requests (+ first token each)
    assert b is not None and len(b.chunks) == n and all(c.phase == "prefill" for c in b.chunks)
    steps, t0 = 0, time.perf_counter()
    while (b := e.step()) is not None:
        assert len(b.chunks) == n and all(c.phase == "decode" for c in b.chunks)
        steps += 1
    dt = time.perf_counter() - t0
    return n * steps / dt, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per request (timed)")
    ap.add_argument("--backends", nargs="+", default=["cells", "paged"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: infertrace's policy, the cores available now; OpenMP "
                         "threads that wait on a descheduled sibling make small ops 10-50x slower)")
    a = ap.parse_args()
    choice = choose_threads(a.threads)
    apply_threads(choice)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()} ({choice.reason}), model {default_model_path().name}, "
          f"dtype {a.dtype}, {a.tokens} decode tokens per request")
    loaded = load_model(dtype=a.dtype)
    for be in a.backends:
        decode_tps(loaded, be, 2, 4)  # warm-up
    # every repeat runs each (backend, concurrency) once, in turn: the machine's drift hits all alike;
    # a speedup is the median over repeats of (n requests / 1 request) measured in the same repeat
    runs: dict[tuple[str, int], list[float]] = {(be, n): [] for be in a.backends for n in a.concurrency}
    for r in range(a.repeats):
        for n in a.concurrency:
            for be in a.backends:
                tps = decode_tps(loaded, be, n, a.tokens)[0]
                runs[(be, n)].append(tps)
                print(f"  repeat {r}: {be:<6} {n:>3} requests: {tps:8.1f} tok/s", flush=True)
    n0 = a.concurrency[0]
    print()
    print(f"{'backend':<8} {'requests':>8} {'decode tok/s':>13} {'per request':>12} {f'speedup vs {n0}':>13}"
          f"  (medians of {a.repeats}; speedup = median of same-repeat ratios)")
    speed = {}
    for be in a.backends:
        for n in a.concurrency:
            v = runs[(be, n)]
            sp = statistics.median(x / y for x, y in zip(v, runs[(be, n0)]))
            speed[(be, n)] = sp
            print(f"{be:<8} {n:>8} {statistics.median(v):>13.1f} {statistics.median(v) / n:>12.1f} {sp:>12.2f}x")
    if len(a.backends) > 1:
        b0, b1 = a.backends[:2]
        for n in a.concurrency:
            ratio = statistics.median(x / y for x, y in zip(runs[(b1, n)], runs[(b0, n)]))
            print(f"{b1}/{b0} at {n:>2} requests (median of same-repeat ratios): {ratio:.2f}x")
    for be in a.backends:
        if (be, 8) in speed and n0 == 1:
            sp = speed[(be, 8)]
            print(f"goal (8 concurrent >= 5x one), {be}: {sp:.2f}x {'met' if sp >= 5 else 'NOT met'}")

if __name__ == "__main__":
    main()
