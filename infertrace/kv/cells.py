"""llama.cpp-style KV cache: cells with ``pos`` and a ``seq_id`` set, and a host-filled kq_mask.

Mirrors llama.cpp ``src/llama-kv-cache.cpp`` / ``llama-kv-cells.h`` (standard
``llama_kv_cache``, unified: one stream):

* ``cells``: ``pos[i]`` (-1 = empty) and ``seq[i]`` (set of owning seq_ids);
* ``find_slot``: from ``head`` (reset to 0 when ``head > used + 2 * n_tokens``), take the first
  free cells for the ubatch (wrapping); ``head`` = last cell + 1; ``seq_rm`` moves ``head`` back to
  the first cell it frees;
* current K/V are copied to those cell indices (``cpy_k``/``cpy_v``);
* ``n_kv``: cells the graph reads, ``used_max_p1`` padded to 256 (``get_n_kv``: ``max(n_pad, 256)``);
* ``kq_mask``: ggml ``ne = [n_kv, n_tokens, 1, n_stream]`` (no row padding since llama.cpp
  dropped ``GGML_KQ_MASK_PAD``), 0 where
  the cell holds the query's seq_id and ``cell.pos <= query pos``, -inf elsewhere
  (``set_input_kq_mask``);
* ``kq_mask_swa``: for models with sliding-window layers (llama.cpp ``llama_kv_cache_iswa``,
  ``build_attn_inp_kv_iswa``), the same mask with ``is_masked_swa`` also applied: a cell is
  dropped when ``query pos - cell pos >= n_swa``, so the query at p sees keys p-W+1..p
  (``LLAMA_SWA_TYPE_STANDARD``). Windowed layers read ``kq_mask_swa``, the others ``kq_mask``.
  Here both masks index one cell pool; llama.cpp's second, smaller SWA pool (cells reused once
  they leave every window) is :class:`~infertrace.kv.iswa.IswaCellsKV`, which the engine builds for
  windowed models (this single pool remains for the prefix cache, draft models and the KV audit).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from infertrace.attention.reference import attention_with_kq_mask
from infertrace.errors import InfertraceError
from infertrace.kv.base import CellsInputs, ChunkSpec, MemOp, MemoryDefaults, ranges_text
from infertrace.kv import seq_ops
from infertrace.limits import N_KV_PAD_MAX

#: query rows of kq_mask are padded to a multiple of this (llama.cpp once padded to
#: ``GGML_KQ_MASK_PAD`` = 64; the llama.cpp measured by ``run --runtime llama.cpp`` does not pad).
KQ_MASK_PAD = 1
#: ``n_kv`` is padded to a multiple of this (llama.cpp ``llama_kv_cache::get_n_kv``: ``max(n_pad, 256)``,
#: "so that the graph remains constant across batches and can be reused"), capped at the cache size;
#: one constant with the trace checks and the ``dump-kv`` text (torch-free: :mod:`infertrace.limits`).
N_PAD = N_KV_PAD_MAX


class CellsKV(MemoryDefaults):
    """Unified cell cache for ``n_layer`` layers (the :class:`~infertrace.kv.base.Memory` protocol).

    Args:
        n_layer, n_kv_heads, head_dim: model shape.
        size: number of cells (``n_ctx``), shared by all sequences.
        n_seq_max: maximum distinct seq_ids (``n_seq_max``).
        dtype, device: storage dtype/device of K and V.

        windows: per layer sliding window W (0 = full); all windowed layers share one W (``n_swa``).

    Storage: ``k[layer]``, ``v[layer]``: ``[size, n_kv_heads, head_dim]``.
    """

    kind = "cells"
    layout = "cells"  # what the views read (infertrace.capture.kv_views)

    def __init__(self, n_layer: int, n_kv_heads: int, head_dim: int, size: int, n_seq_max: int = 64,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", windows: Sequence[int] | None = None):
        self.size = size
        self.capacity_tokens = size
        self.n_seq_max = n_seq_max
        self.n_layer = n_layer
        self.kv_layers = list(range(n_layer))  # model layers with K/V: all of them
        self.k = [torch.zeros(size, n_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(n_layer)]  # [size, n_kv_heads, hd]
        self.v = [torch.zeros(size, n_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(n_layer)]  # [size, n_kv_heads, hd]
        self.pos = torch.full((size,), -1, dtype=torch.int64)  # [size]
        self.seq = torch.zeros(size, n_seq_max, dtype=torch.bool)  # [size, n_seq_max]
        self.head = 0
        self.device = device
        self.attn_impl = "torch"
        self.windows = list(windows) if windows is not None else [0] * n_layer  # per layer, 0 = full attention
        ws = {w for w in self.windows if w}
        if len(ws) > 1:
            raise InfertraceError(f"layers with different sliding windows {sorted(ws)} are not implemented (llama.cpp has one n_swa)")
        self.n_swa = ws.pop() if ws else 0  # llama.cpp hparams.n_swa

    # --- bookkeeping -------------------------------------------------------------
    @property
    def used(self) -> int:
        """Number of non-empty cells (llama.cpp ``cells.get_used()``)."""
        return int((self.pos >= 0).sum())

    def used_max_p1(self) -> int:
        nz = torch.nonzero(self.pos >= 0)
        return int(nz.max()) + 1 if nz.numel() else 0

    def n_kv(self) -> int:
        """Cells the graph reads: ``min(size, max(n_pad, pad(used_max_p1, n_pad)))``."""
        u = self.used_max_p1()
        padded = ((u + N_PAD - 1) // N_PAD) * N_PAD
        return min(self.size, max(N_PAD, padded))

    def seq_len(self, seq_id: int) -> int:
        return int(self.seq[:, seq_id].sum())

    def can_fit(self, plan: list[tuple[int, int]]) -> bool:
        """Whether every ``(seq_id, n_new)`` of ``plan`` fits at once (free cells)."""
        return self.size - self.used >= sum(n for _, n in plan)

    def _check_seq(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.n_seq_max:
            raise InfertraceError(f"seq_id {seq_id} out of range: the cells cache holds at most {self.n_seq_max} sequences (n_seq_max)")

    def find_slot(self, n_tokens: int) -> list[int]:
        """Indices of ``n_tokens`` free cells scanning from ``head`` with wrap-around.

        Raises:
            InfertraceError: not enough free cells (the context is full).
        """
        free = (self.pos < 0).nonzero().flatten().tolist()
        if len(free) < n_tokens:
            raise InfertraceError(
                f"KV cache full: need {n_tokens} cells, {len(free)} free of {self.size}; raise --ctx-size or shorten the prompt"
            )
        head = self.head
        if head > self.used + 2 * n_tokens:  # llama.cpp: plenty of unused cells before head -> restart at 0
            head = 0
        after = [i for i in free if i >= head]
        before = [i for i in free if i < head]
        return (after + before)[:n_tokens]

    # --- per step ----------------------------------------------------------------
    def _ubatch_rows(self, chunks: Sequence[ChunkSpec]) -> tuple[list[int], list[int]]:
        """Per token of the ubatch its position (past + 0..T-1; a draft tree: past + depth(node)) and
        seq_id, as llama.cpp's ``ubatch.pos`` / ``ubatch.seq_id``.

        Raises:
            InfertraceError: a seq_id outside this memory's sequences.
        """
        positions, seq_ids = [], []
        for c in chunks:
            self._check_seq(c.seq_id)
            positions += [c.C + d for d in c.depths()]
            seq_ids += [c.seq_id] * c.T
        return positions, seq_ids

    def _place(self, positions: list[int], seq_ids: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
        """``find_slot`` for the ubatch: its cells and, as int64 tensors ``[N]``, cells, positions, seq_ids."""
        idx = self.find_slot(len(positions))
        return (idx, torch.tensor(idx, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                torch.tensor(seq_ids, dtype=torch.int64))

    def prepare(self, chunks: Sequence[ChunkSpec]) -> CellsInputs:
        """Find cells for every current token, mark them, and fill ``kq_mask``.

        Returns :class:`~infertrace.kv.base.CellsInputs` (``cell_idx`` ``[N]`` int64, ``n_kv``,
        ``kq_mask`` ``[1, 1, n_tokens_pad, n_kv]`` float32, ``head_before`` / ``head_after``, ...).
        """
        positions, seq_ids = self._ubatch_rows(chunks)
        N = len(positions)
        head_before = self.head
        idx, idx_t, pos_t, sid_t = self._place(positions, seq_ids)
        self.pos[idx_t] = pos_t
        self.seq[idx_t, sid_t] = True
        self.head = (idx[-1] + 1) % self.size if idx else self.head
        n_kv = self.n_kv()
        n_pad = ((N + KQ_MASK_PAD - 1) // KQ_MASK_PAD) * KQ_MASK_PAD
        owns = self.seq[:n_kv][:, sid_t].T  # [N, n_kv]: cell holds the query's seq_id
        causal = self.pos[:n_kv].unsqueeze(0) <= pos_t.unsqueeze(1)  # [N, n_kv]
        keep = owns & causal & (self.pos[:n_kv] >= 0).unsqueeze(0)  # [N, n_kv]
        row = 0
        for c in chunks:  # speculative tree verify: the past, plus the query's ancestors among the step's cells
            if c.parents is not None:
                anc = torch.zeros(c.T, n_kv, dtype=torch.bool)  # [T, n_kv]
                anc[:, idx_t[row : row + c.T]] = c.ancestors()  # [T, T] onto the chunk's cells
                past = (self.pos[:n_kv] >= 0) & (self.pos[:n_kv] < c.C)  # [n_kv]
                keep[row : row + c.T] = owns[row : row + c.T] & (past.unsqueeze(0) | anc)  # [T, n_kv]
            row += c.T
        mask = torch.full((1, 1, n_pad, n_kv), float("-inf"))  # ne = [n_kv, n_pad, 1, 1]
        mask[0, 0, :N] = torch.where(keep, 0.0, float("-inf"))  # [N, n_kv]
        inp = CellsInputs(list(chunks), pos_t, sid_t, self.kind, cell_idx=idx_t, n_kv=n_kv, kq_mask=mask, n_tokens_pad=n_pad,
                          head_before=head_before, head_after=self.head, cell_pos=self.pos[:n_kv].clone(),
                          cell_seq=self.seq[:n_kv].clone())
        if self.n_swa:
            in_win = (pos_t.unsqueeze(1) - self.pos[:n_kv].unsqueeze(0)) < self.n_swa  # [N, n_kv] not is_masked_swa
            mask_swa = torch.full((1, 1, n_pad, n_kv), float("-inf"))  # ne = [n_kv, n_pad, 1, 1]
            mask_swa[0, 0, :N] = torch.where(keep & in_win, 0.0, float("-inf"))  # [N, n_kv]
            inp.kq_mask_swa, inp.n_swa = mask_swa, self.n_swa
            inp.swa_layers = [i for i, w in enumerate(self.windows) if w]
        return inp

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, inp: CellsInputs) -> None:
        """Copy current K/V ``[N, n_kv_heads, hd]`` into the chosen cells (``cpy_k``/``cpy_v``)."""
        idx = inp.cell_idx
        self.k[layer][idx] = k.to(self.k[layer].dtype)
        self.v[layer][idx] = v.to(self.v[layer].dtype)

    def attend(self, layer: int, q: torch.Tensor, inp: CellsInputs, scale: float) -> torch.Tensor:
        """Attention of ``q`` ``[N, n_head, hd]`` over cells ``0..n_kv-1`` with the kq_mask
        (``kq_mask_swa`` on sliding-window layers)."""
        n_kv, N = inp.n_kv, q.shape[0]
        mask = (inp.kq_mask_swa if self.windows[layer] else inp.kq_mask)[0, 0, :N].to(q.device)  # [N, n_kv]
        return attention_with_kq_mask(q, self.k[layer][:n_kv], self.v[layer][:n_kv], mask, scale)

    def release(self, seq_id: int) -> None:
        """Remove ``seq_id`` from every cell; cells left with no owner become empty
        (llama.cpp ``seq_rm(seq_id, -1, -1)``)."""
        before = self.pos >= 0  # [size]
        self.seq[:, seq_id] = False
        empty = ~self.seq.any(dim=1)  # [size]
        self.pos[empty] = -1
        freed = (before & empty).nonzero().flatten()
        if freed.numel() and int(freed[0]) < self.head:  # llama_kv_cache::seq_rm: head back to the first freed cell
            self.head = int(freed[0])

    # --- sequence operations (llama_kv_cache::seq_*; K-shift math in kv/seq_ops.py) ------------------
    # Subclasses that run an operation on several pools (kv/iswa.py) override these; where one
    # operation is built from others (context shift, rewind) it calls this class's own, non-virtually.
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> MemOp:
        """``llama_kv_cache::seq_rm``: remove ``seq_id`` from its cells with ``p0 <= pos < p1``; cells left
        without owner become empty (``seq_id < 0``: remove every owner); ``head`` moves back to the
        first freed cell. Answers ``{"op", "seq_id", "range", "pos", "cells", "freed"}``."""
        a, b = seq_ops.pos_range(p0, p1)
        in_range = (self.pos >= a) & (self.pos < b) & (self.pos >= 0)  # [size]
        hit = in_range if seq_id < 0 else in_range & self.seq[:, seq_id]
        idx = hit.nonzero().flatten()
        removed = self.pos[idx].tolist()
        if seq_id < 0:
            self.seq[idx] = False
        else:
            self.seq[idx, seq_id] = False
        freed = idx[~self.seq[idx].any(dim=1)]
        self.pos[freed] = -1
        if freed.numel():
            self.head = min(self.head, int(freed.min()))
        return MemOp({"op": "seq_rm", "seq_id": seq_id, "range": seq_ops.range_text(a, b), "pos": ranges_text(removed),
                      "cells": ranges_text(idx.tolist()), "freed": ranges_text(freed.tolist())})

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> MemOp:
        """``llama_kv_cache::seq_cp`` (unified cache): ``dst`` joins the owners of ``src``'s cells with
        ``p0 <= pos < p1`` (no K/V copied). Answers ``{"op", "src", "dst", "cells", "pos"}``."""
        a, b = seq_ops.pos_range(p0, p1)
        idx = ((self.pos >= a) & (self.pos < b) & (self.pos >= 0) & self.seq[:, src]).nonzero().flatten()
        self.seq[idx, dst] = True
        return MemOp({"op": "seq_cp", "src": src, "dst": dst, "cells": ranges_text(idx.tolist()),
                      "pos": ranges_text(self.pos[idx].tolist())})

    def seq_keep(self, seq_id: int) -> MemOp:
        """``llama_kv_cache::seq_keep``: ``seq_id``'s cells keep only that owner, other cells become empty."""
        mine = self.seq[:, seq_id].clone()  # [size]
        others = ((self.pos >= 0) & ~mine).nonzero().flatten()
        self.seq[:] = False
        self.seq[mine, seq_id] = True
        self.pos[others] = -1
        if others.numel():
            self.head = min(self.head, int(others.min()))
        return MemOp({"op": "seq_keep", "seq_id": seq_id, "freed": ranges_text(others.tolist())})

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int, ropes: Sequence[Any]) -> MemOp:
        """llama.cpp ``seq_add`` + ``build_graph_shift``: positions ``[p0, p1)`` of ``seq_id``'s cells +=
        ``delta``, their K re-rotated in every layer with ``ropes[il]`` (K-shift); a cell whose position
        becomes negative is removed. As llama.cpp, a cell shared with other sequences moves for all of them.
        Answers ``{"op", "seq_id", "range", "delta", "cells", "from", "to", "removed"}``."""
        a, b = seq_ops.pos_range(p0, p1)
        tables = seq_ops.shift_tables(self, ropes)
        if delta == 0:
            return MemOp({"op": "seq_add", "seq_id": seq_id, "delta": 0, "cells": "-"})
        idx = ((self.pos >= a) & (self.pos < b) & (self.pos >= 0) & self.seq[:, seq_id]).nonzero().flatten()  # [M]
        old = self.pos[idx].clone()
        new = old + delta
        gone, keep = idx[new < 0], idx[new >= 0]
        d = torch.full((keep.numel(),), delta, dtype=torch.int64)  # [M']
        for layer in range(self.n_layer):
            self.k[layer][keep] = seq_ops.rotate_k(self.k[layer][keep], d, tables[layer])  # [M', n_kv_heads, hd]
        self.pos[keep] = new[new >= 0]
        self.seq[gone] = False
        self.pos[gone] = -1
        if gone.numel():
            self.head = min(self.head, int(gone.min()))
        return MemOp({"op": "seq_add", "seq_id": seq_id, "range": seq_ops.range_text(a, b), "delta": delta,
                      "cells": ranges_text(keep.tolist()), "from": ranges_text(old[new >= 0].tolist()),
                      "to": ranges_text(new[new >= 0].tolist()), "removed": ranges_text(old[new < 0].tolist())})

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int, ropes: Sequence[Any]) -> MemOp:
        """llama.cpp ``seq_div`` (self-extend): positions ``[p0, p1)`` //= ``d``, K re-rotated by ``new - old``
        in every layer with ``ropes[il]``.

        Raises:
            InfertraceError: ``d < 1``.
        """
        if d < 1:
            raise InfertraceError(f"seq_div by {d}: the divisor must be >= 1")
        a, b = seq_ops.pos_range(p0, p1)
        tables = seq_ops.shift_tables(self, ropes)
        idx = ((self.pos >= a) & (self.pos < b) & (self.pos >= 0) & self.seq[:, seq_id]).nonzero().flatten()  # [M]
        old = self.pos[idx].clone()  # [M]
        new = old // d  # [M]
        if d > 1 and idx.numel():
            for layer in range(self.n_layer):
                self.k[layer][idx] = seq_ops.rotate_k(self.k[layer][idx], new - old, tables[layer])  # [M, n_kv_heads, hd]
            self.pos[idx] = new
        return MemOp({"op": "seq_div", "seq_id": seq_id, "range": seq_ops.range_text(a, b), "d": d,
                      "cells": ranges_text(idx.tolist()), "from": ranges_text(old.tolist()), "to": ranges_text(new.tolist())})

    def seq_pos_min(self, seq_id: int) -> int:
        """``llama_memory_seq_pos_min`` (-1 when ``seq_id`` holds no cell)."""
        p = self.pos[self.seq[:, seq_id]]
        return int(p.min()) if p.numel() else -1

    def seq_pos_max(self, seq_id: int) -> int:
        """``llama_memory_seq_pos_max`` (-1 when ``seq_id`` holds no cell)."""
        p = self.pos[self.seq[:, seq_id]]
        return int(p.max()) if p.numel() else -1

    def copy_on_write(self, seq_id: int, p0: int) -> dict[str, Any]:
        """Give ``seq_id`` its own copy of every cell with ``pos >= p0`` it shares with other sequences
        (before a shift, which would otherwise move the cell for every owner).
        Returns ``{"op": "copy_on_write", "seq_id", "from", "to"}``."""
        shared = ((self.pos >= p0) & self.seq[:, seq_id] & (self.seq.sum(dim=1) > 1)).nonzero().flatten()
        if not shared.numel():
            return {"op": "copy_on_write", "seq_id": seq_id, "from": "-", "to": "-"}
        dst = torch.tensor(self.find_slot(int(shared.numel())), dtype=torch.int64)
        for layer in range(self.n_layer):
            self.k[layer][dst] = self.k[layer][shared]
            self.v[layer][dst] = self.v[layer][shared]
        self.pos[dst] = self.pos[shared]
        self.seq[shared, seq_id] = False
        self.seq[dst, seq_id] = True
        return {"op": "copy_on_write", "seq_id": seq_id, "from": ranges_text(shared.tolist()), "to": ranges_text(dst.tolist())}

    def shift_out(self, seq_id: int, p0: int, p1: int, ropes: Sequence[Any]) -> MemOp:
        """Context shift on cells: copy-on-write of the cells shared with other sequences, ``seq_rm(p0, p1)``,
        ``seq_add(p1, end, -(p1 - p0))`` (llama.cpp server's pair)."""
        seq_ops.shift_tables(self, ropes)
        steps = [self.copy_on_write(seq_id, p1), dict(CellsKV.seq_rm(self, seq_id, p0, p1)),
                 dict(CellsKV.seq_add(self, seq_id, p1, -1, -(p1 - p0), ropes))]
        return MemOp({"op": "shift_out", "seq_id": seq_id, "steps": steps, "removed": ranges_text(range(p0, p1)),
                      "delta": -(p1 - p0)})

    def rewind(self, seq_id: int, C: int, T: int, accepted: Sequence[int], inp: CellsInputs, row: int,
               is_chain: bool) -> MemOp:
        """Speculative rollback: ``seq_rm`` of the rejected candidates' cells (rows ``row..row+T-1``)."""
        return self.rewind_cells(seq_id, C, T, accepted, inp.cell_idx[row : row + T], is_chain)

    def rewind_cells(self, seq_id: int, C: int, T: int, accepted: Sequence[int], cell_idx: torch.Tensor,
                     is_chain: bool = True) -> MemOp:
        """Keep the accepted candidates ``accepted`` (chunk-local node indices, root 0 first, depth
        ``0..len-1`` in order) of a verify chunk ``C, T`` of ``seq_id``; free the rest (llama.cpp
        ``common/speculative.cpp``: a chain is ``seq_rm(seq, C + n_accepted + 1, -1)``; a tree's rejected
        cells are freed one by one, as llama.cpp drops each rejected branch's seq_id).

        Args:
            cell_idx: ``[T]`` cells the chunk's candidates went to (rows of ``CellsInputs.cell_idx``).
            is_chain: the chunk was a chain (accepted is then ``0..a``): one ``seq_rm(seq, C + a, -1)``.

        Returns ``{"op", "seq_id", "kept_pos", "removed_pos", "n_removed", "freed", ...}``.
        """
        keep = C + len(accepted)
        rec: dict[str, Any] = {"seq_id": seq_id, "kept_pos": ranges_text(range(C, keep)), "n_removed": T - len(accepted)}
        if is_chain:
            op = CellsKV.seq_rm(self, seq_id, keep, -1)
            return MemOp({**rec, "op": "seq_rm", "range": op["range"], "removed_pos": op["pos"], "freed": op["freed"]})
        acc = set(accepted)
        rej = torch.tensor([int(cell_idx[i]) for i in range(T) if i not in acc], dtype=torch.int64)  # [T - a]
        removed = self.pos[rej].tolist()
        self.seq[rej, seq_id] = False
        freed = rej[~self.seq[rej].any(dim=1)]
        self.pos[freed] = -1
        if freed.numel():
            self.head = min(self.head, int(freed.min()))
        return MemOp({**rec, "op": "seq_rm_cells", "removed_pos": ranges_text(removed), "freed": ranges_text(freed.tolist())})

    def defrag(self) -> MemOp:
        """llama.cpp's defragmentation (``defrag_prepare`` move list): used cells moved down into the holes
        so they occupy ``0..used-1`` in their current order, K/V of every layer with them; ``head`` = used.
        Answers ``{"op", "moves": [[src, dst], ...], "used"}``."""
        used = (self.pos >= 0).nonzero().flatten()  # [U] ascending
        dst = torch.arange(used.numel())
        moves = [[int(s), int(d)] for s, d in zip(used.tolist(), dst.tolist()) if s != d]
        if moves:
            for layer in range(self.n_layer):
                self.k[layer][dst] = self.k[layer][used].clone()
                self.v[layer][dst] = self.v[layer][used].clone()
            pos, seq = self.pos[used].clone(), self.seq[used].clone()
            self.pos[:] = -1
            self.seq[:] = False
            self.pos[dst], self.seq[dst] = pos, seq
        self.head = int(used.numel()) % self.size
        return MemOp({"op": "defrag", "moves": moves, "used": int(used.numel())})

    def occupy(self, idx: Sequence[int], positions: Sequence[int], seq_id: int) -> None:
        """``apply_ubatch`` of one sequence's tokens in this (stream's) cells: cells ``idx`` get
        ``positions`` and owner ``seq_id``; ``head`` = last cell + 1 (not wrapped: the next search wraps)."""
        it = torch.tensor(list(idx), dtype=torch.int64)  # [T]
        self.pos[it] = torch.tensor(list(positions), dtype=torch.int64)
        self.seq[it, seq_id] = True
        self.head = idx[-1] + 1 if len(idx) else self.head

    def copy_from(self, other: "CellsKV", src: int, dst: int) -> torch.Tensor:
        """Become a copy of ``other``'s cells of ``src``, owned by ``dst`` (llama.cpp ``seq_cp`` across
        streams: cells reset, ``src``'s cells at the same indices, head copied, every layer's K/V copied by
        ``ggml_backend_tensor_copy``). Returns the copied cells ``[M]`` int64."""
        idx = other.seq[:, src].nonzero().flatten()  # [M] the source cells
        self.pos.fill_(-1)
        self.seq.zero_()
        self.pos[idx] = other.pos[idx]
        self.seq[idx, dst] = True
        self.head = other.head
        for layer in range(self.n_layer):
            self.k[layer].copy_(other.k[layer])
            self.v[layer].copy_(other.v[layer])
        return idx

    # --- description ---------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """``kind``, ``dtype`` (torch name), ``n_layer`` (physical), ``kv_layers``, ``n_kv_heads``, ``head_dim``,
        ``block_size`` 0, ``n_seq_max``, ``physical_shape`` ``[size, n_kv_heads, head_dim]`` per layer."""
        k = self.k[0]
        return {"kind": self.kind, "dtype": str(k.dtype).replace("torch.", ""), "n_layer": self.n_layer,
                "kv_layers": list(self.kv_layers), "n_kv_heads": int(k.shape[1]), "head_dim": int(k.shape[2]),
                "block_size": 0, "n_seq_max": self.n_seq_max, "physical_shape": [self.size, *k.shape[1:]]}

    # --- state read ----------------------------------------------------------------
    def cells_of(self, seq_id: int) -> list[tuple[int, int]]:
        """``[(cell, pos)]`` owned by ``seq_id``, ordered by pos."""
        idx = self.seq[:, seq_id].nonzero().flatten()
        pairs = sorted(zip(self.pos[idx].tolist(), idx.tolist()))
        return [(c, p) for p, c in pairs]

    def read(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        cells = torch.tensor([c for c, _ in self.cells_of(seq_id)], dtype=torch.int64)
        return self.k[layer][cells], self.v[layer][cells]  # [L, n_kv_heads, hd] each

    def logical_mask(self, inp: CellsInputs, swa: bool = False) -> list[torch.Tensor]:
        """Per chunk, bool ``[T, C+T]`` keep-matrix read back from the real kq_mask (``kq_mask_swa``
        when ``swa`` and the model has windowed layers):
        entry (i, j) is True iff some cell with pos j owned by the chunk's seq is 0 in row i.
        If a query could see a cell its sequence does not own (a broken mask), one extra
        last column is appended and set for that query, so comparisons fail loudly."""
        mask = inp.mask(swa)[0, 0]  # [n_pad, n_kv]
        n_kv = inp.n_kv
        cell_pos, cell_seq = inp.cell_pos, inp.cell_seq  # state when the mask was filled
        out, row = [], 0
        for c in inp.chunks:
            keep = mask[row : row + c.T, :n_kv] == 0  # [T, n_kv]
            p = cell_pos[:n_kv].to(torch.int64)  # [n_kv] pos of each cell (-1: empty)
            ok = (p >= 0) & (p < c.C + c.T)
            # column pos gets the OR over the cells holding that pos (a count > 0), all cells at once
            m = torch.zeros(c.T, c.C + c.T, dtype=torch.int32).index_add_(1, p[ok], keep[:, ok].to(torch.int32)) > 0
            # a cell visible to a query but not owned by its seq would be a leak: expose it
            owned = cell_seq[:, c.seq_id]
            leak = keep & ~owned.unsqueeze(0)
            if bool(leak.any()):
                m = torch.cat([m, leak.any(dim=1, keepdim=True)], dim=1)  # extra column flags a foreign key
            out.append(m)
            row += c.T
        return out

    def snapshot(self) -> dict[str, Any]:
        """Cell map like llama.cpp's cache debug print: per used cell its pos and seq_ids."""
        used = (self.pos >= 0).nonzero().flatten()  # [U] cells in use
        used_idx = used.tolist()
        owners: list[list[int]] = [[] for _ in used_idx]
        for r, s in self.seq[used].nonzero().tolist():  # [nnz, 2] (row in used, seq_id), row-major: seq_ids ascending
            owners[r].append(s)
        cells = [{"cell": i, "pos": p, "seq_ids": o} for i, p, o in zip(used_idx, self.pos[used].tolist(), owners)]
        seqs = sorted({s for c in cells for s in c["seq_ids"]})
        of = {s: self.cells_of(s) for s in seqs}
        return {
            "kind": self.kind, "size": self.size, "head": self.head, "used": len(used_idx), "n_kv": self.n_kv(),
            "n_swa": self.n_swa, "swa_layers": [i for i, w in enumerate(self.windows) if w],
            "cells": cells,
            "seqs": {str(s): {"cells": ranges_text([c for c, _ in of[s]]), "pos": ranges_text([p for _, p in of[s]])}
                     for s in seqs},
        }
