"""llama.cpp's sequence state file (``llama_state_seq_save_file``; llama-server's slot save), read
torch-free, bounded and validated against the model: the file is untrusted input.

What it mirrors (llama.cpp as vendored by llama-cpp-python 0.3.36: ``LLAMA_STATE_SEQ_VERSION 3`` in
``llama.h``; checked byte for byte against files that build writes, ``tests/runtimes/llamacpp/test_state_file.py``):

* ``src/llama-context.cpp`` ``llama_context::state_seq_save_file``: ``u32 magic`` (``LLAMA_STATE_SEQ_MAGIC``
  ``'ggsq'`` = ``0x67677371``), ``u32 version`` (3), ``u32 n_token_count``, ``i32 tokens[n_token_count]``,
  then ``state_seq_write_data`` -> the memory's ``state_write(io, seq_id, flags)``;
* ``src/llama-kv-cache.cpp`` ``llama_kv_cache::state_write``: ``u32 n_stream``, then per stream
  ``u32 cell_count`` and, when it is not 0, ``state_write_meta`` (per cell ``i32 pos``, ``u32 n_seq_id``,
  ``i32 seq_id[n_seq_id]``; no cell index: the cells are written in cell order, ranges concatenated,
  and ``state_read_meta`` places them anew with ``find_slot``) and ``state_write_data``: ``u32 v_trans``,
  ``u32 n_layer``, per layer ``i32 k_type``, ``u64 k_size_row`` (``ggml_row_size(k_type, n_embd_k_gqa)``),
  ``cell_count`` K rows; then V: not transposed (flash attention) per layer ``i32 v_type``,
  ``u64 v_size_row``, ``cell_count`` rows; transposed per layer ``i32 v_type``, ``u32 v_size_el``
  (``ggml_type_size``), ``u32 n_embd_v_gqa``, then for each of the ``n_embd_v_gqa`` channels the
  ``cell_count`` elements of the cells.

Read here: the plain ``llama_kv_cache`` (every layer in one cache: the llama family the default model
is), and ``src/llama-kv-cache-iswa.cpp`` ``llama_kv_cache_iswa::state_write`` of sliding-window models
(Gemma 3): the base cache (the full-attention layers) then the SWA cache (the windowed layers), each a
whole ``llama_kv_cache::state_write`` as above (its ``n_layer`` = its own layers; a sequence's cells that
left the window are not saved in the SWA cache: ``is_masked_swa``). Refused in one line: hybrid models
(``llama_memory_hybrid`` writes the recurrent state after the attention cache), M-RoPE models (their
cells carry a ``llama_kv_cell_ext`` the layout above does not have).

Quantised caches hold rotated K/V: llama.cpp (``llama_kv_cache`` constructor, ``attn_rot_k`` /
``attn_rot_v``; PR #21038) multiplies K and V by an orthonormal Walsh-Hadamard matrix before storing them
when the cache type is quantised, ``n_embd_head % 64 == 0`` and ``LLAMA_ATTN_ROT_DISABLE`` is unset or 0;
K in blocks of ``nrot`` = the largest power of two dividing ``n_embd_head_k`` (``build_input_k_rot``), V in
blocks of 64 (``build_input_v_rot``); ``ggml_gen_hadamard`` (Sylvester, ``1/sqrt(n)``, ``H·H = I``). The
file does not say whether it ran, so the same rule is applied here, ``LLAMA_ATTN_ROT_DISABLE`` read from
this process's environment (set it as the server had it), and what was undone is recorded
(:func:`attn_rot`; ``StateStream.rot``).

Every count and size the file holds is bounded before it is used: by the model (``n_layer``,
``n_embd_k_gqa`` / ``n_embd_v_gqa``, the K/V type's ``ggml_row_size``, ``vocab_size``), by llama.cpp's
own limits (``LLAMA_MAX_SEQ`` = 256 sequences / streams) and by the bytes left in the file. Reads are
positional and bounded (:func:`infertrace.safe_io.pread_exact`); only the cell metadata and the one
chosen layer's K/V are ever in memory.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from infertrace.errors import ConfigError, InfertraceError
from infertrace.safe_io import open_regular, pread_exact
from infertrace.safe_text import visible

#: ``LLAMA_FILE_MAGIC_GGSQ`` ('ggsq') and the ``LLAMA_STATE_SEQ_VERSION`` this reader follows
STATE_SEQ_MAGIC, STATE_SEQ_VERSION = 0x67677371, 3
#: ``LLAMA_MAX_SEQ`` (``src/llama-cparams.h``): seq ids and streams are below it
LLAMA_MAX_SEQ = 256
#: cells / tokens in one file at most (any context llama.cpp runs; the file size bounds it first)
MAX_CELLS = 1 << 24
#: ggml types whose rows are plain numpy values (id -> little-endian dtype); bf16 is handled apart
_PLAIN = {0: "<f4", 1: "<f2"}
GGML_BF16 = 30


def norm_to_neox(x: np.ndarray) -> np.ndarray:
    """``[..., hd]`` in GGUF adjacent-pair order -> half-split order: ``out[j + a*hd/2] = x[2j + a]``
    (the inverse of llama.cpp ``convert_hf_to_gguf``'s Q/K permutation, per head)."""
    hd = x.shape[-1]
    return x.reshape(*x.shape[:-1], hd // 2, 2).swapaxes(-1, -2).reshape(x.shape)


@dataclass
class StateLayer:
    """Where one layer's K and V of one stream lie in the file (byte offsets, absolute)."""

    il: int
    k_type: int
    k_row: int  # bytes per cell (ggml_row_size)
    k_off: int
    v_type: int
    v_row: int  # bytes per cell (not transposed) or per element (transposed: v_size_el)
    v_off: int


@dataclass
class StateStream:
    """One stream of one saved cache (``pool``: ``kv``, or ``base`` / ``swa`` for an iSWA cache): its cells
    in file order and its layers' data (``StateLayer.il``: the model layer)."""

    pool: str
    stream: int
    pos: np.ndarray  # int32 [n_cells]
    seq_ids: list[tuple[int, ...]]  # per cell
    v_trans: bool = False
    layers: list[StateLayer] = field(default_factory=list)
    k: np.ndarray | None = None  # float32 [n_cells, n_kv, hd] of the chosen layer (infertrace's K order)
    v: np.ndarray | None = None  # float32 [n_cells, n_kv, hd]
    rot: tuple[int, int] = (0, 0)  # Hadamard block size undone on K, V of the chosen layer (0: none)


@dataclass
class SlotState:
    """A parsed state file: header, token list, streams (see the module docstring)."""

    path: str
    size: int
    version: int
    tokens: list[int]
    n_stream: dict[str, int]  # per cache (pool) its n_stream
    streams: list[StateStream]
    layer: int | None = None

    def n_cells(self, pool: str) -> int:
        """Cells saved in cache ``pool``, all its streams together."""
        return sum(len(s.pos) for s in self.streams if s.pool == pool)


class _File:
    """Bounded positional reads of an open state file; every failure names the file and the field."""

    def __init__(self, fd: int, size: int, name: str):
        self.fd, self.size, self.name, self.at = fd, size, name, 0

    def fail(self, msg: str) -> InfertraceError:
        return InfertraceError(f"{self.name}: {msg}")

    def left(self) -> int:
        return self.size - self.at

    def take(self, n: int, what: str) -> bytes:
        if n > self.left():
            raise self.fail(f"truncated at byte {self.at}: {what} needs {n} bytes, {self.left()} left "
                            "(the file is cut short; save the slot again)")
        b = pread_exact(self.fd, self.at, n, f"{self.name} shrank while being read; read it again")
        self.at += n
        return b

    def skip(self, n: int, what: str) -> int:
        if n > self.left():
            raise self.fail(f"truncated at byte {self.at}: {what} needs {n} bytes, {self.left()} left "
                            "(the file is cut short; save the slot again)")
        off, self.at = self.at, self.at + n
        return off

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def i32(self, what: str) -> int:
        return struct.unpack("<i", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]


def _check_model(cfg: Any) -> None:
    """Refuse the memories whose state layout this reader does not follow (module docstring)."""
    if getattr(cfg, "is_hybrid", False):
        raise InfertraceError("--state: this model is hybrid (llama.cpp saves its recurrent state after the attention "
                              "cache); reading it is not supported: use a model with attention layers only")
    if getattr(cfg, "mrope_sections", ()):
        raise InfertraceError("--state: this model uses M-RoPE (its cells carry llama_kv_cell_ext in the file); "
                              "reading it is not supported")


def _quant_sizes() -> dict[int, tuple[int, int]]:
    """ggml type id -> (block size, bytes per block), from gguf-py's ``GGML_QUANT_SIZES``."""
    from infertrace.loading.gguf_lib import gguf

    return {int(t): (int(b), int(s)) for t, (b, s) in gguf().GGML_QUANT_SIZES.items()}


def type_name(t: int) -> str:
    """ggml type name (``F16``, ``Q8_0`` ...) or ``type N`` for an id gguf-py does not know."""
    from infertrace.loading.gguf_lib import gguf

    try:
        return gguf().GGMLQuantizationType(t).name
    except ValueError:
        return f"type {t}"


def _row_size(f: _File, t: int, n: int, what: str) -> int:
    """``ggml_row_size(t, n)`` or a one-line error for a type the reader does not know."""
    sizes = _quant_sizes()
    if t not in sizes:
        raise f.fail(f"{what} type {t} is not a ggml type gguf-py knows; not a state file this reader can read")
    blk, nb = sizes[t]
    if n % blk:
        raise f.fail(f"{what} type {type_name(t)} has blocks of {blk} values, which do not divide the model's width {n}")
    return n // blk * nb


def read_state_file(path: str | Path, cfg: Any, layer: int | None = None) -> SlotState:
    """Parse a ``llama_state_seq_save_file`` / llama-server slot file for the model ``cfg``.

    Args:
        path: the file (a regular file; a symlink, FIFO or device is refused).
        cfg: the model's :class:`~infertrace.model.config.ModelConfig` (``n_layer``, ``n_head_kv``,
            ``head_dim``, ``vocab_size``, ``rope_pairing_in_file``).
        layer: also read this layer's K/V of every stream (``StateStream.k`` / ``v``: float32
            ``[n_cells, n_kv_heads, head_dim]``; K in infertrace's half-split order, as traces hold it).

    Raises:
        InfertraceError: one line for every defect: not a regular file, wrong magic or version,
            truncation, counts past their bounds, a layer count, type or row size that disagrees
            with the model, bytes left over, a K/V type gguf-py cannot dequantise.
    """
    _check_model(cfg)
    if layer is not None and not 0 <= layer < cfg.n_layer:
        raise ConfigError("run.layer", f"{layer} out of range: the model has layers 0..{cfg.n_layer - 1}")
    name = visible(str(path))
    fd, st = open_regular(path, "slot state file", follow=False)
    try:
        f = _File(fd, st.st_size, name)
        version, tokens = _header(f, cfg)
        streams: list[StateStream] = []
        n_stream = {}
        for pool, layers in pools(cfg):
            n_stream[pool] = _cache(f, cfg, pool, layers, streams)
        if f.left():
            raise f.fail(f"{f.left()} bytes after the saved cache (at byte {f.at}); not a slot file of this model "
                         "(a hybrid memory writes its recurrent state after the cache)")
        out = SlotState(name, st.st_size, version, tokens, n_stream, streams, layer)
        if layer is not None:
            for s in streams:
                if any(L.il == layer for L in s.layers):
                    s.k, s.v = _layer_values(f, cfg, s, layer)
        return out
    except OSError as e:
        raise InfertraceError(f"cannot read {name}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def pools(cfg: Any) -> list[tuple[str, list[int]]]:
    """The caches llama.cpp saves for ``cfg``, in file order, each with its model layers: ``[("kv", all)]``, or
    for sliding-window models ``[("base", full-attention layers), ("swa", windowed layers)]``
    (``llama_kv_cache_iswa``: ``kv_base`` then ``kv_swa``)."""
    win = set(getattr(cfg, "windowed_layers", None) or [])
    if not win:
        return [("kv", list(range(cfg.n_layer)))]
    return [("base", [i for i in range(cfg.n_layer) if i not in win]), ("swa", sorted(win))]


def _cache(f: _File, cfg: Any, pool: str, layers: list[int], out: list[StateStream]) -> int:
    """One ``llama_kv_cache::state_write``: ``n_stream``, then each stream's cells and data (into ``out``)."""
    what = "" if pool == "kv" else f"{pool} cache "
    n_stream = f.u32(f"{what}n_stream")
    if not 1 <= n_stream <= LLAMA_MAX_SEQ:
        raise f.fail(f"{what}n_stream {n_stream} is outside 1..{LLAMA_MAX_SEQ} (LLAMA_MAX_SEQ); not a state file of a KV cache")
    for s in range(n_stream):
        n = f.u32(f"{what}stream {s} cell_count")
        if n == 0:
            continue
        if n > MAX_CELLS or n > f.left() // 12:
            raise f.fail(f"{what}stream {s} claims {n} cells, more than the {f.left()} bytes left can hold "
                         f"(12+ bytes each) or than {MAX_CELLS}; the file is corrupt")
        out.append(_stream(f, cfg, pool, layers, s, n))
    return n_stream


def _header(f: _File, cfg: Any) -> tuple[int, list[int]]:
    """Magic, version and the token list (``state_seq_save_file``)."""
    if f.size < 12:
        raise f.fail(f"{f.size} bytes: too short for a llama.cpp state file (magic, version, token count)")
    magic = f.u32("magic")
    if magic != STATE_SEQ_MAGIC:
        raise f.fail(f"not a llama.cpp sequence state file (magic {magic:#010x}, want 'ggsq' {STATE_SEQ_MAGIC:#010x}); "
                     "give a file written by llama_state_seq_save_file or llama-server's slot save")
    version = f.u32("version")
    if version != STATE_SEQ_VERSION:
        raise f.fail(f"state file version {version}, this reader follows version {STATE_SEQ_VERSION} "
                     "(llama-cpp-python 0.3.36's llama.cpp); save it with a matching llama.cpp")
    n_tok = f.u32("n_token_count")
    if n_tok > MAX_CELLS or 4 * n_tok > f.left():
        raise f.fail(f"n_token_count {n_tok} needs {4 * n_tok} bytes, {f.left()} left; the file is cut short or corrupt")
    toks = np.frombuffer(f.take(4 * n_tok, "tokens"), dtype="<i4")  # [n_tok]
    bad = np.flatnonzero((toks < 0) | (toks >= cfg.vocab_size))
    if bad.size:
        raise f.fail(f"token {int(toks[bad[0]])} at index {int(bad[0])} is outside the model's vocabulary "
                     f"(0..{cfg.vocab_size - 1}); the file is for another model or corrupt")
    return version, toks.astype(int).tolist()


def _cells(f: _File, s: int, n: int) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    """``state_write_meta``: per cell pos, n_seq_id, seq ids (fast path: one seq id per cell)."""
    start = f.at
    a = np.frombuffer(f.take(12 * n, f"stream {s} cells"), dtype="<i4").reshape(n, 3)  # [n, (pos, n_seq_id, seq_id)]
    if bool((a[:, 1] == 1).all()):
        pos, sids = a[:, 0].copy(), a[:, 2]
        seq_ids = [(int(x),) for x in sids]
    else:  # several owners somewhere: walk cell by cell
        f.at = start
        pos, seq_ids = np.empty(n, dtype=np.int32), []
        for i in range(n):
            pos[i], k = f.i32(f"cell {i} pos"), f.u32(f"cell {i} n_seq_id")
            if not 1 <= k <= LLAMA_MAX_SEQ:
                raise f.fail(f"stream {s} cell {i}: n_seq_id {k} is outside 1..{LLAMA_MAX_SEQ}; the file is corrupt")
            ids = struct.unpack(f"<{k}i", f.take(4 * k, f"cell {i} seq ids"))
            if len(set(ids)) != k:
                raise f.fail(f"stream {s} cell {i}: seq ids {list(ids)} repeat; the file is corrupt")
            seq_ids.append(tuple(ids))
        sids = np.array([x for t in seq_ids for x in t], dtype=np.int64)
    if sids.size and (int(sids.min()) < 0 or int(sids.max()) >= LLAMA_MAX_SEQ):
        raise f.fail(f"stream {s}: a seq id is outside 0..{LLAMA_MAX_SEQ - 1} (LLAMA_MAX_SEQ); the file is corrupt")
    if pos.size and int(pos.min()) < 0:
        raise f.fail(f"stream {s}: cell {int(np.argmin(pos))} has position {int(pos.min())} (< 0); the file is corrupt")
    return pos, seq_ids


def _stream(f: _File, cfg: Any, pool: str, layers: list[int], s: int, n: int) -> StateStream:
    """One stream: cells, then ``state_write_data`` checked layer by layer against the model."""
    pos, seq_ids = _cells(f, s, n)
    v_trans = f.u32("v_trans")
    if v_trans not in (0, 1):
        raise f.fail(f"v_trans {v_trans} is neither 0 nor 1; the file is corrupt")
    n_layer = f.u32("n_layer")
    if n_layer != len(layers):
        where = "" if pool == "kv" else f" in its {pool} cache"
        raise f.fail(f"the file holds {n_layer} layers{where}, the model has {len(layers)}; give the --model the slot "
                     "was saved with")
    width = cfg.n_head_kv * cfg.head_dim  # n_embd_k_gqa = n_embd_v_gqa
    st = StateStream(pool, s, pos, seq_ids, bool(v_trans))
    ks = []
    for il in layers:
        t, row = f.i32(f"layer {il} k_type"), f.u64(f"layer {il} k_size_row")
        want = _row_size(f, t, width, f"layer {il} K")
        if row != want:
            raise f.fail(f"layer {il} K row is {row} bytes; {type_name(t)} rows of the model's n_embd_k_gqa {width} "
                         f"are {want}; the file is for another model or corrupt")
        ks.append((t, row, f.skip(n * row, f"layer {il} K data")))
    for j, il in enumerate(layers):
        t = f.i32(f"layer {il} v_type")
        if v_trans:
            el, w = f.u32(f"layer {il} v_size_el"), f.u32(f"layer {il} n_embd_v_gqa")
            sizes = _quant_sizes()
            if t not in sizes or sizes[t][0] != 1 or el != sizes[t][1]:
                raise f.fail(f"layer {il} V is transposed with type {type_name(t)} and element size {el}; "
                             "transposed V is stored as plain f32/f16/bf16 elements only; the file is corrupt")
            if w != width:
                raise f.fail(f"layer {il} V has n_embd_v_gqa {w}, the model {width}; the file is for another model")
            row, off = el, f.skip(w * n * el, f"layer {il} V data")
        else:
            row, want = f.u64(f"layer {il} v_size_row"), _row_size(f, t, width, f"layer {il} V")
            if row != want:
                raise f.fail(f"layer {il} V row is {row} bytes; {type_name(t)} rows of the model's n_embd_v_gqa {width} "
                             f"are {want}; the file is for another model or corrupt")
            off = f.skip(n * row, f"layer {il} V data")
        kt, kr, ko = ks[j]
        st.layers.append(StateLayer(il, kt, kr, ko, t, row, off))
    return st


def _decode(raw: bytes, t: int, n_rows: int, width: int) -> np.ndarray:
    """float32 ``[n_rows, width]`` of ``n_rows`` ggml rows of type ``t`` (gguf-py dequantises blocks).

    Raises:
        InfertraceError: a type gguf-py cannot dequantise.
    """
    if t in _PLAIN:
        return np.frombuffer(raw, dtype=_PLAIN[t]).astype(np.float32).reshape(n_rows, width)
    if t == GGML_BF16:
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32).reshape(n_rows, width)
    from infertrace.loading.dequant import dequantize
    from infertrace.loading.gguf_lib import gguf

    data = np.frombuffer(raw, dtype=np.uint8).reshape(n_rows, -1)  # [n_rows, bytes_per_row]
    try:
        return np.asarray(dequantize(data, gguf().GGMLQuantizationType(t)), dtype=np.float32).reshape(n_rows, width)
    except (NotImplementedError, ValueError):
        raise InfertraceError(f"--state: K/V type {type_name(t)} cannot be dequantised by gguf-py; "
                              "save the slot with an f16 / f32 / q8_0 cache") from None


def _atoi(text: str | None) -> int:
    """C ``atoi``: leading blanks, an optional sign, the digits that follow (0 when there are none)."""
    t = (text or "").lstrip()
    sign = -1 if t[:1] == "-" else 1
    t = t[1:] if t[:1] in "+-" else t
    digits = len(t) - len(t.lstrip("0123456789"))
    return sign * int(t[:digits]) if digits else 0


def attn_rot(t: int, head_dim: int, which: str) -> int:
    """Block size of the Hadamard rotation llama.cpp applied to a ``which`` (``"k"``/``"v"``) cache of ggml
    type ``t`` (0: none), by the rule of the module docstring.

    Returns:
        0, or ``nrot``: K the largest power of two dividing ``head_dim``, V 64.
    """
    if _atoi(os.environ.get("LLAMA_ATTN_ROT_DISABLE")) or head_dim % 64:
        return 0
    blk = _quant_sizes().get(t, (1, 0))[0]
    if blk <= 1:  # F32 / F16 / BF16 / integers: ggml_is_quantized false
        return 0
    if which == "v":
        return 64
    nrot = 64
    while head_dim % (nrot * 2) == 0:
        nrot *= 2
    return nrot


def hadamard(n: int) -> np.ndarray:
    """``ggml_gen_hadamard``: the orthonormal Sylvester Walsh-Hadamard matrix, float32 ``[n, n]`` (n a power of 2)."""
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def _unrotate(x: np.ndarray, nrot: int) -> np.ndarray:
    """``x`` ``[n, width]`` with each run of ``nrot`` values multiplied by H again (``H·H = I``)."""
    if not nrot:
        return x
    n = x.shape[0]
    return (x.reshape(n, -1, nrot) @ hadamard(nrot)).reshape(n, -1)  # [n, width / nrot, nrot] -> [n, width]


def _layer_values(f: _File, cfg: Any, s: StateStream, il: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer ``il``'s K and V of stream ``s``: float32 ``[n_cells, n_kv, hd]`` each, un-rotated
    (:func:`attn_rot`), K in half-split order."""
    L, n, nkv, hd = next(x for x in s.layers if x.il == il), len(s.pos), cfg.n_head_kv, cfg.head_dim
    short = f"{f.name} shrank while being read; read it again"
    rk, rv = attn_rot(L.k_type, hd, "k"), attn_rot(L.v_type, hd, "v")
    s.rot = (rk, rv)
    k = _unrotate(_decode(pread_exact(f.fd, L.k_off, n * L.k_row, short), L.k_type, n, nkv * hd), rk)  # [n, nkv*hd]
    k = k.reshape(n, nkv, hd)
    if getattr(cfg, "rope_pairing_in_file", "norm") == "norm":  # GGUF Q/K rows permuted (llama): half-split, as traces
        k = norm_to_neox(k)
    if s.v_trans:  # [n_embd_v_gqa, n_cells] elements -> [n_cells, n_embd_v_gqa]
        v = _decode(pread_exact(f.fd, L.v_off, nkv * hd * n * L.v_row, short), L.v_type, nkv * hd, n).T
    else:
        v = _decode(pread_exact(f.fd, L.v_off, n * L.v_row, short), L.v_type, n, nkv * hd)
    v = _unrotate(np.ascontiguousarray(v), rv)
    return np.ascontiguousarray(k), v.reshape(n, nkv, hd)
