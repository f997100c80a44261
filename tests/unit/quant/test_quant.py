"""Weights that stay quantised (:mod:`infertrace.quant`) against gguf-py's dequantisation.

* every block type's codes and group parameters rebuild ``gguf.quants.dequantize``'s float32
  bits exactly: synthetic blocks (gguf-py's own quantiser where it has one, random bytes for
  the K types) and real tensors of SmolLM2-135M Q4_1 and Gemma 3 270M Q4_K_M;
* each kernel's output against the float path's ``F.linear`` on gguf-py's weights, with the
  error of a float64 product as the yardstick (tolerances measured, stated per test);
* Q/K rows un-permuted like :func:`infertrace.model.rope.unpermute_from_norm`, stacks of
  different types, embedding rows, the chunked scratch path, and the one-line refusal.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFReader
from gguf import quants as gq

from infertrace.errors import InfertraceError
from infertrace.quant import linear as ql
from infertrace.quant.blocks import DECODERS, affine_dequantize, split_rows
from infertrace.quant.source import choose_kernel, open_gguf_quant


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.float32 and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


QUANTISABLE = [t for t in DECODERS if t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")]  # gguf-py has quantize_blocks


@pytest.mark.parametrize("name", QUANTISABLE)
def test_quantised_by_gguf_py_rebuilds_its_dequantisation(name):
    """Weights quantised by gguf-py's own quantiser: codes/scales rebuild its dequantisation bit for bit."""
    w = np.random.default_rng(1).standard_normal((48, 256)).astype(np.float32)
    data = gq.quantize(w, Q[name])  # uint8 [48, bytes_per_row]
    assert same_bits(affine_dequantize(split_rows(data, name)), gq.dequantize(data, Q[name]))


@pytest.mark.parametrize("name", list(DECODERS))
def test_random_blocks_rebuild_gguf_py_bit_for_bit(name):
    """Any bytes (scales of any value): the same float32 bits and the same NaN/inf positions."""
    bs, ts = GGML_QUANT_SIZES[Q[name]]
    data = np.random.default_rng(int(Q[name])).integers(0, 256, size=(37, 3 * ts), dtype=np.uint8)
    with np.errstate(all="ignore"):
        want = gq.dequantize(data, Q[name])
        got = affine_dequantize(split_rows(data, name))
    fin = np.isfinite(want)
    assert fin.mean() > 0.8  # the comparison covers most values
    assert np.array_equal(fin, np.isfinite(got))
    assert same_bits(np.where(fin, got, 0), np.where(fin, want, 0))


def test_partial_block_is_refused():
    with pytest.raises(ValueError):
        split_rows(np.zeros((2, 30), dtype=np.uint8), "Q4_0")


@functools.lru_cache(maxsize=2)
def _reader(path) -> GGUFReader:
    return GGUFReader(str(path))  # parsing Gemma's 262k-token vocabulary once, not per test


def _real_tensors(path, names):
    return {t.name: t for t in _reader(path).tensors if t.name in names}


def test_real_tensors_rebuild_gguf_py_bit_for_bit(smol_path, gemma_path):
    """Real tensors of each type the two shipped models hold (Q4_1, Q8_0; Q4_K, Q5_0, Q6_K, Q8_0)."""
    cases = {smol_path: ["blk.0.ffn_down.weight", "blk.3.attn_q.weight"],
             gemma_path: ["blk.0.attn_output.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.0.attn_v.weight"]}
    seen = set()
    for path, names in cases.items():
        for n, t in _real_tensors(path, names).items():
            data = np.asarray(t.data)
            seen.add(t.tensor_type.name)
            assert same_bits(affine_dequantize(split_rows(data, t.tensor_type.name)), gq.dequantize(data, t.tensor_type)), n
    assert seen == {"Q4_1", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}


