"""Served throughput of a real ``vllm serve`` with infertrace's vLLM plugin: not installed, installed and off,
and recording (one marked request of 8 concurrent).

Three servers run side by side on the default model (SmolLM2-135M converted as ``--runtime vllm`` does;
each idle while another is measured); rounds alternate A, B, C, A, B, C ...; each round sends
``--concurrency`` requests at once (greedy, ``--max-tokens`` each, ``ignore_eos``) and measures output
tokens per second of wall time. Prints the medians and the ratios to A as JSON.

* A ``none``: the plugin's entry point is not on the server's path (vLLM finds no ``infertrace`` plugin).
* B ``off``: the entry point is there, ``INFERTRACE_SPOOL`` unset: :func:`register` returns at once.
* C ``on``: ``INFERTRACE_SPOOL`` set: the engine core records every step; one request of the round is marked
  (``vllm_xargs``), so the worker captures layer ``--layer`` of every step it runs in.

Usage: ``python benchmarks/served_overhead.py --rounds 7`` (about 10 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.vllm_served import Server  # noqa: E402


def _round(srv: Server, n: int, max_tokens: int, mark: bool) -> float:
    c = srv.client()

    def one(i: int) -> int:
        xb = {"ignore_eos": True}
        if mark and i == 0:
            xb["vllm_xargs"] = {"infertrace": "bench"}
        r = c.completions.create(model="smol", prompt=f"Request {i}: list the numbers from one to ten.",
                                 max_tokens=max_tokens, temperature=0, extra_body=xb)
        return int(r.usage.completion_tokens)

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(n) as ex:
        toks = sum(ex.map(one, range(n)))
    return toks / (time.perf_counter() - t0)


def main() -> None:
    from infertrace.loading.registry import default_model_path
    from infertrace.runtimes.vllm.convert import hf_dir_for

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--layer", type=int, default=3)
    a = ap.parse_args()
    model = hf_dir_for(default_model_path())
    d = Path(tempfile.mkdtemp(prefix="served-bench-"))
    args = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "32", "--enable-prefix-caching",
            "--max-num-seqs", str(a.concurrency), "--max-num-batched-tokens", "512"]
    cfgs = {"none": ({}, False), "off": ({}, True),
            "on": ({"INFERTRACE_SPOOL": str(d / "spool"), "INFERTRACE_LAYER": str(a.layer)}, True)}
    servers: dict[str, Server] = {}
    try:
        for k, (env, plugin) in cfgs.items():
            servers[k] = Server(model, args, env, d / f"{k}.log", plugin=plugin)
            print(f"{k}: started in {servers[k].wait(900):.0f} s", file=sys.stderr)
        for s in servers.values():  # warm-up round each
            _round(s, a.concurrency, 4, False)
        got: dict[str, list[float]] = {k: [] for k in cfgs}
        for r in range(a.rounds):
            for k, s in servers.items():
                got[k].append(_round(s, a.concurrency, a.max_tokens, k == "on"))
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in got.items()), file=sys.stderr)
    finally:
        for s in servers.values():
            s.stop()
    med = {k: statistics.median(v) for k, v in got.items()}
    print(json.dumps({"rounds": a.rounds, "concurrency": a.concurrency, "max_tokens": a.max_tokens, "tok_per_s": got,
                      "median_tok_per_s": med, "off_vs_none": med["off"] / med["none"],
                      "on_vs_none": med["on"] / med["none"]}, indent=1))


if __name__ == "__main__":
    main()
