"""GGUF weights that stay quantised: build each linear layer's :class:`QuantLinear` from the file.

The file is read with ``os.pread`` a chunk of rows at a time (no mapping stays open, so the
process never holds the file's pages besides what it keeps); each tensor becomes codes plus
group parameters (:mod:`infertrace.quant.blocks`) and then the kernel :func:`choose_kernel`
names for its type and the activation dtype. Vectors (norms, biases) and the embedding rows a
step looks up are float, as in the float path.

Row order: Q/K rows that the converter permuted for adjacent-pair RoPE (llama.cpp ``norm``)
are put back in half-split order by moving whole quantised rows — the same permutation
:func:`infertrace.model.rope.unpermute_from_norm` applies to float rows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from infertrace.errors import InfertraceError
from infertrace.quant.blocks import DECODERS, Affine, affine_dequantize, split_rows
from infertrace.quant import choice as _choice
from infertrace.quant import linear as _ql
from infertrace.quant.choice import FLOAT_TYPES, kernel_for  # the rule, torch-free (trace/check asks it too)
from infertrace.quant.linear import (DenseLinear, DequantLinear, Int4PackLinear, Int4Pair16Linear, Int4x2Linear,
                                     QuantLinear, StackedLinear, cat_affine, permute_rows)

#: bytes read per pread when decoding a tensor (rows are decoded a chunk at a time)
READ_CHUNK_BYTES = 1 << 20
#: kernel per (type, activation dtype) where one measured faster than ``dequant``: :data:`infertrace.quant.choice.FAST_KERNELS`
#: keyed by torch dtype (benchmarks/quant_kernels.py, table in benchmarks/README.md)
FAST_KERNELS: dict[tuple[str, torch.dtype], str] = {(t, getattr(torch, d)): k for (t, d), k in _choice.FAST_KERNELS.items()}
KERNEL_CLASSES = {"int4pack": Int4PackLinear, "int4x2": Int4x2Linear, "int4pair16": Int4Pair16Linear, "dequant": DequantLinear}


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Building a kernel object frees temporaries several times its own size (codes as int8, then
    uint8 chunks for packing); glibc keeps such freed blocks in the process, so without this
    the resident size after loading SmolLM2 was 549 MB instead of 389 MB (measured).
    """
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - probe
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: Any = None


def supported_types() -> tuple[str, ...]:
    """GGUF tensor types the quantised path reads (floats and :data:`DECODERS`)."""
    return FLOAT_TYPES + tuple(DECODERS)


def choose_kernel(type_name: str, act_dtype: torch.dtype, shape: tuple[int, int]) -> str:
    """``dense`` for float types, ``int4pack`` where :data:`FAST_KERNELS` says so and the shape
    packs (out % 16, in % 32), else ``dequant``.

    Raises:
        InfertraceError: ``type_name`` is not supported (one line naming the type and ``--weights float``).
    """
    k = kernel_for(type_name, str(act_dtype).removeprefix("torch."), shape)
    if k is None or (type_name not in FLOAT_TYPES and type_name not in DECODERS):
        raise InfertraceError(f"tensor type {type_name} has no quantised kernel in infertrace "
                              f"(supported: {', '.join(supported_types())}); run with --weights float")
    return k