def _linear_error(y: torch.Tensor, x: torch.Tensor, w: np.ndarray) -> float:
    ref = x.double() @ torch.from_numpy(w).double().T  # [T, out] float64
    return float((y.double() - ref).abs().max())


@pytest.mark.parametrize("name", list(DECODERS))
def test_dequant_kernel_equals_the_float_path(name):
    """``dequant``: float32 weights are gguf-py's bits, so the product is the float path's ``F.linear``."""
    w = np.random.default_rng(2).standard_normal((64, 512)).astype(np.float32)
    if name in QUANTISABLE:
        data = gq.quantize(w, Q[name])
    else:  # K types: random bytes with tame float16 scales (gguf-py has no quantiser for them)
        bs, ts = GGML_QUANT_SIZES[Q[name]]
        data = np.random.default_rng(3).integers(0, 256, size=(64, 2 * ts), dtype=np.uint8)
        with np.errstate(all="ignore"):
            ok = np.isfinite(gq.dequantize(data, Q[name])).all(axis=1)
        data = data[ok][:32]
    a = split_rows(data, name)
    wq = gq.dequantize(data, Q[name])
    lin = ql.DequantLinear(a, name, torch.float32)
    assert same_bits(lin.dequantize().numpy(), wq)
    x = torch.randn(5, wq.shape[1], generator=torch.Generator().manual_seed(0))
    assert torch.equal(lin(x), F.linear(x, torch.from_numpy(wq)))


