"""``run --runtime llama.cpp --kv-unified off``: llama.cpp's non-unified cache (``kv_unified = false``,
one stream per sequence) read back at run time into the shape of :class:`~infertrace.kv.streams.CellsStreamsKV`.

What is read, per ``llama_decode`` (one ubatch: the scheduler hands llama.cpp one ``split_equal``
ubatch per step, see :mod:`infertrace.kv.streams`):

* ``attn_inp_k_idxs`` I64 ``[N]``: the global row ``stream * n_ctx_seq + cell`` of every token
  (``llama_kv_cache::set_input_k_idxs``); stream and cell are split from it and applied to the
  streams' cells (``apply_ubatch``: head of each stream = its last cell + 1);
* ``attn_inp_kq_mask`` ``ne = [n_kv, n_tps, 1, n_stream of the ubatch]`` (F16 with flash attention);
* ``cache_k_l{il} (reshaped) (view)``: the ``ggml_set_rows`` result over the streams merged into
  ``[n_embd_gqa, n_ctx_seq * n_stream]`` (``cpy_k``), read at the written rows;
* ``llama_memory_seq_pos_min/max`` per sequence, checked against the cells every step.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from infertrace.errors import InfertraceError
from infertrace.kv.base import ChunkSpec
from infertrace.kv.streams import CellsStreamsKV, StreamsInputs, split_equal_chunks
from infertrace.runtimes.llamacpp.capture import Captured
from infertrace.runtimes.llamacpp.native import add_native
from infertrace.runtimes.readback import ReadBack


class LlamaCppStreamsKV(ReadBack):
    """llama.cpp's non-unified cache as read back (placement never chosen here; K/V of layer ``layer``
    only, as llama.cpp stored it, F16).

    Not a subclass of our memory: it holds a :class:`~infertrace.kv.streams.CellsStreamsKV` mirror
    (:attr:`mirror`: one ``cells`` stream of ``n_ctx_seq`` cells per sequence, one K/V storage each for the
    captured layer) and implements what the engine drives in a llama.cpp run (``prepare``, ``can_fit``,
    ``capacity_tokens``, ``release``, ``seq_len``) and what the recorder's probe reads (``kind``, ``layout``,
    ``logical_mask``, ``read``, ``holds_values``, ``describe``, ``snapshot``, ``recurrent_state``).

    Args:
        cfg: model config; lctx: the :class:`~infertrace.runtimes.llamacpp.capture.LlamaCppContext`
            (created with ``kv_unified=False``); n_seq_max: its streams; layer: the captured layer;
        to_neox: ``[..., hd]`` GGUF adjacent-pair order -> half-split order
            (:func:`infertrace.runtimes.llamacpp.engine.norm_to_neox`, passed in: engine.py imports this module).
    """

    kind = "cells"
    runtime = "llama.cpp"
    layout = "cells_streams"  # what the views read (infertrace.capture.kv_views)

    def __init__(self, cfg: Any, lctx: Any, n_seq_max: int, layer: int, to_neox: Callable[[np.ndarray], np.ndarray]):
        self.mirror = CellsStreamsKV(1, cfg.n_head_kv, cfg.head_dim, lctx.n_ctx_seq, n_seq_max, torch.float16, "cpu")
        self.n_layer = cfg.n_layer  # llama.cpp caches every layer; the mirror stores the captured one
        self.lctx, self.layer, self.cfg, self.to_neox = lctx, layer, cfg, to_neox
        self._n_kv: int | None = None
        self._memory_seq_pos: dict[str, list[int]] = {}
        self.notes: list[str] = []

    # --- what the engine drives and the probe reads, answered by the mirror -------------------------
    @property
    def streams(self) -> list[Any]:
        """The mirror's streams (``streams[s]``: a ``cells`` memory owned by sequence ``s``)."""
        return self.mirror.streams

    @property
    def size(self) -> int:
        """Cells per stream (llama.cpp ``n_ctx_seq``)."""
        return self.mirror.size

    @property
    def n_stream(self) -> int:
        """Streams (llama.cpp ``n_seq_max``)."""
        return self.mirror.n_stream

    def stream_of(self, seq_id: int) -> Any:
        """The stream of ``seq_id`` (``seq_to_stream[seq_id] = seq_id``).

        Raises:
            InfertraceError: ``seq_id`` outside ``0..n_seq_max-1``.
        """
        return self.mirror.stream_of(seq_id)

    def cells_of(self, seq_id: int) -> list[tuple[int, int]]:
        """``[(global cell row, pos)]`` of ``seq_id``, ordered by pos."""
        return self.mirror.cells_of(seq_id)

    def prepare(self, chunks: Sequence[ChunkSpec]) -> StreamsInputs:
        """Pack positions and seq_ids; the rest is filled by :meth:`after_decode` from llama.cpp's graph.

        Raises:
            InfertraceError: the chunks are not one ``split_equal`` ubatch (llama.cpp would split them).
        """
        chunks = list(chunks)
        keep, n_tps = split_equal_chunks([c.seq_id for c in chunks], [c.T for c in chunks])
        if len(keep) != len(chunks) or any(c.T != n_tps for c in chunks):
            raise InfertraceError("--kv-unified off: a llama_decode here must be one split_equal ubatch (consecutive "
                                  f"seq_ids, equal T); got {[(c.seq_id, c.T) for c in chunks]}")
        for c in chunks:
            self.stream_of(c.seq_id)
        none = torch.zeros(0, dtype=torch.int64)
        return StreamsInputs(chunks, torch.tensor([c.C + i for c in chunks for i in range(c.T)], dtype=torch.int64),
                             torch.tensor([c.seq_id for c in chunks for _ in range(c.T)], dtype=torch.int64), self.kind,
                             cell_idx=none, n_kv=0, kq_mask=torch.zeros(len(chunks), 1, 0, 0), n_tokens_pad=n_tps,
                             head_before=[], head_after=[], cell_pos=none, cell_seq=none, streams=[c.seq_id for c in chunks],
                             n_stream=self.n_stream, n_tps=n_tps, stream_size=self.size, cell_local=none)

    def after_decode(self, inp: StreamsInputs, cap: Captured, step: int) -> None:
        """Apply llama.cpp's placement (``k_idxs`` split into stream and cell) and fill ``inp`` with its mask.

        Raises:
            InfertraceError: a graph input missing, or llama.cpp decoded the batch as several ubatches.
        """
        t = cap.tensors
        for name in ("inp_pos", "attn_inp_kq_mask", "attn_inp_k_idxs"):
            if name not in t:
                raise InfertraceError(f"llama.cpp graph gave no {name} at step {step}; this model's graph is not supported by --runtime llama.cpp")
        N = inp.n_tokens
        gi = t["attn_inp_k_idxs"].reshape(-1).astype(np.int64)
        if gi.shape[0] != N:
            raise InfertraceError(f"llama.cpp decoded step {step} as several ubatches ({gi.shape[0]} of {N} tokens in the first): "
                                  "the batch was not one split_equal ubatch")
        idx = torch.from_numpy(gi)  # [N] global rows
        strm, local = idx // self.size, idx % self.size  # [N] each
        pos = torch.from_numpy(t["inp_pos"].reshape(-1)[:N].astype(np.int64))  # [N]
        ne = [int(x) for x in cap.ne["attn_inp_kq_mask"]]
        n_kv, n_tps, ns = ne[0], ne[1], ne[3]
        if strm.tolist() != inp.seq_ids.tolist():
            self.notes.append(f"step {step}: llama.cpp put tokens in streams {strm.tolist()} for seq_ids {inp.seq_ids.tolist()}")
        heads_b, heads_a = [], []
        for j, s in enumerate(inp.streams):
            st = self.streams[s]
            rows = slice(j * n_tps, (j + 1) * n_tps)
            heads_b.append(st.head)
            st.pos[local[rows]] = pos[rows]
            st.seq[local[rows], s] = True
            st.head = int(local[rows][-1]) + 1  # llama_kv_cache::apply_ubatch
            heads_a.append(st.head)
        self._n_kv = n_kv
        m = t["attn_inp_kq_mask"].reshape(ns, ne[2], n_tps, n_kv)  # [ns, 1, n_tps, n_kv]
        inp.positions, inp.cell_idx, inp.cell_local, inp.n_kv = pos, idx, local, n_kv
        inp.kq_mask, inp.n_tokens_pad, inp.n_tps = torch.from_numpy(m.copy()), n_tps, n_tps
        inp.head_before, inp.head_after = heads_b, heads_a
        inp.cell_pos = torch.stack([self.streams[s].pos[:n_kv].clone() for s in inp.streams])  # [ns, n_kv]
        inp.cell_seq = torch.stack([self.streams[s].seq[:n_kv].clone() for s in inp.streams])  # [ns, n_kv, n_seq_max]
        add_native(inp, kq_mask_ne=ne, kq_mask_dtype=cap.dtype["attn_inp_kq_mask"],
                   out_ids=t["out_ids"].reshape(-1).astype(int).tolist() if "out_ids" in t else None,
                   inp_tokens=t["inp_tokens"].reshape(-1).astype(int).tolist() if "inp_tokens" in t else None)
        self._store_layer(cap, inp)
        self._check_memory(inp, step)

    def _store_layer(self, cap: Captured, inp: StreamsInputs) -> None:
        """Layer ``layer``'s K/V of the current tokens, read from the merged-streams cache after ``ggml_set_rows``."""
        t, il, N = cap.tensors, self.layer, inp.n_tokens
        nkv, hd = self.cfg.n_head_kv, self.cfg.head_dim
        gi = inp.cell_idx.numpy()

        def rows(name: str, fallback: str) -> np.ndarray:
            c = t.get(name)  # [kv_size * n_stream, n_embd_gqa]
            if c is not None and c.ndim == 2 and c.shape[1] == nkv * hd and (N == 0 or int(gi.max()) < c.shape[0]):
                return c[gi].reshape(N, nkv, hd)  # [N, nkv, hd] as stored (F16)
            return t[fallback].reshape(N, nkv, hd)

        k = torch.from_numpy(self.to_neox(np.asarray(rows(f"cache_k_l{il} (reshaped) (view)", f"Kcur-{il}"), dtype=np.float32)))
        v_rows = self.lctx.flash_attn_used is not False  # no flash attention: V is stored transposed (v_trans), not rows
        v = torch.from_numpy(np.asarray(rows(f"cache_v_l{il} (reshaped) (view)", f"Vcur-{il}") if v_rows else
                                        t[f"Vcur-{il}"].reshape(N, nkv, hd), dtype=np.float32))
        for j, s in enumerate(inp.streams):
            r = slice(j * inp.n_tps, (j + 1) * inp.n_tps)
            st = self.streams[s]
            st.k[0][inp.cell_local[r]] = k[r].to(st.k[0].dtype)
            st.v[0][inp.cell_local[r]] = v[r].to(st.v[0].dtype)

    def _check_memory(self, inp: StreamsInputs, step: int) -> None:
        """Per sequence holding cells: our reading vs ``llama_memory_seq_pos_min/max``."""
        ranges = {}
        for sid in range(self.n_stream):
            ps = [p for _, p in self.cells_of(sid)]
            if not ps:
                continue
            lo, hi = self.lctx.seq_pos_range(sid)
            ranges[str(sid)] = [lo, hi]
            if (min(ps), max(ps)) != (lo, hi):
                self.notes.append(f"step {step}: seq {sid} cells read from k_idxs hold pos {min(ps)}..{max(ps)}, "
                                  f"llama_memory_seq_pos_min/max say {lo}..{hi}")
        add_native(inp, memory_seq_pos=ranges)
        self._memory_seq_pos = ranges

    def snapshot(self) -> dict[str, Any]:
        """As :meth:`CellsStreamsKV.snapshot`, plus ``llama_memory_seq_pos`` after the last ubatch."""
        snap = self.mirror.snapshot()
        snap["n_kv"] = self.n_kv()  # llama.cpp's, as the graph read it
        snap["llama_memory_seq_pos"] = dict(self._memory_seq_pos)
        return snap

    def n_kv(self) -> int:
        """``n_kv`` of the last ubatch as llama.cpp built it (``attn_inp_kq_mask`` ``ne[0]``); before the
        first, as :meth:`CellsStreamsKV.n_kv`."""
        return self._n_kv if self._n_kv is not None else max(s.n_kv() for s in self.streams)

    def read(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[len, n_kv_heads, head_dim]`` (F16, as llama.cpp stored them) of ``seq_id`` in the captured layer,
        by position.

        Raises:
            ConfigError: ``layer`` is not the captured one.
        """
        self.check_layer(layer)
        return self.stream_of(seq_id).read(0, seq_id)  # [L, n_kv_heads, hd] each

    def release(self, seq_id: int) -> None:
        """``llama_memory_seq_rm(seq_id, -1, -1)`` and the same on the read-back stream."""
        self.lctx.seq_rm(seq_id)
        self.mirror.release(seq_id)
