"""Triton paged attention: the GPU path of :func:`~infertrace.attention.reference.paged_attention_torch`.

Same contract as the torch twins in :mod:`infertrace.attention.reference` (read those
first): one layer's pool ``[num_blocks, 2, n_kv_heads, tokens_per_block, head_dim]``
(index 0 = K, 1 = V), ``block_tables`` int32 ``[num_seqs, max_blocks]`` padded with -1,
``seq_lens`` = current tokens T, ``kv_lens`` = C + T, ``cu_seqlens`` = prefix sums of
``seq_lens``; query j of request i sits at position ``kv_lens[i] - seq_lens[i] + j`` and
sees keys ``0..that position`` of request i only.

Runtime sources mirrored (facts only, no code taken):

* vLLM ``vllm/attention/ops/paged_attn.py`` (decode over block tables, one query per
  request; its V2 path partitions long sequences and merges the partitions with
  per-partition max logits / exp sums in a second kernel) and ``triton_unified_attention.py`` (moved to ``vllm/v1/attention/ops/`` in
  later releases): prefill and decode read the same block table; query heads of one KV
  head are packed into the rows of a tile so GQA costs one K/V read per KV head; the
  tile-to-request map is ``cu_seqlens[i] // BLOCK_Q + i`` found by binary search
  in-kernel (no host sync); long decodes are split into KV segments whose partial
  softmax states are merged by a second "reduce segments" kernel.
* TensorRT-LLM ``tensorrt_llm/_torch/attention_backend/trtllm.py``: the kernel gets
  per-request ``seq_lens`` / ``kv_lens`` and block offsets, not a dense mask; context
  (T > 1) and generation (T == 1) requests travel in one batch and the runtime runs a
  context kernel and a generation (XQA / masked-MHA, multi-block for long KV) kernel.

Kernels (all built lazily on first use, see :func:`_kernels`):

* ``_write_kv`` -- one program per token scatters its K and V rows into the pool by slot
  mapping (vLLM ``reshape_and_cache``).
* ``_prefill`` -- varlen flash attention: one program per (query tile of one request,
  KV head); rows of the tile are ``BLOCK_Q`` tokens x ``GROUP`` query heads (non
  power-of-2 groups such as SmolLM2's 3 simply leave the last rows idle); it streams the
  request's cached blocks plus its current tokens in ``TILE_N``-token tiles, unmasked
  below the tile's first query position and causally masked on the diagonal; online
  softmax in fp32 (base-2 exponent, ``scale * log2(e)`` folded into one multiply).
* ``_decode`` -- split-K flash decoding for requests with T == 1: one program per
  (request, KV head, split) handling all ``GROUP`` query heads of that KV head, so each
  K/V byte is read once; the number of splits is chosen on the host from the grid size
  and SM count (enough programs to keep HBM busy), each split covers an equal share of
  that request's KV tiles, and ``_reduce`` merges the per-split (output, log-sum-exp)
  pairs. With one split the decode kernel writes the output directly.

Both attention kernels are launched for every batch and each skips the requests that
are not its kind (T == 1 -> decode, T > 1 -> prefill), so a mixed batch needs no host
synchronisation; for a pure decode batch (N == num_seqs) the prefill launch is skipped.

Triton itself is imported only when a kernel is first needed, so importing this module
never fails without triton. ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors
through Triton's interpreter. Triton reads it when ``@triton.jit`` decorates a function
(not at launch): our kernels are decorated lazily, once per interpreter setting, and they
avoid ``tl.max`` / ``tl.sum`` / ``tl.zeros`` -- Triton's own ``@jit`` library, decorated
when triton is first imported -- so setting the variable after ``import triton`` works too
(see :func:`_bind_combiners`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from infertrace.errors import InfertraceError

# Bound lazily by _kernels(); the @triton.jit functions resolve `tl` / `triton` through
# this module's globals.
triton: Any = None
tl: Any = None
_max_combine: Any = None  # combine functions for tl.reduce, bound by _kernels()
_sum_combine: Any = None

_KERNELS: dict[bool, dict[str, Any]] = {}
_LOG2E = 1.4426950408889634


def interpreter_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter (read now, not cached).

    Same truthy spellings as Triton's own ``getenv_bool`` (``1``, ``true``, ``on``).
    """
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