def test_chunked_scratch_path_matches_one_chunk(monkeypatch):
    """Rows dequantised a chunk at a time (tensors larger than the scratch buffer): same values."""
    w = np.random.default_rng(4).standard_normal((100, 256)).astype(np.float32)
    data = gq.quantize(w, Q.Q8_0)
    wq = torch.from_numpy(gq.dequantize(data, Q.Q8_0))
    lin = ql.DequantLinear(split_rows(data, "Q8_0"), "Q8_0", torch.float32)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    b = torch.randn(100, generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(ql, "SCRATCH_VALUES", 7 * 256)  # 7 rows per chunk, the last chunk partial
    got = lin(x, b)
    want = F.linear(x, wq, b)
    # per-row dot products; a chunk boundary may only change the matmul's blocking (measured: 0 or 1 ulp)
    assert torch.allclose(got, want, rtol=0, atol=4 * float(torch.finfo(torch.float32).eps) * float(want.abs().max()))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4pack_weights_in_float32(name, gemma_path):
    """``int4pack`` with float32 scales/zeros: the kernel's own weights (read back through it) vs
    gguf-py. Q4_0 is exact (z = 0, (u - 8)·d); Q4_1/Q4_K round z = offset + 8s once in float32:
    at most 2 ulp of the group's largest value (measured: ≤ 1)."""
    if name == "Q4_K":
        t = _real_tensors(gemma_path, ["blk.0.attn_output.weight"])["blk.0.attn_output.weight"]
        data = np.asarray(t.data)[:64]
    else:
        w = np.random.default_rng(5).standard_normal((64, 256)).astype(np.float32)
        data = gq.quantize(w, Q[name])
    wq = gq.dequantize(data, Q[name])
    lin = ql.Int4PackLinear(split_rows(data, name), name, torch.float32)
    got = lin.dequantize().numpy()
    err = np.abs(got - wq)
    if name == "Q4_0":
        assert np.array_equal(got, wq)  # equal values (the kernel gives +0 where gguf-py has d * -0)
    else:
        assert (err <= 2 * np.spacing(np.abs(wq).max(axis=1, keepdims=True))).all()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4pack_bf16_error_is_that_of_the_bf16_float_path(name, gemma_path):
    """bf16 activations (scales and zeros rounded to bf16 too): the output's max |Δ| against the
    float64 product stays within 3x the bf16 float path's own (F.linear on gguf-py's weights cast
    to bf16). Measured on these tensors: 0.5x-2.1x."""
    if name == "Q4_K":
        t = _real_tensors(gemma_path, ["blk.0.attn_output.weight"])["blk.0.attn_output.weight"]
        data = np.asarray(t.data)
    else:
        w = np.random.default_rng(6).standard_normal((256, 512)).astype(np.float32) * 0.05
        data = gq.quantize(w, Q[name])
    wq = gq.dequantize(data, Q[name])
    lin = ql.Int4PackLinear(split_rows(data, name), name, torch.bfloat16)
    x = torch.randn(8, wq.shape[1], generator=torch.Generator().manual_seed(3))
    xb = x.bfloat16()
    e_quant = _linear_error(lin(xb), xb.float(), wq)
    e_float = _linear_error(F.linear(xb, torch.from_numpy(wq).bfloat16()), xb.float(), wq)
    assert e_quant <= 3 * e_float


def test_smollm2_q_k_rows_unpermuted_like_the_float_path(smol_path):
    """llama-arch GGUF Q/K rows: moved whole, as unpermute_from_norm moves the float rows."""
    from infertrace.model.rope import unpermute_from_norm

    ck, src = open_gguf_quant(smol_path, torch.float32)
    cfg = ck.config
    ts = _real_tensors(smol_path, ["blk.1.attn_q.weight", "blk.1.attn_k.weight"])
    for n, heads in (("attn_q", cfg.n_head), ("attn_k", cfg.n_head_kv)):
        want = unpermute_from_norm(torch.from_numpy(gq.dequantize(np.asarray(ts[f"blk.1.{n}.weight"].data), Q.Q4_1)), heads)
        assert torch.equal(src.linear([f"blk.1.{n}"]).dequantize(), want)
    fused = src.linear(["blk.1.attn_q", "blk.1.attn_k", "blk.1.attn_v"])
    assert fused.kernel == "dequant" and fused.shape == ((cfg.n_head + 2 * cfg.n_head_kv) * cfg.head_dim, cfg.n_embd)
    src.close()


def test_gemma_mixed_types_stack_and_embedding_rows(gemma_path):
    """Gemma 3's Q/K are Q5_0 and V is Q8_0: one stacked linear, each part its own kernel; the
    embedding rows are read from the file and equal gguf-py's rows."""
    ck, src = open_gguf_quant(gemma_path, torch.bfloat16)
    lin = src.linear(["blk.0.attn_q", "blk.0.attn_k", "blk.0.attn_v"])
    assert lin.qtype == "Q5_0+Q8_0" and lin.kernel == "stack(int4x2,int4x2)"
    ts = _real_tensors(gemma_path, ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "token_embd.weight"])
    w = np.concatenate([gq.dequantize(np.asarray(ts[f"blk.0.{n}.weight"].data), ts[f"blk.0.{n}.weight"].tensor_type)
                        for n in ("attn_q", "attn_k", "attn_v")])
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(4)).bfloat16()
    part = [ql.Int4x2Linear(split_rows(np.asarray(ts[f"blk.0.{n}.weight"].data), ts[f"blk.0.{n}.weight"].tensor_type.name),
                            "", torch.bfloat16) for n in ("attn_q", "attn_k", "attn_v")]
    one = ql.Int4x2Linear(ql.cat_affine([split_rows(np.asarray(ts[f"blk.0.{n}.weight"].data), "Q5_0") for n in ("attn_q", "attn_k")]),
                          "Q5_0", torch.bfloat16)
    assert torch.equal(lin(x), torch.cat([one(x), part[2](x)], dim=-1))  # Q+K fused in one kernel, V its own
    assert torch.equal(one(x), torch.cat([part[0](x), part[1](x)], dim=-1))  # fusing rows changes no value
    ids = torch.tensor([0, 2, 262143])
    emb = np.asarray(ts["token_embd.weight"].data)[ids.numpy()]
    assert same_bits(src.rows("token_embd", ids).numpy(), gq.dequantize(emb, Q.Q8_0))
    with pytest.raises(InfertraceError, match="outside"):
        src.rows("token_embd", torch.tensor([262144]))
    assert src.kernels == {"Q5_0": "int4x2", "Q8_0": "int4x2"}
    src.close()


