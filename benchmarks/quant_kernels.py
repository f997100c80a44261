"""Microbenchmark of the quantised-weight kernels (:mod:`infertrace.quant.linear`) per GGUF type.

    python benchmarks/quant_kernels.py [--shapes smol,gemma,2k,4k] [--types Q4_K,Q6_K,...] [--rounds 15]
        [--tokens 1,32] [--dtypes float32,bfloat16] [--threads N] [--fp32-int4]

For each (type, matrix shape [out, in], tokens, activation dtype) the contenders are the float
path (``F.linear`` on the dequantised matrix in the activation dtype: what ``--weights float``
runs) and every quantised kernel the type maps onto: ``dequant`` (int8 codes, one reused scratch
buffer), ``int4pack`` (Q4_0/Q4_1/Q4_K), ``int4x2`` (two int4 planes: the group-32 5- and 8-bit
types), ``int4pair16`` (group-16 types on a doubled ``in``: Q6_K). Weights are random codes in the type's range with random scales (speed does not depend
on the values). The machine is shared (2 cores, other processes compiling and testing), so the
contenders alternate inside every round, each timing is the median of a few calls, and the table
prints the median over rounds, the minimum, and the median of the per-round ratio to the float
path (same round, same machine state). Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from infertrace.quant.blocks import CODES, Affine
from infertrace.quant.linear import DequantLinear, Int4PackLinear, Int4Pair16Linear, Int4x2Linear

SHAPES = {
    "smol": [("smol q", 576, 576), ("smol kv", 192, 576), ("smol gate", 1536, 576), ("smol down", 576, 1536),
             ("smol head", 49152, 576)],
    "gemma": [("gemma q", 1024, 640), ("gemma o", 640, 1024), ("gemma gate", 2048, 640), ("gemma down", 640, 2048)],
    "2k": [("2k sq", 2048, 2048), ("2k up", 8192, 2048)],
    "4k": [("4k sq", 4096, 4096), ("4k up", 14336, 4096), ("4k down", 4096, 14336)],
}
FP32_INT4 = False
TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0"]


def synthetic(type_name: str, n: int, k: int, seed: int = 0) -> Affine:
    """Random codes and scales of ``type_name``'s layout: ``[n, k]``."""
    lo, hi, g, has_off = CODES[type_name]
    rng = np.random.default_rng(seed)
    q = rng.integers(lo, hi + 1, size=(n, k), dtype=np.int16).astype(np.int8)  # [n, k]
    s = (rng.random((n, k // g), dtype=np.float32) * 0.01).astype(np.float32)  # [n, k/g]
    off = -(rng.random((n, k // g), dtype=np.float32) * 0.05) if has_off else None
    return Affine(q, s, off, g)


def contenders(type_name: str, a: Affine, dt: torch.dtype) -> dict:
    w = DequantLinear(a, type_name, torch.float32).dequantize().to(dt)  # [n, k] the float path's matrix
    out = {"float": lambda x: F.linear(x, w), "dequant": DequantLinear(a, type_name, dt)}
    if dt == torch.float32 and not FP32_INT4:
        # torch's fp32 int4 matmul is 30-200x the float path (first run of this script: smol/gemma shapes, one
        # token) and, timed in the same rounds, its threads slowed every other contender: --fp32-int4 to see it
        return out
    if type_name in ("Q4_0", "Q4_1", "Q4_K"):
        out["int4pack"] = Int4PackLinear(a, type_name, dt)
    if a.group == 32:
        out["int4x2"] = Int4x2Linear(a, type_name, dt)
    else:
        out["int4pair16"] = Int4Pair16Linear(a, type_name, dt)
    return out


def time_call(f, x, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        f(x)
    return (time.perf_counter() - t0) / inner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="smol,gemma,2k,4k")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--tokens", default="1,32")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default). On a 2-core machine "
                    "shared with other work, 1 thread avoids the 10-20 ms stalls of a parallel op waiting for its second thread")
    ap.add_argument("--fp32-int4", action="store_true", help="also time the int4 kernels with float32 activations")
    args = ap.parse_args()
    global FP32_INT4
    FP32_INT4 = args.fp32_int4
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median over {args.rounds} alternating rounds "
          "(min in brackets), ratio = median of per-round time / float path")
    print("| type | shape [out, in] | tokens | act | " + " | ".join(["float ms", "dequant", "int4pack", "int4x2", "int4pair16"]) + " |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for tn in args.types.split(","):
        for group in args.shapes.split(","):
            for label, n, k in SHAPES[group]:
                a = synthetic(tn, n, k)
                for dname in args.dtypes.split(","):
                    dt = getattr(torch, dname)
                    cs = contenders(tn, a, dt)
                    for m in (int(t) for t in args.tokens.split(",")):
                        x = torch.randn(m, k).to(dt)
                        for f in cs.values():
                            f(x)  # warm-up (scratch buffers, packing caches)
                        inner = 3 if n * k < (1 << 22) else 1
                        times = {c: [] for c in cs}
                        for _ in range(args.rounds):
                            for c, f in cs.items():
                                times[c].append(time_call(f, x, inner))
                        fl = times["float"]
                        cells = [f"{statistics.median(fl) * 1e3:.3f} [{min(fl) * 1e3:.3f}]"]
                        for c in ("dequant", "int4pack", "int4x2", "int4pair16"):
                            if c not in times:
                                cells.append("-")
                                continue
                            ratio = statistics.median(t / f0 for t, f0 in zip(times[c], fl))
                            cells.append(f"{statistics.median(times[c]) * 1e3:.3f} [{min(times[c]) * 1e3:.3f}] ×{ratio:.2f}")
                        print(f"| {tn} | {label} [{n}, {k}] | {m} | {dname} | " + " | ".join(cells) + " |", flush=True)
                    del cs


if __name__ == "__main__":
    main()
