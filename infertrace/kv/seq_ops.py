"""What the KV sequence operations share, and the entry points that raise where a memory cannot.

The operations themselves (remove a range, shift positions with a K-shift, copy / share a sequence,
keep one sequence, defragment, rewind after a speculative verify) are methods of the memory whose
state they change: :class:`~infertrace.kv.cells.CellsKV` (llama.cpp ``src/llama-kv-cache.cpp`` /
``llama-kv-cells.h``: ``llama_memory_seq_rm``, ``seq_add``, ``seq_cp``, ``seq_keep``, ``seq_div``,
the K-shift graph ``build_graph_shift``, defragmentation), :class:`~infertrace.kv.paged.PagedKV`
(vLLM ``block_pool.py`` / TensorRT-LLM block reuse: free the tail blocks of a sequence, fork a
sequence by sharing its full blocks), the streams, iSWA and hybrid memories on top of them; each
answers a :class:`~infertrace.kv.base.MemOp` (the engine puts it in the step trace).

Here: llama.cpp's position range (``p0 < 0`` means 0, ``p1 < 0`` means "to the end":
:func:`pos_range`), the K-shift math, and ``seq_rm(kv, ...)`` / ``seq_cp`` / ``seq_keep`` /
``shift_out``, which call the memory's method and raise where it answers "cannot". The K-shift is
applied eagerly (llama.cpp applies it at the next ``update``): RoPE is a rotation, so
``R(p + d) k = R(d) R(p) k`` and the cached (already rotated) K is rotated once more by ``d``, in
each layer with that layer's own RoPE (:func:`~infertrace.model.rope.layer_ropes`: Gemma 3's windowed
layers rotate with base 10000, its global layers with 1e6; llama.cpp ``build_rope_shift`` per layer).
V is never touched. The memories call :func:`rotate_k` through this module (a test replaces it to
prove the K-shift evidence catches a missing rotation).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from infertrace.errors import InfertraceError
from infertrace.kv.base import MemOp, Memory
from infertrace.model.rope import LayerRope, apply_rope_neox, cos_sin

_END = 1 << 62


def pos_range(p0: int, p1: int) -> tuple[int, int]:
    """llama.cpp's position range: ``p0 < 0`` means 0, ``p1 < 0`` means "to the end" (a large bound)."""
    return (0 if p0 < 0 else p0), (_END if p1 < 0 else p1)


def range_text(a: int, b: int) -> str:
    """``[a, b)`` of :func:`pos_range` as a trace shows it (``[a, end)`` for the open end)."""
    return f"[{a}, {'end' if b == _END else b})"


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


def shift_tables(kv: Any, ropes: Sequence[LayerRope | None]) -> list[torch.Tensor]:
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
