"""Big-endian GGUF (case G2): a file written for a big-endian host — by gguf-py's own writer
(``GGUFWriter(endianess=GGUFEndian.BIG)``) or converted by gguf-py's ``gguf_convert_endian.py`` — loads
with logits equal to the little-endian copy's; a type whose big-endian block layout gguf-py does not
define is refused in one line naming the byte order, never as "GGUF version 50331648"."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.loading.gguf_check import check_gguf_header
from tests.helpers.tiny import make_weights, write_gguf

IDS = [72, 101, 108, 108, 111, 32, 119]  # "Hello w"


def _logits(path: Path) -> torch.Tensor:
    """Our engine's logits ``[T, V]`` at every prompt position (one prefill)."""
    from infertrace.kv.base import ChunkSpec
    from infertrace.kv.cells import CellsKV
    from infertrace.runner import load_model

    m = load_model(path).model
    cfg = m.cfg
    kv = CellsKV(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, 64, 1, m.dtype, m.device, windows=[0] * cfg.n_layer)
    inp = kv.prepare([ChunkSpec(0, 0, len(IDS))])
    return m.forward(torch.tensor(IDS), inp, kv, torch.arange(len(IDS)))  # [T, V]


def _quant(name: str, arr: np.ndarray):
    """Q8_0 attention, Q4_0 FFN gate/up, BF16 embedding; norms and the rest F32."""
    t = (gguf.GGMLQuantizationType.Q8_0 if ".attn_" in name and "norm" not in name else
         gguf.GGMLQuantizationType.Q4_0 if ".ffn_gate" in name or ".ffn_up" in name else
         gguf.GGMLQuantizationType.BF16 if name == "token_embd.weight" else None)
    return None if t is None else (quantize(arr, t), t)


def test_big_endian_f32_from_gguf_py_writer_loads_with_equal_logits(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERTRACE_NO_CACHE", "1")
    w, s = make_weights(seed=4)
    le = write_gguf(tmp_path / "le.gguf", w, s)
    be = write_gguf(tmp_path / "be.gguf", w, s, endianess=gguf.GGUFEndian.BIG)
    assert be.read_bytes()[4:8] == b"\x00\x00\x00\x03"  # version 3, big-endian (read little-endian: 50331648)
    assert gguf.GGUFReader(str(be)).byte_order == "S"  # gguf-py reads it, swapped
    facts = check_gguf_header(be)
    assert (facts.byte_order, facts.version, facts.n_tensors) == (">", 3, check_gguf_header(le).n_tensors)
    a, b = _logits(le), _logits(be)
    assert torch.equal(a, b)
    r = CliRunner().invoke(app, ["run", "-m", str(be), "-p", "Hello w", "-n", "3", "--ignore-eos"])
    assert r.exit_code == 0, r.output
    assert "GGUF in big-endian byte order" in r.output  # the run header's notes say it


def test_big_endian_quantised_from_gguf_convert_endian_loads_with_equal_logits(tmp_path, monkeypatch):
    """Q8_0 / Q4_0 / BF16 tensors: gguf-py's converter swaps each block's fp16 scale (and BF16 values);
    we swap them back before gguf-py dequantises: the same float32 weights, equal logits."""
    monkeypatch.setenv("INFERTRACE_NO_CACHE", "1")
    w, s = make_weights(seed=6, ff=64)
    le = write_gguf(tmp_path / "le.gguf", w, s, quant=_quant)
    be = tmp_path / "be.gguf"
    shutil.copyfile(le, be)
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_convert_endian", str(be), "big"], input="YES\n",
                   text=True, check=True, capture_output=True)
    r = gguf.GGUFReader(str(be))
    assert r.byte_order == "S"
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert {"Q8_0", "Q4_0", "BF16", "F32"} <= set(types.values())
    assert be.read_bytes() != le.read_bytes()
    assert torch.equal(_logits(le), _logits(be))


def test_big_endian_type_without_a_defined_layout_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERTRACE_NO_CACHE", "1")
    w, s = make_weights(seed=4)
    q41 = lambda n, a: (quantize(a, gguf.GGMLQuantizationType.Q4_1), gguf.GGMLQuantizationType.Q4_1) \
        if ".attn_q." in n else None  # noqa: E731
    be = write_gguf(tmp_path / "be.gguf", w, s, endianess=gguf.GGUFEndian.BIG, quant=q41)
    r = CliRunner().invoke(app, ["run", "-m", str(be), "-p", "Hello", "-n", "1"])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "Q4_1 in a big-endian GGUF" in lines[0] and "version" not in lines[0], r.output


@pytest.mark.needs_llamacpp
def test_big_endian_k_quants_from_llama_cpp_quantize_load_with_equal_logits(tmp_path, monkeypatch):
    """Q4_K and Q6_K (llama.cpp's own ``llama_model_quantize``, Q4_K_M), converted to big-endian by
    gguf-py: the blocks' fp16 d / dmin swapped back, equal logits."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import ctypes

    monkeypatch.setenv("INFERTRACE_NO_CACHE", "1")
    w, s = make_weights(seed=7, H=256, n_head=4, n_kv=2, head_dim=64, ff=256)  # K-quant rows: multiples of 256
    f32 = write_gguf(tmp_path / "f32.gguf", w, s)
    le = tmp_path / "q4km.gguf"
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(le).encode(), ctypes.byref(p)) == 0
    assert {"Q4_K", "Q6_K"} <= {t.tensor_type.name for t in gguf.GGUFReader(str(le)).tensors}
    be = tmp_path / "be.gguf"
    shutil.copyfile(le, be)
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_convert_endian", str(be), "big"], input="YES\n",
                   text=True, check=True, capture_output=True)
    assert gguf.GGUFReader(str(be)).byte_order == "S"
    a, b = _logits(le), _logits(be)
    assert torch.equal(a, b)
    assert float((a - _logits(f32)).abs().max()) > 0  # quantised: not the F32 weights (the swap is exercised)


@pytest.mark.needs_llamacpp
def test_llama_cpp_engine_names_the_byte_order(tmp_path):
    """llama.cpp itself reads only its host's byte order: ``--runtime llama.cpp`` on a big-endian file
    says why in one line (exit 2)."""
    pytest.importorskip("llama_cpp")
    w, s = make_weights(seed=4)
    be = write_gguf(tmp_path / "be.gguf", w, s, endianess=gguf.GGUFEndian.BIG)
    r = CliRunner().invoke(app, ["run", "-m", str(be), "-p", "Hello", "-n", "1", "--runtime", "llama.cpp"])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
    assert "big-endian GGUF" in r.output and "gguf_convert_endian.py" in r.output, r.output
