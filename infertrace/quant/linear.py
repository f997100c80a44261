"""Linear layers whose weights stay quantised: ``y = x @ W.T (+ b)`` from codes and group scales.

Five kernels, one interface (:class:`QuantLinear`); which one each type gets per activation dtype
is :data:`infertrace.quant.source.FAST_KERNELS` (measured in ``benchmarks/quant_kernels.py``):

* ``int4pack`` — torch's weight-only int4 matmul (``aten._weight_int4pack_mm_for_cpu``, the CPU
  port of gpt-fast's tinygemm path). It computes ``w = (u - 8) * s + z`` per group of 32 from
  4-bit codes ``u`` with a scale ``s`` and a zero ``z`` per (row, group), both in the activation
  dtype. Q4_0 (``u = q + 8``, ``s = d``, ``z = 0``), Q4_1 (``s = d``, ``z = m + 8d``) and Q4_K
  (``s = d·sc``, ``z = -dmin·m + 8s``) map onto it. ``z`` is rounded once in float32, and with
  bf16 activations ``s`` and ``z`` are rounded to bf16 (8 significant bits; ``d`` is float16 with 11):
  a weight can move by up to about 2^-9 of its group's range — measured per type in
  ``tests/unit/quant/test_quant.py`` and ``benchmarks/quant_kernels.py``.
* ``int4x2`` — the group-32 5- and 8-bit types (Q5_0, Q5_1, Q5_K, Q8_0) as two int4pack
  matmuls over the high and low nibble planes of their codes (:class:`Int4x2Linear`).
* ``int4pair16`` — the group-16 types (Q6_K) on the int4pack kernel with ``in`` doubled and a
  small dense correction (:class:`Int4Pair16Linear`).
* ``dequant`` — any type of :mod:`infertrace.quant.blocks`: int8 codes plus float32 scales
  (and offsets) kept in memory; each call dequantises a chunk of rows into one reused scratch
  buffer (float32, then the activation dtype) and multiplies densely. The float32 weights are
  gguf-py's bits exactly, so the product equals the float path's up to the matmul's own
  blocking.
* ``dense`` — F32 / F16 / BF16 tensors, held in the activation dtype.

No object here holds a float copy of a whole quantised matrix; the scratch buffer is bounded
by :data:`SCRATCH_VALUES` values per dtype and shared by every layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from infertrace.quant.blocks import Affine

#: types the int4pack kernel can hold exactly as (4-bit code, scale, zero) per group of 32
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
#: values of the shared dequantisation scratch buffer (per dtype): 4 Mi = 16 MiB in float32
SCRATCH_VALUES = 1 << 22

_scratch: dict[torch.dtype, torch.Tensor] = {}


def _buffer(dtype: torch.dtype, n: int) -> torch.Tensor:
    """A reused flat buffer of at least ``n`` values of ``dtype`` (grown, never shrunk). Always a normal
    tensor, even when first made under ``torch.inference_mode()`` (an inference tensor could not be written
    in place by a later call outside it: "Inplace update to inference tensor outside InferenceMode")."""
    b = _scratch.get(dtype)
    if b is None or b.numel() < n or b.is_inference():
        with torch.inference_mode(False):
            b = torch.empty(n, dtype=dtype)  # [n]
        _scratch[dtype] = b
    return b[:n]


#: rows of a row block built at a time (a multiple of 64: packed row chunks of 64k rows concatenate to
#: the packing of the whole, checked in tests/unit/quant/test_quant.py)
PACK_ROWS = 2048
#: codes packed per chunk (bounds the packing temporaries to a few MiB whatever the row length)
PACK_VALUES = 1 << 22

_PACK_OP = "aten._convert_weight_to_int4pack_for_cpu"
_layout: Any = None  # (block_n, split) found by _pack_layout, False: none matched (torch's op packs)


def _pack_np(u: np.ndarray, block_n: int, split: bool) -> np.ndarray:
    """``uint8 [n, k]`` codes 0..15 -> ``uint8 [n, k/2]`` in the byte layout of torch's CPU int4 packing
    (``weight_to_int4pack_kernel``, aten/src/ATen/native/cpu/int4mm_kernel.cpp): rows in blocks of
    ``block_n`` (64 with AVX-512, 32 otherwise), each block stored ``[k, block_n/2]``; a full block pairs
    row ``j`` with row ``j + block_n/2`` when ``split`` (vectorised builds), the last partial block (16, 32
    or 48 rows) and non-vectorised builds pair adjacent rows, the second row in the high nibble."""
    n, k = u.shape
    out = np.empty((n, k // 2), np.uint8)
    flat = out.reshape(-1)
    nfull = n // block_n if split else 0
    if nfull:
        b = u[: nfull * block_n].reshape(nfull, block_n, k)  # [nb, block_n, k]
        h = block_n // 2
        pk = b[:, :h] | (b[:, h:] << 4)  # [nb, block_n/2, k]
        flat[: nfull * block_n * k // 2].reshape(nfull, k, h)[:] = pk.transpose(0, 2, 1)  # [nb, k, block_n/2]
    r0 = nfull * block_n
    while r0 < n:  # adjacent pairs, block by block
        r1 = min(n, r0 + block_n)
        b = u[r0:r1]  # [nb_size, k]
        pk = b[0::2] | (b[1::2] << 4)  # [nb_size/2, k]
        flat[r0 * k // 2: r1 * k // 2].reshape(k, (r1 - r0) // 2)[:] = pk.T  # [k, nb_size/2]
        r0 = r1
    return out


def _pack_layout() -> Any:
    """The :func:`_pack_np` layout that reproduces torch's packing on this machine, found once on a probe
    (two full 64-row blocks and a 48-row remainder of random codes); ``False`` when none does (then torch's
    op packs every matrix, as before)."""
    global _layout
    if _layout is None:
        g = np.random.default_rng(20)
        probe = g.integers(0, 16, (176, 64), dtype=np.uint8)  # [176, 64]
        want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(probe.astype(np.int32)), 1).numpy()
        _layout = next((c for c in ((64, True), (32, True), (32, False))
                        if want.shape == (176, 32) and np.array_equal(_pack_np(probe, *c), want)), False)
    return _layout


def pack_int4(codes: Callable[[int, int], np.ndarray], n: int) -> torch.Tensor:
    """``_convert_weight_to_int4pack_for_cpu`` of an ``[n, k]`` code matrix, a chunk of rows at a time.

    The bytes are written by :func:`_pack_np` in numpy from uint8 codes (measured ~10x faster than the op
    and no int32 copy of the codes), in the layout :func:`_pack_layout` checked against the op on this
    machine; torch's op packs when no layout matched.

    Args:
        codes: ``codes(r0, r1)`` -> ``uint8 [r1-r0, k]`` values 0..15 of rows ``r0:r1``.
        n: rows.

    Returns:
        ``uint8 [n, k/2]`` packed as the op packs the whole matrix.
    """
    first = codes(0, min(n, 64))
    k = first.shape[1]
    step = max(64, min(PACK_ROWS, PACK_VALUES // max(1, k) // 64 * 64))  # rows per chunk, a multiple of 64
    out = torch.empty((n, k // 2), dtype=torch.uint8)  # [n, k/2]
    layout = _pack_layout()
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        u = first if r1 - r0 == first.shape[0] and r0 == 0 else codes(r0, r1)  # [r, k] uint8
        if layout:
            out[r0:r1] = torch.from_numpy(_pack_np(np.ascontiguousarray(u, dtype=np.uint8), *layout))
        else:
            out[r0:r1] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(u.astype(np.int32)), 1)
    return out


class QuantLinear(ABC):
    """One weight matrix ``[out, in]`` and its matmul.

    Attributes:
        qtype: GGUF type name of the data (``Q4_K``, ``F32``; ``"Q5_0+Q8_0"`` for a stack).
        kernel: ``int4pack``, ``dequant``, ``dense`` or ``stack(...)``.
        shape: ``(out, in)``.
        act_dtype: dtype of ``x`` and ``y``.
    """

    qtype: str
    kernel: str
    shape: tuple[int, int]
    act_dtype: torch.dtype

    @abstractmethod
    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[..., in]`` (act dtype) -> ``[..., out]`` (act dtype) = ``x @ W.T (+ bias)``."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """``float32 [out, in]``: the weights exactly as this kernel multiplies them (tests, reference)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this object holds (codes, scales, zeros, dense values)."""


class DenseLinear(QuantLinear):
    """A float matrix (``F32``/``F16``/``BF16`` in the file) in the activation dtype: ``F.linear``."""

    kernel = "dense"

    def __init__(self, w: torch.Tensor, qtype: str, act_dtype: torch.dtype):
        self.w = w.to(act_dtype).contiguous()  # [out, in]
        self.qtype, self.act_dtype = qtype, act_dtype
        self.shape = (int(w.shape[0]), int(w.shape[1]))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.w, bias)  # [..., out]

    def dequantize(self) -> torch.Tensor:
        return self.w.float()  # [out, in]

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()


class DequantLinear(QuantLinear):
    """int8 codes + float32 group scales (+ offsets); dequantised a chunk of rows at a time.

    Args:
        a: codes and parameters from :func:`infertrace.quant.blocks.split_rows`.
        qtype: the GGUF type name.
        act_dtype: ``torch.float32`` or ``torch.bfloat16`` (float16 works too).
    """

    kernel = "dequant"

    def __init__(self, a: Affine, qtype: str, act_dtype: torch.dtype):
        n, k = a.q.shape
        self.q = torch.from_numpy(np.ascontiguousarray(a.q))  # [out, in] int8
        self.scale = torch.from_numpy(np.ascontiguousarray(a.scale, dtype=np.float32))  # [out, in/g]
        self.offset = (None if a.offset is None else
                       torch.from_numpy(np.ascontiguousarray(a.offset, dtype=np.float32)))  # [out, in/g]
        self.group, self.qtype, self.act_dtype, self.shape = a.group, qtype, act_dtype, (int(n), int(k))

    def _rows_f32(self, r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
        """Rows ``r0:r1`` dequantised into ``out`` (``float32 [(r1-r0)*in]``) -> ``[r1-r0, in]``."""
        g, k = self.group, self.shape[1]
        o3 = out.view(r1 - r0, k // g, g)  # [r, in/g, g]
        torch.mul(self.q[r0:r1].view(r1 - r0, k // g, g), self.scale[r0:r1, :, None], out=o3)  # scale * q
        if self.offset is not None:
            o3.add_(self.offset[r0:r1, :, None])  # + offset
        return out.view(r1 - r0, k)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = self.shape
        step = max(1, min(n, SCRATCH_VALUES // k))
        if step >= n:
            return F.linear(x, self._weights(0, n), bias)  # [..., out]
        y = x.new_empty((*x.shape[:-1], n))  # [..., out]
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            y[..., r0:r1] = F.linear(x, self._weights(r0, r1))  # [..., r1-r0]
        return y if bias is None else y + bias

    def _weights(self, r0: int, r1: int) -> torch.Tensor:
        """Rows ``r0:r1`` in the activation dtype, in the scratch buffer: ``[r1-r0, in]``."""
        k = self.shape[1]
        w = self._rows_f32(r0, r1, _buffer(torch.float32, (r1 - r0) * k))  # [r, in] float32
        if self.act_dtype == torch.float32:
            return w
        wb = _buffer(self.act_dtype, (r1 - r0) * k).view(r1 - r0, k)  # [r, in]
        wb.copy_(w)  # one rounding, as the float path's .to(dtype)
        return wb

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        return self._rows_f32(0, n, torch.empty(n * k)).clone()  # [out, in]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup (ggml ``get_rows``): ``ids`` ``[T]`` -> ``[T, in]`` float32, gguf-py's values."""
        g, k = self.group, self.shape[1]
        w = self.q[ids].view(-1, k // g, g) * self.scale[ids][:, :, None]  # [T, in/g, g]
        if self.offset is not None:
            w = w + self.offset[ids][:, :, None]
        return w.reshape(-1, k)  # [T, in]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset) if t is not None)


class _RowChunked:
    """Building an int4 kernel object a block of rows at a time (bounded temporaries for large tensors).

    ``_ROW_FIELDS`` names each tensor attribute and the dimension along which it follows the
    matrix rows (packed codes: 0; ``[groups, out, 2]`` scales/zeros: 1); a field may be None
    (int4pair16's correction for the symmetric types).
    """

    _ROW_FIELDS: dict[str, int] = {}

    @classmethod
    def from_row_chunks(cls, chunks: Iterable[Affine], n: int, qtype: str, act_dtype: torch.dtype) -> "QuantLinear":
        """The kernel object of an ``[n, in]`` matrix from consecutive row blocks (each a multiple of 64
        rows but the last: packed row blocks of such sizes concatenate to the whole packing, as
        ``tests/unit/quant/test_quant.py`` checks); each field is preallocated whole and filled block by block.

        Raises:
            ValueError: the blocks do not add up to ``n`` rows, or a block cannot be packed.
        """
        obj: Any = None
        r0 = 0
        for a in chunks:
            part = cls(a, qtype, act_dtype)  # type: ignore[call-arg]
            r1 = r0 + part.shape[0]
            if obj is None:
                obj = cls.__new__(cls)
                obj.qtype, obj.act_dtype, obj.shape = qtype, act_dtype, (int(n), part.shape[1])
                fields = {f: dim for f, dim in cls._ROW_FIELDS.items() if getattr(part, f) is not None}
                for f in cls._ROW_FIELDS:
                    t = getattr(part, f)
                    setattr(obj, f, None if t is None else
                            t.new_empty([n if d == fields[f] else size for d, size in enumerate(t.shape)]))
            if r1 > n:
                raise ValueError(f"row blocks add up to more than {n} rows")
            for f, dim in fields.items():
                if getattr(part, f) is None:
                    raise ValueError(f"row blocks disagree on {f}")
                getattr(obj, f).narrow(dim, r0, r1 - r0).copy_(getattr(part, f))
            r0 = r1
            del part
        if obj is None or r0 != n:
            raise ValueError(f"row blocks add up to {r0} rows, not {n}")
        return obj


def int4_params(a: Affine) -> tuple[Callable[[int, int], np.ndarray], torch.Tensor, torch.Tensor]:
    """(codes ``u(r0, r1)`` -> ``uint8 [r1-r0, in]`` in 0..15, scale ``float32 [out, in/32]``, zero
    ``float32 [out, in/32]``) such that ``(u - 8) * scale + zero`` is ``a``'s weight (zero rounded once
    in float32).

    Raises:
        ValueError: the group is not 32 or the codes do not fit 4 bits.
    """
    if a.group != 32:
        raise ValueError(f"int4pack needs groups of 32, not {a.group}")
    lo, hi = int(a.q.min(initial=0)), int(a.q.max(initial=0))
    q = a.q  # [out, in] int8
    if a.offset is None:  # symmetric: q in -8..7
        if lo < -8 or hi > 7:
            raise ValueError("codes do not fit in 4 bits")
        zero = np.zeros_like(a.scale)
        shift = 8
    else:
        if lo < 0 or hi > 15:
            raise ValueError("codes do not fit in 4 bits")
        zero = a.offset + np.float32(8) * a.scale  # [out, in/32]; (u - 8) s + z = s u + offset
        shift = 0
    return ((lambda r0, r1: (q[r0:r1] + np.int8(shift)).view(np.uint8)),  # [r, in] 0..15
            torch.from_numpy(np.ascontiguousarray(a.scale)), torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32)))


