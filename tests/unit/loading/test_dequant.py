"""Chunked dequantisation (:mod:`infertrace.loading.dequant`) gives exactly gguf-py's values:
for every type gguf-py dequantises, random block bytes (any scale, NaN and inf included) and the
real SmolLM2-135M tensors, compared bit for bit with ``gguf.quants.dequantize``, across chunk
boundaries and for 1-D and 3-D tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gq

from infertrace.loading import dequant


def _dequantisable() -> list[Q]:
    out = []
    for qt in Q:
        if qt in (Q.F32, Q.F16):
            continue
        try:
            bs, ts = GGML_QUANT_SIZES[qt]
            gq.dequantize(np.zeros((1, ts), dtype=np.uint8), qt)
        except (NotImplementedError, KeyError):
            continue
        out.append(qt)
    return out


TYPES = _dequantisable()


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.float32 and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_the_chunked_path_covers_the_common_types():
    """The speed-up is real for what models ship (else every type would silently fall back)."""
    for qt in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K):
        assert qt in TYPES and dequant._row_dequantizer(qt) is not None, qt


@pytest.mark.parametrize("qt", TYPES, ids=[q.name for q in TYPES])
@pytest.mark.parametrize("shape", [(37, 2), (5,), (2, 3, 1)], ids=["rows-37", "1d", "3d"])
def test_random_blocks_match_gguf_py_bit_for_bit(qt, shape, monkeypatch):
    bs, ts = GGML_QUANT_SIZES[qt]
    *lead, blocks = shape
    data = np.random.default_rng(int(qt)).integers(0, 256, size=(*lead, blocks * ts), dtype=np.uint8)
    monkeypatch.setattr(dequant, "CHUNK_VALUES", 3 * blocks * bs)  # 3 rows per chunk: 37 rows end in a partial chunk
    with np.errstate(all="ignore"):
        want = gq.dequantize(data, qt)
        got = dequant.dequantize(data, qt)
    assert got.shape == (*lead, blocks * bs)
    assert same_bits(got, want)
    assert got.flags.writeable and got.flags.c_contiguous


def test_partial_block_is_refused_like_gguf_py():
    bs, ts = GGML_QUANT_SIZES[Q.Q4_1]
    data = np.zeros((2, ts + 1), dtype=np.uint8)
    with pytest.raises(ValueError):
        gq.dequantize(data, Q.Q4_1)
    with pytest.raises(ValueError):
        dequant.dequantize(data, Q.Q4_1)


def test_float_types_go_through_gguf_py():
    x = np.arange(12, dtype=np.float16).reshape(3, 4)
    assert same_bits(dequant.dequantize(x, Q.F16), gq.dequantize(x, Q.F16))


@pytest.mark.model
def test_smollm2_tensors_match_gguf_py_bit_for_bit():
    """Every quantised tensor type in the default model (Q4_1, Q8_0), the largest tensor included."""
    from gguf import GGUFReader

    from infertrace.loading.registry import resolve_model

    r = GGUFReader(str(resolve_model(None)))
    seen: dict[str, int] = {}
    for t in sorted(r.tensors, key=lambda t: -int(t.n_bytes)):
        qt = Q(t.tensor_type)
        if qt in (Q.F32, Q.F16) or seen.get(qt.name, 0) >= 2:
            continue
        seen[qt.name] = seen.get(qt.name, 0) + 1
        with np.errstate(all="ignore"):
            assert same_bits(dequant.dequantize(t.data, qt), gq.dequantize(t.data, qt)), t.name
    assert {"Q4_1", "Q8_0"} <= set(seen)