def test_unsupported_type_is_refused_in_one_line():
    with pytest.raises(InfertraceError) as e:
        choose_kernel("IQ2_XXS", torch.bfloat16, (64, 256))
    assert "IQ2_XXS" in e.value.message and "--weights float" in e.value.message and "\n" not in e.value.message


def test_kernel_choice():
    assert choose_kernel("Q4_K", torch.bfloat16, (640, 1024)) == "int4pack"
    assert choose_kernel("Q4_K", torch.bfloat16, (8, 1024)) == "dequant"  # out not a multiple of 16: cannot pack
    assert choose_kernel("Q4_K", torch.float32, (640, 1024)) == "dequant"  # fp32 int4 kernel is ~15x slower (benchmarks)
    assert choose_kernel("Q6_K", torch.bfloat16, (640, 1024)) == "int4pair16"
    assert choose_kernel("Q8_0", torch.bfloat16, (640, 1024)) == "int4x2"
    assert choose_kernel("Q3_K", torch.bfloat16, (640, 1024)) == "dequant"
    assert choose_kernel("Q6_K", torch.float32, (640, 1024)) == "dequant"
    assert choose_kernel("F32", torch.float32, (640, 1024)) == "dense"


def _real_or_quantised(name, gemma_path, rows=256):
    """A real Gemma tensor of ``name`` when the model has one, else gguf-py's quantisation of random weights."""
    real = {"Q4_K": "blk.0.attn_output.weight", "Q5_0": "blk.0.ffn_gate.weight", "Q8_0": "blk.0.attn_v.weight",
            "Q6_K": "blk.0.ffn_down.weight"}
    if name in real:
        return np.asarray(_real_tensors(gemma_path, [real[name]])[real[name]].data)[:rows]
    w = np.random.default_rng(7).standard_normal((rows, 512)).astype(np.float32) * 0.05
    return gq.quantize(w, Q[name])


@pytest.mark.parametrize("name,cls", [("Q5_0", ql.Int4x2Linear), ("Q5_1", ql.Int4x2Linear), ("Q8_0", ql.Int4x2Linear),
                                      ("Q6_K", ql.Int4Pair16Linear)])
def test_split_int4_kernels_in_float32(name, cls, gemma_path):
    """``int4x2`` / ``int4pair16`` with float32 activations: the weights read back through the kernel
    are gguf-py's (at most 2 ulp of the row's largest value: the one rounding of ``o + 8s``; measured 0),
    and the output is within 8x the float path's own error against a float64 product (int4pair16
    adds the ``8·s·Σx`` correction separately; measured 3.0x-6.3x, about 5e-6 absolute)."""
    data = _real_or_quantised(name, gemma_path)
    wq = gq.dequantize(data, Q[name])
    lin = cls(split_rows(data, name), name, torch.float32)
    got = lin.dequantize().numpy()
    assert (np.abs(got - wq) <= 2 * np.spacing(np.abs(wq).max(axis=1, keepdims=True))).all()
    x = torch.randn(8, wq.shape[1], generator=torch.Generator().manual_seed(5))
    e_quant = _linear_error(lin(x), x, wq)
    e_float = _linear_error(F.linear(x, torch.from_numpy(wq)), x, wq)
    assert e_quant <= 8 * e_float


@pytest.mark.parametrize("name,cls", [("Q5_0", ql.Int4x2Linear), ("Q5_1", ql.Int4x2Linear), ("Q8_0", ql.Int4x2Linear),
                                      ("Q6_K", ql.Int4Pair16Linear)])
