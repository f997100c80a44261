"""KV rewind after a speculative verify step, on both backends.

The verify step wrote K/V for all T candidates of a request (positions ``C + depth``); only the
accepted path (the root, i.e. the last accepted token, plus the accepted drafts) may stay.

* cells (llama.cpp ``common/speculative.cpp`` / ``examples/speculative``): a chain is rewound with
  ``llama_memory_seq_rm(seq, C + n_accepted + 1, -1)``; for a tree the rejected branches' cells are
  freed one by one (llama.cpp gives each branch its own seq_id and drops it with ``seq_rm``; here
  one seq_id owns the tree and the rejected cells are named directly). Accepted cells already
  hold the right ``pos`` (``C + depth``).
* paged (vLLM v1 / TensorRT-LLM): the candidates were written in packed order to slots of
  positions ``C..C+T-1``; the accepted path's K/V are moved to positions ``C + depth`` (TensorRT-LLM
  ``update_kv_cache_draft_token_location`` does this for tree drafts), then the tail is freed:
  ``seq_lens`` shrinks and blocks left empty go back to the free list.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from infertrace.kv.base import ranges_text
from infertrace.kv.seq_ops import cells_seq_rm, paged_seq_rm


def cells_rewind(kv: Any, seq_id: int, C: int, T: int, accepted: Sequence[int], cell_idx: torch.Tensor,
                 is_chain: bool = True) -> dict[str, Any]:
    """Keep the accepted candidates ``accepted`` (chunk-local node indices, root 0 first, depth
    ``0..len-1`` in order) of a verify chunk ``C, T`` of ``seq_id`` in a cells cache; free the rest.

    Args:
        cell_idx: ``[T]`` cells the chunk's candidates went to (rows of ``CellsInputs.cell_idx``).
        is_chain: the chunk was a chain (accepted is then ``0..a``): one ``seq_rm(seq, C + a, -1)``.

    Returns:
        ``{"op", "seq_id", "kept_pos", "removed_pos", "n_removed", "freed", ...}``.
    """
    keep = C + len(accepted)
    rec: dict[str, Any] = {"seq_id": seq_id, "kept_pos": ranges_text(range(C, keep)), "n_removed": T - len(accepted)}
    if is_chain:
        op = cells_seq_rm(kv, seq_id, keep, -1)
        return {**rec, "op": "seq_rm", "range": op["range"], "removed_pos": op["pos"], "freed": op["freed"]}
    acc = set(accepted)
    rej = torch.tensor([int(cell_idx[i]) for i in range(T) if i not in acc], dtype=torch.int64)  # [T - a]
    removed = kv.pos[rej].tolist()
    kv.seq[rej, seq_id] = False
    freed = rej[~kv.seq[rej].any(dim=1)]
    kv.pos[freed] = -1
    if freed.numel():
        kv.head = min(kv.head, int(freed.min()))
    return {**rec, "op": "seq_rm_cells", "removed_pos": ranges_text(removed), "freed": ranges_text(freed.tolist())}


def paged_rewind(kv: Any, seq_id: int, C: int, T: int, accepted: Sequence[int]) -> dict[str, Any]:
    """The same on a paged pool: the accepted path's K/V move to positions ``C + depth`` (TensorRT-LLM
    ``update_kv_cache_draft_token_location``), then the tail is freed.

    Returns:
        ``{"op", "seq_id", "kept_pos", "removed_pos", "n_removed", "moved_slots", "freed_blocks", ...}``.
    """
    keep = C + len(accepted)
    rec: dict[str, Any] = {"seq_id": seq_id, "kept_pos": ranges_text(range(C, keep)), "n_removed": T - len(accepted)}
    moves = []
    for depth, node in enumerate(accepted):
        if node != depth:  # candidate `node` was stored at position C + node; it belongs at C + depth
            src, dst = kv.slot(seq_id, C + node), kv.slot(seq_id, C + depth)
            for pool in kv.pool:
                pool[dst // kv.B, :, :, dst % kv.B, :] = pool[src // kv.B, :, :, src % kv.B, :]
            moves.append([src, dst])
    op = paged_seq_rm(kv, seq_id, keep, -1)
    return {**rec, "op": "seq_rm", "range": op["range"], "removed_pos": op["pos"], "moved_slots": moves,
            "freed_blocks": list(op["freed_blocks"])}
