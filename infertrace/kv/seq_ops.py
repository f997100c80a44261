"""KV sequence operations on both backends: remove a range, shift positions (K-shift), copy /
share a sequence, keep one sequence, defragment.

Mirrors llama.cpp ``src/llama-kv-cache.cpp`` / ``llama-kv-cells.h`` (``llama_memory_seq_rm``,
``seq_add``, ``seq_cp``, ``seq_keep``, the K-shift graph ``build_graph_shift`` that re-rotates
the cached K of shifted cells by the shift amount, and defragmentation), and on the paged side
vLLM ``block_pool.py`` / TensorRT-LLM block reuse (free the tail blocks of a sequence, fork a
sequence by sharing its full blocks with reference counts and copying the partial last block).

Positions follow llama.cpp: ``p0 < 0`` means 0, ``p1 < 0`` means "to the end". The K-shift is
applied eagerly (llama.cpp applies it at the next ``update``): RoPE is a rotation, so
``R(p + d) k = R(d) R(p) k`` and the cached (already rotated) K is rotated once more by ``d``, in
each layer with that layer's own RoPE (:func:`~infertrace.model.rope.layer_ropes`: Gemma 3's windowed
layers rotate with base 10000, its global layers with 1e6; llama.cpp ``build_rope_shift`` per layer).
V is never touched. The ``cells_*`` / ``paged_*`` functions are the algorithms each memory kind's
methods run (``CellsKV.seq_rm`` ... :class:`~infertrace.kv.base.Memory`); each takes the memory and
mutates it and returns a small JSON-ready dict describing what it did (the engine puts it in the step
trace). The unprefixed functions (``seq_rm(kv, ...)``) call the memory's method and raise where it
answers "cannot".
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from infertrace.errors import InfertraceError
from infertrace.kv.base import MemOp, Memory, ranges_text
from infertrace.model.rope import LayerRope, apply_rope_neox, cos_sin

_END = 1 << 62


def _range(p0: int, p1: int) -> tuple[int, int]:
    return (0 if p0 < 0 else p0), (_END if p1 < 0 else p1)


def rotate_k(k: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Re-rotate cached (RoPE-applied, half-split pairing) keys by ``delta`` positions.

    Args:
        k: ``[M, n_kv_heads, head_dim]`` cached K (already rotated at their old positions).
        delta: ``[M]`` int64 shift per row (llama.cpp ``k_shift`` input of ``build_graph_shift``).
        inv_freq: ``[rope_dim/2]`` the layer's frequencies (:attr:`~infertrace.model.rope.LayerRope.inv_freq`).
            No cos/sin factor: the cached K already carries YaRN's ``mscale`` from its first rotation.

    Returns:
        ``[M, n_kv_heads, head_dim]`` K rotated as if computed at ``old_pos + delta``, dtype of ``k``.
    """
    cos, sin = cos_sin(delta.to(k.device), inv_freq.to(k.device), torch.float32)  # [M, rope_dim/2] each
    return apply_rope_neox(k.float(), cos, sin).to(k.dtype)  # [M, n_kv_heads, head_dim]


def _shift_tables(kv: Any, ropes: Sequence[LayerRope | None]) -> list[torch.Tensor]:
    """``inv_freq`` of each physical KV layer of ``kv`` from the model's per-layer RoPE.

    Raises:
        InfertraceError: ``ropes`` is not one entry per layer (a single table for every layer is the
            bug this guards against), or a KV layer has no RoPE.
    """
    if isinstance(ropes, torch.Tensor) or len(ropes) != kv.n_layer:
        raise InfertraceError(f"a K-shift needs one RoPE per layer ({kv.n_layer}; model.rope.layer_ropes(cfg)), "
                              f"got {'one table' if isinstance(ropes, torch.Tensor) else len(ropes)}")
    out = []
    for il, r in enumerate(ropes):
        if r is None:
            raise InfertraceError(f"K-shift: layer {il} has no RoPE")
        out.append(r.inv_freq)
    return out


# ----------------------------------------------------------------------------- cells (llama.cpp)