def rope_row_order(rows: int, n_heads: int) -> np.ndarray:
    """``int64 [rows]``: source row of each output row when un-permuting GGUF Q/K (``norm`` -> ``neox``),
    the index form of :func:`infertrace.model.rope.unpermute_from_norm`."""
    idx = np.arange(rows)
    return idx.reshape(n_heads, rows // n_heads // 2, 2).swapaxes(1, 2).reshape(rows)


class GGUFQuantSource:
    """Quantised linear layers and float vectors of one GGUF file, built on request.

    Args:
        path: the GGUF file (already checked by :func:`infertrace.loading.weights.load_checkpoint`).
        header: its :class:`infertrace.loading.gguf_meta.GGUFHeader`.
        act_dtype: activation dtype (``torch.float32`` or ``torch.bfloat16``).
        permuted_heads: engine name -> head count for tensors stored in llama.cpp ``norm`` row order
            (``attn_q``: ``head_count``, ``attn_k``: ``head_count_kv``); empty when the file is ``neox``.

    Raises:
        InfertraceError: the file cannot be opened.
    """

    def __init__(self, path: Path, header: Any, act_dtype: torch.dtype, permuted_heads: dict[str, int] | None = None):
        from infertrace.loading.limits import open_regular

        self.path, self.act_dtype = Path(path), act_dtype
        self.entries = {(t.name[:-7] if t.name.endswith(".weight") else t.name): t for t in header.tensors}
        self.permuted_heads = dict(permuted_heads or {})
        self._fd = open_regular(self.path, "model file")
        self.kernels: dict[str, str] = {}  # type name -> kernel(s) used, for the run header

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # -------------------------------------------------------------- raw reads

    def _entry(self, name: str) -> Any:
        t = self.entries.get(name)
        if t is None:
            raise InfertraceError(f"{self.path.name} lacks tensor {name}; the checkpoint is incomplete")
        return t

    def _rows_bytes(self, t: Any, r0: int, r1: int) -> np.ndarray:
        """Bytes of rows ``r0:r1`` of tensor ``t``: ``uint8 [r1-r0, bytes_per_row]``."""
        row_bytes = int(t.n_bytes) // self._n_rows(t)
        want = (r1 - r0) * row_bytes
        buf = os.pread(self._fd, want, int(t.data_offset) + r0 * row_bytes)
        if len(buf) != want:
            raise InfertraceError(f"{self.path.name}: tensor {t.name} is cut short (file truncated?); download it again")
        return np.frombuffer(buf, dtype=np.uint8).reshape(r1 - r0, row_bytes)

    def _n_rows(self, t: Any) -> int:
        return int(np.prod([int(x) for x in t.shape[1:]])) if len(t.shape) > 1 else 1

    def affine(self, name: str) -> Affine:
        """Codes and group parameters of quantised matrix ``name`` (rows un-permuted when needed).

        Raises:
            InfertraceError: unsupported type, not a matrix, or unreadable data.
        """
        t = self._entry(name)
        if t.type_name not in DECODERS:
            choose_kernel(t.type_name, self.act_dtype, (1, 1))  # raises for unsupported types
            raise InfertraceError(f"{name} is {t.type_name}, not a quantised type")
        n = self._n_rows(t)
        row_bytes = int(t.n_bytes) // n
        step = max(1, READ_CHUNK_BYTES // max(1, row_bytes))
        a = None
        with np.errstate(all="ignore"):  # broken scales give inf/nan, as in the float path
            for r0 in range(0, n, step):
                r1 = min(n, r0 + step)
                c = split_rows(self._rows_bytes(t, r0, r1), t.type_name)
                if a is None:  # whole-tensor arrays filled chunk by chunk (no list of parts, no concatenation copy)
                    if r1 == n:
                        a = c
                        break
                    a = Affine(np.empty((n, c.q.shape[1]), np.int8), np.empty((n, c.scale.shape[1]), np.float32),
                               None if c.offset is None else np.empty((n, c.offset.shape[1]), np.float32), c.group)
                a.q[r0:r1], a.scale[r0:r1] = c.q, c.scale
                if a.offset is not None:
                    a.offset[r0:r1] = c.offset
        if self._heads(name):
            a = permute_rows(a, rope_row_order(a.q.shape[0], self._heads(name)))
        return a

    def _heads(self, name: str) -> int:
        """Head count to un-permute ``name``'s rows with (0: stored in half-split order)."""
        return self.permuted_heads.get(name.split(".")[-1], 0)

    def float_tensor(self, name: str) -> torch.Tensor:
        """A tensor as float32 ``[out, in]`` or ``[n]`` (dequantised by gguf-py's arithmetic when quantised)."""
        t = self._entry(name)
        shape = [int(x) for x in reversed(list(t.shape))]  # ggml ne -> torch order
        if t.type_name in FLOAT_TYPES:
            n = self._n_rows(t)
            raw = self._rows_bytes(t, 0, n).reshape(-1)
            dt = {"F32": np.float32, "F16": np.float16}.get(t.type_name)
            arr = (raw.view(dt).astype(np.float32) if dt is not None else
                   (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32))  # BF16 -> F32 exactly
            w = torch.from_numpy(arr.reshape(shape).copy())
        else:
            w = torch.from_numpy(affine_dequantize(self.affine(name)).reshape(shape))
            return w  # rows already un-permuted by affine()
        heads = self._heads(name.removesuffix(".bias"))
        if heads:  # an F32 Q/K matrix or a Q/K bias: the converter permuted it like the rows (case R5)
            w = w[torch.from_numpy(rope_row_order(w.shape[0], heads))]
        return w

    def vector(self, name: str) -> torch.Tensor:
        """A 1-D tensor (norm weight, bias) in the activation dtype: ``[n]``."""
        return self.float_tensor(name).to(self.act_dtype)

    # -------------------------------------------------------------- linear layers

    def linear(self, names: Sequence[str]) -> QuantLinear:
        """One :class:`QuantLinear` for the row-concatenation of ``names`` (e.g. Q, K, V).

        Parts of one type are concatenated before packing (one kernel call); parts of different
        types become a :class:`StackedLinear`.

        Raises:
            InfertraceError: a missing tensor or an unsupported type (one line, ``--weights float``).
        """
        groups: list[tuple[str, list[str]]] = []
        for n in names:
            tn = self._entry(n).type_name
            if groups and groups[-1][0] == tn:
                groups[-1][1].append(n)
            else:
                groups.append((tn, [n]))
        parts = [self._build(tn, ns) for tn, ns in groups]
        return parts[0] if len(parts) == 1 else StackedLinear(parts)

    def _build(self, type_name: str, names: list[str]) -> QuantLinear:
        try:
            return self._build_one(type_name, names)
        finally:
            release_free_memory()

    def _row_blocks(self, name: str) -> Iterator[Affine]:
        """Codes of matrix ``name`` a block of :data:`infertrace.quant.linear.PACK_ROWS` rows at a time
        (the whole matrix in one block when its rows are un-permuted: the permutation spans heads)."""
        t = self._entry(name)
        n = self._n_rows(t)
        if self._heads(name) or n <= _ql.PACK_ROWS:
            yield self.affine(name)
            return
        with np.errstate(all="ignore"):  # broken scales give inf/nan, as in the float path
            for r0 in range(0, n, _ql.PACK_ROWS):
                yield split_rows(self._rows_bytes(t, r0, min(n, r0 + _ql.PACK_ROWS)), t.type_name)

    def _build_one(self, type_name: str, names: list[str]) -> QuantLinear:
        rows = [self._n_rows(self._entry(n)) for n in names]
        k_in = int(self._entry(names[0]).shape[0])
        if type_name in DECODERS and sum(rows) > _ql.PACK_ROWS and all(r % 64 == 0 for r in rows):
            k = choose_kernel(type_name, self.act_dtype, (sum(rows), k_in))
            if k != "dequant":  # an int4 kernel, built from row blocks: temporaries of PACK_ROWS rows, not of the matrix
                self._note(type_name, k)
                blocks = (b for n in names for b in self._row_blocks(n))
                return KERNEL_CLASSES[k].from_row_chunks(blocks, sum(rows), type_name, self.act_dtype)
        if type_name in FLOAT_TYPES:
            w = torch.cat([self.float_tensor(n) for n in names]) if len(names) > 1 else self.float_tensor(names[0])
            self._note(type_name, "dense")
            return DenseLinear(w, type_name, self.act_dtype)
        a = cat_affine([self.affine(n) for n in names]) if len(names) > 1 else self.affine(names[0])
        k = choose_kernel(type_name, self.act_dtype, a.q.shape)
        self._note(type_name, k)
        return KERNEL_CLASSES[k](a, type_name, self.act_dtype)

    def _note(self, type_name: str, kernel: str) -> None:
        old = self.kernels.get(type_name)
        self.kernels[type_name] = kernel if old in (None, kernel) else ",".join(sorted({*old.split(","), kernel}))

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup (ggml ``get_rows``) read from the file: ``ids`` ``[T]`` -> ``float32 [T, in]``,
        gguf-py's values (only the requested rows are read and decoded).

        Raises:
            InfertraceError: an id outside the table.
        """
        t = self._entry(name)
        n = self._n_rows(t)
        idl = [int(i) for i in ids.reshape(-1).tolist()]
        if any(i < 0 or i >= n for i in idl):
            raise InfertraceError(f"token id outside the {n}-row table {name}")
        out = []
        with np.errstate(all="ignore"):  # broken scales give inf/nan, as in the float path (the engine reports them)
            for i in idl:
                raw = self._rows_bytes(t, i, i + 1)  # [1, bytes_per_row]
                if t.type_name in FLOAT_TYPES:
                    dt = {"F32": np.float32, "F16": np.float16}.get(t.type_name)
                    row = (raw.reshape(-1).view(dt).astype(np.float32) if dt is not None else
                           (raw.reshape(-1).view(np.uint16).astype(np.uint32) << 16).view(np.float32))  # [in]
                else:
                    row = affine_dequantize(split_rows(raw, t.type_name)).reshape(-1)  # [in]
                out.append(row)
        return torch.from_numpy(np.stack(out)) if out else torch.empty(0, 0)  # [T, in]


def open_gguf_quant(path: str | Path, act_dtype: torch.dtype) -> tuple[Any, GGUFQuantSource]:
    """The header-only :class:`~infertrace.loading.weights.Checkpoint` (config, tokenizer, tensor
    table, notes) of a GGUF file and a :class:`GGUFQuantSource` over its tensor data.

    Raises:
        InfertraceError: anything :func:`~infertrace.loading.weights.load_checkpoint` refuses, a
            refused setting, a family whose GGUF layout needs more than a row permutation
            (Qwen3.5's V-head reorder), or an unsupported tensor type (``--weights float``).
    """
    from infertrace.loading.gguf_meta import load_header
    from infertrace.loading.weights import _read_checked_gguf, load_checkpoint, raise_refusals

    p = Path(path)
    ck = load_checkpoint(p, header_only=True)
    if ck.path.is_dir():
        raise InfertraceError(f"{p.name} is an HF directory; --weights quant reads GGUF files only (use --weights float)")
    raise_refusals(ck.config, p.name)
    cfg = ck.config
    from infertrace.model.families import family_of

    if family_of(cfg).gguf_weights is not None:  # e.g. Qwen3.5's V-head reorder: more than moving Q/K rows
        raise InfertraceError(f"--weights quant does not implement the {cfg.family} GGUF weight conversions yet; "
                              "run with --weights float")
    with open(p, "rb") as fh:
        head = fh.read(8)
    if int.from_bytes(head[4:8], "little") not in (2, 3):  # a big-endian GGUF: version 3 reads 0x03000000
        raise InfertraceError(f"{p.name} is a big-endian GGUF; --weights quant reads little-endian block layouts only "
                              "(run with --weights float, or convert it: gguf-py gguf_convert_endian.py FILE little)")
    header, _ = load_header(p, _read_checked_gguf)
    unsupported = sorted({t.type_name for t in header.tensors if t.type_name not in supported_types()})
    if unsupported:
        choose_kernel(unsupported[0], act_dtype, (1, 1))  # one-line refusal naming the type
    heads = {"attn_q": cfg.n_head, "attn_k": cfg.n_head_kv} if cfg.rope_pairing_in_file == "norm" else {}
    return ck, GGUFQuantSource(p, header, act_dtype, heads)


class QuantWeight:
    """A quantised matrix of the file as the decoder's weight object (``model/ops.py`` ``LinearWeight``).

    Built on first use, unless :class:`~infertrace.quant.ops.QuantOps` fuses it with its siblings
    first (Q/K/V, gate/up: one kernel per type). ``rows`` (the embedding lookup) reads only the
    requested rows from the file.

    Attributes:
        name: engine name (``blk.0.attn_q``).
        shape: ``(out, in)``.
    """

    def __init__(self, source: GGUFQuantSource, name: str):
        t = source._entry(name)
        self.source, self.name = source, name
        self.shape = tuple(int(x) for x in reversed(list(t.shape)))  # (out, in)
        self.type_name = t.type_name
        self._lin: QuantLinear | None = None
        self.fused = False  # set when QuantOps built it into a fused kernel with its siblings (never built alone)

    def built(self) -> QuantLinear:
        """The kernel object (built from the file on the first call)."""
        if self._lin is None:
            self._lin = self.source.linear([self.name])
        return self._lin

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[..., in]`` -> ``[..., out]`` through this type's kernel."""
        return self.built()(x, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` ``[N]`` -> ``[N, in]`` in the activation dtype (gguf-py's values, then one rounding)."""
        return self.source.rows(self.name, ids).to(self.source.act_dtype)


def quant_weights(path: str | Path, act_dtype: torch.dtype) -> tuple[Any, dict[str, Any], GGUFQuantSource]:
    """Engine-named weights of a GGUF file for :class:`~infertrace.model.decoder.DecoderModel` with
    :class:`~infertrace.quant.ops.QuantOps`: matrices as :class:`QuantWeight`, vectors (norms,
    biases) as float tensors in ``act_dtype``.

    Returns:
        ``(checkpoint, weights, source)``: the header-only checkpoint (config, tokenizer, notes),
        the weights dict, and the source (its ``kernels`` says which kernel each type got).

    Raises:
        InfertraceError: as :func:`open_gguf_quant`.
    """
    ck, src = open_gguf_quant(path, act_dtype)
    w: dict[str, Any] = {}
    for name, t in src.entries.items():
        if name == "rope_freqs":
            continue
        if len(t.shape) >= 2 and int(t.shape[1]) > 1:
            w[name] = QuantWeight(src, name)
        else:
            w[name] = src.vector(name)  # [n]
    return ck, w, src


def build_unfused(weights: dict[str, Any]) -> dict[str, str]:
    """Build now every :class:`QuantWeight` of ``weights`` that was not fused into a sibling's kernel
    (output projections, ``ffn_down``, the lm head), so loading — not the first step — pays for it.
    ``token_embd`` is built only when it is also the lm head (tied, no ``output``): otherwise only its
    rows are looked up, read from the file (an 8B-shaped Q4_K_M held 313 MiB of never-used kernel for it).

    Call after :class:`~infertrace.model.decoder.DecoderModel` was built with
    :class:`~infertrace.quant.ops.QuantOps`. Returns the source's ``kernels`` (type -> kernel).
    """
    src = None
    for name, v in weights.items():
        if name == "token_embd" and "output" in weights:
            continue  # an embedding table only: QuantWeight.rows reads rows from the file, no matmul ever runs
        if isinstance(v, QuantWeight) and not v.fused:
            v.built()
            src = v.source
    return dict(src.kernels) if src is not None else {}
