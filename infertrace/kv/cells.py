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
  Here both masks index one cell pool (llama.cpp keeps a second, smaller pool for the SWA
  layers and reuses its cells once they leave every window).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from infertrace.attention.reference import attention_with_kq_mask
from infertrace.errors import InfertraceError
from infertrace.kv.base import AttnInputs, ChunkSpec, ranges_text
from infertrace.trace.schema import N_KV_PAD_MAX

#: query rows of kq_mask are padded to a multiple of this (llama.cpp once padded to
#: ``GGML_KQ_MASK_PAD`` = 64; the llama.cpp measured by ``run --engine llama.cpp`` does not pad).
KQ_MASK_PAD = 1
#: ``n_kv`` is padded to a multiple of this (llama.cpp ``llama_kv_cache::get_n_kv``: ``max(n_pad, 256)``,
#: "so that the graph remains constant across batches and can be reused"), capped at the cache size;
#: one constant with the trace checks and the ``dump-kv`` text (torch-free, in the trace layer).
N_PAD = N_KV_PAD_MAX


class CellsKV:
    """Unified cell cache for ``n_layer`` layers.

    Args:
        n_layer, n_kv_heads, head_dim: model shape.
        size: number of cells (``n_ctx``), shared by all sequences.
        n_seq_max: maximum distinct seq_ids (``n_seq_max``).
        dtype, device: storage dtype/device of K and V.

        windows: per layer sliding window W (0 = full); all windowed layers share one W (``n_swa``).

    Storage: ``k[layer]``, ``v[layer]``: ``[size, n_kv_heads, head_dim]``.
    """

    kind = "cells"

    def __init__(self, n_layer: int, n_kv_heads: int, head_dim: int, size: int, n_seq_max: int = 64,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", windows: Sequence[int] | None = None):
        self.size = size
        self.capacity_tokens = size
        self.n_seq_max = n_seq_max
        self.n_layer = n_layer
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
    def prepare(self, chunks: Sequence[ChunkSpec]) -> AttnInputs:
        """Find cells for every current token, mark them, and fill ``kq_mask``.

        Returns an :class:`AttnInputs` with ``extra = {cell_idx [N] int64, n_kv, kq_mask
        [1, 1, n_tokens_pad, n_kv] float32, n_tokens_pad, head_before, head_after}``.
        """
        positions, seq_ids = [], []
        for c in chunks:
            self._check_seq(c.seq_id)
            positions += [c.C + d for d in c.depths()]  # past + 0..T-1; a draft tree: past + depth(node)
            seq_ids += [c.seq_id] * c.T
        N = len(positions)
        head_before = self.head
        idx = self.find_slot(N)
        idx_t = torch.tensor(idx, dtype=torch.int64)  # [N]
        pos_t = torch.tensor(positions, dtype=torch.int64)  # [N]
        sid_t = torch.tensor(seq_ids, dtype=torch.int64)  # [N]
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
        extra = {"cell_idx": idx_t, "n_kv": n_kv, "kq_mask": mask, "n_tokens_pad": n_pad,
                 "head_before": head_before, "head_after": self.head,
                 "cell_pos": self.pos[:n_kv].clone(), "cell_seq": self.seq[:n_kv].clone()}
        if self.n_swa:
            in_win = (pos_t.unsqueeze(1) - self.pos[:n_kv].unsqueeze(0)) < self.n_swa  # [N, n_kv] not is_masked_swa
            mask_swa = torch.full((1, 1, n_pad, n_kv), float("-inf"))  # ne = [n_kv, n_pad, 1, 1]
            mask_swa[0, 0, :N] = torch.where(keep & in_win, 0.0, float("-inf"))  # [N, n_kv]
            extra.update({"kq_mask_swa": mask_swa, "n_swa": self.n_swa,
                          "swa_layers": [i for i, w in enumerate(self.windows) if w]})
        return AttnInputs(list(chunks), pos_t, sid_t, self.kind, extra)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, inp: AttnInputs) -> None:
        """Copy current K/V ``[N, n_kv_heads, hd]`` into the chosen cells (``cpy_k``/``cpy_v``)."""
        idx = inp.extra["cell_idx"]
        self.k[layer][idx] = k.to(self.k[layer].dtype)
        self.v[layer][idx] = v.to(self.v[layer].dtype)

    def attend(self, layer: int, q: torch.Tensor, inp: AttnInputs, scale: float) -> torch.Tensor:
        """Attention of ``q`` ``[N, n_head, hd]`` over cells ``0..n_kv-1`` with the kq_mask
        (``kq_mask_swa`` on sliding-window layers)."""
        n_kv, N = inp.extra["n_kv"], q.shape[0]
        name = "kq_mask_swa" if self.windows[layer] else "kq_mask"
        mask = inp.extra[name][0, 0, :N].to(q.device)  # [N, n_kv]
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

    # --- views -------------------------------------------------------------------
    def cells_of(self, seq_id: int) -> list[tuple[int, int]]:
        """``[(cell, pos)]`` owned by ``seq_id``, ordered by pos."""
        idx = self.seq[:, seq_id].nonzero().flatten()
        pairs = sorted(zip(self.pos[idx].tolist(), idx.tolist()))
        return [(c, p) for p, c in pairs]

    def read(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        cells = torch.tensor([c for c, _ in self.cells_of(seq_id)], dtype=torch.int64)
        return self.k[layer][cells], self.v[layer][cells]  # [L, n_kv_heads, hd] each

    def logical_mask(self, inp: AttnInputs, swa: bool = False) -> list[torch.Tensor]:
        """Per chunk, bool ``[T, C+T]`` keep-matrix read back from the real kq_mask (``kq_mask_swa``
        when ``swa`` and the model has windowed layers):
        entry (i, j) is True iff some cell with pos j owned by the chunk's seq is 0 in row i.
        If a query could see a cell its sequence does not own (a broken mask), one extra
        last column is appended and set for that query, so comparisons fail loudly."""
        mask = inp.extra["kq_mask_swa" if (swa and "kq_mask_swa" in inp.extra) else "kq_mask"][0, 0]  # [n_pad, n_kv]
        n_kv = inp.extra["n_kv"]
        cell_pos, cell_seq = inp.extra["cell_pos"], inp.extra["cell_seq"]  # state when the mask was filled
        out, row = [], 0
        for c in inp.chunks:
            m = torch.zeros(c.T, c.C + c.T, dtype=torch.bool)
            keep = mask[row : row + c.T, :n_kv] == 0  # [T, n_kv]
            for cell in range(n_kv):
                p = int(cell_pos[cell])
                if p < 0 or p >= c.C + c.T:
                    continue
                m[:, p] |= keep[:, cell]
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
        used_idx = (self.pos >= 0).nonzero().flatten().tolist()
        cells = [{"cell": i, "pos": int(self.pos[i]), "seq_ids": self.seq[i].nonzero().flatten().tolist()} for i in used_idx]
        seqs = sorted({s for c in cells for s in c["seq_ids"]})
        return {
            "kind": self.kind, "size": self.size, "head": self.head, "used": len(used_idx), "n_kv": self.n_kv(),
            "n_swa": self.n_swa, "swa_layers": [i for i, w in enumerate(self.windows) if w],
            "cells": cells,
            "seqs": {str(s): {"cells": ranges_text([c for c, _ in self.cells_of(s)]),
                               "pos": ranges_text([p for _, p in self.cells_of(s)])} for s in seqs},
        }