def cells_seq_rm(kv: Any, seq_id: int, p0: int = -1, p1: int = -1) -> dict[str, Any]:
    """Remove ``seq_id`` from its cells with ``p0 <= pos < p1``; cells left without owner become
    empty (``seq_id < 0``: remove every owner). ``head`` moves back to the first freed cell.

    Mirrors ``llama_kv_cache::seq_rm``. Returns ``{"op", "seq_id", "range", "cells", "freed"}``.
    """
    a, b = _range(p0, p1)
    in_range = (kv.pos >= a) & (kv.pos < b) & (kv.pos >= 0)  # [size]
    hit = in_range if seq_id < 0 else in_range & kv.seq[:, seq_id]
    idx = hit.nonzero().flatten()
    removed = kv.pos[idx].tolist()
    if seq_id < 0:
        kv.seq[idx] = False
    else:
        kv.seq[idx, seq_id] = False
    freed = idx[~kv.seq[idx].any(dim=1)]
    kv.pos[freed] = -1
    if freed.numel():
        kv.head = min(kv.head, int(freed.min()))
    return {"op": "seq_rm", "seq_id": seq_id, "range": f"[{a}, {'end' if b == _END else b})",
            "pos": ranges_text(removed), "cells": ranges_text(idx.tolist()), "freed": ranges_text(freed.tolist())}


def cells_seq_add(kv: Any, seq_id: int, p0: int, p1: int, delta: int, ropes: Sequence[LayerRope | None]) -> dict[str, Any]:
    """Add ``delta`` to the position of ``seq_id``'s cells with ``p0 <= pos < p1`` and re-rotate
    their K in every layer with that layer's RoPE (``ropes``, one per layer: K-shift). A cell whose
    position becomes negative is removed.

    Note (as llama.cpp): a cell shared with other sequences moves for all of them.
    Mirrors ``llama_kv_cache::seq_add`` + ``build_graph_shift``.
    Returns ``{"op", "seq_id", "range", "delta", "cells", "from", "to", "removed"}``.
    """
    a, b = _range(p0, p1)
    tables = _shift_tables(kv, ropes)
    if delta == 0:
        return {"op": "seq_add", "seq_id": seq_id, "delta": 0, "cells": "-"}
    idx = ((kv.pos >= a) & (kv.pos < b) & (kv.pos >= 0) & kv.seq[:, seq_id]).nonzero().flatten()  # [M]
    old = kv.pos[idx].clone()
    new = old + delta
    gone = idx[new < 0]
    keep = idx[new >= 0]
    d = torch.full((keep.numel(),), delta, dtype=torch.int64)  # [M']
    for layer in range(kv.n_layer):
        kv.k[layer][keep] = rotate_k(kv.k[layer][keep], d, tables[layer])  # [M', n_kv_heads, hd]
    kv.pos[keep] = new[new >= 0]
    kv.seq[gone] = False
    kv.pos[gone] = -1
    if gone.numel():
        kv.head = min(kv.head, int(gone.min()))
    return {"op": "seq_add", "seq_id": seq_id, "range": f"[{a}, {'end' if b == _END else b})", "delta": delta,
            "cells": ranges_text(keep.tolist()), "from": ranges_text(old[new >= 0].tolist()),
            "to": ranges_text(new[new >= 0].tolist()), "removed": ranges_text(old[new < 0].tolist())}


def cells_seq_cp(kv: Any, src: int, dst: int, p0: int = -1, p1: int = -1) -> dict[str, Any]:
    """Let ``dst`` share ``src``'s cells with ``p0 <= pos < p1``: ``dst`` is added to each cell's
    seq_id set (no K/V copied). Mirrors ``llama_kv_cache::seq_cp`` (unified cache).
    Returns ``{"op", "src", "dst", "cells", "pos"}``."""
    a, b = _range(p0, p1)
    idx = ((kv.pos >= a) & (kv.pos < b) & (kv.pos >= 0) & kv.seq[:, src]).nonzero().flatten()
    kv.seq[idx, dst] = True
    return {"op": "seq_cp", "src": src, "dst": dst, "cells": ranges_text(idx.tolist()),
            "pos": ranges_text(kv.pos[idx].tolist())}


