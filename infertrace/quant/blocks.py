"""GGUF quant blocks split into integer codes and per-group affine parameters.

Every block type handled here dequantises, in ggml (``ggml-quants.c`` ``dequantize_row_*``) and in
gguf-py (``gguf.quants.<TYPE>.dequantize_blocks``), as one affine map per group of ``group``
consecutive values::

    w = scale[g] * q + offset[g]        (float32; offset absent for the symmetric types)

with small integer codes ``q``. This module returns ``(q, scale, offset)`` so a kernel can keep
the codes (4 or 8 bits a value) instead of float32. The float32 arithmetic is the one gguf-py
does, in the same order (``d * q`` for Q4_0/Q5_0/Q8_0, ``d * q + m`` for Q4_1/Q5_1,
``(d * sc) * q - dmin * m`` for the K types), so :func:`affine_dequantize` gives gguf-py's bits
exactly (``tests/unit/quant/test_quant.py`` checks every type against ``gguf.quants.dequantize``).

| type | group | q range | offset |
| --- | ---: | --- | --- |
| Q4_0 | 32 | -8..7 | none |
| Q4_1 | 32 | 0..15 | m |
| Q5_0 | 32 | -16..15 | none |
| Q5_1 | 32 | 0..31 | m |
| Q8_0 | 32 | -128..127 | none |
| Q2_K | 16 | 0..3 | -dmin·m |
| Q3_K | 16 | -4..3 | none |
| Q4_K | 32 | 0..15 | -dmin·m |
| Q5_K | 32 | 0..31 | -dmin·m |
| Q6_K | 16 | -32..31 | none |

``scale`` products ``d * sc`` of a float16 and a 6/8-bit integer are exact in float32 (at most
11 + 8 significant bits), so storing them as float32 loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

QK_K = 256


@dataclass(frozen=True)
class Affine:
    """Codes and group parameters of ``n_blocks`` blocks.

    Attributes:
        q: ``int8 [n_blocks, block_size]`` codes (ranges in the module table).
        scale: ``float32 [n_blocks, block_size // group]``.
        offset: ``float32 [n_blocks, block_size // group]`` or None (symmetric types: 0).
        group: values per (scale, offset) pair.
    """

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None
    group: int


def _f16(b: np.ndarray) -> np.ndarray:
    """``uint8 [n, 2]`` little-endian float16 bytes -> ``float32 [n, 1]``."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, n_blocks: int, span: int) -> np.ndarray:
    """Low nibbles then high nibbles of each ``span``-byte run: ``uint8 [n_blocks, 2 * len]``
    (the ggml layout: byte j holds values j and j + span)."""
    qs = qs.reshape((n_blocks, -1, span))  # [n, runs, span]
    out = np.empty((n_blocks, qs.shape[1], 2, span), np.uint8)  # [n, runs, 2, span]; written in place (2.5x faster)
    np.bitwise_and(qs, np.uint8(0x0F), out=out[:, :, 0])
    np.right_shift(qs, np.uint8(4), out=out[:, :, 1])
    return out.reshape((n_blocks, -1))


def _q4_0(b: np.ndarray) -> Affine:
    n = b.shape[0]
    d = _f16(b[:, :2])  # [n, 1]
    q = _nibbles(b[:, 2:], n, 16).view(np.int8) - np.int8(8)  # [n, 32]
    return Affine(q, d, None, 32)


def _q4_1(b: np.ndarray) -> Affine:
    n = b.shape[0]
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])  # [n, 1] each
    q = _nibbles(b[:, 4:], n, 16).view(np.int8)  # [n, 32] (0..15: the view is the value)
    return Affine(q, d, m, 32)


def _q5_high(qh: np.ndarray, n: int) -> np.ndarray:
    """Bit i of the little-endian uint32 ``qh`` -> the 5th bit of value i: ``uint8 [n, 32]``."""
    h = np.ascontiguousarray(qh).view(np.uint32).reshape((n, 1)) >> np.arange(32, dtype=np.uint32).reshape((1, 32))
    return (h & np.uint32(1)).astype(np.uint8)