class _PackedKernel(QuantLinear):
    """A kernel defined by ``_mm(x2 [T, in]) -> [T, out]`` in the act dtype: the call reshapes around it
    (and adds the bias), and :meth:`dequantize` reads the weights back through it with an identity
    (``I @ W.T``), so the tests check exactly what the kernel multiplies."""

    @abstractmethod
    def _mm(self, x2: torch.Tensor) -> torch.Tensor: ...

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self._mm(x.reshape(-1, self.shape[1])).view(*x.shape[:-1], self.shape[0])  # [..., out]
        return y if bias is None else y + bias

    def dequantize(self) -> torch.Tensor:
        """The kernel's own weights, read back through it with an identity (float32 ``[out, in]``)."""
        return self._mm(torch.eye(self.shape[1], dtype=self.act_dtype)).T.float().contiguous()  # [out, in]


class Int4PackLinear(_RowChunked, _PackedKernel):
    """torch's weight-only int4 matmul (groups of 32, one scale and zero per group and row).

    Args:
        a: codes and parameters of a Q4_0 / Q4_1 / Q4_K tensor (:func:`int4_params` maps them).
        qtype: the GGUF type name.
        act_dtype: dtype of ``x``; the scales and zeros are stored in it (the kernel's rule).

    Raises:
        ValueError: ``out`` not a multiple of 16 (the packing's tile), or codes outside 4 bits.
    """

    kernel = "int4pack"
    _ROW_FIELDS = {"packed": 0, "sz": 1}

    def __init__(self, a: Affine, qtype: str, act_dtype: torch.dtype):
        n, k = a.q.shape
        if n % 16 or k % 32:
            raise ValueError(f"int4pack needs out % 16 == 0 and in % 32 == 0, got [{n}, {k}]")
        u, s, z = int4_params(a)
        self.packed = pack_int4(u, n)  # [out, in/2] uint8
        self.sz = torch.stack([s.T, z.T], -1).to(act_dtype).contiguous()  # [in/32, out, 2]
        self.qtype, self.act_dtype, self.shape = qtype, act_dtype, (int(n), int(k))

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, 32, self.sz)  # [T, out]

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.sz.numel() * self.sz.element_size()


