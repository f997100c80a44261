"""llama.cpp's sequence state file (llama-server's slot save format) read by ``dump-kv --state``,
checked on files llama.cpp itself writes through llama-cpp-python on the real SmolLM2-135M GGUF.

Independent values: the K/V infertrace's ``--runtime llama.cpp`` capture recorded for the same run
(llama.cpp's own ``cache_k_l{il}`` / ``Vcur-{il}`` graph tensors, read by the eval callback), the
cell count / positions llama.cpp decided (one cell per decoded token), llama.cpp's own
``llama_model_n_head_kv`` / ``n_embd`` / ``n_head`` for the row width, and for a Q8_0 cache the
same run's F16 cache within Q8_0's quantisation step.

Needs llama-cpp-python (the ``llama_cpp`` fixture fails by name without it, never skips).
"""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.engine.engine import EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.runner import PromptSpec

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"
LAYER = 5
SAVE_AT = 2  # the state is saved right after this step: prompt + 2 decoded tokens in the cache


def _save(L, ctx, path: Path, tokens: list[int], seq_id: int = 0) -> int:
    arr = (L.llama_token * len(tokens))(*tokens)
    n = L.llama_state_seq_save_file(ctx, str(path).encode(), seq_id, arr, len(tokens))
    assert n > 0, "llama_state_seq_save_file failed"
    return int(n)


def _traced_run(smol, path: Path, flash: str, layer: int = LAYER) -> tuple[dict, list[int]]:
    """infertrace's llama.cpp engine on PROMPT, layer ``layer``, full tensors kept; llama.cpp saves seq 0's
    state into ``path`` right after step SAVE_AT (the cache tokens: prompt + the tokens decoded so far)."""
    from infertrace.capture.recorder import Recorder
    from infertrace.engine.drive import drive_bounded, encode_requests
    from infertrace.runtimes.llamacpp.engine import LlamaCppEngine

    specs = [PromptSpec(PROMPT, SamplingParams(max_new_tokens=5, ignore_eos=True))]
    tensors: dict = {}
    rec = Recorder(smol.tokenizer, smol.config, layer=layer, layers=[layer], tensors=tensors)
    eng = LlamaCppEngine(smol, EngineOptions(ctx_size=256), rec, layer, n_seq_max=1, n_threads=1, flash_attn=flash)
    saved: list[int] = []

    def on_step(_batch) -> None:
        if eng.step_no - 1 == SAVE_AT:
            r = eng.requests[0]
            saved.extend(list(r.prompt_ids) + list(r.output_ids[:-1]))  # the last sampled token is not decoded yet
            _save(eng.lctx.L, eng.lctx.ctx, path, saved)

    try:
        drive_bounded(eng, encode_requests(smol.tokenizer, specs), on_step)
    finally:
        eng.close()
    return tensors, saved


@pytest.fixture(scope="module", params=["off", "on"], ids=["v_trans", "flash_attn"])
def traced(request, smol, llama_cpp, tmp_path_factory):
    path = tmp_path_factory.mktemp("slot") / f"slot_{request.param}.bin"
    tensors, tokens = _traced_run(smol, path, request.param)
    return path, tensors, tokens, request.param


def test_cells_and_tokens_are_what_llamacpp_holds(traced, smol) -> None:
    from infertrace.runtimes.llamacpp.state_file import read_state_file

    path, _, tokens, _ = traced
    st = read_state_file(path, smol.config)
    assert st.tokens == tokens and len(tokens) == len(smol.tokenizer.encode(PROMPT)) + SAVE_AT
    assert st.n_stream == {"kv": 1} and len(st.streams) == 1
    s = st.streams[0]
    assert s.pos.tolist() == list(range(len(tokens)))  # one cell per decoded token, positions 0..n-1
    assert s.seq_ids == [(0,)] * len(tokens)


def test_v_layout_follows_flash_attention(traced, smol) -> None:
    from infertrace.runtimes.llamacpp.state_file import read_state_file

    path, _, _, flash = traced
    assert read_state_file(path, smol.config).streams[0].v_trans is (flash == "off")  # llama.cpp: v_trans = !flash_attn


def test_kv_equal_to_the_trace_of_the_same_run(traced, smol) -> None:
    """The file's layer-LAYER K/V = what the capture recorded after step SAVE_AT, by position."""
    path, tensors, tokens, flash = traced
    _assert_kv_equal_trace(path, tensors, tokens, smol.config, LAYER)


