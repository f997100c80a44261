#!/usr/bin/env python
"""Benchmark the Triton paged-attention kernels on a GPU.

Decode (one query per request, T == 1): batch 1..64 x kv_len 1k..32k, achieved HBM
bandwidth (unique K/V bytes read + q/out) against the device peak, and against
``torch.nn.functional.scaled_dot_product_attention`` on the same K/V gathered into
contiguous ``[batch, n_kv_heads, kv_len, head_dim]`` tensors. Goal on an H200: >= 70% of
peak HBM bandwidth for kv_len >= 4k (at sizes where the read is not launch-latency bound).

Prefill (T tokens per request, no cache): TFLOP/s of the varlen kernel (causal FLOPs
``4 * n_head * head_dim * sum(T*(T+1)/2)``) against SDPA ``is_causal``.

Timings are CUDA-event medians of CUDA-graph replays (Python launch overhead excluded;
``--no-graph`` times eager calls), with L2 flushed before each replay.

Peak bandwidth: detected from the device name (H200, H100 SXM/PCIe/NVL, A100 40/80 GB)
or given with ``--peak-gbps``.

Without a GPU: prints that none is present and exits 0; ``--smoke`` then runs a tiny
parity check of the kernels through Triton's interpreter (``TRITON_INTERPRET=1``).

Usage::

    python benchmarks/attention.py                 # full decode grid + prefill
    python benchmarks/attention.py --quick         # smaller grid (gpu_check.sh)
    python benchmarks/attention.py --sweep         # decode launch-config sweep at one shape
    python benchmarks/attention.py --smoke         # CPU: interpreter parity smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name fragment -> peak HBM GB/s (vendor datasheets); first match wins, most specific first
PEAKS_GBPS: list[tuple[str, float]] = [
    ("GH200", 4000.0),
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIE", 2000.0),
    ("H100", 3350.0),  # SXM5 80GB HBM3
    ("H800", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIE", 1935.0),
    ("A100-PCIE-80GB", 1935.0),
    ("A100", 1555.0),  # 40 GB parts
]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def detect_peak_gbps(name: str) -> float | None:
    up = name.upper()
    for frag, gbps in PEAKS_GBPS:
        if frag.upper() in up:
            return gbps
    return None


def _ints(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        out.append(int(part.rstrip("k")) * mult)
    return out


class Timer:
    """Median time of ``fn`` in microseconds: CUDA events over graph replays (or eager
    calls), L2 flushed before each; on CPU (interpreter smoke run) wall-clock."""

    def __init__(self, iters: int, graph: bool, device: torch.device):
        self.iters = iters
        self.cuda = device.type == "cuda"
        self.graph = graph and self.cuda
        self.flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device) if self.cuda else None  # > L2

    def __call__(self, fn) -> float:
        if not self.cuda:
            fn()
            times = []
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        for _ in range(3):  # compile + warm up
            fn()
        torch.cuda.synchronize()
        run = fn
        if self.graph:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                run = g.replay
            except Exception as exc:  # noqa: BLE001 - report and fall back to eager timing
                print(f"  (graph capture failed: {type(exc).__name__}: {exc}; timing eager)")
                torch.cuda.synchronize()
        times = []
        for _ in range(self.iters):
            self.flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000.0)
        return statistics.median(times)


def make_uniform_batch(batch, cached, T, n_kv, n_head, hd, tpb, dtype, dev, seed=0):
    """Requests of C = cached, T current tokens each, shuffled block ids, on ``dev``."""
    g = torch.Generator(device=dev).manual_seed(seed)
    L = cached + T
    nb = -(-L // tpb)
    total = batch * nb
    pool = torch.empty(total, 2, n_kv, tpb, hd, device=dev, dtype=dtype)  # [blocks, 2, Hkv, B, hd]
    pool.normal_(generator=g)
    perm = torch.randperm(total, device=dev, generator=g).to(torch.int32)  # [blocks]
    bt = perm.view(batch, nb)  # [batch, nb]
    seq_lens = torch.full((batch,), T, dtype=torch.int32, device=dev)  # [batch]
    kv_lens = torch.full((batch,), L, dtype=torch.int32, device=dev)  # [batch]
    cu = torch.arange(0, (batch + 1) * T, T, dtype=torch.int32, device=dev)  # [batch+1]
    q = torch.randn(batch * T, n_head, hd, device=dev, dtype=dtype, generator=g)  # [N, H, hd]
    return q, pool, bt, seq_lens, kv_lens, cu


def gather_contiguous(pool, bt, L):
    """Paged pool -> contiguous K, V ``[batch, n_kv, L, hd]`` (what SDPA reads)."""
    b, nb = bt.shape
    kv = pool[bt.long()]  # [b, nb, 2, Hkv, B, hd]
    k = kv[:, :, 0].permute(0, 2, 1, 3, 4).reshape(b, pool.shape[2], nb * pool.shape[3], -1)[:, :, :L]  # [b, Hkv, L, hd]
    v = kv[:, :, 1].permute(0, 2, 1, 3, 4).reshape(b, pool.shape[2], nb * pool.shape[3], -1)[:, :, :L]  # [b, Hkv, L, hd]
    return k.contiguous(), v.contiguous()


def sdpa_fn(q4, k, v, causal):
    """SDPA on [b, H, Tq, hd] x [b, Hkv, L, hd] with GQA (enable_gqa when torch has it)."""
    F = torch.nn.functional
    group = q4.shape[1] // k.shape[1]
    try:
        F.scaled_dot_product_attention(q4[:1, :, :1], k[:1, :, :16], v[:1, :, :16], enable_gqa=True)
        return lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=causal, enable_gqa=True)
    except TypeError:  # torch < 2.5: expand heads (reads group x more bytes)
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [b, H, L, hd]
        return lambda: F.scaled_dot_product_attention(q4, ke, ve, is_causal=causal)


def _free_bytes(dev: torch.device) -> float:
    return torch.cuda.mem_get_info()[0] if dev.type == "cuda" else float("inf")


def _release(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def bench_decode(args, timer, peak, dev) -> float:
    """Decode table; returns the largest |triton - sdpa| seen."""
    from infertrace.attention.triton_paged import paged_attention_triton

    dtype = DTYPES[args.dtype]
    es = torch.finfo(dtype).bits // 8
    H, Hkv, hd, tpb = args.n_head, args.n_kv_heads, args.head_dim, args.tokens_per_block
    print(f"\n## decode  H={H} Hkv={Hkv} hd={hd} B={tpb} {args.dtype}  (peak {peak or '?'} GB/s)")
    print(f"{'batch':>5} {'kv_len':>7} {'triton_us':>10} {'GB/s':>8} {'%peak':>6} {'sdpa_us':>9} {'sdpa%pk':>7} {'speedup':>7} {'maxdiff':>8}")
    goal_rows = []
    worst_diff = 0.0
    for b in _ints(args.batches):
        for L in _ints(args.kv_lens):
            nbytes = b * L * Hkv * hd * 2 * es + 2 * b * H * hd * es  # unique K/V + q + out
            if 2.2 * nbytes > _free_bytes(dev):
                print(f"{b:>5} {L:>7}  skipped (memory)")
                continue
            q, pool, bt, sl, kl, cu = make_uniform_batch(b, L - 1, 1, Hkv, H, hd, tpb, dtype, dev)
            scale = hd**-0.5
            t_tr = timer(lambda: paged_attention_triton(q, pool, bt, sl, kl, cu, scale))
            out = paged_attention_triton(q, pool, bt, sl, kl, cu, scale)  # [b, H, hd]
            k, v = gather_contiguous(pool, bt, L)
            q4 = q.view(b, 1, H, hd).transpose(1, 2)  # [b, H, 1, hd]
            sd = sdpa_fn(q4, k, v, causal=False)
            t_sd = timer(sd)
            ref = sd().transpose(1, 2).reshape(b, H, hd)  # [b, H, hd]
            diff = (out.float() - ref.float()).abs().max().item()
            worst_diff = max(worst_diff, diff)
            bw = nbytes / (t_tr * 1e-6) / 1e9
            bw_sd = nbytes / (t_sd * 1e-6) / 1e9
            pk = f"{100 * bw / peak:5.1f}" if peak else "    ?"
            pk_sd = f"{100 * bw_sd / peak:6.1f}" if peak else "     ?"
            print(f"{b:>5} {L:>7} {t_tr:>10.1f} {bw:>8.0f} {pk:>6} {t_sd:>9.1f} {pk_sd:>7} {t_sd / t_tr:>7.2f} {diff:>8.1e}")
            if peak and L >= 4096:
                goal_rows.append((b, L, bw / peak))
            del q, pool, bt, k, v, out, ref
            _release(dev)
    if goal_rows:
        big = [r for r in goal_rows if r[0] * r[1] * Hkv * hd * 2 * es >= 64 * 2**20]  # >= 64 MiB read
        rows = big or goal_rows
        worst = min(rows, key=lambda r: r[2])
        ok = worst[2] >= 0.70
        print(
            f"goal (>= 70% peak for kv_len >= 4k, reads >= 64 MiB): {'MET' if ok else 'MISSED'}; "
            f"worst {100 * worst[2]:.1f}% at batch {worst[0]}, kv_len {worst[1]}"
        )
    return worst_diff


def bench_prefill(args, timer, dev, shapes) -> float:
    """Prefill table over ``shapes`` = [(batch, T), ...]; returns the largest |triton - sdpa|."""
    from infertrace.attention.triton_paged import paged_attention_triton

    dtype = DTYPES[args.dtype]
    H, Hkv, hd, tpb = args.n_head, args.n_kv_heads, args.head_dim, args.tokens_per_block
    print(f"\n## prefill  H={H} Hkv={Hkv} hd={hd} B={tpb} {args.dtype}  (causal, no cache)")
    print(f"{'batch':>5} {'T':>6} {'triton_us':>10} {'TFLOP/s':>8} {'sdpa_us':>9} {'sdpaTF/s':>8} {'maxdiff':>8}")
    worst_diff = 0.0
    for b, T in shapes:
        q, pool, bt, sl, kl, cu = make_uniform_batch(b, 0, T, Hkv, H, hd, tpb, dtype, dev)
        scale = hd**-0.5
        flops = 4 * H * hd * b * T * (T + 1) / 2
        t_tr = timer(lambda: paged_attention_triton(q, pool, bt, sl, kl, cu, scale))
        out = paged_attention_triton(q, pool, bt, sl, kl, cu, scale)  # [b*T, H, hd]
        k, v = gather_contiguous(pool, bt, T)
        q4 = q.view(b, T, H, hd).transpose(1, 2)  # [b, H, T, hd]
        sd = sdpa_fn(q4, k, v, causal=True)
        t_sd = timer(sd)
        ref = sd().transpose(1, 2).reshape(b * T, H, hd)  # [b*T, H, hd]
        diff = (out.float() - ref.float()).abs().max().item()
        worst_diff = max(worst_diff, diff)
        print(f"{b:>5} {T:>6} {t_tr:>10.1f} {flops / t_tr / 1e6:>8.1f} {t_sd:>9.1f} {flops / t_sd / 1e6:>8.1f} {diff:>8.1e}")
        del q, pool, bt, k, v, out, ref
        _release(dev)
    return worst_diff


def sweep_decode(args, timer, peak, dev):
    """Time decode launch configs (TILE_N, num_warps, num_stages) at three shapes."""
    from infertrace.attention import triton_paged as tp

    dtype = DTYPES[args.dtype]
    es = torch.finfo(dtype).bits // 8
    H, Hkv, hd, tpb = args.n_head, args.n_kv_heads, args.head_dim, args.tokens_per_block
    print(f"\n## decode config sweep  H={H} Hkv={Hkv} hd={hd} B={tpb} {args.dtype}")
    table = tp.DECODE_CONFIGS[4 if es >= 4 else 2]
    key = min((k for k in table if k >= hd), default=max(table))
    default = table[key]
    for b, L in [(1, 16384), (8, 8192), (64, 4096)]:
        q, pool, bt, sl, kl, cu = make_uniform_batch(b, L - 1, 1, Hkv, H, hd, tpb, dtype, dev)
        nbytes = b * L * Hkv * hd * 2 * es
        for cfg in [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 3)]:
            if hd >= 256 and cfg[0] >= 128:
                continue
            table[key] = cfg
            try:
                t = timer(lambda: tp.paged_attention_triton(q, pool, bt, sl, kl, cu, hd**-0.5))
                bw = nbytes / (t * 1e-6) / 1e9
                pk = f"{100 * bw / peak:.1f}%" if peak else "?"
                mark = " (default)" if cfg == default else ""
                print(f"  batch {b:>3} kv {L:>6} cfg {cfg}: {t:8.1f} us {bw:7.0f} GB/s {pk}{mark}")
            except Exception as exc:  # noqa: BLE001 - an out-of-resources config is a result too
                print(f"  batch {b:>3} kv {L:>6} cfg {cfg}: failed ({type(exc).__name__}: {str(exc)[:80]})")
        table[key] = default
        del q, pool, bt
        _release(dev)


def smoke_cpu(args) -> int:
    """Tiny run of the benchmark code on CPU, kernels through Triton's interpreter.

    Checks parity (triton vs SDPA) and exercises every table; timings are meaningless.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    from infertrace.attention.triton_paged import triton_available

    ok, why = triton_available()
    print(f"triton: {why}")
    if not ok:
        return 0
    dev = torch.device("cpu")
    args.batches, args.kv_lens = "1,3", "17,40"
    args.n_head, args.n_kv_heads, args.head_dim, args.tokens_per_block, args.dtype = 6, 2, 64, 16, "fp32"
    timer = Timer(1, graph=False, device=dev)
    diff = bench_decode(args, timer, None, dev)
    diff = max(diff, bench_prefill(args, timer, dev, [(1, 20), (2, 9)]))
    print(f"\ninterpreter smoke (GQA 3, hd 64, fp32): max |triton - sdpa| = {diff:.2e}")
    return 0 if diff < 1e-4 else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--kv-lens", default="1k,4k,16k,32k")
    ap.add_argument("--n-head", type=int, default=32)
    ap.add_argument("--n-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens-per-block", type=int, default=32)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--peak-gbps", type=float, default=None, help="device peak HBM bandwidth (GB/s)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="smaller grid (batch 1,8,64; kv 1k,4k,32k)")
    ap.add_argument("--sweep", action="store_true", help="decode launch-config sweep only")
    ap.add_argument("--no-graph", action="store_true", help="time eager calls instead of CUDA-graph replays")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="without a GPU: tiny interpreter run of the benchmark code")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("no GPU present (torch.cuda.is_available() is False): nothing to benchmark")
        return smoke_cpu(args) if args.smoke else 0
    os.environ.pop("TRITON_INTERPRET", None)
    if args.quick:
        args.batches, args.kv_lens = "1,8,64", "1k,4k,32k"
    name = torch.cuda.get_device_name()
    peak = args.peak_gbps or detect_peak_gbps(name)
    import triton

    print(f"device: {name}  peak HBM: {peak or 'unknown (pass --peak-gbps)'} GB/s  "
          f"torch {torch.__version__}  triton {triton.__version__}")
    dev = torch.device("cuda")
    timer = Timer(args.iters, graph=not args.no_graph, device=dev)
    if args.sweep:
        sweep_decode(args, timer, peak, dev)
        return 0
    bench_decode(args, timer, peak, dev)
    if not args.no_prefill:
        shapes = [(1, 1024), (4, 2048), (1, 8192)] if args.quick else [(1, 1024), (1, 4096), (8, 1024), (4, 2048), (1, 16384)]
        bench_prefill(args, timer, dev, shapes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
