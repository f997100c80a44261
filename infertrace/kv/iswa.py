"""llama.cpp's iSWA cache for models with sliding-window layers (Gemma 3): two cell pools.

Mirrors llama.cpp ``src/llama-kv-cache-iswa.cpp`` (``llama_kv_cache_iswa``) and the SWA side of
``src/llama-kv-cache.cpp`` (a ``llama_kv_cache`` built with ``n_swa > 0``), as vendored by
llama-cpp-python 0.3.x:

* two ``llama_kv_cache``: ``kv_base`` for the full-attention layers (``kv_size`` = ``n_ctx`` cells)
  and ``kv_swa`` for the windowed layers, of
  ``size_swa = GGML_PAD(min(n_ctx, n_swa * n_seq_max + n_ubatch), 256)`` cells (unified cache;
  ``swa_full``: ``size_swa = n_ctx``). Both place every token of every ubatch (``prepare`` of
  both, same ubatch), so each has its own cells, ``head`` and ``used``;
* ``find_slot`` on the SWA pool (``llama_kv_cache::find_slot``, non-contiguous): scanning from
  ``head`` (reset to 0 when ``head > used + 2 * n_tokens``) with wrap-around, a cell is usable when
  it is empty **or** it is held by exactly one sequence and ``is_masked_swa(n_swa, pos_cell,
  seq_pos_max(seq) + 1)``: no later query of that sequence can see it (it left every window);
* ``apply_ubatch``: a reused cell is cleared first; afterwards every sequence whose cell was
  overwritten has its positions ``[seq_pos_min, max overwritten pos]`` removed (``seq_rm``: "all
  positions between pos_min and pos_max stay present"); ``head`` = last cell + 1 (not wrapped);
* ``n_kv`` per pool (``get_n_kv``: ``min(size, max(256, GGML_PAD(used_max_p1, 256)))``);
  ``kq_mask`` is filled over the base pool, ``kq_mask_swa`` over the SWA pool with
  ``is_masked_swa`` (``llm_graph_input_attn_kv_iswa::set_input``); the windowed layers write to
  and read the SWA pool (``build_attn`` with ``is_swa``: ``k_idxs_swa``, ``kq_mask_swa``);
* sequence operations go to both pools (``llama_kv_cache_iswa::seq_rm`` ...);
  ``seq_pos_min/max`` answer from the SWA pool; a K-shift needs both pools of one size
  (``get_can_shift``).

Here the windowed layers' K/V are also kept in the base pool's storage (never read by attention),
so :meth:`IswaCellsKV.read` / ``dump-kv`` / the KV audit still see a sequence's whole history.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Sequence

import torch

from infertrace.errors import InfertraceError
from infertrace.kv.base import CellsInputs, ChunkSpec, MemOp, SwaPoolStep, ranges_text
from infertrace.kv.cells import KQ_MASK_PAD, CellsKV

#: the SWA pool is padded to a multiple of this (llama_kv_cache_iswa: "the SWA cache is always padded to 256")
SWA_POOL_PAD = 256


def swa_pool_size(n_ctx: int, n_swa: int, n_seq_max: int, n_ubatch: int, swa_full: bool = False) -> int:
    """Cells of llama.cpp's SWA pool (``llama_kv_cache_iswa`` constructor, unified cache):
    ``GGML_PAD(min(n_ctx, n_swa * n_seq_max + n_ubatch), 256)``, ``n_ctx`` with ``swa_full``.

    llama.cpp's ``n_ctx`` is itself a multiple of 256, so the pool never exceeds it; an ``n_ctx``
    that is not (the cells backend does not pad ``--ctx-size``) caps the pool at ``n_ctx``.

    Raises:
        InfertraceError: a non-positive size, window, sequence count or ubatch.
    """
    if min(n_ctx, n_swa, n_seq_max, n_ubatch) < 1:
        raise InfertraceError(f"SWA pool: n_ctx {n_ctx}, n_swa {n_swa}, n_seq_max {n_seq_max}, n_ubatch {n_ubatch} "
                              "must all be >= 1")
    if swa_full:
        return n_ctx
    want = min(n_ctx, n_swa * n_seq_max + n_ubatch)
    return min(n_ctx, -(-want // SWA_POOL_PAD) * SWA_POOL_PAD)


def is_masked_swa(n_swa: int, p0: int | torch.Tensor, p1: int | torch.Tensor) -> Any:
    """``llama_hparams::is_masked_swa`` for ``LLAMA_SWA_TYPE_STANDARD``: key at ``p0`` is outside the
    window of a query at ``p1`` iff ``p1 - p0 >= n_swa`` (ints or broadcasting int64 tensors)."""
    return (p1 - p0) >= n_swa


def _fill_mask(kv: CellsKV, chunks: Sequence[ChunkSpec], idx_t: torch.Tensor, pos_t: torch.Tensor, sid_t: torch.Tensor,
               n_kv: int, n_pad: int, window: int) -> torch.Tensor:
    """``set_input_kq_mask`` over ``kv``'s cells ``0..n_kv-1``: 0 where the cell holds the query's
    seq_id and ``cell.pos <= query pos`` (a draft tree: the past plus the query's ancestors) and, with
    ``window`` > 0, ``not is_masked_swa``; -inf elsewhere. Returns ``[1, 1, n_pad, n_kv]`` float32."""
    N = int(pos_t.numel())
    cpos = kv.pos[:n_kv]  # [n_kv]
    owns = kv.seq[:n_kv][:, sid_t].T  # [N, n_kv]
    keep = owns & (cpos.unsqueeze(0) <= pos_t.unsqueeze(1)) & (cpos >= 0).unsqueeze(0)  # [N, n_kv]
    row = 0
    for c in chunks:  # speculative tree verify: the past, plus the query's ancestors among the step's cells
        if c.parents is not None:
            anc = torch.zeros(c.T, n_kv, dtype=torch.bool)  # [T, n_kv]
            anc[:, idx_t[row : row + c.T]] = c.ancestors()  # [T, T] onto the chunk's cells
            past = (cpos >= 0) & (cpos < c.C)  # [n_kv]
            keep[row : row + c.T] = owns[row : row + c.T] & (past.unsqueeze(0) | anc)  # [T, n_kv]
        row += c.T
    if window:
        keep &= ~is_masked_swa(window, cpos.unsqueeze(0), pos_t.unsqueeze(1))  # [N, n_kv]
    mask = torch.full((1, 1, n_pad, n_kv), float("-inf"))  # ne = [n_kv, n_pad, 1, 1]
    mask[0, 0, :N] = torch.where(keep, 0.0, float("-inf"))  # [N, n_kv]
    return mask


def _reuse(inp: CellsInputs) -> dict[str, str]:
    """``{"reused", "purged"}`` of a SWA pool's step (``-`` each when the inputs carry no :class:`SwaPoolStep`)."""
    sp = inp.swa_pool if inp.swa_pool is not None else SwaPoolStep()
    return {"reused": sp.reused, "purged": sp.purged}


class SwaCellsPool(CellsKV):
    """The SWA pool of :class:`IswaCellsKV`: a :class:`CellsKV` of ``size`` cells whose ``find_slot``
    may reuse a cell that left every window and whose ``prepare`` purges what it overwrote (module
    docstring). Storage ``k[layer]`` / ``v[layer]`` ``[size, n_kv_heads, head_dim]`` for every layer
    (the windowed ones are written and read)."""

    kind = "cells"

    def usable(self) -> torch.Tensor:
        """Bool ``[size]``: cells ``find_slot`` may take now (empty, or one owner whose next query
        ``seq_pos_max + 1`` no longer sees the cell)."""
        one = self.seq.sum(dim=1) == 1  # [size]
        owner = self.seq.float().argmax(dim=1)  # [size] the single owner where one
        pmax = torch.full((self.n_seq_max,), -1, dtype=torch.int64)  # [n_seq_max]
        for s in self.seq.any(dim=0).nonzero().flatten().tolist():
            pmax[s] = int(self.pos[self.seq[:, s]].max())
        stale = one & (self.pos >= 0) & is_masked_swa(self.n_swa, self.pos, pmax[owner] + 1)  # [size]
        return (self.pos < 0) | stale

    def can_fit(self, plan: list[tuple[int, int]]) -> bool:
        """Whether every ``(seq_id, n_new)`` of ``plan`` fits at once (empty or reusable cells)."""
        return int(self.usable().sum()) >= sum(n for _, n in plan)

    def find_slot(self, n_tokens: int) -> list[int]:
        """``llama_kv_cache::find_slot`` (``cont = false``) on the SWA pool: the first ``n_tokens``
        usable cells from ``head`` with wrap-around.

        Raises:
            InfertraceError: fewer usable cells than tokens (llama_decode would return 1).
        """
        ok = self.usable()  # [size]
        free = ok.nonzero().flatten().tolist()
        if len(free) < n_tokens:
            raise InfertraceError(f"SWA KV pool full: need {n_tokens} cells, {len(free)} usable of {self.size}; "
                                  "raise --ctx-size or lower the number of parallel requests")
        head = self.head
        if head > self.used + 2 * n_tokens:  # llama.cpp: plenty of unused cells before head -> restart at 0
            head = 0
        return ([i for i in free if i >= head] + [i for i in free if i < head])[:n_tokens]

    def prepare(self, chunks: Sequence[ChunkSpec]) -> CellsInputs:
        """``find_slot`` + ``apply_ubatch`` (reused cells cleared, older positions of the sequences
        they held purged, ``head`` = last cell + 1) and the pool's masks.

        Returns :class:`~infertrace.kv.base.CellsInputs` of this pool (``kq_mask_swa`` ``[1, 1, n_pad,
        n_kv]`` float32 is the one the windowed layers read; ``swa_pool``: cells taken over and positions
        removed, as range text, and the pool's size).
        """
        positions, seq_ids = self._ubatch_rows(chunks)
        N = len(positions)
        head_before = self.head
        idx, idx_t, pos_t, sid_t = self._place(positions, seq_ids)  # [N] each
        reused, purged = self.apply_ubatch(idx_t, pos_t, sid_t)
        n_kv = self.n_kv()
        n_pad = ((N + KQ_MASK_PAD - 1) // KQ_MASK_PAD) * KQ_MASK_PAD
        mask = _fill_mask(self, chunks, idx_t, pos_t, sid_t, n_kv, n_pad, 0)
        mask_swa = _fill_mask(self, chunks, idx_t, pos_t, sid_t, n_kv, n_pad, self.n_swa)
        inp = CellsInputs(list(chunks), pos_t, sid_t, self.kind, cell_idx=idx_t, n_kv=n_kv, kq_mask=mask, n_tokens_pad=n_pad,
                          head_before=head_before, head_after=self.head, cell_pos=self.pos[:n_kv].clone(),
                          cell_seq=self.seq[:n_kv].clone(), kq_mask_swa=mask_swa, n_swa=self.n_swa,
                          swa_layers=[i for i, w in enumerate(self.windows) if w],
                          swa_pool=SwaPoolStep(reused, purged, self.size))
        return inp

    def apply_ubatch(self, idx_t: torch.Tensor, pos_t: torch.Tensor, sid_t: torch.Tensor) -> tuple[str, str]:
        """``llama_kv_cache::apply_ubatch`` on this pool: tokens at positions ``pos_t`` ``[N]`` of sequences
        ``sid_t`` ``[N]`` go to cells ``idx_t`` ``[N]``; a cell still holding a token is cleared first
        (``cells.rm``), then every sequence that lost a cell has its positions ``[seq_pos_min, largest
        overwritten pos]`` removed (``seq_rm``); ``head`` = last cell + 1.

        Returns:
            ``(reused, purged)``: the cells taken over and the positions purged, as range text.
        """
        idx = idx_t.tolist()
        max_rm: dict[int, int] = {}
        reused = [i for i in idx if int(self.pos[i]) >= 0]
        for i in reused:  # cells.rm(idx) of a reused cell, remembering the largest pos overwritten per sequence
            s = int(self.seq[i].nonzero().flatten()[0])
            max_rm[s] = max(max_rm.get(s, -1), int(self.pos[i]))
            self.seq[i] = False
            self.pos[i] = -1
        self.pos[idx_t] = pos_t
        self.seq[idx_t, sid_t] = True
        purged = []
        for s, m in sorted(max_rm.items()):  # "all positions between [pos_min, pos_max] stay present"
            pmin = self.seq_pos_min(s)
            if 0 <= pmin <= m:
                p = CellsKV.seq_rm(self, s, pmin, m + 1)["pos"]
                if p and p != "-":
                    purged.append(f"seq {s}: {p}")
        self.head = idx[-1] + 1 if idx else self.head
        return ranges_text(reused), "; ".join(purged) or "-"

    def pool_record(self, inp: CellsInputs | None, max_cells: int = 4096) -> dict[str, Any]:
        """The pool as a trace shows it: ``size``, ``head``, ``used``, ``n_kv``, the step's cells
        (``k_idxs_swa``), cells reused and positions purged, and per used cell its pos / seq_ids
        (at most ``max_cells``)."""
        used_idx = (self.pos >= 0).nonzero().flatten().tolist()
        d: dict[str, Any] = {"size": self.size, "head": self.head, "used": len(used_idx), "n_kv": self.n_kv(),
                             "cells": [{"cell": i, "pos": int(self.pos[i]), "seq_ids": self.seq[i].nonzero().flatten().tolist()}
                                       for i in used_idx[:max_cells]]}
        if inp is not None:
            d.update({"k_idxs": ranges_text(inp.cell_idx.tolist()), "head_before": inp.head_before,
                      "head_after": inp.head_after, **_reuse(inp)})
        return d


@dataclass
class IswaInputs(CellsInputs):
    """:class:`~infertrace.kv.base.CellsInputs` of the base pool plus ``swa``: the SWA pool's inputs
    (its ``cell_idx`` = ``k_idxs_swa``, ``n_kv``, ``kq_mask_swa`` ``[1, 1, n_pad, n_kv_swa]``,
    ``cell_pos`` / ``cell_seq``, ``head_before`` / ``head_after``)."""

    swa: CellsInputs | None = field(default=None, kw_only=True)

    def mask(self, swa: bool = False) -> torch.Tensor:
        """``kq_mask_swa`` over the SWA pool when ``swa``, else ``kq_mask`` over the base pool."""
        return self.swa.kq_mask_swa if (swa and self.swa is not None) else self.kq_mask


def _combine(name: str, a: MemOp, b: MemOp) -> MemOp:
    """One answer for an operation done on both pools (llama.cpp: ``res & kv_base->op() & kv_swa->op()``)."""
    if not a.ok or not b.ok:
        return a if not a.ok else b
    return MemOp({**a, "swa_pool": dict(b)})


class IswaCellsKV(CellsKV):
    """llama.cpp's ``llama_kv_cache_iswa`` (module docstring): this object is the base pool
    (:class:`CellsKV`, ``size`` cells, read by the full-attention layers) and ``self.swa`` the SWA pool
    (:class:`SwaCellsPool`, :func:`swa_pool_size` cells, read by the windowed layers).

    Args:
        n_layer, n_kv_heads, head_dim, size, n_seq_max, dtype, device, windows: as :class:`CellsKV`
            (at least one windowed layer).
        n_ubatch: tokens per ubatch (llama.cpp ``n_ubatch``; the engine's ``min(max_batch_tokens, ctx_size)``).
        swa_full: llama.cpp ``swa_full`` (the SWA pool as large as the base pool).

    Raises:
        InfertraceError: no windowed layer; bad sizes (:func:`swa_pool_size`).
    """

    layout = "cells_iswa"  # what the views read (infertrace.capture.kv_views): the base pool and the SWA pool

    def __init__(self, n_layer: int, n_kv_heads: int, head_dim: int, size: int, n_seq_max: int = 64,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", windows: Sequence[int] | None = None,
                 n_ubatch: int = 512, swa_full: bool = False):
        super().__init__(n_layer, n_kv_heads, head_dim, size, n_seq_max, dtype, device, windows)
        if not self.n_swa:
            raise InfertraceError("the iSWA cache needs at least one sliding-window layer; use the plain cells cache")
        self.swa_full = bool(swa_full)
        self.n_ubatch = int(n_ubatch)
        self.swa = SwaCellsPool(n_layer, n_kv_heads, head_dim, swa_pool_size(size, self.n_swa, n_seq_max, n_ubatch, swa_full),
                                n_seq_max, dtype, device, self.windows)
        # the SWA pool stores the windowed layers only (llama.cpp's filter_swa); the global layers' slots point at
        # one shared scratch pair the sequence operations may rotate or move but nothing reads
        glob = [il for il, w in enumerate(self.windows) if not w]
        if glob:
            sk, sv = self.swa.k[glob[0]], self.swa.v[glob[0]]  # [size_swa, n_kv_heads, hd] each
            for il in glob:
                self.swa.k[il], self.swa.v[il] = sk, sv

    # --- per step --------------------------------------------------------------------------------
    def can_fit(self, plan: list[tuple[int, int]]) -> bool:
        """Both pools can place the plan (base: free cells; SWA: empty or reusable cells)."""
        return super().can_fit(plan) and self.swa.can_fit(plan)

    def prepare(self, chunks: Sequence[ChunkSpec]) -> IswaInputs:
        """Place the ubatch in both pools (``kv_base->prepare``, ``kv_swa->prepare``) and build
        ``kq_mask`` (base) and ``kq_mask_swa`` (SWA pool). Returns :class:`IswaInputs`."""
        if not self.swa.can_fit([(0, sum(c.T for c in chunks))]):  # fail before touching either pool
            self.swa.find_slot(sum(c.T for c in chunks))
        base = super().prepare(chunks)
        swa = self.swa.prepare(chunks)
        inp = IswaInputs(**{f.name: getattr(base, f.name) for f in fields(base)}, swa=swa)
        inp.kq_mask_swa = swa.kq_mask_swa  # the windowed layers' mask is the SWA pool's
        return inp

    def pool_for(self, layer: int, inp: Any) -> tuple[CellsKV, Any]:
        """The pool layer ``layer`` reads and its inputs: ``(self.swa, inp.swa)`` for a windowed layer,
        else ``(self, inp)``."""
        if self.windows[layer] and isinstance(inp, IswaInputs) and inp.swa is not None:
            return self.swa, inp.swa
        return self, inp

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, inp: CellsInputs) -> None:
        """``cpy_k``/``cpy_v`` into the layer's pool; a windowed layer's K/V also into the base pool's
        storage (kept for :meth:`read`, never read by attention)."""
        super().write(layer, k, v, inp)
        pool, pinp = self.pool_for(layer, inp)
        if pool is not self:
            pool.write(layer, k, v, pinp)

    def attend(self, layer: int, q: torch.Tensor, inp: CellsInputs, scale: float) -> torch.Tensor:
        """Attention over the layer's pool: ``kq_mask_swa`` over the SWA pool's ``n_kv_swa`` cells for a
        windowed layer, ``kq_mask`` over the base pool otherwise."""
        pool, pinp = self.pool_for(layer, inp)
        if pool is self:
            return super().attend(layer, q, inp, scale)
        return pool.attend(layer, q, pinp, scale)

    def logical_mask(self, inp: CellsInputs, swa: bool = False) -> list[torch.Tensor]:
        """As :meth:`CellsKV.logical_mask`; ``swa``: read back from ``kq_mask_swa`` over the SWA pool."""
        if swa and isinstance(inp, IswaInputs) and inp.swa is not None:
            return self.swa.logical_mask(inp.swa, True)
        return super().logical_mask(inp, swa)

    def release(self, seq_id: int) -> None:
        """``seq_rm(seq_id, -1, -1)`` on both pools."""
        super().release(seq_id)
        self.swa.release(seq_id)

    # --- sequence operations: both pools (llama_kv_cache_iswa::seq_*) --------------------------------
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> MemOp:
        return _combine("seq_rm", super().seq_rm(seq_id, p0, p1), self.swa.seq_rm(seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> MemOp:
        return _combine("seq_cp", super().seq_cp(src, dst, p0, p1), self.swa.seq_cp(src, dst, p0, p1))

    def seq_keep(self, seq_id: int) -> MemOp:
        return _combine("seq_keep", super().seq_keep(seq_id), self.swa.seq_keep(seq_id))

    def _can_shift(self, op: str) -> MemOp | None:
        if self.swa.size != self.size:  # llama_kv_cache_iswa::get_can_shift
            return MemOp.refused(op, f"{op} needs a K-shift, which llama.cpp's iSWA cache refuses when the SWA pool "
                                     f"({self.swa.size} cells) is smaller than the base pool ({self.size}); raise "
                                     "--max-batch-tokens or lower --ctx-size so both pools have one size")
        return None

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int, ropes: Sequence[Any]) -> MemOp:
        """``seq_add`` on both pools (refused unless both pools have one size, as llama.cpp)."""
        return self._can_shift("seq_add") or _combine("seq_add", super().seq_add(seq_id, p0, p1, delta, ropes),
                                                      self.swa.seq_add(seq_id, p0, p1, delta, ropes))

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int, ropes: Sequence[Any]) -> MemOp:
        """``seq_div`` on both pools (refused unless both pools have one size, as llama.cpp)."""
        return self._can_shift("seq_div") or _combine("seq_div", super().seq_div(seq_id, p0, p1, d, ropes),
                                                      self.swa.seq_div(seq_id, p0, p1, d, ropes))

    def shift_out(self, seq_id: int, p0: int, p1: int, ropes: Sequence[Any]) -> MemOp:
        """Context shift on both pools (refused unless both pools have one size, as llama.cpp)."""
        return self._can_shift("shift_out") or _combine("shift_out", super().shift_out(seq_id, p0, p1, ropes),
                                                        self.swa.shift_out(seq_id, p0, p1, ropes))

    def seq_pos_min(self, seq_id: int) -> int:
        """``llama_kv_cache_iswa::seq_pos_min``: the SWA pool's (the base pool holds a superset)."""
        return self.swa.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """``llama_kv_cache_iswa::seq_pos_max``: the SWA pool's."""
        return self.swa.seq_pos_max(seq_id)

    def rewind(self, seq_id: int, C: int, T: int, accepted: Sequence[int], inp: CellsInputs, row: int,
               is_chain: bool) -> MemOp:
        """Speculative rollback in both pools (each with the cells its rows went to)."""
        a = self.rewind_cells(seq_id, C, T, accepted, inp.cell_idx[row : row + T], is_chain)
        sinp = inp.swa if isinstance(inp, IswaInputs) and inp.swa is not None else inp
        b = self.swa.rewind_cells(seq_id, C, T, accepted, sinp.cell_idx[row : row + T], is_chain)
        return _combine("rewind", a, b)

    def defrag(self) -> MemOp:
        """Defragmentation of both pools."""
        return _combine("defrag", super().defrag(), self.swa.defrag())

    # --- description ----------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """:meth:`CellsKV.describe` plus ``swa_pool_size`` and ``swa_full``."""
        d = super().describe()
        d.update({"swa_pool_size": self.swa.size, "swa_full": self.swa_full})
        return d

    def snapshot(self) -> dict[str, Any]:
        """:meth:`CellsKV.snapshot` (the base pool) plus ``swa_pool``: :meth:`SwaCellsPool.pool_record`."""
        snap = super().snapshot()
        snap["swa_pool"] = self.swa.pool_record(None)
        return snap