def _assert_kv_equal_trace(path: Path, tensors: dict, tokens: list[int], cfg, layer: int, pool: str = "kv") -> None:
    from infertrace.runtimes.llamacpp.state_file import read_state_file

    st = read_state_file(path, cfg, layer=layer)
    (s,) = [x for x in st.streams if x.k is not None]
    assert s.pool == pool
    k_tr = tensors[f"step{SAVE_AT}/layer{layer}/seq0/k_cache"].float().numpy()  # [len, n_kv, hd]
    v_tr = tensors[f"step{SAVE_AT}/layer{layer}/seq0/v_cache"].float().numpy()
    order = np.argsort(s.pos)
    k, v = s.k[order], s.v[order]
    assert k.shape == k_tr.shape == (len(tokens), cfg.n_head_kv, cfg.head_dim)
    # both are llama.cpp's F16 cache values, bit for bit (measured: max |diff| 0.0 for SmolLM2 and Gemma 3, with and
    # without flash attention); without flash attention the trace's V is the F32 Vcur-{il} rounded to F16 by torch
    # and the file's ggml's F32 -> F16 conversion of the same values: both round to nearest even
    assert np.array_equal(k, k_tr), float(np.abs(k - k_tr).max())
    assert np.array_equal(v, v_tr), float(np.abs(v - v_tr).max())
    assert float(np.abs(k).max()) > 0.1 and float(np.abs(v).max()) > 0.01  # real values, not an empty cache


def test_k_row_width_is_llamacpps_n_embd_k_gqa(traced, smol, llama_cpp) -> None:
    from infertrace.runtimes.llamacpp.state_file import read_state_file

    L = llama_cpp
    m = L.llama_model_load_from_file(str(smol.ckpt.path).encode(), L.llama_model_default_params())
    try:
        n_embd_k_gqa = L.llama_model_n_embd(m) // L.llama_model_n_head(m) * L.llama_model_n_head_kv(m)
    finally:
        L.llama_model_free(m)
    st = read_state_file(traced[0], smol.config)
    assert n_embd_k_gqa == 192
    assert {(x.k_type, x.k_row) for x in st.streams[0].layers} == {(1, 2 * n_embd_k_gqa)}  # F16 rows
    assert len(st.streams[0].layers) == 30


