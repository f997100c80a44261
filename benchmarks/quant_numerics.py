"""Numerics of the quantised kernels on the real models' tensors, per tensor type.

    python benchmarks/quant_numerics.py [--model smollm2-135m,gemma3-270m] [--tokens 8]

For one tensor of each type in each model (the first layer that has it), with ``x`` drawn from a
standard normal (``--tokens`` rows), prints the max |Δ| of the layer output ``x @ W.T`` of the
quantised kernel against the float path (``F.linear`` on gguf-py's dequantised ``W`` in the same
activation dtype), and both against a float64 product, for float32 and bf16 activations.
Nothing is asserted (``tests/unit/quant/test_quant.py`` holds the bounds).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGUFReader
from gguf import quants as gq

from infertrace.loading.registry import resolve_model
from infertrace.quant.blocks import DECODERS, split_rows
from infertrace.quant.source import KERNEL_CLASSES, choose_kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()
    print("| model | tensor | type | act | kernel | max |Δ| vs float path | quant vs f64 | float path vs f64 | max |y| |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for m in args.model.split(","):
        r = GGUFReader(str(resolve_model(m)))
        seen: set[str] = set()
        for t in r.tensors:
            tn = t.tensor_type.name
            if tn not in DECODERS or tn in seen or len(t.shape) != 2:
                continue
            seen.add(tn)
            data = np.asarray(t.data)
            rows = min(data.shape[0], 4096)  # embedding tables: the first 4096 rows
            data = data[:rows]
            w = torch.from_numpy(gq.dequantize(data, t.tensor_type))  # [out, in] float32, gguf-py
            a = split_rows(data, tn)
            x = torch.randn(args.tokens, w.shape[1], generator=torch.Generator().manual_seed(0))
            for dt in (torch.float32, torch.bfloat16):
                k = choose_kernel(tn, dt, tuple(w.shape))
                lin = KERNEL_CLASSES[k](a, tn, dt)
                xd = x.to(dt)
                ref = xd.double() @ w.double().T  # [T, out]
                yq, yf = lin(xd).double(), F.linear(xd, w.to(dt)).double()
                print(f"| {m} | {t.name} | {tn} | {str(dt)[6:]} | {k} | {(yq - yf).abs().max():.3g} | "
                      f"{(yq - ref).abs().max():.3g} | {(yf - ref).abs().max():.3g} | {ref.abs().max():.3g} |", flush=True)


if __name__ == "__main__":
    main()