class Int4x2Linear(_RowChunked, _PackedKernel):
    """5- to 8-bit codes in groups of 32 as two int4pack matmuls (high and low nibble planes).

    ``q = 16·hi + lo`` with ``hi = q >> 4`` (-8..7, arithmetic shift) and ``lo = q & 15``, so
    ``w = s·q + o = (16s·hi + 8s) + (s·(lo - 8) + o)``: plane A holds ``u = hi + 8`` with scale
    ``16s`` and zero ``8s``, plane B ``u = lo`` with scale ``s`` and zero ``o``. Both planes are
    centred (B in -8s..7s, A odd multiples of 8s), which keeps the partial sums small: each
    plane's output is rounded to the activation dtype before the sum, and with B in 0..15s the
    bf16 error was 3.4x the float path's on Gemma's Q5_0 ``ffn_gate`` (centred: see
    ``tests/unit/quant/test_quant.py``). The asymmetric types' codes 0..31 are centred first (``q - 16``,
    ``o + 16s``). Exact in float32 (``8s`` and ``16s`` are exact) up to the rounding of
    ``o + 16s`` and of ``(u - 8)·s + o`` inside the kernel; in bf16 ``s`` and ``o`` are rounded once.
    Q8_0, Q5_0, Q5_1 and Q5_K map onto it.

    Raises:
        ValueError: group not 32 or ``out`` not a multiple of 16.
    """

    kernel = "int4x2"
    _ROW_FIELDS = {"packed_hi": 0, "packed_lo": 0, "sz_hi": 1, "sz_lo": 1}

    def __init__(self, a: Affine, qtype: str, act_dtype: torch.dtype):
        n, k = a.q.shape
        if a.group != 32 or n % 16 or k % 32:
            raise ValueError(f"int4x2 needs groups of 32, out % 16 == 0 and in % 32 == 0, got group {a.group} [{n}, {k}]")
        q8 = a.q  # [out, in] int8
        s = torch.from_numpy(np.ascontiguousarray(a.scale, dtype=np.float32))  # [out, in/32]
        if a.offset is None:
            o, c = torch.zeros_like(s), 0
        else:  # Q5_1 / Q5_K codes 0..31: centre them (q - 16) and move 16s into the offset (one float32 rounding)
            o, c = torch.from_numpy(np.ascontiguousarray(a.offset, dtype=np.float32)) + 16 * s, 16  # [out, in/32]
        q = lambda r0, r1: q8[r0:r1] - np.int8(c)  # noqa: E731 - [r, in] int8 centred codes (-128..127)
        self.packed_hi = pack_int4(lambda r0, r1: ((q(r0, r1) >> 4) + np.int8(8)).view(np.uint8), n)  # [out, in/2] hi + 8
        self.packed_lo = pack_int4(lambda r0, r1: (q(r0, r1) & np.int8(15)).view(np.uint8), n)  # [out, in/2] lo
        self.sz_hi = torch.stack([(16 * s).T, (8 * s).T], -1).to(act_dtype).contiguous()  # [in/32, out, 2] 16s·hi + 8s
        self.sz_lo = torch.stack([s.T, o.T], -1).to(act_dtype).contiguous()  # [in/32, out, 2] s·(lo - 8) + o
        self.qtype, self.act_dtype, self.shape = qtype, act_dtype, (int(n), int(k))

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        return mm(x2, self.packed_hi, 32, self.sz_hi) + mm(x2, self.packed_lo, 32, self.sz_lo)  # [T, out]

    @property
    def nbytes(self) -> int:
        return (self.packed_hi.numel() + self.packed_lo.numel()
                + (self.sz_hi.numel() + self.sz_lo.numel()) * self.sz_hi.element_size())