def test_cli_json_and_render(traced, smol) -> None:
    path, tensors, tokens, _ = traced
    r = CliRunner().invoke(app, ["dump-kv", "--state", str(path), "--layer", str(LAYER), "--head", "1", "--full", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    rows = d["values"]["requests"][0]["rows"]
    k_tr = tensors[f"step{SAVE_AT}/layer{LAYER}/seq0/k_cache"].float().numpy()
    assert [x["pos"] for x in rows] == list(range(len(tokens)))
    np.testing.assert_allclose(np.array([x["k"] for x in rows]), k_tr[:, 1, :], rtol=2 ** -10, atol=2 ** -24)
    assert d["tokens"] == tokens and d["streams"][0]["layout"]["stretches"][0]["pos"] == f"0..{len(tokens) - 1}"
    r = CliRunner().invoke(app, ["dump-kv", "--state", str(path), "--layer", str(LAYER)])
    assert r.exit_code == 0 and "llama.cpp slot state" in r.output and "K/V values: layer 5" in r.output


# ----------------------------------------------------------------------------- a Q8_0 cache, llama_cpp.Llama


def _llama_slot(llama_cpp, model: Path, path: Path, **kw) -> list[int]:
    """llama-cpp-python's high-level ``Llama`` evaluates PROMPT, then llama.cpp saves seq 0."""
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=64, n_threads=1, verbose=False, **kw)
    try:
        toks = llm.tokenize(PROMPT.encode(), add_bos=False)
        llm.eval(toks)
        _save(llama_cpp, llm._ctx.ctx, path, toks)
        return toks
    finally:
        llm.close()


@pytest.fixture(scope="module")
def q8_f16(smol, llama_cpp, tmp_path_factory):
    """The same prompt into a Q8_0 cache and an F16 cache (flash attention: V rows, as quantised V needs)."""
    d = tmp_path_factory.mktemp("q8")
    q8, f16 = d / "q8.bin", d / "f16.bin"
    _llama_slot(llama_cpp, smol.ckpt.path, q8, type_k=8, type_v=8, flash_attn=True)  # GGML_TYPE_Q8_0 = 8
    _llama_slot(llama_cpp, smol.ckpt.path, f16, flash_attn=True)
    return q8, f16


def test_q8_0_cache_dequantised_and_unrotated(q8_f16, smol, monkeypatch) -> None:
    """Layer 0's K/V come from the same embeddings in both runs: the Q8_0 file's values, dequantised by
    gguf-py and un-rotated (llama.cpp rotates quantised caches, attn_rot_k/v), are the F16 file's within
    Q8_0's error: in the rotated domain each value is off by at most half a step, ``amax / 127 / 2`` with
    ``amax <= ||x||`` (any coordinate of an orthonormal rotation), so per 64-value head the error's norm is at
    most ``sqrt(64) * ||x|| / 254``, plus 2^-9 relative for the F16 scale and the F16 cache's rounding."""
    from infertrace.runtimes.llamacpp.state_file import read_state_file

    monkeypatch.delenv("LLAMA_ATTN_ROT_DISABLE", raising=False)
    a, b = read_state_file(q8_f16[0], smol.config, layer=0), read_state_file(q8_f16[1], smol.config, layer=0)
    assert {(x.k_type, x.k_row, x.v_type, x.v_row) for x in a.streams[0].layers} == {(8, 204, 8, 204)}  # 6 blocks of 34 B
    assert a.streams[0].rot == (64, 64) and b.streams[0].rot == (0, 0)
    for q, f in ((a.streams[0].k, b.streams[0].k), (a.streams[0].v, b.streams[0].v)):  # [5 cells, 3 kv heads, 64]
        err, norm = np.linalg.norm(q - f, axis=-1), np.linalg.norm(f, axis=-1)  # [5, 3] per head
        assert np.all(err <= norm * (8 / 254 + 2 ** -9)), float((err / norm).max())
        assert float(np.abs(q - f).max()) > 0  # really quantised
    # without the un-rotation the values are far off (what a reader ignoring attn_rot would show)
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    c = read_state_file(q8_f16[0], smol.config, layer=0)
    assert c.streams[0].rot == (0, 0)
    err = np.linalg.norm(c.streams[0].v - b.streams[0].v, axis=-1) / np.linalg.norm(b.streams[0].v, axis=-1)
    assert float(err.min()) > 0.3, float(err.min())


def test_q8_0_server_without_rotation(smol, llama_cpp, tmp_path, monkeypatch) -> None:
    """A llama.cpp that ran with LLAMA_ATTN_ROT_DISABLE=1 stores Q8_0 values unrotated; the same variable here reads them."""
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")  # read by llama.cpp when the context is created
    from infertrace.runtimes.llamacpp.state_file import read_state_file

    q8, f16 = tmp_path / "q8.bin", tmp_path / "f16.bin"
    _llama_slot(llama_cpp, smol.ckpt.path, q8, type_k=8, type_v=8, flash_attn=True)
    _llama_slot(llama_cpp, smol.ckpt.path, f16, flash_attn=True)
    a, b = read_state_file(q8, smol.config, layer=0), read_state_file(f16, smol.config, layer=0)
    assert a.streams[0].rot == (0, 0)
    amax = np.abs(b.streams[0].v).max(axis=-1, keepdims=True)
    assert np.all(np.abs(a.streams[0].v - b.streams[0].v) <= amax * (1 / 254 + 2 ** -9))


# ----------------------------------------------------------------------------- shared cells, streams


def _ctx_save(lc, path: Path, seq_id: int, tokens: list[int]) -> None:
    _save(lc.L, lc.ctx, path, tokens, seq_id)


def test_shared_cells_and_whole_cache_save(smol_path, smol, llama_cpp, tmp_path) -> None:
    """seq 1 shares seq 0's first 3 cells (llama_memory_seq_cp) and adds 2 of its own; llama.cpp saves the
    whole cache (seq_id -1: every cell with all its owners) and seq 1 alone (its 5 cells, seq id 1 only)."""
    from infertrace.runtimes.llamacpp.capture import LlamaCppContext
    from infertrace.runtimes.llamacpp.state_file import read_state_file

    toks = smol.tokenizer.encode(PROMPT)
    n = len(toks)
    lc = LlamaCppContext(smol_path, 256, 64, 2, 0, 1)
    try:
        lc.decode(toks, list(range(n)), [0] * n, [False] * (n - 1) + [True])
        lc.seq_cp(0, 1, 0, 3)
        lc.decode([11, 12], [3, 4], [1, 1], [False, True])
        ranges = {sid: lc.seq_pos_range(sid) for sid in (0, 1)}  # llama_memory_seq_pos_min / _max
        _ctx_save(lc, tmp_path / "all.bin", -1, toks)
        _ctx_save(lc, tmp_path / "s1.bin", 1, toks[:3] + [11, 12])
    finally:
        lc.close()
    a = read_state_file(tmp_path / "all.bin", smol.config, layer=2).streams[0]
    one = read_state_file(tmp_path / "s1.bin", smol.config, layer=2).streams[0]
    assert ranges == {0: (0, n - 1), 1: (0, 4)}
    assert a.seq_ids == [(0, 1)] * 3 + [(0,)] * (n - 3) + [(1,), (1,)]  # cell order: seq 1's new cells after seq 0's
    assert a.pos.tolist() == list(range(n)) + [3, 4]
    for sid, (lo, hi) in ranges.items():
        assert sorted(int(p) for p, ids in zip(a.pos, a.seq_ids) if sid in ids) == list(range(lo, hi + 1))
    assert one.seq_ids == [(1,)] * 5 and one.pos.tolist() == [0, 1, 2, 3, 4]
    assert np.array_equal(one.k[:3], a.k[:3]) and np.array_equal(one.k[3:], a.k[n:])  # the same cells, saved twice
    assert not np.allclose(one.v[3:], a.v[3:5])  # seq 1's tokens 11, 12 at pos 3, 4 are not seq 0's
    r = CliRunner().invoke(app, ["dump-kv", "--state", str(tmp_path / "all.bin")])
    assert r.exit_code == 0 and "MMM" in r.output  # the cell map marks shared cells as dump-kv does


def test_non_unified_cache_saves_every_stream(smol_path, smol, llama_cpp, tmp_path) -> None:
    """kv_unified = false (one stream per sequence): the file has n_stream 2, stream 0 empty, seq 1 in stream 1."""
    from infertrace.runtimes.llamacpp.capture import LlamaCppContext
    from infertrace.runtimes.llamacpp.state_file import read_state_file

    toks = smol.tokenizer.encode(PROMPT)
    lc = LlamaCppContext(smol_path, 512, 64, 2, 0, 1, kv_unified=False)
    try:
        lc.decode(toks, list(range(len(toks))), [0] * len(toks), [False] * (len(toks) - 1) + [True])
        lc.decode([11, 12], [0, 1], [1, 1], [False, True])
        _ctx_save(lc, tmp_path / "s1.bin", 1, [11, 12])
    finally:
        lc.close()
    st = read_state_file(tmp_path / "s1.bin", smol.config)
    assert st.n_stream == {"kv": 2} and [(s.stream, s.pos.tolist(), s.seq_ids) for s in st.streams] == [(1, [0, 1], [(1,), (1,)])]


# ----------------------------------------------------------------------------- Gemma 3: llama.cpp's iSWA cache


@pytest.mark.parametrize("flash", ["off", "on"])
@pytest.mark.parametrize("layer, pool", [(5, "base"), (0, "swa")], ids=["full_attention", "windowed"])
def test_iswa_kv_equal_to_the_trace_of_the_same_run(gemma, llama_cpp, tmp_path, layer, pool, flash) -> None:
    """Gemma 3 270M: the base cache (layers 5, 11, 17) then the SWA cache (the windowed layers); each layer's
    K/V = what the capture recorded from the pool llama.cpp wrote it to."""
    path = tmp_path / "gemma.bin"
    tensors, tokens = _traced_run(gemma, path, flash, layer)
    _assert_kv_equal_trace(path, tensors, tokens, gemma.config, layer, pool)


def test_iswa_saves_only_cells_inside_the_window(gemma_path, gemma, llama_cpp, tmp_path) -> None:
    """A prompt longer than the window W = 512: the base cache saves every position, the SWA cache only those
    a query at the last position still sees (llama_kv_cache::state_write skips is_masked_swa cells:
    p_max - p >= W), i.e. positions p_max - W + 1 .. p_max."""
    from infertrace.runtimes.llamacpp.state_file import read_state_file

    llm = llama_cpp.Llama(model_path=str(gemma_path), n_ctx=1024, n_batch=1024, n_threads=1, verbose=False)
    try:
        toks = llm.tokenize(("one two three four five six seven eight " * 70).encode(), add_bos=True)[:530]
        llm.eval(toks)
        _save(llama_cpp, llm._ctx.ctx, tmp_path / "long.bin", toks)
    finally:
        llm.close()
    W, n = gemma.config.sliding_window, len(toks)
    assert W == 512 and n == 530
    st = read_state_file(tmp_path / "long.bin", gemma.config)
    by = {s.pool: sorted(s.pos.tolist()) for s in st.streams}
    assert by == {"base": list(range(n)), "swa": list(range(n - W, n))}


# ----------------------------------------------------------------------------- hostile files


@pytest.fixture(scope="module")
def real(llama_cpp, smol, tmp_path_factory) -> tuple[bytes, int]:
    """A small file llama.cpp wrote (5 tokens, V transposed) and its token count."""
    p = tmp_path_factory.mktemp("hostile") / "slot.bin"
    toks = _llama_slot(llama_cpp, smol.ckpt.path, p)
    return p.read_bytes(), len(toks)


def _err(path: Path) -> str:
    r = CliRunner().invoke(app, ["dump-kv", "--state", str(path), "--layer", "0"])
    assert r.exit_code == 2, r.output
    out = r.output.strip()
    assert out.startswith("error:") and "\n" not in out and "Traceback" not in out, out
    return out


def _put(b: bytes, off: int, fmt: str, val: int) -> bytes:
    return b[:off] + struct.pack(fmt, val) + b[off + struct.calcsize(fmt):]


def _offsets(n_tok: int) -> dict[str, int]:
    """Field offsets of a one-stream file (llama-context.cpp state_seq_save_file, llama-kv-cache.cpp state_write)."""
    o = {"magic": 0, "version": 4, "n_tok": 8, "tok0": 12, "n_stream": 12 + 4 * n_tok, "cell_count": 16 + 4 * n_tok}
    o["cell0"] = o["cell_count"] + 4
    o["v_trans"] = o["cell0"] + 12 * n_tok
    o["n_layer"], o["k_type0"], o["k_row0"] = o["v_trans"] + 4, o["v_trans"] + 8, o["v_trans"] + 12
    return o


@pytest.mark.parametrize("case, want", [
    ("magic", "not a llama.cpp sequence state file"),
    ("version", "state file version 2"),
    ("cells_2e31", "claims 2147483648 cells"),
    ("n_layer", "the file holds 31 layers, the model has 30"),
    ("k_row", "layer 0 K row is 386 bytes"),
    ("k_type", "layer 0 K type 999 is not a ggml type"),
    ("v_trans", "v_trans 2 is neither 0 nor 1"),
    ("token", "outside the model's vocabulary"),
    ("n_seq_id", "n_seq_id 0 is outside"),
    ("seq_id", "a seq id is outside"),
    ("n_stream", "n_stream 1000000 is outside"),
    ("n_tok", "n_token_count 4294967295"),
    ("trailing", "bytes after the saved cache"),
])
def test_hostile_field_one_line(real, tmp_path, case, want) -> None:
    b, n = real
    o = _offsets(n)
    bad = {"magic": lambda: _put(b, o["magic"], "<I", 0x6767736E),  # 'ggsn': a whole-context session file
           "version": lambda: _put(b, o["version"], "<I", 2),
           "cells_2e31": lambda: _put(b, o["cell_count"], "<I", 2 ** 31),
           "n_layer": lambda: _put(b, o["n_layer"], "<I", 31),
           "k_row": lambda: _put(b, o["k_row0"], "<Q", 386),
           "k_type": lambda: _put(b, o["k_type0"], "<i", 999),
           "v_trans": lambda: _put(b, o["v_trans"], "<I", 2),
           "token": lambda: _put(b, o["tok0"], "<i", 10 ** 6),
           "n_seq_id": lambda: _put(b, o["cell0"] + 4, "<I", 0),
           "seq_id": lambda: _put(b, o["cell0"] + 8, "<i", 300),
           "n_stream": lambda: _put(b, o["n_stream"], "<I", 10 ** 6),
           "n_tok": lambda: _put(b, o["n_tok"], "<I", 2 ** 32 - 1),
           "trailing": lambda: b + b"\0" * 7}[case]()
    p = tmp_path / "bad.bin"
    p.write_bytes(bad)
    assert want in _err(p)


def test_truncated_anywhere_one_line(real, tmp_path) -> None:
    b, n = real
    o = _offsets(n)
    for cut in (0, 3, 11, o["n_stream"] + 2, o["cell0"] + 5, o["k_row0"] + 3, o["k_row0"] + 100, len(b) // 2, len(b) - 1):
        p = tmp_path / f"cut{cut}.bin"
        p.write_bytes(b[:cut])
        out = _err(p)
        assert "truncated" in out or "too short" in out, (cut, out)


def test_absurd_cell_count_is_bounded_in_memory(real, tmp_path, smol) -> None:
    """A cell count of 2**31 (and tokens claiming the whole 4 GiB) is refused before anything that size is read."""
    from infertrace.errors import InfertraceError
    from infertrace.runtimes.llamacpp.state_file import read_state_file

    b, n = real
    p = tmp_path / "big.bin"
    p.write_bytes(_put(b, _offsets(n)["cell_count"], "<I", 2 ** 31 - 1))
    tracemalloc.start()
    try:
        with pytest.raises(InfertraceError):
            read_state_file(p, smol.config, layer=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak


def test_symlink_fifo_directory_device_refused(real, tmp_path) -> None:
    b, _ = real
    target = tmp_path / "slot.bin"
    target.write_bytes(b)
    link = tmp_path / "link.bin"
    link.symlink_to(target)
    assert "is a symlink" in _err(link)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in _err(fifo)  # no writer: refused at once, never blocks
    assert "not a regular file" in _err(tmp_path)
    assert "not a regular file" in _err(Path("/dev/zero"))
    assert "cannot read" in _err(tmp_path / "missing.bin")


def test_slot_of_another_model_refused(real, tmp_path, gemma_path) -> None:
    """SmolLM2's slot file read as Gemma 3's: its one 30-layer cache is not Gemma's 3-layer base cache."""
    p = tmp_path / "slot.bin"
    p.write_bytes(real[0])
    r = CliRunner().invoke(app, ["dump-kv", "--state", str(p), "--model", str(gemma_path)])
    assert r.exit_code == 2 and "the file holds 30 layers in its base cache, the model has 3" in r.output
    assert "Traceback" not in r.output


def test_state_options_conflicts_one_line(real, tmp_path) -> None:
    p = tmp_path / "slot.bin"
    p.write_bytes(real[0])
    for extra, want in ((["--step", "0"], "drop --step"), (["--prompt", "x"], "drop --step"),
                        (["--head", "7"], "--head 7 out of range"), (["--layer", "30"], "--layer: 30 out of range"),
                        (["--layer", "0", "--positions", "9"], "no cell at those positions")):
        r = CliRunner().invoke(app, ["dump-kv", "--state", str(p), *extra])
        assert r.exit_code == 2 and want in r.output and "Traceback" not in r.output, (extra, r.output)
    r = CliRunner().invoke(app, ["dump-kv"])
    assert r.exit_code in (0, 2)  # no_args_is_help
    r = CliRunner().invoke(app, ["dump-kv", "--layer", "0"])
    assert r.exit_code == 2 and "--step N is required" in r.output


def test_dump_kv_state_imports_no_torch(real, tmp_path) -> None:
    """``dump-kv --state`` reads the GGUF header and the file only: a fresh interpreter never imports torch."""
    from tests.real_models.test_startup import HEAVY, probe

    p = tmp_path / "slot.bin"
    p.write_bytes(real[0])
    r = probe(tmp_path, "dump-kv", "--state", str(p), "--layer", "3", "--json")
    assert r["code"] == 0 and not any(r["loaded"][m] for m in HEAVY), r["loaded"]


@pytest.mark.parametrize("field, value, want", [
    ("layer_types", ("linear_attention", "full_attention"), "this model is hybrid"),
    ("mrope_sections", (11, 11, 10), "uses M-RoPE"),
])
def test_memories_with_another_layout_refused(real, tmp_path, smol, field, value, want) -> None:
    """Hybrid memories (recurrent state after the cache) and M-RoPE cells (llama_kv_cell_ext) are refused in one line."""
    import dataclasses

    from infertrace.errors import InfertraceError
    from infertrace.runtimes.llamacpp.state_file import read_state_file

    p = tmp_path / "slot.bin"
    p.write_bytes(real[0])
    cfg = dataclasses.replace(smol.config, **{field: value})
    with pytest.raises(InfertraceError, match=want):
        read_state_file(p, cfg)
