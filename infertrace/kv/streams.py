"""llama.cpp's non-unified KV cache (``kv_unified = false``): one cell stream per sequence.

Mirrors llama.cpp ``src/llama-kv-cache.cpp`` / ``llama-kv-cache.h`` (``llama_kv_cache`` with
``n_stream = unified ? 1 : n_seq_max``):

* ``n_stream = n_seq_max`` streams, each with its own cells (``v_cells[s]``: ``pos`` and a seq_id
  set), its own ``head`` (``v_heads[s]``) and ``used``; ``seq_to_stream[s] = s``. Every stream
  holds ``kv_size`` cells (llama.cpp ``n_ctx_seq = pad256(pad256(n_ctx) / n_seq_max)``: :func:`n_ctx_seq`);
  K/V are one tensor ``ne = [n_embd_gqa, kv_size, n_stream]`` per layer, addressed by global row
  ``stream * kv_size + cell`` (``set_input_k_idxs``: ``offs = strm * get_size()``);
* a ubatch is cut by ``split_equal(n_ubatch, sequential = true)`` (``init_batch``): consecutive
  seq_ids (``seq_id == last + 1``), the same number of tokens each, grouped per sequence
  (``n_tps = n_tokens / n_seqs``); ``find_slot`` searches each sequence's own stream from its head;
* ``n_kv`` (``get_n_kv``) is the largest padded ``used_max_p1`` over the ubatch's streams;
* ``kq_mask``: ggml ``ne = [n_kv, n_tps, 1, n_stream_ubatch]`` (torch ``[ns, 1, n_tps, n_kv]``),
  row ``ii`` of stream block ``s`` is token ``s * n_tps + ii`` over the cells of stream ``s``
  (``set_input_kq_mask_impl``); attention reads the streams ``s0..s1`` of the ubatch as a 4-D view
  (``get_k``: ``ne = [hd, n_head_kv, n_kv, ns]``), so a query only ever meets its own stream;
* sequence operations act on the sequence's stream (``seq_rm``, ``seq_add``, ``seq_div``,
  ``seq_keep``: only the stream of ``seq_id`` is touched); ``seq_cp`` across streams copies the
  whole stream (``v_cells[dst]`` reset, ``src``'s cells set at the same indices with owner
  ``dst``, ``v_heads[dst] = v_heads[src]``, and the K/V buffers of every layer copied by
  ``update`` / ``ggml_backend_tensor_copy``) and only for the full range: llama.cpp aborts
  (``GGML_ASSERT(is_full && "seq_cp() is only supported for full KV buffers")``), here it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from infertrace.attention.reference import attention_with_kq_mask
from infertrace.errors import ConfigError, InfertraceError
from infertrace.kv.base import CellsInputs, ChunkSpec, MemOp, MemoryDefaults, ranges_text
from infertrace.kv.cells import CellsKV

_NEG = float("-inf")


def n_ctx_seq(ctx_size: int, n_seq_max: int) -> int:
    """Cells per stream of a non-unified cache, as llama.cpp sets them (``llama_context`` constructor,
    ``src/llama-context.cpp``): ``n_ctx = GGML_PAD(n_ctx, 256)``, then
    ``n_ctx_seq = GGML_PAD(n_ctx / n_seq_max, 256)`` (integer division), e.g. 600 tokens over
    2 sequences -> 768 -> 384 -> 512 cells per stream.

    Args:
        ctx_size: ``--ctx-size`` in tokens; n_seq_max: sequences = streams.

    Returns:
        cells per stream (a multiple of 256; 0 only when ``ctx_size`` is 0).
    """
    pad = lambda x: -(-x // 256) * 256  # noqa: E731  GGML_PAD(x, 256)
    return pad(pad(ctx_size) // max(1, n_seq_max))


def split_equal_chunks(seq_ids: Sequence[int], lengths: Sequence[int]) -> tuple[list[int], int]:
    """The first ubatch llama.cpp's ``llama_batch_allocr::split_equal(n_ubatch, sequential=true)``
    makes of a batch whose chunks (packed order) belong to ``seq_ids`` with ``lengths`` tokens.

    Returns:
        ``(chunk indices kept, n_tps)``: the chunks of consecutive seq_ids starting with the first
        (``batch.seq_id[i][0] == last_seq_id + 1``), each cut to ``n_tps`` = the shortest of them
        (``can_expand`` stops at the first sequence without a token left).
    """
    keep: list[int] = []
    last = None
    for i, s in enumerate(seq_ids):
        if last is None or s == last + 1:
            keep.append(i)
            last = s
    return keep, (min(lengths[i] for i in keep) if keep else 0)


@dataclass
class StreamsInputs(CellsInputs):
    """Cells inputs of a non-unified cache (:class:`CellsStreamsKV`): ``streams`` the ubatch's
    streams ``s0..s1`` (llama.cpp ``slot_info::strm``), ``n_stream`` of the cache, ``n_tps`` tokens per
    stream; ``cell_idx`` ``[N]`` the global rows ``stream * stream_size + cell`` (``k_idxs``),
    ``cell_local`` ``[N]`` the cell inside the stream; ``kq_mask`` ``[ns, 1, n_tps, n_kv]`` float32
    (ggml ``ne = [n_kv, n_tps, 1, ns]``), ``cell_pos`` ``[ns, n_kv]`` / ``cell_seq`` ``[ns, n_kv, n_seq_max]``
    of each stream when the mask was filled; ``head_before`` / ``head_after``: one per ubatch stream."""

    head_before: list[int] = field(kw_only=True)  # type: ignore[assignment]
    head_after: list[int] = field(kw_only=True)  # type: ignore[assignment]
    streams: list[int] = field(kw_only=True)
    n_stream: int = field(kw_only=True)
    n_tps: int = field(kw_only=True)
    stream_size: int = field(kw_only=True)
    cell_local: torch.Tensor = field(kw_only=True)

    @property
    def ne(self) -> list[int]:
        """ggml ``ne`` of ``kq_mask``: ``[n_kv, n_tps, 1, n_stream of the ubatch]``."""
        return [self.n_kv, self.n_tps, 1, len(self.streams)]

    def flat_mask(self, swa: bool = False) -> torch.Tensor:
        """``[N, n_kv]``: the stream blocks of the mask stacked in packed order (row i = token i)."""
        m = self.mask(swa)  # [ns, 1, n_tps, n_kv]
        return m[:, 0].reshape(-1, m.shape[-1])[: self.n_tokens]  # [N, n_kv]

    def verify_record(self, chunk_index: int, row: int, T: int) -> dict[str, Any]:
        """Never answered: speculative decoding is refused with ``--kv-unified off`` before a run starts.

        Raises:
            InfertraceError: always (a guard if a caller reaches it).
        """
        raise InfertraceError("speculative decoding is not implemented with --kv-unified off")


class CellsStreamsKV(MemoryDefaults):
    """llama.cpp's non-unified cell cache (the :class:`~infertrace.kv.base.Memory` protocol): ``n_seq_max``
    streams of ``size`` cells, stream ``s`` owned by sequence ``s`` (``seq_to_stream``).

    Args:
        n_layer, n_kv_heads, head_dim: model shape.
        size: cells per stream (llama.cpp ``n_ctx_seq``).
        n_seq_max: sequences = streams (``n_stream``).
        dtype, device: K/V storage; windows: per layer sliding window (0 = full).

    Storage: stream ``s`` is a :class:`~infertrace.kv.cells.CellsKV` of ``size`` cells
    (``k[layer]`` ``[size, n_kv_heads, head_dim]``), llama.cpp's ``k_stream[s]`` views.

    Raises:
        InfertraceError: fewer than 2 sequences (a single stream is the unified cache).
    """

    kind = "cells"
    layout = "cells_streams"  # what the views read (infertrace.capture.kv_views)

    def __init__(self, n_layer: int, n_kv_heads: int, head_dim: int, size: int, n_seq_max: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", windows: Sequence[int] | None = None):
        if n_seq_max < 1:
            raise ConfigError("cache.n_seq_max", f"must be >= 1 (got {n_seq_max})")
        if size < 1:
            raise ConfigError("cache.ctx_size", f"leaves no cell per stream for {n_seq_max} streams (kv_unified off); raise it")
        self.n_stream = self.n_seq_max = n_seq_max
        self.size = size
        self.capacity_tokens = size  # what one sequence can hold: its stream
        self.streams = [CellsKV(n_layer, n_kv_heads, head_dim, size, n_seq_max, dtype, device, windows) for _ in range(n_seq_max)]
        self.n_layer, self.kv_layers = n_layer, list(range(n_layer))
        self.windows, self.n_swa = self.streams[0].windows, self.streams[0].n_swa
        self.device, self.attn_impl = device, "torch"

    # --- bookkeeping -------------------------------------------------------------
    def stream_of(self, seq_id: int) -> CellsKV:
        """The stream of ``seq_id`` (``seq_to_stream[seq_id] = seq_id``).

        Raises:
            InfertraceError: ``seq_id`` outside ``0..n_seq_max-1``.
        """
        if not 0 <= seq_id < self.n_stream:
            raise InfertraceError(f"seq_id {seq_id} out of range: the non-unified cache has {self.n_stream} streams (n_seq_max)")
        return self.streams[seq_id]

    @property
    def used(self) -> int:
        """Used cells over all streams."""
        return sum(s.used for s in self.streams)

    def n_kv(self) -> int:
        """``n_kv`` of the last ubatch (what the graph read: the largest of its streams'); before any,
        the largest of every stream."""
        last = getattr(self, "_ubatch_n_kv", None)
        return last if last is not None else max(s.n_kv() for s in self.streams)

    def seq_len(self, seq_id: int) -> int:
        return self.stream_of(seq_id).seq_len(seq_id)

    def can_fit(self, plan: list[tuple[int, int]]) -> bool:
        """Whether every ``(seq_id, n_new)`` fits in its own stream's free cells."""
        need: dict[int, int] = {}
        for sid, n in plan:
            need[sid] = need.get(sid, 0) + n
        return all(0 <= sid < self.n_stream and self.streams[sid].size - self.streams[sid].used >= n for sid, n in need.items())

    # --- per step ----------------------------------------------------------------
    def prepare(self, chunks: Sequence[ChunkSpec]) -> StreamsInputs:
        """Place a ubatch (chunks of consecutive seq_ids, equal T: llama.cpp ``split_equal``) in each
        sequence's stream and fill ``kq_mask`` ``[ns, 1, n_tps, n_kv]``.

        Raises:
            InfertraceError: the chunks are not one ``split_equal`` ubatch, a draft tree, or a stream is full.
        """
        chunks = list(chunks)
        sids = [c.seq_id for c in chunks]
        keep, n_tps = split_equal_chunks(sids, [c.T for c in chunks])
        if len(keep) != len(chunks) or any(c.T != n_tps for c in chunks):
            raise InfertraceError(f"--kv-unified off: a ubatch must hold consecutive seq_ids with equal token counts "
                                  f"(llama.cpp split_equal); got seq_ids {sids} with T {[c.T for c in chunks]}")
        if any(c.parents is not None for c in chunks):
            raise InfertraceError("speculative decoding is not implemented with --kv-unified off")
        positions, local, glob, heads_b, heads_a = [], [], [], [], []
        for c in chunks:
            st = self.stream_of(c.seq_id)
            heads_b.append(st.head)
            pos = list(range(c.C, c.C + c.T))
            idx = st.find_slot(c.T)  # this stream only, from its head (llama_kv_cache::find_slot)
            st.occupy(idx, pos, c.seq_id)  # apply_ubatch: head = idxs.back() + 1 (may equal size: wraps next search)
            heads_a.append(st.head)
            positions += pos
            local += idx
            glob += [c.seq_id * self.size + i for i in idx]  # set_input_k_idxs: strm * kv_size + idx
        ns = len(chunks)
        pos_t = torch.tensor(positions, dtype=torch.int64)  # [N]
        sid_t = torch.tensor([c.seq_id for c in chunks for _ in range(c.T)], dtype=torch.int64)  # [N]
        n_kv = max(self.streams[s].n_kv() for s in sids)  # get_n_kv: max over the ubatch's streams
        self._ubatch_n_kv = n_kv
        mask = torch.full((ns, 1, n_tps, n_kv), _NEG)  # ne = [n_kv, n_tps, 1, ns]
        mask_swa = torch.full((ns, 1, n_tps, n_kv), _NEG) if self.n_swa else None
        cell_pos = torch.full((ns, n_kv), -1, dtype=torch.int64)  # [ns, n_kv]
        cell_seq = torch.zeros(ns, n_kv, self.n_seq_max, dtype=torch.bool)  # [ns, n_kv, n_seq_max]
        for j, c in enumerate(chunks):
            st = self.streams[c.seq_id]
            p = pos_t[j * n_tps : (j + 1) * n_tps]  # [n_tps]
            cp, cs = st.pos[:n_kv], st.seq[:n_kv]  # [n_kv], [n_kv, n_seq_max]
            keep_m = cs[:, c.seq_id].unsqueeze(0) & (cp >= 0).unsqueeze(0) & (cp.unsqueeze(0) <= p.unsqueeze(1))  # [n_tps, n_kv]
            mask[j, 0] = torch.where(keep_m, 0.0, _NEG)
            if mask_swa is not None:
                in_win = (p.unsqueeze(1) - cp.unsqueeze(0)) < self.n_swa  # [n_tps, n_kv] not is_masked_swa
                mask_swa[j, 0] = torch.where(keep_m & in_win, 0.0, _NEG)
            cell_pos[j], cell_seq[j] = cp, cs
        inp = StreamsInputs(chunks, pos_t, sid_t, self.kind, cell_idx=torch.tensor(glob, dtype=torch.int64), n_kv=n_kv,
                            kq_mask=mask, n_tokens_pad=n_tps, head_before=heads_b, head_after=heads_a, cell_pos=cell_pos,
                            cell_seq=cell_seq, streams=sids, n_stream=self.n_stream, n_tps=n_tps, stream_size=self.size,
                            cell_local=torch.tensor(local, dtype=torch.int64))
        if mask_swa is not None:
            inp.kq_mask_swa, inp.n_swa = mask_swa, self.n_swa
            inp.swa_layers = [i for i, w in enumerate(self.windows) if w]
        return inp

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, inp: StreamsInputs) -> None:
        """Copy current K/V ``[N, n_kv_heads, hd]`` into each token's stream and cell (``cpy_k`` /
        ``cpy_v`` with the global ``k_idxs``)."""
        t = inp.n_tps
        for j, s in enumerate(inp.streams):
            st, idx = self.streams[s], inp.cell_local[j * t : (j + 1) * t]
            st.k[layer][idx] = k[j * t : (j + 1) * t].to(st.k[layer].dtype)
            st.v[layer][idx] = v[j * t : (j + 1) * t].to(st.v[layer].dtype)

    def attend(self, layer: int, q: torch.Tensor, inp: StreamsInputs, scale: float) -> torch.Tensor:
        """Per ubatch stream: its ``n_tps`` queries ``[n_tps, n_head, hd]`` over its own cells
        ``0..n_kv-1`` with its block of ``kq_mask`` (``kq_mask_swa`` on windowed layers)."""
        t, n_kv = inp.n_tps, inp.n_kv
        m = inp.mask(bool(self.windows[layer]))  # [ns, 1, n_tps, n_kv]
        out = [attention_with_kq_mask(q[j * t : (j + 1) * t], self.streams[s].k[layer][:n_kv], self.streams[s].v[layer][:n_kv],
                                      m[j, 0].to(q.device), scale) for j, s in enumerate(inp.streams)]  # [n_tps, n_head, hd] each
        return torch.cat(out)  # [N, n_head, hd]

    def release(self, seq_id: int) -> None:
        """``seq_rm(seq_id, -1, -1)`` in the sequence's stream."""
        self.stream_of(seq_id).release(seq_id)

    # --- sequence operations (llama_kv_cache::seq_* with seq_to_stream) -------------------------------
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> MemOp:
        """``llama_kv_cache::seq_rm``: in ``seq_id``'s stream; ``seq_id < 0``: every stream."""
        if seq_id >= 0:
            return MemOp({**self.stream_of(seq_id).seq_rm(seq_id, p0, p1), "stream": seq_id})
        ops = [st.seq_rm(-1, p0, p1) for st in self.streams]
        return MemOp({"op": "seq_rm", "seq_id": seq_id, "range": ops[0]["range"],
                      "streams": [{"stream": s, "cells": o["cells"], "freed": o["freed"]} for s, o in enumerate(ops) if o["cells"] != "-"]})

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> MemOp:
        """``llama_kv_cache::seq_cp`` across streams: ``dst``'s stream becomes a copy of ``src``'s
        (cells reset, ``src``'s cells at the same indices owned by ``dst``, head copied, every layer's
        K/V copied); refused for a partial range (llama.cpp aborts: full KV buffers only)."""
        a, b = self.stream_of(src), self.stream_of(dst)
        if src == dst:  # same stream: llama.cpp returns without a change
            return MemOp({"op": "seq_cp", "src": src, "dst": dst, "cells": "-", "pos": "-"})
        full = not (0 < p0 and p0 + 1 < self.size) and not (0 < p1 and p1 + 1 < self.size)
        if not full:
            return MemOp.refused("seq_cp", f"seq_cp of a part [{p0}, {p1}) of seq {src} into seq {dst} across streams: llama.cpp "
                                 "copies whole streams only (GGML_ASSERT is_full: 'seq_cp() is only supported for full KV "
                                 "buffers'); use --kv-unified on or copy the whole sequence (p0 = p1 = -1)", src=src, dst=dst)
        idx = b.copy_from(a, src, dst)  # [M] the source cells; update(): ggml_backend_tensor_copy(k_stream[src], k_stream[dst])
        return MemOp({"op": "seq_cp", "src": src, "dst": dst, "stream_copy": [src, dst], "cells": ranges_text(idx.tolist()),
                      "pos": ranges_text(a.pos[idx].tolist())})

    def seq_keep(self, seq_id: int) -> MemOp:
        """``llama_kv_cache::seq_keep``: only ``seq_id``'s stream is touched (other streams keep theirs)."""
        return MemOp({**self.stream_of(seq_id).seq_keep(seq_id), "stream": seq_id})

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int, ropes: Sequence[Any]) -> MemOp:
        """llama.cpp ``seq_add`` in ``seq_id``'s stream (K re-rotated per layer)."""
        return self.stream_of(seq_id).seq_add(seq_id, p0, p1, delta, ropes)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int, ropes: Sequence[Any]) -> MemOp:
        """llama.cpp ``seq_div`` in ``seq_id``'s stream."""
        return self.stream_of(seq_id).seq_div(seq_id, p0, p1, d, ropes)

    def seq_pos_min(self, seq_id: int) -> int:
        return self.stream_of(seq_id).seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.stream_of(seq_id).seq_pos_max(seq_id)

    def shift_out(self, seq_id: int, p0: int, p1: int, ropes: Sequence[Any]) -> MemOp:
        return self.stream_of(seq_id).shift_out(seq_id, p0, p1, ropes)

    def rewind(self, seq_id: int, C: int, T: int, accepted: Sequence[int], inp: StreamsInputs, row: int,
               is_chain: bool) -> MemOp:
        """Speculative rollback in the sequence's stream (cells of rows ``row..row+T-1``)."""
        return self.stream_of(seq_id).rewind_cells(seq_id, C, T, accepted, inp.cell_local[row : row + T], is_chain)

    def defrag(self) -> MemOp:
        """Defragment every stream."""
        return MemOp({"op": "defrag", "streams": [dict(st.defrag()) for st in self.streams]})

    # --- description ---------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """As :meth:`CellsKV.describe`, ``physical_shape`` ``[n_stream * size, n_kv_heads, head_dim]`` (the
        global rows ``k_idxs`` address), plus ``n_stream`` and ``stream_size``."""
        d = self.streams[0].describe()
        d.update({"physical_shape": [self.n_stream * self.size, *d["physical_shape"][1:]], "n_stream": self.n_stream,
                  "stream_size": self.size})
        return d

    # --- state read ----------------------------------------------------------------
    def cells_of(self, seq_id: int) -> list[tuple[int, int]]:
        """``[(global cell row, pos)]`` of ``seq_id``, ordered by pos."""
        return [(seq_id * self.size + c, p) for c, p in self.stream_of(seq_id).cells_of(seq_id)]

    def read(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.stream_of(seq_id).read(layer, seq_id)  # [L, n_kv_heads, hd] each

    def logical_mask(self, inp: StreamsInputs, swa: bool = False) -> list[torch.Tensor]:
        """Per chunk, bool ``[T, C+T]`` read back from its stream's block of the mask (an extra last
        column flags a visible cell its sequence does not own, as :meth:`CellsKV.logical_mask`)."""
        m = inp.mask(swa)  # [ns, 1, n_tps, n_kv]
        out = []
        for j, c in enumerate(inp.chunks):
            keep = m[j, 0, : c.T, : inp.n_kv] == 0  # [T, n_kv]
            lg = torch.zeros(c.T, c.C + c.T, dtype=torch.bool)
            cp = inp.cell_pos[j]
            for cell in range(inp.n_kv):
                p = int(cp[cell])
                if 0 <= p < c.C + c.T:
                    lg[:, p] |= keep[:, cell]
            leak = keep & ~inp.cell_seq[j, :, c.seq_id].unsqueeze(0)
            if bool(leak.any()):
                lg = torch.cat([lg, leak.any(dim=1, keepdim=True)], dim=1)
            out.append(lg)
        return out

    def snapshot(self) -> dict[str, Any]:
        """The cell map over the global rows (``stream * size + cell``), with ``n_stream``,
        ``stream_size`` and per stream ``{"stream", "head", "used", "used_max_p1", "n_kv", "seq_ids"}``."""
        cells, seqs, per = [], {}, []
        for s, st in enumerate(self.streams):
            snap = st.snapshot()
            cells += [{**c, "cell": c["cell"] + s * self.size} for c in snap["cells"]]
            for sid, v in snap["seqs"].items():
                seqs[sid] = {"cells": ranges_text([c for c, _ in self.cells_of(int(sid))]), "pos": v["pos"]}
            per.append({"stream": s, "head": st.head, "used": st.used, "used_max_p1": st.used_max_p1(), "n_kv": st.n_kv(),
                        "seq_ids": sorted(int(x) for x in snap["seqs"])})
        return {"kind": self.kind, "size": self.n_stream * self.size, "used": len(cells), "n_kv": self.n_kv(),
                "n_swa": self.n_swa, "swa_layers": [i for i, w in enumerate(self.windows) if w], "cells": cells,
                "seqs": seqs, "n_stream": self.n_stream, "stream_size": self.size, "streams": per}
