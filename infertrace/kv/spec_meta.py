"""Speculative-decoding verify metadata in the TensorRT-LLM / vLLM form: per request the
generation length (K+1 candidates), the position offsets of the candidates (their depth in the
draft tree) and the packed tree mask, plus the unpacked boolean tree mask attention reads.

Mirrors TensorRT-LLM ``_torch/attention_backend/trtllm.py`` / ``interface.py``
(``spec_decoding_generation_lengths``, ``spec_decoding_position_offsets``
``[num_gen_requests, max_draft_len + 1]`` and ``spec_decoding_packed_mask``
``[num_gen_requests, max_draft_len + 1, ceil((max_draft_len + 1) / 32)]`` int32: bit j of row i is
set when candidate i may attend to candidate j) and vLLM v1 ``spec_decode`` (tree attention
metadata). A chain is the tree whose node i has parent i - 1: its mask is the causal block and its
offsets are ``0..K``. llama.cpp has no such metadata: its verify mask is rows of ``kq_mask``
(``CellsKV.prepare``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from infertrace.kv.chunk import ChunkSpec


def pack_mask(rows: torch.Tensor) -> torch.Tensor:
    """Pack a bool ``[T, T]`` mask into int32 words ``[T, ceil(T / 32)]``: bit ``j % 32`` of word
    ``j // 32`` of row i is ``rows[i, j]`` (TensorRT-LLM ``spec_decoding_packed_mask`` layout)."""
    T = rows.shape[0]
    W = max(1, -(-T // 32))
    out = torch.zeros(T, W, dtype=torch.int64)  # [T, W] built in int64, stored as int32 bit patterns
    for j in range(T):
        out[:, j // 32] |= rows[:, j].long() << (j % 32)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)  # [T, W]


def unpack_mask(packed: torch.Tensor, T: int) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: int32 ``[R, W]`` -> bool ``[R, T]``."""
    words = packed.long() & 0xFFFFFFFF  # [R, W]
    j = torch.arange(T)
    return ((words[:, j // 32] >> (j % 32)) & 1).bool()  # [R, T]


def spec_metadata(chunks: Sequence[ChunkSpec]) -> dict[str, Any]:
    """The verify metadata of a step, ``{}`` when no chunk verifies drafts.

    Returns ``spec_decoding_generation_lengths`` ``[S]`` int32 (T of verify chunks, 0 otherwise),
    ``spec_decoding_position_offsets`` ``[S, T_spec]`` int32 (depth per candidate),
    ``spec_decoding_packed_mask`` ``[S, T_spec, ceil(T_spec/32)]`` int32, and -- only when some
    tree branches -- ``spec_tree_mask`` ``[S, T_max, T_max]`` bool (the packed mask unpacked, plain
    chunks causal; what :func:`~infertrace.attention.reference.paged_attention_torch` reads) and
    ``spec_q_pos`` ``[S, T_max]`` int64 (query positions).
    """
    spec = [c for c in chunks if c.parents is not None]
    if not spec:
        return {}
    S = len(chunks)
    T_spec = max(c.T for c in spec)
    W = max(1, -(-T_spec // 32))
    gen = torch.zeros(S, dtype=torch.int32)  # [S]
    offs = torch.zeros(S, T_spec, dtype=torch.int32)  # [S, T_spec]
    packed = torch.zeros(S, T_spec, W, dtype=torch.int32)  # [S, T_spec, W]
    for i, c in enumerate(chunks):
        if c.parents is None:
            continue
        gen[i] = c.T
        offs[i, : c.T] = torch.tensor(c.depths(), dtype=torch.int32)
        rows = torch.zeros(c.T, T_spec, dtype=torch.bool)  # [T, T_spec]
        rows[:, : c.T] = c.ancestors()
        packed[i, : c.T] = pack_mask(rows)
    out: dict[str, Any] = {"spec_decoding_generation_lengths": gen, "spec_decoding_position_offsets": offs,
                           "spec_decoding_packed_mask": packed}
    if any(c.parents != list(range(-1, c.T - 1)) for c in spec):  # a branching tree: attention needs the mask
        T_max = max(c.T for c in chunks)
        tree = torch.zeros(S, T_max, T_max, dtype=torch.bool)  # [S, T_max, T_max]
        q_pos = torch.zeros(S, T_max, dtype=torch.int64)  # [S, T_max]
        for i, c in enumerate(chunks):
            if c.parents is None:
                tree[i, : c.T, : c.T] = torch.ones(c.T, c.T, dtype=torch.bool).tril()
                q_pos[i, : c.T] = torch.arange(c.C, c.C + c.T)
            else:
                tree[i, : c.T, : c.T] = unpack_mask(packed[i, : c.T], T_spec)[:, : c.T]  # read back from the packed form
                q_pos[i, : c.T] = c.C + offs[i, : c.T].long()
        out.update({"spec_tree_mask": tree, "spec_q_pos": q_pos})
    return out
