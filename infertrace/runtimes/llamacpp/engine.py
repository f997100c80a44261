"""``run --runtime llama.cpp``: the same requests, scheduled by infertrace's scheduler step by step,
computed by llama.cpp itself; every variable of the trace is what llama.cpp built.

One engine step = one ``llama_batch`` = one ubatch (``n_ubatch`` >= the step's N, unified KV
cache, so llama.cpp's ``split_simple`` keeps the packed order). Per step the batch carries each
token's ``seq_id``, position and ``logits`` flag, exactly as our engine packs it; the eval
callback of :mod:`infertrace.runtimes.llamacpp.capture` then gives:

========================  ==================================================================
trace field               llama.cpp source
========================  ==================================================================
token ids                 ``inp_tokens`` I32 ``[N]``
positions.inp_pos         ``inp_pos`` I32 ``[N]``
mask.kq_mask              ``attn_inp_kq_mask`` (``ne = [n_kv, n_tokens, 1, n_stream]``; F16 with flash
                          attention, else F32; 0/-inf), rows x cells
kv cells / head           ``attn_inp_k_idxs`` (cell of each token; head = last cell + 1 as
                          ``apply_ubatch``), freed by ``llama_memory_seq_rm``; checked against
                          ``llama_memory_seq_pos_min/max`` every step
kv layer view / cache     layer ``--layer``'s cache rows after ``ggml_set_rows`` (F16)
mask.swa, kv swa_pool     iSWA (Gemma 3): the graph's second ``attn_inp_kq_mask`` / ``attn_inp_k_idxs``,
                          told apart by the layer that consumes them (the SWA pool's, applied as
                          ``apply_ubatch``: reuse, purge, checked against ``llama_memory_seq_pos_min/max``,
                          which answer from that pool; its size from ``cache_k_l{il}``; see kv/iswa.py)
kv recurrent_cells        hybrid: per ubatch, from the first GDN layer's ``build_rs`` nodes: ``head``
                          (offset of the extra-states copy), ``n_rs``, ``rs_z`` (the view zeroed for new
                          sequences), ``rs_s_copy`` I32 ``[n_rs]`` (the cell each state is read from)
hidden                    ``embd`` F32 ``ne=[H, N]`` (embedding output)
RoPE evidence             ``Qcur-l``/``Kcur-l`` before and after ``ggml_rope_ext``, ``Vcur-l``
decode logits             ``llama_get_logits_ith`` for the flagged rows; ``out_ids`` recorded
========================  ==================================================================

Q/K come in GGUF (adjacent-pair, ``norm``) order; they are put in half-split order (as our
engine's un-permuted weights) so the two traces compare element for element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from infertrace.engine.drive import drive_bounded, encode_requests
from infertrace.engine.engine import Engine, EngineOptions
from infertrace.runtimes.llamacpp.capture import TAP_NODES, Captured, LlamaCppContext, tap_node
from infertrace.runtimes.llamacpp.native import add_native
from infertrace.runtimes.readback import ReadBack
from infertrace.runtimes.llamacpp.state_file import norm_to_neox  # torch-free; the slot-file reader uses it too
from infertrace.errors import InfertraceError
from infertrace.kv.base import AttnInputs, CellsInputs, ChunkSpec, SwaPoolStep
from infertrace.kv.cells import CellsKV
from infertrace.kv.iswa import IswaInputs, SwaCellsPool, swa_pool_size
from infertrace.model.taps import EMBED, K, K_ROT, Q, Q_ROT, V

ENGINE = "llama.cpp"


class LlamaCppKV(ReadBack):
    """llama.cpp's unified KV cache as read back at run time, in the ``cells`` shape infertrace
    records (so the ordinary recorder, ``show``, ``report`` and ``dump-kv`` read it).

    Not a subclass of our memory: it holds a :class:`~infertrace.kv.cells.CellsKV` mirror
    (:attr:`mirror`: the cells' pos / seq_ids, the head, one K/V storage ``[n_ctx, n_kv_heads, head_dim]``
    for the captured layer) and implements what the engine drives in a llama.cpp run (``prepare``,
    ``can_fit``, ``capacity_tokens``, ``release``, ``seq_len``) and what the recorder's probe reads
    (``kind``, ``layout``, ``logical_mask``, ``read``, ``holds_values``, ``describe``, ``snapshot``,
    ``recurrent_state``, ``head``).

    Placement is never chosen here: :meth:`prepare` only packs positions and seq_ids, and
    :meth:`after_decode` applies the cells llama.cpp chose (``attn_inp_k_idxs``). K/V storage
    holds layer ``layer`` only, as llama.cpp wrote it (its cache dtype).

    Args:
        cfg: model config; lctx: the :class:`LlamaCppContext`; layer: the captured layer.
    """

    kind = "cells"
    runtime = "llama.cpp"
    layout = "cells"  # what the views read (infertrace.capture.kv_views)

    def __init__(self, cfg: Any, lctx: LlamaCppContext, n_seq_max: int, layer: int):
        self.mirror = CellsKV(1, cfg.n_head_kv, cfg.head_dim, lctx.n_ctx, n_seq_max, torch.float16, "cpu")
        self.lctx, self.layer, self.cfg = lctx, layer, cfg
        self.n_layer = cfg.n_layer  # llama.cpp caches every layer; the mirror stores the captured one
        self._n_kv = 0
        self.notes: list[str] = []
        #: llama.cpp's SWA pool as read back (models with windowed layers: ``llama_kv_cache_iswa``), else None
        self.swa: SwaCellsPool | None = None
        if getattr(cfg, "windowed_layers", None):
            n_ub = int(lctx.settings().get("n_ubatch", lctx.n_batch))
            size = swa_pool_size(lctx.n_ctx, int(cfg.sliding_window), int(lctx.settings().get("n_seq_max", 1)), n_ub,
                                 bool(lctx.settings().get("swa_full")))
            self.swa = SwaCellsPool(1, cfg.n_head_kv, cfg.head_dim, size, n_seq_max, torch.float16, "cpu",
                                    windows=[int(cfg.sliding_window)])
        #: llama.cpp's recurrent cells per ubatch of the last step (hybrid models; see :meth:`_recurrent`)
        self.rs_cells: list[dict[str, Any]] = []

    # --- what the engine drives and the probe reads, answered by the mirror -------------------------
    @property
    def head(self) -> int:
        """The next-slot search start after the last ubatch (``llama_kv_cache::head``, as ``apply_ubatch`` moves it)."""
        return self.mirror.head

    def cells_of(self, seq_id: int) -> list[tuple[int, int]]:
        """``[(cell, pos)]`` owned by ``seq_id``, ordered by pos (read back from ``attn_inp_k_idxs``)."""
        return self.mirror.cells_of(seq_id)

    def prepare(self, chunks: Sequence[ChunkSpec]) -> AttnInputs:
        """Pack the step's positions and seq_ids; the cells, n_kv and kq_mask are filled by :meth:`after_decode` from
        llama.cpp's graph (placement is never chosen here).

        Raises:
            InfertraceError: a seq_id outside ``0..n_seq_max-1``.
        """
        positions, seq_ids = [], []
        for c in chunks:
            self.mirror._check_seq(c.seq_id)
            positions += list(range(c.C, c.C + c.T))
            seq_ids += [c.seq_id] * c.T
        none = torch.zeros(0, dtype=torch.int64)  # filled from llama.cpp's graph inputs by after_decode
        return (IswaInputs if self.swa is not None else CellsInputs)(list(chunks), torch.tensor(positions, dtype=torch.int64), torch.tensor(seq_ids, dtype=torch.int64),
                           self.kind, cell_idx=none, n_kv=0, kq_mask=torch.zeros(1, 1, 0, 0), n_tokens_pad=0,
                           head_before=self.head, head_after=self.head, cell_pos=none, cell_seq=none)

    def after_decode(self, inp: AttnInputs, cap: Captured, step: int) -> None:
        """Apply llama.cpp's placement and fill ``inp`` with its tensors (see the module table).

        Raises:
            InfertraceError: a tensor the trace needs was not captured (unsupported graph).
        """
        t = cap.tensors
        for name in ("inp_pos", "attn_inp_kq_mask", "attn_inp_k_idxs"):
            if name not in t:
                raise InfertraceError(f"llama.cpp graph gave no {name} at step {step}; this model's graph is not supported by --runtime llama.cpp")
        N = inp.n_tokens
        if t["attn_inp_k_idxs"].size < N:  # llama.cpp split the batch (hybrid memory: split_equal, equal tokens per sequence)
            raise InfertraceError(f"llama.cpp split step {step} ({N} tokens) into several ubatches (a hybrid model's memory "
                                  "needs the same number of new tokens per sequence in a ubatch: split_equal); --runtime "
                                  "llama.cpp records one ubatch per step: run one request at a time, or requests of equal "
                                  "prompt length arriving together")
        idx = torch.from_numpy(t["attn_inp_k_idxs"].reshape(-1)[:N].astype(np.int64))  # [N] cells
        pos = torch.from_numpy(t["inp_pos"].reshape(-1)[:N].astype(np.int64))  # [N]
        mem = self.mirror
        head_before = mem.head
        mem.pos[idx] = pos
        mem.seq[idx, inp.seq_ids] = True
        mem.head = int(idx[-1]) + 1 if N else mem.head  # llama_kv_cache::apply_ubatch
        ne = cap.ne["attn_inp_kq_mask"]
        self._n_kv = int(ne[0])
        m = t["attn_inp_kq_mask"].reshape(ne[3], ne[2], ne[1], ne[0])  # [n_stream, 1, n_tokens, n_kv]
        mask = torch.from_numpy(m.copy())
        inp.positions = pos
        inp.cell_idx, inp.n_kv, inp.kq_mask, inp.n_tokens_pad = idx, self._n_kv, mask, int(ne[1])
        inp.head_before, inp.head_after = head_before, self.head
        inp.cell_pos, inp.cell_seq = mem.pos[: self._n_kv].clone(), mem.seq[: self._n_kv].clone()
        add_native(  # what only a captured llama.cpp step has
            inp, kq_mask_ne=list(ne), kq_mask_dtype=cap.dtype["attn_inp_kq_mask"],
            out_ids=t["out_ids"].reshape(-1).astype(int).tolist() if "out_ids" in t else None,
            inp_tokens=t["inp_tokens"].reshape(-1).astype(int).tolist() if "inp_tokens" in t else None,
        )
        sidx = self._after_decode_swa(inp, cap, step) if self.swa is not None else None
        self._recurrent(inp, cap)
        self._store_layer(cap, idx, sidx if sidx is not None and self.cfg.layer_window(self.layer) else None)
        self._check_memory(inp, step)

    def _after_decode_swa(self, inp: AttnInputs, cap: Captured, step: int) -> torch.Tensor:
        """The SWA pool's side of a step (``build_attn_inp_kv_iswa``): apply ``attn_inp_k_idxs_swa`` to the
        read-back pool as ``apply_ubatch`` does (reused cells cleared, older positions purged) and put
        ``attn_inp_kq_mask_swa`` in ``inp.swa``. Returns the step's SWA cells ``[N]`` int64.

        Raises:
            InfertraceError: the graph gave no SWA-pool inputs (not llama.cpp's iSWA cache).
        """
        t, N = cap.tensors, inp.n_tokens
        for name in ("attn_inp_k_idxs_swa", "attn_inp_kq_mask_swa"):
            if name not in t:
                raise InfertraceError(f"llama.cpp graph gave no {name} at step {step}; the model has windowed layers but "
                                      "llama.cpp did not build its iSWA cache")
        pool = self.swa
        size = self.lctx.cache_cells.get(min(i for i in range(self.cfg.n_layer) if self.cfg.layer_window(i)))
        if size is not None and size != pool.size and step == 0:
            self.notes.append(f"llama.cpp allocated an SWA pool of {size} cells; llama_kv_cache_iswa's formula gives {pool.size}")
        sidx = torch.from_numpy(t["attn_inp_k_idxs_swa"].reshape(-1)[:N].astype(np.int64))  # [N] SWA-pool cells
        head_before = pool.head
        reused, purged = pool.apply_ubatch(sidx, inp.positions, inp.seq_ids)
        ne = cap.ne["attn_inp_kq_mask_swa"]
        m = torch.from_numpy(t["attn_inp_kq_mask_swa"].reshape(ne[3], ne[2], ne[1], ne[0]).copy())  # [n_stream, 1, n_tokens, n_kv]
        n_kv = int(ne[0])
        sinp = CellsInputs(list(inp.chunks), inp.positions, inp.seq_ids, self.kind, cell_idx=sidx, n_kv=n_kv, kq_mask=m,
                           n_tokens_pad=int(ne[1]), head_before=head_before, head_after=pool.head,
                           cell_pos=pool.pos[:n_kv].clone(), cell_seq=pool.seq[:n_kv].clone(), kq_mask_swa=m,
                           n_swa=pool.n_swa, swa_layers=list(self.cfg.windowed_layers),
                           swa_pool=SwaPoolStep(reused, purged, pool.size))
        add_native(sinp, kq_mask_ne=list(ne), kq_mask_dtype=cap.dtype["attn_inp_kq_mask_swa"], n_kv_read_back=pool.n_kv())
        inp.swa, inp.kq_mask_swa, inp.n_swa = sinp, m, pool.n_swa  # type: ignore[attr-defined]
        inp.swa_layers = list(self.cfg.windowed_layers)
        return sidx

    def _recurrent(self, inp: AttnInputs, cap: Captured) -> None:
        """Hybrid models: llama.cpp's recurrent cells of each ubatch of the step
        (:attr:`~infertrace.runtimes.llamacpp.capture.Captured.rs`: ``head``, ``n_rs``, ``rs_z``, ``s_copy``)
        into ``inp.native.llama_rs`` and :attr:`rs_cells`."""
        if cap.rs:
            self.rs_cells = [dict(r) for r in cap.rs]
            add_native(inp, llama_rs=self.rs_cells)

    def _store_layer(self, cap: Captured, idx: torch.Tensor, src_idx: torch.Tensor | None = None) -> None:
        """Layer ``layer``'s K/V rows of the current tokens, as written into the cache (``src_idx``: the
        cells they went to in llama.cpp's cache when that is the SWA pool; stored here at ``idx``)."""
        t, il, N = cap.tensors, self.layer, int(idx.numel())
        nkv, hd = self.cfg.n_head_kv, self.cfg.head_dim
        ii = (src_idx if src_idx is not None else idx).numpy()

        def rows(name: str, fallback: str) -> np.ndarray:
            c = t.get(name)  # the ggml_set_rows result: a view of the cache from cell 0, [cells, nkv, hd]
            if c is not None and c.ndim == 3 and c.shape[1:] == (nkv, hd) and (N == 0 or int(ii.max()) < c.shape[0]):
                return c[ii]  # [N, nkv, hd] as stored (F16)
            return t[fallback].reshape(N, nkv, hd)  # not readable as rows: the values the graph wrote

        k = rows(f"cache_k_l{il} (view)", f"Kcur-{il}")
        # without flash attention llama.cpp stores V transposed (v_trans): its cache view is not rows of cells,
        # even when its shape happens to read as [cells, nkv, hd] (Gemma 3: nkv 1, hd 256 = a 256-cell cache)
        v = rows(f"cache_v_l{il} (view)", f"Vcur-{il}") if self.lctx.flash_attn_used is not False else \
            t[f"Vcur-{il}"].reshape(N, nkv, hd)
        k = np.asarray(k, dtype=np.float32)
        if getattr(self.cfg, "rope_pairing_in_file", "norm") == "norm":  # GGUF Q/K rows permuted (llama): back to half-split
            k = norm_to_neox(k)
        K, V_ = self.mirror.k[0], self.mirror.v[0]  # [n_ctx, n_kv, hd]
        K[idx] = torch.from_numpy(k).to(K.dtype)
        V_[idx] = torch.from_numpy(np.asarray(v, dtype=np.float32)).to(V_.dtype)

    def _check_memory(self, inp: AttnInputs, step: int) -> None:
        """Per sequence in the cache: our reading of the cells vs ``llama_memory_seq_pos_min/max``."""
        ranges = {}
        pool = self.swa if self.swa is not None else self.mirror  # llama_kv_cache_iswa::seq_pos_min/max answer from the SWA pool
        for sid in sorted(set(self.mirror.seq.any(dim=0).nonzero().flatten().tolist())):
            lo, hi = self.lctx.seq_pos_range(sid)
            ranges[str(sid)] = [lo, hi]
            ps = [p for _, p in pool.cells_of(sid)]
            if ps and self.rs_cells:  # llama_memory_hybrid::seq_pos_min/max: the recurrent cell holds the last pos only
                ps = [max(ps)]
            if ps and (min(ps), max(ps)) != (lo, hi):
                self.notes.append(f"step {step}: seq {sid} cells read from k_idxs hold pos {min(ps)}..{max(ps)}, "
                                  f"llama_memory_seq_pos_min/max say {lo}..{hi}")
        add_native(inp, memory_seq_pos=ranges)
        self._memory_seq_pos = ranges

    def snapshot(self) -> dict[str, Any]:
        """The cells map (as :meth:`CellsKV.snapshot`) plus ``llama_memory_seq_pos``: per sequence
        ``[llama_memory_seq_pos_min, llama_memory_seq_pos_max]`` after the last ubatch."""
        snap = self.mirror.snapshot()
        snap["llama_memory_seq_pos"] = dict(getattr(self, "_memory_seq_pos", {}))
        if self.swa is not None:
            snap["swa_pool"] = self.swa.pool_record(None)
            snap["n_swa"], snap["swa_layers"] = self.swa.n_swa, list(self.cfg.windowed_layers)
        if self.rs_cells:
            snap["recurrent_cells"] = [dict(r) for r in self.rs_cells]
        return snap

    def logical_mask(self, inp: CellsInputs, swa: bool = False) -> list[torch.Tensor]:
        """As :meth:`CellsKV.logical_mask`; ``swa`` with the iSWA cache: read back from llama.cpp's
        ``kq_mask_swa`` over its SWA pool."""
        if swa and self.swa is not None and getattr(inp, "swa", None) is not None:
            return self.swa.logical_mask(inp.swa, True)  # type: ignore[attr-defined]
        return self.mirror.logical_mask(inp, swa)

    def n_kv(self) -> int:
        """``n_kv`` of the last ubatch as llama.cpp built it (``attn_inp_kq_mask`` ``ne[0]``)."""
        return self._n_kv

    def read(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[len, n_kv_heads, head_dim]`` (F16, as llama.cpp stored them) of ``seq_id`` in the captured layer,
        by position.

        Raises:
            ConfigError: ``layer`` is not the captured one.
        """
        self.check_layer(layer)
        cells = torch.tensor([c for c, _ in self.mirror.cells_of(seq_id)], dtype=torch.int64)
        return self.mirror.k[0][cells], self.mirror.v[0][cells]  # [L, n_kv_heads, hd] each

    def release(self, seq_id: int) -> None:
        """``llama_memory_seq_rm(seq_id, -1, -1)``; head moves back to the first freed cell
        (``llama_kv_cache::seq_rm``)."""
        self.lctx.seq_rm(seq_id)
        self.mirror.release(seq_id)
        if self.swa is not None:
            self.swa.release(seq_id)


class LlamaCppModel:
    """Stands in for :class:`~infertrace.model.decoder.DecoderModel` in the engine loop: ``forward``
    decodes the step with llama.cpp and returns its logits rows."""

    def __init__(self, base: Any, lctx: LlamaCppContext):
        self.cfg, self.dtype, self.device = base.cfg, base.dtype, base.device
        self.lctx = lctx
        self.step = 0
        self.captures: list[Captured] = []
        self.keep_captures = False

    def forward(self, ids: torch.Tensor, inp: AttnInputs, kv: LlamaCppKV, rows: torch.Tensor, tracer: Any) -> torch.Tensor:
        """Decode ``ids`` ``[N]`` at ``inp.positions`` / ``inp.seq_ids`` with logits for ``rows``.

        Returns:
            logits ``[M, V]`` float32 (llama.cpp's, rows in batch order).
        """
        N = int(ids.shape[0])
        flags = [False] * N
        for r in rows.tolist():
            flags[r] = True
        cap = self.lctx.decode(ids.tolist(), inp.positions.tolist(), inp.seq_ids.tolist(), flags)
        kv.after_decode(inp, cap, self.step)
        if self.keep_captures:
            self.captures.append(cap)
        if tracer.enabled:
            self._taps(cap, N, tracer)
        self.step += 1
        return torch.from_numpy(cap.tensors["logits"].astype(np.float32))  # [M, V]

    def _taps(self, cap: Captured, N: int, tracer: Any) -> None:
        """Hand llama.cpp's captured nodes to the recorder under the tap vocabulary (:mod:`infertrace.model.taps`):
        the embedding, then for the captured layer and every ``tap_layers`` layer Q/K/V and the block outputs."""
        t = cap.tensors
        emb = t.get("inp_scaled", t.get("embd"))  # Gemma: the scaled embedding (build_inp_embd output), as our EMBED tap
        if emb is not None:
            tracer.tap(EMBED, value=torch.from_numpy(emb.reshape(N, -1).astype(np.float32)))  # [N, H]
        for il in sorted({self.lctx.layer, *self.lctx.tap_layers} & set(tracer.layers)):
            for name, value in {**self._qkv(cap, N, il), **self._block_outputs(cap, N, il)}.items():
                if name in tracer.taps:
                    tracer.tap(name, layer=il, value=value)

    def _qkv(self, cap: Captured, N: int, il: int) -> dict[str, torch.Tensor]:
        """Layer ``il``'s ``Qcur``/``Kcur``/``Vcur``: the projections (first node of a name) and Q/K after RoPE
        (last), back in half-split (NeoX) pairing when the file stores llama's interleaved rows."""
        cfg, t = self.cfg, cap.tensors
        names = (f"Qcur-{il}", f"Kcur-{il}", f"Vcur-{il}")
        if not all(n in t for n in names):
            return {}
        nh, nkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim

        def qk(a: np.ndarray, heads: int) -> torch.Tensor:
            a = a.reshape(N, heads, hd).astype(np.float32)  # [N, heads, hd]
            return torch.from_numpy(norm_to_neox(a) if getattr(cfg, "rope_pairing_in_file", "norm") == "norm" else a)

        return {Q: qk(cap.first[names[0]], nh), Q_ROT: qk(t[names[0]], nh), K: qk(cap.first[names[1]], nkv),
                K_ROT: qk(t[names[1]], nkv), V: torch.from_numpy(t[names[2]].reshape(N, nkv, hd).astype(np.float32))}

    def _block_outputs(self, cap: Captured, N: int, il: int) -> dict[str, torch.Tensor]:
        """Layer ``il``'s ``attn_out`` / ``mlp_out`` / ``resid_post`` ``[N, H]`` float32 from the nodes of
        :data:`~.capture.TAP_NODES`; a node llama.cpp computed for the output rows only (the last layer after
        ``inp_out_ids``) has fewer than N rows and is left out (never padded)."""
        out: dict[str, torch.Tensor] = {}
        for tap, nodes in TAP_NODES.items():
            a = next((cap.tensors[n] for n in (tap_node(x, il) for x in nodes) if n in cap.tensors), None)
            if a is not None and a.size == N * self.cfg.n_embd:
                out[tap] = torch.from_numpy(a.reshape(N, -1).astype(np.float32))  # [N, H]
        return out


@dataclass(frozen=True)
class LlamaCppCacheConfig:
    """The cache config of a llama.cpp run (:class:`~infertrace.engine.parts.MemoryConfig`): llama.cpp's own
    cache as read back, :class:`LlamaCppKV` (or one stream per sequence with ``kv_unified`` off); no
    infertrace cache is allocated beside it."""

    lctx: Any
    cfg: Any
    n_seq_max: int
    layer: int

    def build(self, model: Any, opts: EngineOptions, attn_impl: str) -> Any:
        """The read-back memory for ``opts`` (``model``/``attn_impl`` unused: llama.cpp computes)."""
        if not opts.kv_unified:  # one stream per sequence (runtimes/llamacpp/streams.py)
            from infertrace.runtimes.llamacpp.streams import LlamaCppStreamsKV

            return LlamaCppStreamsKV(self.cfg, self.lctx, int(self.lctx.L.llama_n_seq_max(self.lctx.ctx)), self.layer,
                                     norm_to_neox)
        return LlamaCppKV(self.cfg, self.lctx, self.n_seq_max, self.layer)


class LlamaCppEngine:
    """infertrace's :class:`Engine` (its scheduler and step loop) with llama.cpp's forward pass and cache
    injected: the model is :class:`LlamaCppModel`, the memory :class:`LlamaCppCacheConfig`'s, the
    sampler llama.cpp's order (forced tokens through :class:`~infertrace.engine.parts.ForcedSampler`).

    Args:
        loaded: :class:`~infertrace.loading.model.Loaded` (tokenizer, config; the GGUF path).
        opts: engine options (backend must be ``cells``: llama.cpp's convention).
        tracer: recorder or null tracer.
        layer: the layer whose Q/K/V and cache are captured.
        forced: teacher forcing, ``{seq_id: [token, ...]}``: the i-th sampled token of a request
            is replaced by ``forced[seq_id][i]`` (llama.cpp's own choice is kept in ``top``).
        n_seq_max: sequences llama.cpp must hold (the number of requests).
        flash_attn: ``auto`` | ``on`` | ``off`` (``--llamacpp-flash-attn``; see :class:`LlamaCppContext`).
        tap_layers: layers whose Q/K/V and block outputs (``attn_out``, ``mlp_out``, ``resid_post``) are read
            from llama.cpp's graph for ``--keep tensors --layers`` (:data:`~.capture.TAP_NODES`).

    Raises:
        InfertraceError: llama-cpp-python missing, non-GGUF model, ``--backend paged``, or a model with
            sliding-window layers under ``--kv-unified off`` (llama.cpp would keep an iSWA pool per stream;
            not captured). Sliding-window models with the unified cache are captured: both iSWA pools.
    """

    def __init__(self, loaded: Any, opts: EngineOptions, tracer: Any, layer: int = 0,
                 forced: dict[int, list[int]] | None = None, n_seq_max: int = 1, n_threads: int = 2,
                 flash_attn: str = "auto", tap_layers: Any = ()):
        from infertrace.engine.parts import ForcedSampler

        if opts.backend != "cells":
            raise InfertraceError("--runtime llama.cpp records llama.cpp's own cells cache; drop --backend paged")
        if loaded.config.windowed_layers and not opts.kv_unified:  # an iSWA pool per stream: not captured
            raise InfertraceError("--runtime llama.cpp --kv-unified off on a model with sliding-window layers is not captured "
                                  "(llama.cpp would keep an iSWA pool per stream); drop --kv-unified off")
        n_batch = max(1, min(opts.max_batch_tokens, opts.ctx_size))
        self.lctx = LlamaCppContext(loaded.ckpt.path, opts.ctx_size, n_batch, n_seq_max, layer, n_threads, flash_attn,
                                    kv_unified=opts.kv_unified,
                                    swa_layers=getattr(loaded.config, "windowed_layers", None) or (),
                                    tap_layers=tap_layers)
        self.lmodel = LlamaCppModel(loaded.model, self.lctx)
        try:
            self.engine = Engine(self.lmodel, loaded.tokenizer, opts, tracer,
                                 memory=LlamaCppCacheConfig(self.lctx, loaded.config, opts.n_seq_max, layer),
                                 sampler=ForcedSampler(forced or {}), attention="llama.cpp", sampler_order="llama.cpp")
        except BaseException:
            self.lctx.close()
            raise
        self.forced = forced or {}

    # the engine's loop, as drive() and the runtime use it
    def add_request(self, *a: Any, **k: Any) -> Any:
        """:meth:`Engine.add_request`."""
        return self.engine.add_request(*a, **k)

    def step(self) -> Any:
        """:meth:`Engine.step` (one ``llama_decode``)."""
        return self.engine.step()

    @property
    def step_no(self) -> int:
        """The next step's number."""
        return self.engine.step_no

    @property
    def requests(self) -> dict[int, Any]:
        """The engine's requests by seq_id."""
        return self.engine.requests

    @property
    def kv(self) -> Any:
        """llama.cpp's cache as read back (:class:`LlamaCppKV`)."""
        return self.engine.kv

    @property
    def opts(self) -> EngineOptions:
        """The engine options."""
        return self.engine.opts

    @property
    def sampler_order(self) -> str:
        """The sampler order that ran (llama.cpp's unless ``--sampler-order``)."""
        return self.engine.sampler_order

    @property
    def attn_impl(self) -> str:
        """``llama.cpp``."""
        return self.engine.attn_impl

    def close(self) -> None:
        """Free llama.cpp's context."""
        self.lctx.close()


def run_llamacpp(loaded: Any, prompts: list[Any], opts: EngineOptions, recorder: Any, layer: int = 0,
                 forced: dict[int, list[int]] | None = None, on_step: Callable[[Any], None] | None = None,
                 keep_captures: bool = False, flash_attn: str = "auto") -> tuple[LlamaCppEngine, list[str]]:
    """Run ``prompts`` through llama.cpp with our scheduler; returns the finished engine and notes
    (``flash_attn``: ``auto`` | ``on`` | ``off``, llama.cpp's ``flash_attn_type``).

    Raises:
        InfertraceError: as :class:`LlamaCppEngine`, or a llama_decode failure.
    """
    eng = LlamaCppEngine(loaded, opts, recorder, layer, forced, n_seq_max=max(1, len(prompts)), flash_attn=flash_attn)
    eng.lmodel.keep_captures = keep_captures
    emitted = 0

    def emit(_batch: Any) -> None:  # hand each new StepTrace of the recorder to on_step as it is made
        nonlocal emitted
        steps = getattr(recorder, "steps", None)
        if steps is not None:
            for st in steps[emitted:]:
                on_step(st)  # type: ignore[misc]
            emitted = len(steps)

    drive_bounded(eng, encode_requests(loaded.tokenizer, prompts), emit if on_step is not None else None)
    return eng, run_notes(eng, opts)


def run_notes(eng: LlamaCppEngine, opts: EngineOptions) -> list[str]:
    """The trace notes of a llama.cpp run: its context and batch sizes, the settings that change its numbers
    (flash attention, cache types, threads), llama.cpp's padding of ``n_ctx``, and what reading its cache noted."""
    st = eng.lctx.settings()
    notes = [f"engine llama.cpp (llama-cpp-python {_version()}): n_ctx {eng.lctx.n_ctx}, n_ubatch = n_batch "
             f"{min(opts.max_batch_tokens, opts.ctx_size)}, "
             f"{'kv_unified' if opts.kv_unified else f'non-unified KV ({eng.lctx.n_ctx_seq} cells per stream)'}, "
             "one llama_batch per step",
             f"llama.cpp flash attention {st['flash_attn'] or '?'} (asked {st['flash_attn_type']}), K/V cache "
             f"{st['type_k']}/{st['type_v']}, {st['n_threads']} threads: these change its numbers"]
    if not opts.kv_unified and eng.lctx.n_ctx_seq != opts.ctx_size // max(1, opts.n_seq_max):
        notes.append(f"llama.cpp pads n_ctx_seq to a multiple of 256: {opts.ctx_size // max(1, opts.n_seq_max)} -> "
                     f"{eng.lctx.n_ctx_seq} cells per stream (the cells backend does the same)")
    if eng.lctx.n_ctx != opts.ctx_size:
        notes.append(f"llama.cpp pads n_ctx to a multiple of 256: {opts.ctx_size} -> {eng.lctx.n_ctx} cells")
    notes += eng.kv.notes
    return notes


def _version() -> str:
    try:
        import importlib.metadata as md

        return md.version("llama-cpp-python")
    except Exception:  # pragma: no cover
        return "?"


def run_requests_llamacpp(loaded: Any, prompts: list[Any], opts: EngineOptions, layer: int = 0,
                          show: tuple[str, ...] | None = None, on_step: Callable[[Any], None] | None = None,
                          options_for_record: dict[str, Any] | None = None,
                          tensors: dict[str, torch.Tensor] | None = None,
                          forced: dict[int, list[int]] | None = None, flash_attn: str = "auto") -> Any:
    """:func:`infertrace.runner.run_requests` with llama.cpp computing: the same records, with
    ``engine = "llama.cpp"`` in the header (:func:`~infertrace.runtimes.loop.record_run` on
    :class:`~infertrace.runtimes.llamacpp.runtime.LlamaCppRuntime`).

    Args:
        loaded: the GGUF model (our tokenizer and config; llama.cpp loads the same file).
        tensors: as ``run_requests`` (layer ``layer`` only: K/V cache, Q/K/V, hidden, top-k logits).
        forced: teacher forcing (see :class:`LlamaCppEngine`).
        flash_attn: ``auto`` | ``on`` | ``off`` (``--llamacpp-flash-attn``); what ran is in the header.

    Raises:
        InfertraceError: bad layer, llama-cpp-python missing, non-GGUF model, decode failure.
    """
    from infertrace.capture.recorder import VARIABLES
    from infertrace.runtimes.api import RunSettings
    from infertrace.runtimes.loop import record_run

    settings = RunSettings(opts=opts, layer=layer, show=tuple(show or VARIABLES), tensor_layers=(layer,), forced=forced,
                           native={"flash_attn": flash_attn}, record=dict(options_for_record or {}))
    return record_run(ENGINE, loaded, prompts, settings, on_step, tensors)