def _q5_0(b: np.ndarray) -> Affine:
    n = b.shape[0]
    d = _f16(b[:, :2])  # [n, 1]
    q = (_nibbles(b[:, 6:], n, 16) | (_q5_high(b[:, 2:6], n) << np.uint8(4))).astype(np.int8) - np.int8(16)  # [n, 32]
    return Affine(q, d, None, 32)


def _q5_1(b: np.ndarray) -> Affine:
    n = b.shape[0]
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])  # [n, 1] each
    q = (_nibbles(b[:, 8:], n, 16) | (_q5_high(b[:, 4:8], n) << np.uint8(4))).astype(np.int8)  # [n, 32]
    return Affine(q, d, m, 32)


def _q8_0(b: np.ndarray) -> Affine:
    d = _f16(b[:, :2])  # [n, 1]
    q = np.ascontiguousarray(b[:, 2:]).view(np.int8)  # [n, 32]
    return Affine(q, d, None, 32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K 12-byte packed 6-bit scales and mins -> ``uint8 [n, 8]`` each (gguf-py ``Q4_K.get_scale_min``)."""
    n = scales.shape[0]
    s = scales.reshape((n, 3, 4))
    d, m, m_d = s[:, 0:1], s[:, 1:2], s[:, 2:3]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1).reshape((n, 8))
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1).reshape((n, 8))
    return sc, mn


def _q4_k(b: np.ndarray) -> Affine:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])  # [n, 1] each
    sc, mn = _k_scale_min(b[:, 4:16])
    scale = d * sc.astype(np.float32)  # [n, 8]
    offset = -(dmin * mn.astype(np.float32))  # [n, 8]; w = scale*q - dmin*m
    q = _nibbles(b[:, 16:], n, 32).view(np.int8)  # [n, 256] (0..15: the view is the value)
    return Affine(q, scale, offset, 32)


def _q5_k(b: np.ndarray) -> Affine:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])  # [n, 1] each
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = b[:, 16:48].reshape((n, 1, 32)) >> np.arange(8, dtype=np.uint8).reshape((1, 8, 1))  # [n, 8, 32]
    ql = _nibbles(b[:, 48:], n, 32)  # [n, 256]
    q = (ql | ((qh & np.uint8(1)).reshape((n, QK_K)) << np.uint8(4))).astype(np.int8)  # [n, 256]
    return Affine(q, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32)), 32)


def _q6_k(b: np.ndarray) -> Affine:
    n = b.shape[0]
    q = _nibbles(b[:, :128], n, 64).reshape((n, 8, 32))  # [n, 8, 32] low 4 bits
    qh = b[:, 128:192].reshape((n, 2, 1, 32))  # [n, 2, 1, 32]: 2 bits of 4 values per byte
    for j, sh in enumerate((0, 2, 4, 6)):  # value group 4h + j takes bits sh..sh+1 of run h
        q[:, j::4] |= ((qh[:, :, 0] >> np.uint8(sh)) & np.uint8(3)) << np.uint8(4)
    q = q.view(np.int8)
    q -= np.int8(32)
    q = q.reshape((n, QK_K))  # [n, 256] in -32..31
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)  # [n, 16]
    d = _f16(b[:, 208:210])  # [n, 1]
    return Affine(q, d * sc, None, 16)


def _q2_k(b: np.ndarray) -> Affine:
    n = b.shape[0]
    scales = b[:, :16]
    qs = b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])  # [n, 1] each
    scale = d * (scales & 0xF).astype(np.float32)  # [n, 16]
    offset = -(dmin * (scales >> 4).astype(np.float32))  # [n, 16]
    q = ((qs.reshape((n, -1, 1, 32)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1))) & np.uint8(3))
    return Affine(q.reshape((n, QK_K)).astype(np.int8), scale, offset, 16)


def _q3_k(b: np.ndarray) -> Affine:
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b[:, 108:110])  # [n, 1]
    ls = (scales[:, :8].reshape((n, 1, 8)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 2, 1))).reshape((n, 16))
    hs = (scales[:, 8:].reshape((n, 1, 4)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 4, 1))).reshape((n, 16))
    sc = (((ls & np.uint8(0x0F)) | ((hs & np.uint8(0x03)) << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)
    ql = (qs.reshape((n, -1, 1, 32)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1))).reshape((n, QK_K)) & np.uint8(3)
    qh = (hmask.reshape((n, -1, 1, 32)) >> np.arange(8, dtype=np.uint8).reshape((1, 1, 8, 1))).reshape((n, QK_K)) & np.uint8(1)
    q = ql.astype(np.int8) - ((qh ^ np.uint8(1)) << np.uint8(2)).astype(np.int8)  # [n, 256] in -4..3
    return Affine(q, d * sc, None, 16)


#: type name -> (block_size, bytes per block, decoder)
DECODERS: dict[str, tuple[int, int, Callable[[np.ndarray], Affine]]] = {
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q8_0": (32, 34, _q8_0),
    "Q2_K": (QK_K, 84, _q2_k),
    "Q3_K": (QK_K, 110, _q3_k),
    "Q4_K": (QK_K, 144, _q4_k),
    "Q5_K": (QK_K, 176, _q5_k),
    "Q6_K": (QK_K, 210, _q6_k),
}


#: type name -> (lowest code, highest code, group, has offset): the module table as data
CODES: dict[str, tuple[int, int, int, bool]] = {
    "Q4_0": (-8, 7, 32, False), "Q4_1": (0, 15, 32, True), "Q5_0": (-16, 15, 32, False), "Q5_1": (0, 31, 32, True),
    "Q8_0": (-128, 127, 32, False), "Q2_K": (0, 3, 16, True), "Q3_K": (-4, 3, 16, False), "Q4_K": (0, 15, 32, True),
    "Q5_K": (0, 31, 32, True), "Q6_K": (-32, 31, 16, False),
}


def split_rows(data: np.ndarray, type_name: str) -> Affine:
    """Codes and group parameters of whole rows of one GGUF tensor.

    Args:
        data: ``uint8 [n_rows, bytes_per_row]`` as ``GGUFReader`` exposes a quantised tensor.
        type_name: a key of :data:`DECODERS`.

    Returns:
        :class:`Affine` with ``q`` ``int8 [n_rows, values_per_row]`` and ``scale``/``offset``
        ``float32 [n_rows, values_per_row // group]``.

    Raises:
        KeyError: ``type_name`` has no decoder here.
        ValueError: ``bytes_per_row`` is not a whole number of blocks.
    """
    bs, ts, dec = DECODERS[type_name]
    if data.ndim != 2 or data.dtype != np.uint8 or data.shape[1] % ts:
        raise ValueError(f"{type_name} rows must be uint8 [rows, k*{ts}], got {data.dtype} {list(data.shape)}")
    n_rows, nb = data.shape[0], data.shape[1] // ts
    a = dec(np.ascontiguousarray(data).reshape((n_rows * nb, ts)))
    k = nb * bs
    off = None if a.offset is None else a.offset.reshape((n_rows, -1))
    return Affine(a.q.reshape((n_rows, k)), a.scale.reshape((n_rows, -1)), off, a.group)


def affine_dequantize(a: Affine) -> np.ndarray:
    """``float32 [n_rows, k]`` = ``scale * q (+ offset)`` per group, gguf-py's float32 bits."""
    n, k = a.q.shape
    w = a.scale.reshape((n, -1, 1)) * a.q.reshape((n, -1, a.group)).astype(np.float32)  # [n, k/g, g]
    if a.offset is not None:
        w = w + a.offset.reshape((n, -1, 1))  # [n, k/g, g]
    return w.reshape((n, k))