def test_split_int4_kernels_bf16_error_is_that_of_the_bf16_float_path(name, cls, gemma_path):
    """bf16 activations: max |Δ| against the float64 product within 3x the bf16 float path's
    (each int4 plane's output is rounded to bf16 before the sum). Measured: 1.4x-1.9x."""
    data = _real_or_quantised(name, gemma_path)
    wq = gq.dequantize(data, Q[name])
    lin = cls(split_rows(data, name), name, torch.bfloat16)
    xb = torch.randn(8, wq.shape[1], generator=torch.Generator().manual_seed(6)).bfloat16()
    e_quant = _linear_error(lin(xb), xb.float(), wq)
    e_float = _linear_error(F.linear(xb, torch.from_numpy(wq).bfloat16()), xb.float(), wq)
    assert e_quant <= 3 * e_float


@pytest.mark.parametrize("rows", [64 * 5 + 48, 64 * 3 + 16, 64 * 2 + 32, 48])
@pytest.mark.parametrize("numpy_packer", [True, False])
def test_packing_in_row_chunks_equals_packing_the_whole(monkeypatch, rows, numpy_packer):
    """pack_int4 in row chunks (multiples of 64 rows, a last partial block of 16/32/48 rows), by the numpy
    packer or by torch's op, gives torch's packing of the whole matrix byte for byte."""
    codes = np.random.default_rng(8).integers(0, 16, (rows, 96), dtype=np.uint8)
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes.astype(np.int32)), 1)
    monkeypatch.setattr(ql, "PACK_VALUES", 128 * 96)  # 128-row chunks
    if not numpy_packer:
        monkeypatch.setattr(ql, "_layout", False)
    else:
        assert ql._pack_layout(), "the numpy packer reproduces torch's packing on this machine"
    assert torch.equal(ql.pack_int4(lambda r0, r1: codes[r0:r1], rows), whole)


def test_quant_weights_dict_matches_the_float_checkpoint(smol_path):
    """quant_weights: every matrix a QuantWeight of the float path's shape whose float32 kernel gives the
    float path's values; every vector the float path's tensor; build_unfused builds what was not fused."""
    from infertrace.loading.weights import load_checkpoint
    from infertrace.quant.source import QuantWeight, build_unfused, quant_weights

    ck, w, src = quant_weights(smol_path, torch.float32)
    ref = load_checkpoint(smol_path).weights
    assert set(w) == set(ref)
    for n, v in w.items():
        if isinstance(v, QuantWeight):
            assert v.shape == tuple(ref[n].shape), n
        else:
            assert torch.equal(v, ref[n]), n
    assert torch.equal(w["blk.2.attn_k"].built().dequantize(), ref["blk.2.attn_k"])  # un-permuted rows
    for n in ("blk.0.attn_q", "blk.0.attn_k"):
        w[n].fused = True  # as QuantOps.cat_rows marks them
    kernels = build_unfused(w)
    assert w["blk.0.attn_q"]._lin is None and w["blk.0.attn_v"]._lin is not None
    assert kernels == {"Q4_1": "dequant", "Q8_0": "dequant"}
    ids = torch.tensor([1, 49151])
    assert torch.equal(w["token_embd"].rows(ids), ref["token_embd"][ids])
    src.close()


@pytest.mark.parametrize("name,cls", [("Q4_K", ql.Int4PackLinear), ("Q8_0", ql.Int4x2Linear), ("Q6_K", ql.Int4Pair16Linear)])
def test_kernels_built_from_row_blocks_equal_the_whole(name, cls, gemma_path):
    """Large matrices are packed a row block at a time: every field equals packing the matrix at once."""
    if name == "Q8_0":  # Gemma's Q8_0 matrices: attn_v has 256 rows; the embedding's first 448
        data = np.asarray(_real_tensors(gemma_path, ["token_embd.weight"])["token_embd.weight"].data)[:448]
    else:
        data = _real_or_quantised(name, gemma_path, rows=448)  # 7 blocks of 64 rows
    assert data.shape[0] == 448
    a = split_rows(data, name)
    whole = cls(a, name, torch.bfloat16)
    blocks = [ql.permute_rows(a, np.arange(r0, min(448, r0 + 128))) for r0 in range(0, 448, 128)]  # 128 x 3 + 64
    built = cls.from_row_chunks(blocks, 448, name, torch.bfloat16)
    for f in cls._ROW_FIELDS:
        if getattr(whole, f) is None:  # int4pair16 holds no correction for the symmetric types
            assert getattr(built, f) is None, f
        else:
            assert torch.equal(getattr(built, f), getattr(whole, f)), f
    assert built.shape == whole.shape