class Int4Pair16Linear(_RowChunked, _PackedKernel):
    """Codes in groups of 16 (Q6_K, Q3_K, Q2_K) on the group-32 int4pack kernel, doubling ``in``.

    Each group ``j`` of 16 becomes one kernel group of 32: the low nibbles ``lo = (q+8) & 15`` of
    the shifted codes, then their high nibbles ``hi + 8`` (``hi = (q+8) >> 4``, -2..2 for Q6_K),
    multiplied by ``[x_j, 16·x_j]`` (the factor 16 is exact in any float format), scale ``s_j``,
    zero 0. The kernel's ``(u - 8)·s`` then sums to ``s_j·Σ x·(lo - 8 + 16·hi) = s_j·Σ x·q``:
    the shift by 8 cancels the kernel's own ``-8``, so no correction is held for the symmetric
    types. The group offsets of Q2_K come back as a dense product ``G @ C.T`` of the per-group
    sums ``G = Σ_{k∈j} x_k`` (``[T, in/16]``) with ``C = offset`` (``[out, in/16]``). Exact
    arithmetic in float32 up to summation order; in bf16 ``s`` (and ``C``, ``G``) are rounded.
    Held: 1 byte per weight plus ``[in/16, out, 2]`` scales (1.25 bytes per weight; Q6_K's file
    has 0.82).

    Raises:
        ValueError: group not 16, a code above 119, or ``out`` not a multiple of 16.
    """

    kernel = "int4pair16"
    _ROW_FIELDS = {"packed": 0, "sz": 1, "corr": 0}

    def __init__(self, a: Affine, qtype: str, act_dtype: torch.dtype):
        n, k = a.q.shape
        if a.group != 16 or n % 16 or k % 16:
            raise ValueError(f"int4pair16 needs groups of 16 and out % 16 == 0, got group {a.group} [{n}, {k}]")
        if int(a.q.max(initial=0)) > 119:  # q + 8 must stay in int8 (then hi = (q+8) >> 4 is -8..7)
            raise ValueError("int4pair16 needs codes of at most 119")
        q8 = a.q  # [out, in] int8

        def u(r0: int, r1: int) -> np.ndarray:
            q = (q8[r0:r1] + np.int8(8)).reshape(r1 - r0, k // 16, 16)  # [r, in/16, 16] shifted codes
            out = np.empty((r1 - r0, k // 16, 2, 16), np.int8)  # [r, in/16, 2, 16] lo then hi + 8 per group
            np.bitwise_and(q, np.int8(15), out=out[:, :, 0])
            np.right_shift(q, np.int8(4), out=out[:, :, 1])
            out[:, :, 1] += np.int8(8)
            return out.reshape(r1 - r0, 2 * k).view(np.uint8)  # [r, 2*in] 0..15

        s = torch.from_numpy(np.ascontiguousarray(a.scale, dtype=np.float32))  # [out, in/16]
        self.packed = pack_int4(u, n)  # [out, in] uint8
        self.sz = torch.stack([s.T, torch.zeros_like(s).T], -1).to(act_dtype).contiguous()  # [in/16, out, 2]
        self.corr = (None if a.offset is None else
                     torch.from_numpy(np.ascontiguousarray(a.offset, dtype=np.float32)).to(act_dtype).contiguous())  # [out, in/16]
        self.qtype, self.act_dtype, self.shape = qtype, act_dtype, (int(n), int(k))

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        t, k = x2.shape
        xg = x2.reshape(t, k // 16, 1, 16)  # [T, in/16, 1, 16]
        xx = torch.cat([xg, xg * 16], dim=2).reshape(t, 2 * k)  # [T, 2*in]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xx, self.packed, 32, self.sz)  # [T, out]
        if self.corr is None:
            return y
        return y + F.linear(xg.sum(-1).reshape(t, k // 16), self.corr)  # [T, out]

    @property
    def nbytes(self) -> int:
        corr = 0 if self.corr is None else self.corr.numel() * self.corr.element_size()
        return self.packed.numel() + self.sz.numel() * self.sz.element_size() + corr


class StackedLinear(QuantLinear):
    """Row blocks of different kernels/types used as one matrix (e.g. Q5_0 Q/K with a Q8_0 V):
    each part runs its own kernel, outputs are concatenated."""

    def __init__(self, parts: Sequence[QuantLinear]):
        self.parts = list(parts)
        self.act_dtype = parts[0].act_dtype
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        self.qtype = "+".join(dict.fromkeys(p.qtype for p in parts))
        self.kernel = "stack(" + ",".join(p.kernel for p in parts) + ")"

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)  # [..., out]
        return y if bias is None else y + bias

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])  # [out, in]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def cat_affine(parts: Sequence[Affine]) -> Affine:
    """Row-concatenate affine blocks of one group size (an absent offset becomes zeros).

    Raises:
        ValueError: different group sizes or row lengths.
    """
    if len({p.group for p in parts}) != 1 or len({p.q.shape[1] for p in parts}) != 1:
        raise ValueError("only blocks with one group size and row length can be concatenated")
    q = np.concatenate([p.q for p in parts])  # [sum out, in]
    scale = np.concatenate([p.scale for p in parts])  # [sum out, in/g]
    if all(p.offset is None for p in parts):
        off = None
    else:
        off = np.concatenate([p.offset if p.offset is not None else np.zeros_like(p.scale) for p in parts])
    return Affine(q, scale, off, parts[0].group)


def permute_rows(a: Affine, idx: np.ndarray) -> Affine:
    """Rows of ``a`` in the order ``idx`` (``int [out]``): quantised rows move whole (blocks never cross rows)."""
    return Affine(a.q[idx], a.scale[idx], None if a.offset is None else a.offset[idx], a.group)