def cells_seq_keep(kv: Any, seq_id: int) -> dict[str, Any]:
    """Drop every sequence but ``seq_id``: its cells keep only that owner, other cells become empty.
    Mirrors ``llama_kv_cache::seq_keep``."""
    mine = kv.seq[:, seq_id].clone()  # [size]
    others = ((kv.pos >= 0) & ~mine).nonzero().flatten()
    kv.seq[:] = False
    kv.seq[mine, seq_id] = True
    kv.pos[others] = -1
    if others.numel():
        kv.head = min(kv.head, int(others.min()))
    return {"op": "seq_keep", "seq_id": seq_id, "freed": ranges_text(others.tolist())}


def cells_make_private(kv: Any, seq_id: int, p0: int) -> dict[str, Any]:
    """Give ``seq_id`` its own copy of every cell with ``pos >= p0`` it shares with other sequences
    (copy-on-write before a shift, which would otherwise move the cell for every owner).
    Returns ``{"op": "copy_on_write", "seq_id", "from", "to"}``."""
    shared = ((kv.pos >= p0) & kv.seq[:, seq_id] & (kv.seq.sum(dim=1) > 1)).nonzero().flatten()
    if not shared.numel():
        return {"op": "copy_on_write", "seq_id": seq_id, "from": "-", "to": "-"}
    dst = torch.tensor(kv.find_slot(int(shared.numel())), dtype=torch.int64)
    for layer in range(kv.n_layer):
        kv.k[layer][dst] = kv.k[layer][shared]
        kv.v[layer][dst] = kv.v[layer][shared]
    kv.pos[dst] = kv.pos[shared]
    kv.seq[shared, seq_id] = False
    kv.seq[dst, seq_id] = True
    return {"op": "copy_on_write", "seq_id": seq_id, "from": ranges_text(shared.tolist()), "to": ranges_text(dst.tolist())}


def cells_defrag(kv: Any) -> dict[str, Any]:
    """Move used cells down into the holes so they occupy ``0..used-1`` in their current order,
    K/V of every layer moved with them; ``head`` = used. Mirrors llama.cpp's defragmentation
    (``defrag_prepare`` move list, applied with copies of K/V views).
    Returns ``{"op", "moves": [[src, dst], ...], "used"}``."""
    used = (kv.pos >= 0).nonzero().flatten()  # [U] ascending
    dst = torch.arange(used.numel())
    moves = [[int(s), int(d)] for s, d in zip(used.tolist(), dst.tolist()) if s != d]
    if moves:
        for layer in range(kv.n_layer):
            kv.k[layer][dst] = kv.k[layer][used].clone()
            kv.v[layer][dst] = kv.v[layer][used].clone()
        pos, seq = kv.pos[used].clone(), kv.seq[used].clone()
        kv.pos[:] = -1
        kv.seq[:] = False
        kv.pos[dst], kv.seq[dst] = pos, seq
    kv.head = int(used.numel()) % kv.size
    return {"op": "defrag", "moves": moves, "used": int(used.numel())}


# ----------------------------------------------------------------------------- paged (vLLM / TensorRT-LLM)