def test_source_builds_large_matrices_from_row_blocks(smol_path, monkeypatch):
    """The source's block-wise build (gate+up fused, 3072 rows in blocks of 512) gives the whole build's outputs."""
    ck, src = open_gguf_quant(smol_path, torch.bfloat16)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(9)).bfloat16()
    whole = src.linear(["blk.4.ffn_gate", "blk.4.ffn_up"])
    monkeypatch.setattr(ql, "PACK_ROWS", 512)
    blocked = src.linear(["blk.4.ffn_gate", "blk.4.ffn_up"])
    assert torch.equal(blocked.packed, whole.packed) and torch.equal(blocked(x), whole(x))
    src.close()


def test_untied_embedding_is_looked_up_from_the_file_not_built(tmp_path):
    """An untied model (``output.weight`` present): build_unfused builds the lm head but not ``token_embd``
    (only its rows are read), and the quantised model's logits equal the float path's (float32: the
    dequant kernel multiplies gguf-py's weights exactly; the rows are gguf-py's values)."""
    from tests.helpers.tiny import make_weights, write_gguf

    from infertrace.engine.engine import EngineOptions, make_kv
    from infertrace.kv.base import ChunkSpec
    from infertrace.loading.model import load_model
    from infertrace.model.decoder import DecoderModel
    from infertrace.quant.ops import QuantOps
    from infertrace.quant.source import build_unfused, quant_weights

    def q8(name, arr):
        if arr.ndim == 2:
            return gq.quantize(arr, Q.Q8_0), Q.Q8_0
        return None

    w, s = make_weights(seed=4, ff=64, tie=False)
    p = write_gguf(tmp_path / "untied.gguf", w, s, quant=q8)
    ck, qw, src = quant_weights(p, torch.float32)
    assert "output" in qw
    DecoderModel(ck.config, qw, "cpu", QuantOps())
    kernels = build_unfused(qw)
    assert qw["token_embd"]._lin is None and qw["output"]._lin is not None and kernels == {"Q8_0": "dequant"}
    src.close()

    def logits(loaded):
        kv = make_kv(loaded.model, EngineOptions(backend="cells", ctx_size=64), "torch")
        ids = torch.tensor([1, 5, 9, 2])
        return loaded.model.forward(ids, kv.prepare([ChunkSpec(0, 0, 4)]), kv, torch.arange(4))  # [4, V]

    quant, flt = load_model(p, weights="quant"), load_model(p, weights="float")
    assert quant.ckpt.weights["token_embd"]._lin is None
    assert torch.allclose(logits(quant), logits(flt), rtol=0, atol=1e-5)


def test_scratch_buffer_made_in_inference_mode_is_writable_outside_it():
    """The dequantisation scratch buffer is shared by every kernel call: one first made under
    ``torch.inference_mode()`` (an engine run) must still take in-place writes from a later call outside
    it (the kernel equality tests after a run in one session failed with torch's "Inplace update to
    inference tensor outside InferenceMode")."""
    import infertrace.quant.linear as lin

    lin._scratch.clear()
    with torch.inference_mode():
        lin._buffer(torch.float32, 16).fill_(1.0)
    b = lin._buffer(torch.float32, 16)
    b.fill_(2.0)  # raised RuntimeError when the buffer was an inference tensor
    assert not b.is_inference() and float(b.sum()) == 32.0
