"""Prefill time saved by prefix caching, and the cost of ``--audit-kv``, on the default model.

    python benchmarks/serving.py [--repeats 5] [--backends cells paged] [--new-tokens 4] [--threads N]

Workload: 8 requests share a long system prompt (~250 tokens) and differ in a short question.
Request 0 arrives at step 0, the 7 others at step 1 (after request 0's prefill, so its blocks/cells
can be hit; requests arriving in the same step as the first computation of a prefix cannot hit it,
in vLLM as here). Greedy, ignore_eos, tracing off.

Contenders are alternated run by run (off, on, off, on, ...) so drift of a shared machine hits
both alike; each figure is the median of ``--repeats`` runs, and each ratio is the ratio of the
medians. Reported per backend:

* prefill: wall time of the whole run with 1 new token per request (prefill + sampling only),
  prefix cache off vs on, and the prompt tokens actually computed;
* audit: wall time of the same 8 requests with ``--new-tokens`` new tokens, prefix cache on,
  ``--audit-kv`` off vs on (the audit recomputes every cached sequence from scratch every step).

Nothing is asserted; the numbers depend on the machine and its load.
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

SYSTEM = (
    "You are a careful assistant for a public library. Answer questions about opening hours, borrowing rules, "
    "late fees, room bookings, printing, the children's reading club, accessibility services and local history "
    "collections. Opening hours are Monday to Friday from nine in the morning to eight in the evening, Saturday "
    "from ten to five, closed on Sunday and public holidays. Members may borrow up to twelve items for three weeks "
    "and renew twice unless another member has reserved the item. Late fees are twenty cents per day per item, "
    "capped at five dollars, and are waived for children under twelve. Study rooms seat four people and can be "
    "booked two weeks ahead for at most three hours a day. Printing costs ten cents a page in black and white and "
    "fifty cents in colour. The reading club meets on Wednesdays at four. Step-free access is available at the "
    "north entrance, and large-print books are on the ground floor. Always answer briefly and politely.\n\n"
)
QUESTIONS = ["When do you open on Saturday?", "How many books can I borrow?", "What is the late fee?",
             "Can I book a study room?", "How much is colour printing?", "When does the reading club meet?",
             "Is there step-free access?", "Where are the large-print books?"]


def run_once(loaded, backend: str, prefix: bool, audit: bool, new_tokens: int) -> tuple[float, int, list[list[int]]]:
    """Wall seconds of one run, prompt tokens computed, outputs."""
    tok = loaded.tokenizer
    e = Engine(loaded.model, tok, EngineOptions(backend=backend, ctx_size=4096, tokens_per_block=16,
                                                prefix_cache=prefix, audit_kv=audit))
    for i, q in enumerate(QUESTIONS):
        e.add_request(tok.encode(SYSTEM + q), SamplingParams(max_new_tokens=new_tokens, ignore_eos=True),
                      arrival_step=0 if i == 0 else 1)
    computed = 0
    t0 = time.perf_counter()
    while (b := e.step()) is not None:
        computed += sum(c.T for c in b.chunks if c.phase == "prefill")
    dt = time.perf_counter() - t0
    return dt, computed, [r.output_ids for r in e.requests.values()]


def alternate(loaded, backend: str, a: dict, b: dict, repeats: int, new_tokens: int):
    """Median seconds of contenders ``a`` and ``b`` (run alternately), tokens computed, outputs equal?"""
    ta, tb, ca, cb, same = [], [], 0, 0, True
    for _ in range(repeats):
        dt, ca, oa = run_once(loaded, backend, new_tokens=new_tokens, **a)
        ta.append(dt)
        dt, cb, ob = run_once(loaded, backend, new_tokens=new_tokens, **b)
        tb.append(dt)
        same &= oa == ob
    return statistics.median(ta), statistics.median(tb), ca, cb, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backends", nargs="+", default=["cells", "paged"])
    ap.add_argument("--new-tokens", type=int, default=4, help="new tokens per request in the audit comparison")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (1 on a shared CPU)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    loaded = load_model(dtype=a.dtype)
    n_sys = len(loaded.tokenizer.encode(SYSTEM))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, model {default_model_path().name}, "
          f"dtype {a.dtype}; 8 requests, shared system prompt {n_sys} tokens; median of {a.repeats}, alternated")
    for be in a.backends:
        run_once(loaded, be, True, False, 1)  # warm-up
        off, on, c_off, c_on, same = alternate(loaded, be, {"prefix": False, "audit": False},
                                               {"prefix": True, "audit": False}, a.repeats, 1)
        print(f"{be:<6} prefill, prefix cache off: {off * 1e3:8.1f} ms ({c_off} prompt tokens computed)")
        print(f"{be:<6} prefill, prefix cache on : {on * 1e3:8.1f} ms ({c_on} prompt tokens computed)  "
              f"time ratio on/off {on / off:.3f} (saved {100 * (1 - on / off):.1f} %), same outputs: {same}")
        plain, audited, _, _, same = alternate(loaded, be, {"prefix": True, "audit": False},
                                               {"prefix": True, "audit": True}, a.repeats, a.new_tokens)
        print(f"{be:<6} {a.new_tokens} new tokens, audit off: {plain * 1e3:8.1f} ms, audit on: {audited * 1e3:8.1f} ms  "
              f"cost ratio {audited / plain:.2f}x, same outputs: {same}", flush=True)


if __name__ == "__main__":
    main()