def paged_seq_rm(kv: Any, seq_id: int, p0: int = -1, p1: int = -1) -> dict[str, Any]:
    """Remove positions ``p0..`` of ``seq_id`` (the tail: a paged sequence's positions are its slot
    order, so a hole cannot be represented; use :func:`paged_shift_out` to drop a middle range).
    Blocks no longer needed are released (reference counted when the pool shares blocks).

    Raises:
        InfertraceError: ``p1`` is before the end of the sequence.
    """
    L = kv.lens.get(seq_id, 0)
    a, b = _range(p0, p1)
    if b < L:
        raise InfertraceError(f"paged seq_rm({seq_id}, {p0}, {p1}): only a tail can be removed from a block table "
                              f"(sequence holds 0..{L - 1}); use a context shift to drop a middle range")
    if a >= L:
        return {"op": "seq_rm", "seq_id": seq_id, "range": f"[{a}, end)", "pos": "-", "freed_blocks": []}
    if a == 0:
        tab = list(kv.tables.get(seq_id, []))
        kv.release(seq_id)
        return {"op": "seq_rm", "seq_id": seq_id, "range": "[0, end)", "pos": ranges_text(range(L)), "freed_blocks": tab}
    if a % kv.B:
        kv.make_private(seq_id, a // kv.B)  # the kept partial block will be rewritten: copy-on-write / unhash
    keep_blocks = -(-a // kv.B)
    tab = kv.tables[seq_id]
    dropped = tab[keep_blocks:]
    kv.tables[seq_id] = tab[:keep_blocks]
    kv.lens[seq_id] = a
    kv.free_blocks(dropped)  # reference counted when the pool shares blocks (kv/prefix_cache.py)
    return {"op": "seq_rm", "seq_id": seq_id, "range": f"[{a}, end)", "pos": ranges_text(range(a, L)),
            "freed_blocks": dropped}


def paged_shift_out(kv: Any, seq_id: int, p0: int, p1: int, ropes: Sequence[LayerRope | None]) -> dict[str, Any]:
    """Drop positions ``p0 <= p < p1`` of ``seq_id`` and close the gap: the K/V of ``p1..L-1`` move
    to ``p0..`` and their K is re-rotated by ``-(p1 - p0)`` with each layer's RoPE (``ropes``, one
    per layer: K-shift), then the tail is freed.
    This is llama.cpp's ``seq_rm`` + ``seq_add`` pair (server context shift) in block-table form.
    Blocks shared with another sequence are never written: they are replaced by private copies first.

    Returns ``{"op": "shift_out", "seq_id", "removed", "from", "to", "delta", "freed_blocks"}``.
    """
    tables = _shift_tables(kv, ropes)
    L = kv.lens.get(seq_id, 0)
    p1 = min(p1, L)
    n = p1 - p0
    if n <= 0:
        return {"op": "shift_out", "seq_id": seq_id, "removed": "-", "delta": 0, "freed_blocks": []}
    kv.make_private(seq_id, p0 // kv.B)  # copy-on-write of shared blocks that will be rewritten
    src = torch.tensor([kv.slot(seq_id, p) for p in range(p1, L)], dtype=torch.int64)  # [M]
    dst = torch.tensor([kv.slot(seq_id, p) for p in range(p0, L - n)], dtype=torch.int64)  # [M]
    d = torch.full((src.numel(),), -n, dtype=torch.int64)  # [M]
    for pool, inv_freq in zip(kv.pool, tables):
        sb, so, db, do = src // kv.B, src % kv.B, dst // kv.B, dst % kv.B
        k = pool[sb, 0, :, so, :].clone()  # [M, n_kv_heads, hd]
        v = pool[sb, 1, :, so, :].clone()  # [M, n_kv_heads, hd]
        pool[db, 0, :, do, :] = rotate_k(k, d, inv_freq)
        pool[db, 1, :, do, :] = v
    rm = paged_seq_rm(kv, seq_id, L - n, -1)
    return {"op": "shift_out", "seq_id": seq_id, "removed": ranges_text(range(p0, p1)),
            "from": ranges_text(range(p1, L)), "to": ranges_text(range(p0, L - n)), "delta": -n,
            "freed_blocks": rm["freed_blocks"]}


def paged_seq_cp(kv: Any, src: int, dst: int, p0: int = -1, p1: int = -1) -> dict[str, Any]:
    """Fork ``dst`` from ``src``'s prefix ``0..p1-1`` (shared full blocks reference counted, the partial
    last block copied: vLLM / TensorRT-LLM fork).

    Raises:
        InfertraceError: ``p0 > 0`` (a block table can only share a prefix).
    """
    if p0 > 0:
        raise InfertraceError("paged seq_cp copies a prefix: p0 must be 0 (or -1)")
    L = kv.lens.get(src, 0)
    return kv.fork(src, dst, L if p1 < 0 else min(p1, L))


def paged_seq_keep(kv: Any, seq_id: int) -> dict[str, Any]:
    """Release every sequence but ``seq_id``."""
    others = [s for s in list(kv.tables) if s != seq_id]
    for s in others:
        kv.release(s)
    return {"op": "seq_keep", "seq_id": seq_id, "released": others}


def cells_seq_div(kv: Any, seq_id: int, p0: int, p1: int, d: int, ropes: Sequence[LayerRope | None]) -> dict[str, Any]:
    """Divide the positions of ``seq_id``'s cells with ``p0 <= pos < p1`` by ``d`` (integer division)
    and re-rotate their K by ``new - old`` in every layer with that layer's RoPE. Mirrors
    ``llama_kv_cache::seq_div`` (self-extend / group attention) + the K-shift.

    Raises:
        InfertraceError: ``d < 1``.
    """
    if d < 1:
        raise InfertraceError(f"seq_div by {d}: the divisor must be >= 1")
    a, b = _range(p0, p1)
    tables = _shift_tables(kv, ropes)
    idx = ((kv.pos >= a) & (kv.pos < b) & (kv.pos >= 0) & kv.seq[:, seq_id]).nonzero().flatten()  # [M]
    old = kv.pos[idx].clone()  # [M]
    new = old // d  # [M]
    if d > 1 and idx.numel():
        for layer in range(kv.n_layer):
            kv.k[layer][idx] = rotate_k(kv.k[layer][idx], new - old, tables[layer])  # [M, n_kv_heads, hd]
        kv.pos[idx] = new
    return {"op": "seq_div", "seq_id": seq_id, "range": f"[{a}, {'end' if b == _END else b})", "d": d,
            "cells": ranges_text(idx.tolist()), "from": ranges_text(old.tolist()), "to": ranges_text(new.tolist())}


def cells_shift_out(kv: Any, seq_id: int, p0: int, p1: int, ropes: Sequence[LayerRope | None]) -> dict[str, Any]:
    """Context shift on cells: copy-on-write of the cells shared with other sequences, ``seq_rm(p0, p1)``,
    ``seq_add(p1, end, -(p1 - p0))`` (llama.cpp server's pair)."""
    _shift_tables(kv, ropes)
    return {"op": "shift_out", "seq_id": seq_id, "steps": [cells_make_private(kv, seq_id, p1),
                                                          cells_seq_rm(kv, seq_id, p0, p1),
                                                          cells_seq_add(kv, seq_id, p1, -1, -(p1 - p0), ropes)],
            "removed": ranges_text(range(p0, p1)), "delta": -(p1 - p0)}


# ----------------------------------------------------------------------------- entry points that raise on "cannot"


def _done(op: MemOp) -> MemOp:
    if not op:
        raise InfertraceError(op["refused"])
    return op


def seq_rm(kv: Memory, seq_id: int, p0: int = -1, p1: int = -1) -> MemOp:
    """``kv.seq_rm`` (``llama_memory_seq_rm``; paged: tail only; hybrid: whole sequences only).

    Raises:
        InfertraceError: the memory cannot remove that range (its one-line reason).
    """
    return _done(kv.seq_rm(seq_id, p0, p1))


def seq_cp(kv: Memory, src: int, dst: int, p0: int = -1, p1: int = -1) -> MemOp:
    """``kv.seq_cp`` (cells: shared cells; paged: fork of a prefix; hybrid: whole sequences, state copied).

    Raises:
        InfertraceError: the memory cannot copy that range.
    """
    return _done(kv.seq_cp(src, dst, p0, p1))


def seq_keep(kv: Memory, seq_id: int) -> MemOp:
    """``kv.seq_keep`` (``llama_memory_seq_keep``): everything but ``seq_id`` is released."""
    return _done(kv.seq_keep(seq_id))


def shift_out(kv: Memory, seq_id: int, p0: int, p1: int, ropes: Sequence[LayerRope | None]) -> MemOp:
    """``kv.shift_out``: drop ``p0..p1-1`` and shift ``p1..`` down by ``p1 - p0`` (K re-rotated with each
    layer's RoPE, ``ropes`` = :func:`~infertrace.model.rope.layer_ropes`): llama.cpp server's context
    shift ``seq_rm(seq, n_keep, n_keep + n_discard)`` + ``seq_add(seq, n_keep + n_discard, n_past,
    -n_discard)``.

    Raises:
        InfertraceError: the memory cannot (a hybrid model: its recurrent state cannot forget tokens).
    """
    return _done(kv.shift_out(seq_id, p0, p1, ropes))
