"""GGUF tensor dequantisation by gguf-py, over large row chunks.

gguf-py (``gguf.quants``) stays the dequantiser of record: every value comes from its per-type
``dequantize_blocks``. Its public ``gguf.quants.dequantize`` walks a tensor in groups of 16 rows;
with the short rows of a small model (576 values: 18 Q4_1 blocks per row) most of that time is
numpy call overhead per group (the 49,152-row embedding of SmolLM2-135M is 3,072 groups). Here the
same type's ``dequantize_rows`` (the function those groups call) runs on chunks of about
:data:`CHUNK_VALUES` values instead: the same arithmetic on every block, so the same float32 bits
(``tests/unit/loading/test_dequant.py`` compares them with ``gguf.quants.dequantize`` for every type gguf-py
dequantises), in a third of the CPU time: all of SmolLM2-135M Q4_1 in 0.25 s instead of 0.76 s
(``benchmarks/README.md``). Types gguf-py does not expose that way go through
``gguf.quants.dequantize`` itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: float32 values dequantised per call: 1 MiB of output keeps the temporaries in cache (measured on
#: SmolLM2-135M Q4_1: 2^17..2^18 best, 2^19 already 2.8x slower, 2^20 3.6x)
CHUNK_VALUES = 1 << 18


def _row_dequantizer(qtype: Any) -> Any:
    """gguf-py's class for ``qtype`` when it has ``dequantize_rows`` (None: use ``dequantize``)."""
    from infertrace.loading.gguf_lib import gguf

    gq = gguf().quants

    q = getattr(gq, "_type_traits", {}).get(qtype)
    return q if q is not None and hasattr(q, "dequantize_rows") and hasattr(q, "init_grid") else None


def dequantize(data: np.ndarray, qtype: Any) -> np.ndarray:
    """float32 values of one GGUF tensor, bit for bit what ``gguf.quants.dequantize(data, qtype)`` gives.

    Args:
        data: the tensor's data as gguf-py's ``GGUFReader`` exposes it (and
            :meth:`infertrace.loading.gguf_meta.GGUFHeader.tensor_data` rebuilds it): for a quantised
            type ``uint8 [..., bytes_per_row]`` (rows of blocks, ggml ``ne`` reversed); for F32/F16
            the values.
        qtype: a ``gguf.GGMLQuantizationType``.

    Returns:
        ``float32 [..., values_per_row]`` (``values_per_row = bytes_per_row / type_size *
        block_size``); a fresh writable array for quantised and F16 data, for F32 a view of ``data``.

    Raises:
        NotImplementedError: gguf-py cannot dequantise ``qtype``.
        ValueError: ``bytes_per_row`` is not a whole number of blocks.
    """
    from infertrace.loading.gguf_lib import gguf

    gq = gguf().quants

    q = _row_dequantizer(qtype)
    if q is None:
        return gq.dequantize(data, qtype)
    out_shape = gq.quant_shape_from_byte_shape(data.shape, qtype)  # raises ValueError on partial blocks
    rows = data.reshape(-1, data.shape[-1])  # [n_rows, bytes_per_row]
    n_values = int(out_shape[-1])
    out = np.empty((rows.shape[0], n_values), dtype=np.float32)  # [n_rows, values_per_row]
    step = max(1, CHUNK_VALUES // max(1, n_values))
    q.init_grid()  # the IQ types' lookup grids, as gguf.quants.dequantize prepares them
    for r0 in range(0, rows.shape[0], step):
        out[r0: r0 + step] = q.dequantize_rows(rows[r0: r0 + step])  # [chunk_rows, values_per_row]
    return out.reshape(out_shape)


#: quantised types of a big-endian GGUF whose blocks hold fp16 fields, and the byte offsets of those
#: fields in a block (gguf-py ``scripts/gguf_convert_endian.py``: ``byteswap_q4_0`` / ``_q8_0`` / ``_q4_k``
#: / ``_q6_k``; the int8 / packed nibble parts are byte-sized and stay as they are)
_BE_FP16_FIELDS = {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def blocks_to_little_endian(data: np.ndarray, qtype: Any, tensor: str, file: str) -> np.ndarray:
    """The tensor data of a big-endian GGUF rewritten in little-endian block layout, the one gguf-py's
    dequantisers read (the inverse of gguf-py's ``gguf_convert_endian.py``, which swaps each block's
    fp16 scale fields and BF16 values and nothing else).

    Args:
        data: ``uint8 [..., bytes_per_row]`` as ``GGUFReader`` gives a quantised or BF16 tensor.
        qtype: its ``gguf.GGMLQuantizationType``; tensor / file: names for the error.

    Returns:
        a fresh ``uint8`` array of the same shape.

    Raises:
        InfertraceError: a type whose big-endian block layout is not defined by gguf-py's converter
            (one line naming the big-endian byte order and how to convert the file).
    """
    from infertrace.loading.gguf_lib import gguf

    GGML_QUANT_SIZES = gguf().GGML_QUANT_SIZES

    from infertrace.errors import InfertraceError

    name = getattr(qtype, "name", str(qtype))
    out = np.array(data, dtype=np.uint8, copy=True)  # [..., bytes_per_row]
    if name == "BF16":
        flat = out.reshape(-1, 2)  # [n_values, 2]
        flat[:, [0, 1]] = flat[:, [1, 0]]
        return out
    if name == "MXFP4":  # byte-sized fields only (byteswap_noop)
        return out
    fields = _BE_FP16_FIELDS.get(name)
    if fields is None:
        raise InfertraceError(f"cannot read {file}: tensor {tensor} is {name} in a big-endian GGUF, whose block byte order "
                              "is not defined (gguf-py converts F32/F16/BF16/Q4_0/Q8_0/Q4_K/Q6_K); convert the file to "
                              "little-endian (gguf-py gguf_convert_endian.py FILE little) or requantise it")
    type_size = GGML_QUANT_SIZES[qtype][1]
    blocks = out.reshape(-1, type_size)  # [n_blocks, type_size]
    for off in fields:
        blocks[:, [off, off + 1]] = blocks[:, [off + 1, off]]  # fp16 field: big-endian -> little-endian
    return out