def triton_available() -> tuple[bool, str]:
    """Whether the Triton kernels can run here, with a one-line reason for display.

    Returns:
        ``(True, reason)`` when triton imports and either ``TRITON_INTERPRET=1`` is set
        (interpreter on CPU tensors) or a CUDA device is present; ``(False, reason)``
        otherwise (triton missing, or no GPU and no interpreter).
    """
    try:
        import triton as _triton  # noqa: PLC0415 - lazy on purpose
    except Exception as exc:  # ImportError, or a broken install raising something else
        return False, f"triton is not importable ({type(exc).__name__}: {exc}); run `make setup-dev` in the infertrace checkout (or `.venv/bin/pip install -e '.[triton]'` there)"
    version = getattr(_triton, "__version__", "?")
    if interpreter_requested():
        return True, f"triton {version} interpreter (TRITON_INTERPRET=1), kernels run on CPU tensors"
    if torch.cuda.is_available():
        return True, f"triton {version} on CUDA ({torch.cuda.get_device_name()})"
    return False, f"triton {version} installed but no CUDA device; set TRITON_INTERPRET=1 to run it on CPU"


def _kernels() -> dict[str, Any]:
    """Import triton and build the kernels for the current ``TRITON_INTERPRET`` setting.

    Returns:
        dict with the jit functions ``write_kv``, ``prefill``, ``decode``, ``reduce``.

    Raises:
        InfertraceError: triton is not installed.
    """
    interpret = interpreter_requested()
    if interpret in _KERNELS:
        return _KERNELS[interpret]
    global triton, tl
    try:
        import triton as _triton  # noqa: PLC0415
        import triton.language as _tl  # noqa: PLC0415
    except ImportError as exc:
        raise InfertraceError(
            f"triton is not installed ({exc}); run `make setup-dev` in the infertrace checkout (or `.venv/bin/pip install -e '.[triton]'` there) or use --attention torch"
        ) from exc
    triton, tl = _triton, _tl
    _bind_combiners()

    @triton.jit
    def _write_kv(
        k_ptr, v_ptr, pool_ptr, slot_ptr,
        s_kn, s_kh, s_vn, s_vh,
        s_blk, s_kv, s_h, s_t,
        n_kv_heads,
        HEAD_DIM: tl.constexpr, TPB: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    ):
        tok = tl.program_id(0)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot < 0:  # padded token (vLLM convention): nothing to write
            return
        blk = slot // TPB
        off = slot % TPB
        h = tl.arange(0, H_PAD)  # [H_PAD]
        d = tl.arange(0, D_PAD)  # [D_PAD]
        m = (h[:, None] < n_kv_heads) & (d[None, :] < HEAD_DIM)  # [H_PAD, D_PAD]
        k = tl.load(k_ptr + tok * s_kn + h[:, None] * s_kh + d[None, :], mask=m)  # [H_PAD, D_PAD]
        v = tl.load(v_ptr + tok * s_vn + h[:, None] * s_vh + d[None, :], mask=m)  # [H_PAD, D_PAD]
        dst = pool_ptr + blk * s_blk + off * s_t + h[:, None] * s_h + d[None, :]  # [H_PAD, D_PAD]
        tl.store(dst, k.to(pool_ptr.dtype.element_ty), mask=m)
        tl.store(dst + s_kv, v.to(pool_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _prefill(
        q_ptr, pool_ptr, bt_ptr, seq_lens_ptr, kv_lens_ptr, cu_ptr, out_ptr,
        qk_scale, num_seqs, window,
        s_qn, s_qh, s_on, s_oh,
        s_blk, s_kv, s_h, s_t, s_bt,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TPB: tl.constexpr, TILE_N: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        # Request owning tile `pid`: the largest i with cu[i] // BLOCK_Q + i <= pid
        # (request i's tiles start there; the "+ i" leaves room for its partial tile).
        lo = tl.full([], 0, tl.int32)
        hi = tl.full([], 0, tl.int32) + num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            start = tl.load(cu_ptr + mid) // BLOCK_Q + mid
            if start <= pid:
                lo = mid
            else:
                hi = mid
        seq = lo
        q_start = tl.load(cu_ptr + seq)  # first packed row of the request
        q_tile = pid - (q_start // BLOCK_Q + seq)
        T = tl.load(seq_lens_ptr + seq)
        if T <= 1:  # decode requests (and empty ones) belong to the decode kernel
            return
        if q_tile * BLOCK_Q >= T:
            return
        L = tl.load(kv_lens_ptr + seq)

        r = tl.arange(0, BLOCK_M)  # [BLOCK_M] row = token-in-tile * GROUP + head-in-group
        d = tl.arange(0, D_PAD)  # [D_PAD]
        dmask = d < HEAD_DIM  # [D_PAD]
        qi = q_tile * BLOCK_Q + r // GROUP  # [BLOCK_M] token index within the request
        head = kvh * GROUP + r % GROUP  # [BLOCK_M] query head
        rvalid = (r < BLOCK_Q * GROUP) & (qi < T)  # [BLOCK_M]
        qpos = L - T + qi  # [BLOCK_M] absolute position of each row's query
        q_rows = (q_start + qi).to(tl.int64)  # [BLOCK_M]
        qmask = rvalid[:, None] & dmask[None, :]  # [BLOCK_M, D_PAD]
        q = tl.load(q_ptr + q_rows[:, None] * s_qn + head[:, None] * s_qh + d[None, :], mask=qmask, other=0.0)  # [BLOCK_M, D_PAD]

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [BLOCK_M] running max (log2 domain)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)  # [BLOCK_M] running denominator
        acc = tl.full([BLOCK_M, D_PAD], 0.0, tl.float32)  # [BLOCK_M, D_PAD] running numerator
        bt_row = bt_ptr + seq.to(tl.int64) * s_bt
        head_off = kvh.to(tl.int64) * s_h

        # Tiles whose keys all lie at or before the tile's first query position: no mask.
        first_qpos = L - T + q_tile * BLOCK_Q
        n_free = (first_qpos + 1) // TILE_N
        # Sliding window W (0 = none): query at p sees keys p-W+1..p. Tiles wholly left of the
        # first row's window are skipped; the rest go through the masked loop.
        m_lo = n_free
        if window > 0:
            m_lo = tl.maximum(first_qpos - window + 1, 0) // TILE_N
            n_free = 0
        # Keys up to the tile's last query position (inclusive).
        kv_end = L - T + tl.minimum((q_tile + 1) * BLOCK_Q, T)
        n_all = (kv_end + TILE_N - 1) // TILE_N

        for t in range(0, n_free):
            tok = t * TILE_N + tl.arange(0, TILE_N)  # [TILE_N]
            page = tl.load(bt_row + tok // TPB).to(tl.int64)  # [TILE_N] physical block per key
            base = pool_ptr + page * s_blk + head_off + (tok % TPB) * s_t  # [TILE_N]
            kt = tl.load(base[None, :] + d[:, None], mask=dmask[:, None], other=0.0)  # [D_PAD, TILE_N]
            v = tl.load(base[:, None] + s_kv + d[None, :], mask=dmask[None, :], other=0.0)  # [TILE_N, D_PAD]
            s = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, TILE_N]
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))  # [BLOCK_M]
            alpha = tl.exp2(m_i - m_new)  # [BLOCK_M]
            p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, TILE_N]
            l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)  # [BLOCK_M, D_PAD]
            m_i = m_new

        for t in range(m_lo, n_all):
            tok = t * TILE_N + tl.arange(0, TILE_N)  # [TILE_N]
            tmask = tok < kv_end  # [TILE_N]
            page = tl.load(bt_row + tok // TPB, mask=tmask, other=0).to(tl.int64)  # [TILE_N]
            base = pool_ptr + page * s_blk + head_off + (tok % TPB) * s_t  # [TILE_N]
            kt = tl.load(base[None, :] + d[:, None], mask=dmask[:, None] & tmask[None, :], other=0.0)  # [D_PAD, TILE_N]
            v = tl.load(base[:, None] + s_kv + d[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0)  # [TILE_N, D_PAD]
            s = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, TILE_N]
            visible = tmask[None, :] & (tok[None, :] <= qpos[:, None])  # [BLOCK_M, TILE_N]
            visible = visible & ((window <= 0) | (tok[None, :] > qpos[:, None] - window))  # [BLOCK_M, TILE_N]
            s = tl.where(visible, s, float("-inf"))  # [BLOCK_M, TILE_N]
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))  # [BLOCK_M] -inf while a windowed row has seen nothing
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # [BLOCK_M] no (-inf) - (-inf)
            alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]
            p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, TILE_N] 0 where masked
            l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)  # [BLOCK_M, D_PAD]
            m_i = m_new

        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # [BLOCK_M, D_PAD] padding rows may have seen nothing
        o_ptrs = out_ptr + q_rows[:, None] * s_on + head[:, None] * s_oh + d[None, :]  # [BLOCK_M, D_PAD]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=qmask)

    @triton.jit
    def _decode(
        q_ptr, pool_ptr, bt_ptr, seq_lens_ptr, kv_lens_ptr, cu_ptr, out_ptr, po_ptr, plse_ptr,
        qk_scale, num_splits, window,
        s_qn, s_qh, s_on, s_oh,
        s_blk, s_kv, s_h, s_t, s_bt,
        s_po_seq, s_po_head, s_po_split, s_pl_seq, s_pl_head,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
        TPB: tl.constexpr, TILE_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        T = tl.load(seq_lens_ptr + seq)
        if T != 1:  # prefill requests belong to the prefill kernel
            return
        L = tl.load(kv_lens_ptr + seq)
        row = tl.load(cu_ptr + seq).to(tl.int64)  # packed row of the single query

        r = tl.arange(0, BLOCK_M)  # [BLOCK_M] query head within the group (rows >= GROUP idle)
        d = tl.arange(0, D_PAD)  # [D_PAD]
        dmask = d < HEAD_DIM  # [D_PAD]
        rvalid = r < GROUP  # [BLOCK_M]
        head = kvh * GROUP + r  # [BLOCK_M]
        qmask = rvalid[:, None] & dmask[None, :]  # [BLOCK_M, D_PAD]
        q = tl.load(q_ptr + row * s_qn + head[:, None] * s_qh + d[None, :], mask=qmask, other=0.0)  # [BLOCK_M, D_PAD]

        n_tiles = (L + TILE_N - 1) // TILE_N
        # Sliding window W (0 = none): the query at L-1 sees keys L-W..L-1; splits share those tiles.
        lo_key = tl.maximum(L - window, 0) if window > 0 else 0
        t_first = lo_key // TILE_N
        per_split = (n_tiles - t_first + num_splits - 1) // num_splits
        t_begin = t_first + split * per_split
        t_end = tl.minimum(t_begin + per_split, n_tiles)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # [BLOCK_M]
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)  # [BLOCK_M]
        acc = tl.full([BLOCK_M, D_PAD], 0.0, tl.float32)  # [BLOCK_M, D_PAD]
        bt_row = bt_ptr + seq.to(tl.int64) * s_bt
        head_off = kvh.to(tl.int64) * s_h
        for t in range(t_begin, t_end):
            tok = t * TILE_N + tl.arange(0, TILE_N)  # [TILE_N]
            tmask = (tok < L) & (tok >= lo_key)  # [TILE_N]
            page = tl.load(bt_row + tok // TPB, mask=tmask, other=0).to(tl.int64)  # [TILE_N]
            base = pool_ptr + page * s_blk + head_off + (tok % TPB) * s_t  # [TILE_N]
            kt = tl.load(base[None, :] + d[:, None], mask=dmask[:, None] & tmask[None, :], other=0.0)  # [D_PAD, TILE_N]
            v = tl.load(base[:, None] + s_kv + d[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0)  # [TILE_N, D_PAD]
            s = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, TILE_N]
            s = tl.where(tmask[None, :], s, float("-inf"))  # [BLOCK_M, TILE_N]
            m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))  # [BLOCK_M] finite: tile t_begin holds a key in lo_key..L-1
            alpha = tl.exp2(m_i - m_new)  # [BLOCK_M]
            p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, TILE_N]
            l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)  # [BLOCK_M, D_PAD]
            m_i = m_new

        empty = l_i == 0.0  # [BLOCK_M] split past the end of this request's KV
        o = acc / tl.where(empty, 1.0, l_i)[:, None]  # [BLOCK_M, D_PAD]
        if SPLIT:
            lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))  # [BLOCK_M] log2 domain
            po = po_ptr + seq.to(tl.int64) * s_po_seq + head[:, None] * s_po_head + split * s_po_split + d[None, :]  # [BLOCK_M, D_PAD]
            tl.store(po, o, mask=qmask)
            tl.store(plse_ptr + seq.to(tl.int64) * s_pl_seq + head * s_pl_head + split, lse, mask=rvalid)
        else:
            o_ptrs = out_ptr + row * s_on + head[:, None] * s_oh + d[None, :]  # [BLOCK_M, D_PAD]
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=qmask)

    @triton.jit
    def _reduce(
        po_ptr, plse_ptr, seq_lens_ptr, cu_ptr, out_ptr,
        num_splits,
        s_po_seq, s_po_head, s_po_split, s_pl_seq, s_pl_head, s_on, s_oh,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        T = tl.load(seq_lens_ptr + seq)
        if T != 1:
            return
        row = tl.load(cu_ptr + seq).to(tl.int64)
        sp = tl.arange(0, S_PAD)  # [S_PAD]
        d = tl.arange(0, D_PAD)  # [D_PAD]
        smask = sp < num_splits  # [S_PAD]
        dmask = d < HEAD_DIM  # [D_PAD]
        lse = tl.load(plse_ptr + seq.to(tl.int64) * s_pl_seq + head * s_pl_head + sp, mask=smask, other=float("-inf"))  # [S_PAD]
        w = tl.exp2(lse - tl.reduce(lse, 0, _max_combine))  # [S_PAD] empty splits weigh 0
        po = po_ptr + seq.to(tl.int64) * s_po_seq + head * s_po_head + sp[:, None] * s_po_split + d[None, :]  # [S_PAD, D_PAD]
        o = tl.load(po, mask=smask[:, None] & dmask[None, :], other=0.0)  # [S_PAD, D_PAD]
        res = tl.reduce(o * w[:, None], 0, _sum_combine) / tl.reduce(w, 0, _sum_combine)  # [D_PAD]
        tl.store(out_ptr + row * s_on + head * s_oh + d, res.to(out_ptr.dtype.element_ty), mask=dmask)

    built = {"write_kv": _write_kv, "prefill": _prefill, "decode": _decode, "reduce": _reduce}
    _KERNELS[interpret] = built
    return built


def _bind_combiners() -> None:
    """Bind the ``tl.reduce`` combine functions the kernels use for row max / row sum.

    Triton decides between compiled and interpreted functions when ``@triton.jit`` runs,
    and its own standard library (``tl.max``, ``tl.sum``, ``tl.zeros`` are ``@jit``
    functions in triton 3.x) is decorated when ``triton.language`` is first imported. If
    ``TRITON_INTERPRET=1`` is set only after that import, calling ``tl.max`` inside an
    interpreted kernel fails ("Cannot call @triton.jit'd outside of the scope of a
    kernel"). The kernels therefore call the builtin ``tl.reduce`` with the standard
    combiners ``tl.standard._elementwise_max`` / ``_sum_combine``: compiled, this is exactly
    what ``tl.max`` / ``tl.sum`` expand to; interpreted, Triton recognises these objects by
    identity and reduces with numpy without calling them, whatever the import order.
    Should a Triton release drop those names, local combiners are used instead (correct
    either way; slower under the interpreter, which then calls them per element).
    The reverse order -- triton imported under ``TRITON_INTERPRET=1``, kernels later
    compiled natively in the same process -- is not supported (the standard library is
    then interpreted-only).
    """
    global _max_combine, _sum_combine
    if _max_combine is not None:
        return
    std = getattr(tl, "standard", None)
    mx = getattr(std, "_elementwise_max", None)
    sm = getattr(std, "_sum_combine", None)
    if mx is None or sm is None:
        # Always JITFunction: the compiler needs one, the interpreter calls its `.fn`.
        from triton.runtime.jit import JITFunction  # noqa: PLC0415

        mx, sm = JITFunction(_py_max), JITFunction(_py_sum)
    _max_combine, _sum_combine = mx, sm


def _py_max(a, b):
    return tl.maximum(a, b)


def _py_sum(a, b):
    return a + b


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _check_device(*tensors: torch.Tensor) -> None:
    """Raise when the tensors cannot be reached by Triton in the current mode."""
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            raise ValueError(f"all tensors must be on one device, got {dev} and {t.device}")
    if dev.type != "cuda" and not interpreter_requested():
        raise InfertraceError(
            f"triton attention got {dev.type} tensors; set TRITON_INTERPRET=1 to run it on CPU, "
            "use a GPU, or use --attention torch"
        )


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few splits so the split path is exercised


def write_kv_paged_triton(
    kv_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter the current tokens' K/V into the paged pool by slot mapping, as a Triton kernel (in place).

    Args:
        kv_pool: ``[num_blocks, 2, n_kv_heads, tokens_per_block, head_dim]`` one layer's
            pool (fp32 / fp16 / bf16); its last dim must be contiguous (stride 1).
        k, v: ``[N, n_kv_heads, head_dim]`` current tokens' keys / values, any float dtype
            (cast to the pool's dtype by torch first, round-to-nearest-even as the torch twin:
            Triton's interpreter truncates float32 -> bfloat16, ``--kv-dtype bf16`` must not).
        slot_mapping: ``[N]`` int32/int64, physical slot ``block_table[p // B] * B + p % B``.
            A negative slot skips its token (vLLM's padding convention; the torch twin
            does not accept negative slots).

    Raises:
        ValueError: shapes disagree or the pool's last dim is not contiguous.
        InfertraceError: triton missing, or CPU tensors without ``TRITON_INTERPRET=1``.

    One program per token (grid ``[N]``), each storing its ``[n_kv_heads, head_dim]`` K and
    V rows; mirrors vLLM ``reshape_and_cache`` / TensorRT-LLM ``update_kv_cache``.
    """
    if kv_pool.dim() != 5 or kv_pool.shape[1] != 2:
        raise ValueError(f"kv_pool must be [num_blocks, 2, n_kv_heads, B, head_dim], got {tuple(kv_pool.shape)}")
    _, _, n_kv_heads, tpb, head_dim = kv_pool.shape
    n = k.shape[0]
    if k.shape != (n, n_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k/v must be [N, {n_kv_heads}, {head_dim}], got {tuple(k.shape)} / {tuple(v.shape)}")
    if slot_mapping.shape != (n,):
        raise ValueError(f"slot_mapping must be [{n}], got {tuple(slot_mapping.shape)}")
    if kv_pool.stride(-1) != 1:
        raise ValueError("kv_pool's last dim must be contiguous (stride 1)")
    if n == 0:
        return
    _check_device(kv_pool, k, v, slot_mapping)
    kern = _kernels()["write_kv"]
    k, v = k.to(kv_pool.dtype), v.to(kv_pool.dtype)  # [N, n_kv_heads, hd] (no copy when the types agree)
    k = k if k.stride(-1) == 1 else k.contiguous()  # [N, n_kv_heads, hd]
    v = v if v.stride(-1) == 1 else v.contiguous()  # [N, n_kv_heads, hd]
    slot_mapping = slot_mapping.contiguous()  # [N]
    kern[(n,)](
        k, v, kv_pool, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3),
        n_kv_heads,
        HEAD_DIM=head_dim, TPB=tpb, H_PAD=max(2, _next_pow2(n_kv_heads)), D_PAD=_next_pow2(head_dim),
    )


# Launch configurations by query element size (2 = fp16/bf16, 4 = fp32) and head-dim
# bucket (the smallest bucket >= head_dim is used). Picked from register / shared-memory
# use of the kernels compiled for sm_90 (no spills, K/V loads pipelined with cp.async),
# not yet timed on hardware; ``benchmarks/attention.py --sweep`` times decode
# alternatives on a GPU. fp32 uses exact ("ieee") dots, which Triton lowers to FMA loops
# that need far more registers -- hence the small fp32 tiles.
#   decode:  head_dim -> (TILE_N, num_warps, num_stages)
#   prefill: head_dim -> (BLOCK_M, TILE_N, num_warps, num_stages)
DECODE_CONFIGS: dict[int, dict[int, tuple[int, int, int]]] = {
    2: {64: (64, 4, 3), 128: (64, 4, 3), 256: (32, 4, 2)},
    4: {64: (16, 4, 2), 128: (16, 4, 2), 256: (16, 4, 2)},
}
PREFILL_CONFIGS: dict[int, dict[int, tuple[int, int, int, int]]] = {
    2: {64: (128, 64, 8, 3), 128: (128, 64, 8, 2), 256: (64, 32, 8, 2)},
    4: {64: (32, 16, 4, 2), 128: (16, 16, 4, 2), 256: (16, 16, 4, 2)},
}


def _bucket(table: dict, elem_size: int, head_dim: int):
    by_dim = table[4 if elem_size >= 4 else 2]
    keys = sorted(by_dim)
    return by_dim[next((k for k in keys if k >= head_dim), keys[-1])]


def _decode_config(head_dim: int, elem_size: int = 2) -> tuple[int, int, int]:
    """(TILE_N, num_warps, num_stages) of the decode kernel."""
    return _bucket(DECODE_CONFIGS, elem_size, head_dim)


def _prefill_config(head_dim: int, elem_size: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages) of the prefill kernel."""
    return _bucket(PREFILL_CONFIGS, elem_size, head_dim)


def choose_num_splits(
    num_seqs: int, n_kv_heads: int, max_kv_len: int, head_dim: int, device: torch.device, elem_size: int = 2
) -> int:
    """Decode KV splits per (request, KV head): enough programs to fill the GPU.

    Aims at about 4 programs per SM (several in flight per SM hide HBM latency) while
    keeping at least 2 KV tiles per split and at most 64 splits. ``max_kv_len`` is the
    host-known bound ``max_blocks * tokens_per_block``; each program then splits its
    request's actual KV length evenly (TensorRT-LLM "multi-block mode" / vLLM segments).
    """
    tile_n = _decode_config(head_dim, elem_size)[0]
    base = max(1, num_seqs * n_kv_heads)
    want = -(-4 * _num_sms(device) // base)
    by_len = max(1, -(-max_kv_len // (2 * tile_n)))
    return int(max(1, min(want, by_len, 64)))



def _check_shapes(q: torch.Tensor, kv_pool: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  kv_lens: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[int, int, int, int, int]:
    """The shape and dtype checks of :func:`paged_attention_triton` (free: no device sync).

    Returns:
        ``(N, n_head, head_dim, n_kv_heads, B)`` (``B`` = tokens per block).

    Raises:
        ValueError: as :func:`paged_attention_triton` says.
    """
    if q.dim() != 3 or kv_pool.dim() != 5 or kv_pool.shape[1] != 2:
        raise ValueError(
            f"q must be [N, n_head, head_dim] and kv_pool [num_blocks, 2, n_kv_heads, B, head_dim]; "
            f"got {tuple(q.shape)} and {tuple(kv_pool.shape)}"
        )
    n, n_head, head_dim = q.shape
    _, _, n_kv_heads, tpb, pool_hd = kv_pool.shape
    if pool_hd != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and kv_pool ({pool_hd}) differ")
    if n_head % n_kv_heads != 0:
        raise ValueError(f"n_head ({n_head}) must be a multiple of n_kv_heads ({n_kv_heads})")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q must be fp32, fp16 or bf16, got {q.dtype}")
    num_seqs = int(seq_lens.shape[0])
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or kv_lens.shape != (num_seqs,):
        raise ValueError("block_tables [num_seqs, max_blocks] and kv_lens [num_seqs] must match seq_lens")
    if cu_seqlens.shape != (num_seqs + 1,):
        raise ValueError(f"cu_seqlens must be [{num_seqs + 1}], got {tuple(cu_seqlens.shape)}")
    if q.stride(-1) != 1 or kv_pool.stride(-1) != 1:
        raise ValueError("q and kv_pool must be contiguous in head_dim (stride 1)")
    return n, n_head, head_dim, n_kv_heads, tpb


@dataclass(frozen=True)
class _Launch:
    """What both launches of one :func:`paged_attention_triton` call share: the compiled kernels, the GQA
    group (query heads per KV head), ``D_PAD`` (head_dim padded to a power of two >= 16), the softmax
    scale in log2 units, the dot precision, ``B`` (tokens per block) and the sliding window (0 = none)."""

    kern: dict[str, Any]
    group: int
    d_pad: int
    qk_scale: float
    dot_prec: str
    tpb: int
    window: int


def _launch_decode(ln: _Launch, q: torch.Tensor, kv_pool: torch.Tensor, meta: tuple[torch.Tensor, ...],
                   out: torch.Tensor, num_splits: int | None) -> None:
    """Decode (T == 1) requests: split-K flash decoding into ``out`` ``[N, n_head, hd]``, then the
    log-sum-exp reduce of the splits when there are several (``meta``: int32 block_tables, seq_lens,
    kv_lens, cu_seqlens)."""
    block_tables, seq_lens, kv_lens, cu_seqlens = meta
    num_seqs, n_head, n_kv_heads = int(seq_lens.shape[0]), q.shape[1], kv_pool.shape[2]
    head_dim, d_pad, bt_stride = q.shape[2], ln.d_pad, block_tables.stride(0)
    es = q.element_size()
    tile_n, warps, stages = _decode_config(head_dim, es)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, n_kv_heads, block_tables.shape[1] * ln.tpb, head_dim, q.device, es)
    num_splits = max(1, int(num_splits))
    split = num_splits > 1
    if split:
        part_o = torch.empty((num_seqs, n_head, num_splits, d_pad), device=q.device, dtype=torch.float32)  # [S, H, splits, D_PAD]
        part_lse = torch.empty((num_seqs, n_head, num_splits), device=q.device, dtype=torch.float32)  # [S, H, splits]
    else:
        part_o = torch.empty((1, 1, 1, 1), device=q.device, dtype=torch.float32)  # unused
        part_lse = torch.empty((1, 1, 1), device=q.device, dtype=torch.float32)  # unused
    ln.kern["decode"][(num_seqs, n_kv_heads, num_splits)](
        q, kv_pool, block_tables, seq_lens, kv_lens, cu_seqlens, out, part_o, part_lse,
        ln.qk_scale, num_splits, ln.window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3), bt_stride,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        HEAD_DIM=head_dim, D_PAD=d_pad, GROUP=ln.group, BLOCK_M=max(16, _next_pow2(ln.group)),
        TPB=ln.tpb, TILE_N=tile_n, SPLIT=split, DOT_PREC=ln.dot_prec,
        num_warps=warps, num_stages=stages,
    )
    if split:
        ln.kern["reduce"][(num_seqs, n_head)](
            part_o, part_lse, seq_lens, cu_seqlens, out,
            num_splits,
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, D_PAD=d_pad, S_PAD=_next_pow2(num_splits),
            num_warps=4 if d_pad >= 128 else 2,
        )


def _launch_prefill(ln: _Launch, q: torch.Tensor, kv_pool: torch.Tensor, meta: tuple[torch.Tensor, ...],
                    out: torch.Tensor) -> None:
    """Prefill (T > 1) requests: the varlen flash-attention kernel into ``out`` ``[N, n_head, hd]``
    (``meta`` as :func:`_launch_decode`); decode rows are skipped by the kernel."""
    block_tables, seq_lens, kv_lens, cu_seqlens = meta
    n, head_dim, n_kv_heads, num_seqs = q.shape[0], q.shape[2], kv_pool.shape[2], int(seq_lens.shape[0])
    block_m, tile_n, warps, stages = _prefill_config(head_dim, q.element_size())
    block_m = max(block_m, _next_pow2(ln.group))
    block_q = block_m // ln.group
    grid = (n // block_q + num_seqs, n_kv_heads)
    ln.kern["prefill"][grid](
        q, kv_pool, block_tables, seq_lens, kv_lens, cu_seqlens, out,
        ln.qk_scale, num_seqs, ln.window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), kv_pool.stride(3), block_tables.stride(0),
        HEAD_DIM=head_dim, D_PAD=ln.d_pad, GROUP=ln.group, BLOCK_M=block_m, BLOCK_Q=block_q,
        TPB=ln.tpb, TILE_N=tile_n, DOT_PREC=ln.dot_prec,
        num_warps=warps, num_stages=stages,
    )


def paged_attention_triton(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Varlen causal attention read from a paged KV pool through block tables (Triton).

    Same contract as :func:`infertrace.attention.reference.paged_attention_torch`.

    Args:
        q: ``[N, n_head, head_dim]`` packed queries of all requests, fp32 / fp16 / bf16;
            the last dim must have stride 1 (other strides are free, e.g. a view of a
            fused QKV projection).
        kv_pool: ``[num_blocks, 2, n_kv_heads, B, head_dim]`` (index 0 = K, 1 = V) with the
            current tokens already written; any float dtype (cast to q's dtype on load).
        block_tables: ``[num_seqs, max_blocks]`` int32 physical block ids (-1 = unused);
            row i must cover ``kv_lens[i]`` tokens (not checked: reading past it is out of
            bounds, as in the runtimes).
        seq_lens: ``[num_seqs]`` int32, current tokens T >= 1 of each request.
        kv_lens: ``[num_seqs]`` int32, visible KV length C + T.
        cu_seqlens: ``[num_seqs + 1]`` int32, prefix sums of ``seq_lens``.
        scale: softmax scale.
        num_splits: decode KV splits per (request, KV head); default
            :func:`choose_num_splits`. Tests force it to exercise the reduce.
        window: sliding window W (0 = full causal): the query at position p sees keys
            p-W+1..p (HF ``sliding_window``, llama.cpp ``n_swa``); tiles left of every
            row's window are not read.

    Returns:
        ``[N, n_head, head_dim]``, dtype of ``q``; softmax and accumulation in fp32.

    Raises:
        ValueError: shapes/dtypes disagree (n_head not a multiple of n_kv_heads, ...), or
            on CPU tensors (checked there for free) a request has T < 1 or
            ``cu_seqlens[-1] != N``.
        InfertraceError: triton missing, or CPU tensors without ``TRITON_INTERPRET=1``.

    Requests with T == 1 go to the split-K decode kernel, the others to the varlen
    prefill kernel, in the same call. Integer metadata of another int dtype (or not
    contiguous) is copied to contiguous int32 first.
    """
    n, n_head, head_dim, n_kv_heads, tpb = _check_shapes(q, kv_pool, block_tables, seq_lens, kv_lens, cu_seqlens)
    out = torch.empty_like(q)  # [N, n_head, hd]
    num_seqs = int(seq_lens.shape[0])
    if n == 0 or num_seqs == 0:
        return out
    _check_device(q, kv_pool, block_tables, seq_lens, kv_lens, cu_seqlens)
    block_tables, seq_lens, kv_lens, cu_seqlens = (  # int32, unit stride along the last dim
        t.to(torch.int32).contiguous() for t in (block_tables, seq_lens, kv_lens, cu_seqlens)
    )
    if q.device.type == "cpu":  # free to check here; on CUDA it would cost a host sync
        if int(seq_lens.min()) < 1:
            raise ValueError("every request needs seq_lens >= 1 (drop requests with nothing to compute)")
        if int(cu_seqlens[-1]) != n:
            raise ValueError(f"cu_seqlens[-1] ({int(cu_seqlens[-1])}) must equal N ({n})")
    meta = (block_tables, seq_lens, kv_lens, cu_seqlens)
    launch = _Launch(kern=_kernels(), group=n_head // n_kv_heads, d_pad=max(16, _next_pow2(head_dim)),
                     qk_scale=float(scale) * _LOG2E, dot_prec="ieee" if q.dtype == torch.float32 else "tf32",
                     tpb=tpb, window=int(window))
    _launch_decode(launch, q, kv_pool, meta, out, num_splits)
    # Prefill (T > 1) requests: varlen flash attention. With N == num_seqs and every
    # T >= 1 all requests are decodes, so the launch is skipped.
    if n > num_seqs:
        _launch_prefill(launch, q, kv_pool, meta, out)
    return out


__all__ = [
    "DECODE_CONFIGS",
    "PREFILL_CONFIGS",
    "choose_num_splits",
    "interpreter_requested",
    "paged_attention_triton",
    "triton_available",
    "write_kv_paged_triton",
]
