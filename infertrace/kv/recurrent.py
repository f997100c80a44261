"""Fixed-size per-request state of recurrent (Gated DeltaNet) layers, in both runtime conventions,
and the hybrid memory that pairs it with a KV cache.

* ``cells`` — llama.cpp ``src/llama-memory-recurrent.cpp`` inside ``llama-memory-hybrid.cpp``:
  ``size`` recurrent cells, each owned by one sequence (``seq_id``), per layer a conv state
  ``r_l`` ``[size, conv_dim * (K-1)]`` and an SSM state ``s_l`` ``[size, n_embd_s]``; a new
  sequence gets a free cell that is cleared (``rs_z``: the cell zeroed in this ubatch); sequence
  operations copy the cell (``seq_cp``) or free it (``seq_rm`` of the whole sequence; a part of a
  sequence is refused: ``seq_rm`` answers False).
* ``paged`` — TensorRT-LLM ``MambaHybridCacheManager`` (``_torch/pyexecutor/mamba_cache_manager.py``):
  a pool of state slots per layer (``conv_states [slots, conv_dim, K-1]``, ``ssm_states
  [slots, Hv, dk, dv]``), a request is given a slot on admission and keeps it until
  ``free_resources``; the step's ``state_indices`` say which slot each request reads and writes.
  Not paged: the size is constant whatever the sequence length.

Speculative verify (both conventions): a recurrent state cannot drop its last tokens, so a verify
chunk keeps the state after *every* candidate in per-slot snapshots, the request's own state is
left as it was before the chunk, and after acceptance the accepted candidate's snapshot becomes
the state (:meth:`RecurrentState.select`); the other snapshots are dropped (overwritten by the next
verify). TensorRT-LLM: ``intermediate_conv_window`` / ``intermediate_ssm`` ``[layers, slots,
draft_len+1, ...]`` (``_torch/pyexecutor/mamba_cache_manager.py`` ``SpeculativeState``), written by
``_torch/modules/mamba/gdn_mixer.py`` ``forward_decode`` (``is_target_verify``) and chosen in
``update_mamba_states()`` by ``num_accepted_draft_tokens`` (a chain) or ``accepted_leaf_positions``
(a tree). llama.cpp: ``llama_memory_recurrent`` allocates ``mem_size * (1 + n_rs_seq)`` rows of
``r_l`` / ``s_l`` (``src/llama-memory-recurrent.cpp``); ``seq_rm(seq, p0, -1)`` of a tail of at most
``n_rs_seq`` tokens sets ``rs_idx[seq] = rollback`` and the next graph reads the state from that
snapshot plane. A tree here continues each branch from its parent's snapshot; llama.cpp would give
each branch its own seq_id, here one seq owns the tree (as :meth:`infertrace.kv.cells.CellsKV.rewind_cells` does).

Either way a request whose chunk starts at ``C == 0`` (a new request, or one recomputed after
preemption) starts from zero state; the state is never shared between requests, so prefix / block
reuse is off for hybrid models (TensorRT-LLM disables it: the state has no block-sharing semantics).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from infertrace.errors import InfertraceError
from infertrace.kv.base import AttnInputs, ChunkSpec, MemOp, MemoryDefaults
from infertrace.model.config import NO_REUSE_REASON  # noqa: F401 - re-exported (a fact of the model, stated in traces)


def _dt(t: torch.Tensor) -> str:
    """GGUF-style dtype name (``F32``, ``BF16``, ...)."""
    return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
            torch.int32: "I32"}.get(t.dtype, str(t.dtype).replace("torch.", ""))


class RecurrentState:
    """Conv and recurrent state slots of every GDN layer.

    Args:
        layers: indices of the GDN layers.
        conv_dim, kernel: conv channels and kernel K (conv state keeps K-1 inputs).
        n_v_heads, k_head_dim, v_head_dim: recurrent state ``[Hv, dk, dv]``.
        n_slots: slots (llama.cpp ``n_seq_max`` cells; TensorRT-LLM ``max_batch_size``).
        convention: ``"cells"`` (llama.cpp memory_recurrent) or ``"paged"`` (TensorRT-LLM state slots).
        dtype, device: storage.
        n_snap: speculative verify snapshots per slot (the largest verify chunk: draft nodes + 1);
            0 = no speculative decoding. Storage per slot ``snap[slot] = (conv, rec)`` with, per GDN
            layer, ``conv[il]`` ``[n_snap, conv_dim, K-1]`` and ``rec[il]`` ``[n_snap, Hv, dk, dv]``,
            allocated on the slot's first verify (TensorRT-LLM and llama.cpp allocate them for every
            slot up front; :func:`~infertrace.kv.budget.recurrent_state_bytes` counts them all).

    Raises:
        InfertraceError: ``n_slots`` < 1 or ``n_snap`` < 0.
    """

    def __init__(self, layers: Sequence[int], conv_dim: int, kernel: int, n_v_heads: int, k_head_dim: int, v_head_dim: int,
                 n_slots: int, convention: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 n_snap: int = 0):
        if n_snap < 0:
            raise InfertraceError(f"the recurrent state's verify snapshots per slot must be >= 0 (got {n_snap})")
        if n_slots < 1:
            raise InfertraceError("the recurrent state needs at least one slot; raise EngineOptions.n_seq_max (the CLI uses 64; a running batch never needs more)")
        self.layers = list(layers)
        self.convention = convention
        self.n_slots = n_slots
        self.conv_shape = (conv_dim, kernel - 1)
        self.rec_shape = (n_v_heads, k_head_dim, v_head_dim)
        self.conv = {il: torch.zeros(n_slots, *self.conv_shape, dtype=dtype, device=device) for il in self.layers}  # [S, C, K-1]
        self.rec = {il: torch.zeros(n_slots, *self.rec_shape, dtype=dtype, device=device) for il in self.layers}  # [S, Hv, dk, dv]
        self.owner: dict[int, int] = {}  # seq_id -> slot / cell
        self.free: list[int] = list(range(n_slots))
        self.rs_z = -1  # cells: the cell zeroed in the last prepare (-1 = none)
        self.last_indices: list[int] = []
        self.n_snap = n_snap
        self.dtype, self.device = dtype, device
        #: slot -> (conv, rec) snapshots per GDN layer: [n_snap, C, K-1] / [n_snap, Hv, dk, dv]
        self.snap: dict[int, tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]] = {}
        #: seq_id -> (slot, parents) of the verify chunk whose snapshots await :meth:`select`
        self.pending: dict[int, tuple[int, list[int]]] = {}

    # --- bookkeeping ------------------------------------------------------------
    def slot_of(self, seq_id: int) -> int | None:
        """The slot (cell) ``seq_id`` holds, or None."""
        return self.owner.get(seq_id)

    def can_fit(self, plan: list[tuple[int, int]]) -> bool:
        """Whether every new sequence of ``plan`` can get a slot."""
        new = {s for s, _ in plan if s not in self.owner}
        return len(new) <= len(self.free)

    def _acquire(self, seq_id: int) -> int:
        if not self.free:
            raise InfertraceError(f"no free recurrent-state slot for seq {seq_id} ({self.n_slots} slots); raise EngineOptions.n_seq_max (the CLI uses 64; a running batch never needs more)")
        slot = self.free.pop(0)  # lowest free first
        self.owner[seq_id] = slot
        return slot

    def _zero(self, slot: int) -> None:
        for il in self.layers:
            self.conv[il][slot].zero_()
            self.rec[il][slot].zero_()

    def prepare(self, chunks: Sequence[ChunkSpec]) -> list[int]:
        """Slot per chunk (packed order); chunks starting at ``C == 0`` get cleared state.

        Returns ``state_indices`` ``[num_seqs]`` (TensorRT-LLM) = the cell of each sequence (llama.cpp).
        """
        idx, self.rs_z = [], -1
        for c in chunks:
            slot = self.owner.get(c.seq_id)
            if slot is None:
                if c.C:
                    raise InfertraceError(f"seq {c.seq_id} continues at position {c.C} but holds no recurrent state")
                slot = self._acquire(c.seq_id)
            if c.C == 0:
                self._zero(slot)
                self.rs_z = slot if self.rs_z < 0 else min(self.rs_z, slot)
            if c.parents is not None:  # a speculative verify chunk: one snapshot per candidate
                if c.T > self.n_snap:
                    raise InfertraceError(f"a verify chunk of {c.T} candidates needs {c.T} state snapshots per slot but the "
                                          f"recurrent state keeps {self.n_snap}; build the memory with the speculative options")
                self.pending[c.seq_id] = (slot, list(c.parents))
            idx.append(slot)
        self.last_indices = idx
        return idx

    def release(self, seq_id: int) -> None:
        """Free the slot of ``seq_id`` (finish, preemption, ``seq_rm`` of the whole sequence)."""
        slot = self.owner.pop(seq_id, None)
        self.pending.pop(seq_id, None)
        if slot is not None:
            self.free.append(slot)
            self.free.sort()

    def seq_cp(self, src: int, dst: int) -> None:
        """Copy ``src``'s state to ``dst`` (llama.cpp ``llama_memory_seq_cp`` on a recurrent memory).

        Raises:
            InfertraceError: ``src`` holds no state.
        """
        s = self.owner.get(src)
        if s is None:
            raise InfertraceError(f"seq_cp: seq {src} holds no recurrent state")
        d = self.owner.get(dst)
        if d is None:
            d = self._acquire(dst)
        for il in self.layers:
            self.conv[il][d].copy_(self.conv[il][s])
            self.rec[il][d].copy_(self.rec[il][s])

    def seq_rm(self, seq_id: int, p0: int, p1: int, n_cached: int) -> bool:
        """``llama_memory_recurrent::seq_rm``: a state is one summary of all the sequence's tokens, so
        only the whole sequence can go (its slot is freed) or a range past its end (nothing to do);
        a range cutting into it answers False and nothing changes. ``n_cached``: the sequence's length."""
        if p0 >= n_cached >= 0 and p0 > 0:
            return True
        if p0 <= 0 and (p1 < 0 or p1 >= n_cached):
            self.release(seq_id)
            return True
        return False

    def seq_keep(self, seq_id: int) -> None:
        """``llama_memory_recurrent::seq_keep``: every other sequence's slot is freed."""
        for s in [s for s in self.owner if s != seq_id]:
            self.release(s)

    # --- speculative verify snapshots ----------------------------------------------
    def keep_snapshots(self, il: int, slot: int, conv: torch.Tensor, rec: torch.Tensor) -> None:
        """Store the states after each candidate of a verify chunk in layer ``il``'s snapshots of ``slot``.

        Args:
            conv: ``[T, conv_dim, K-1]``; rec: ``[T, Hv, dk, dv]`` (entry i: after candidate i).

        Raises:
            InfertraceError: more candidates than snapshots per slot.
        """
        T = conv.shape[0]
        if T > self.n_snap:
            raise InfertraceError(f"{T} verify candidates but {self.n_snap} state snapshots per slot")
        if slot not in self.snap:  # the slot's first verify
            kw = dict(dtype=self.dtype, device=self.device)
            self.snap[slot] = ({i: torch.zeros(self.n_snap, *self.conv_shape, **kw) for i in self.layers},  # [n_snap, C, K-1]
                               {i: torch.zeros(self.n_snap, *self.rec_shape, **kw) for i in self.layers})  # [n_snap, Hv, dk, dv]
        sc, sr = self.snap[slot]
        sc[il][:T].copy_(conv)  # [T, conv_dim, K-1]
        sr[il][:T].copy_(rec)  # [T, Hv, dk, dv]

    def snapshot_bytes(self) -> int:
        """Bytes of the verify snapshots allocated so far (slots that ran a verify)."""
        return sum(t.numel() * t.element_size() for sc, sr in self.snap.values() for d in (sc, sr) for t in d.values())

    def _stats(self, slot: int, il: int) -> dict[str, float]:
        """L2 norm and sum (checksum) of layer ``il``'s conv / recurrent state of ``slot``."""
        c, r = self.conv[il][slot].float(), self.rec[il][slot].float()
        return {"conv_norm": round(float(c.norm()), 6), "conv_sum": round(float(c.sum()), 6),
                "rec_norm": round(float(r.norm()), 6), "rec_sum": round(float(r.sum()), 6)}

    def _shown_layers(self) -> list[int]:
        return self.layers[:2] + ([self.layers[-1]] if len(self.layers) > 2 else [])

    def select(self, seq_id: int, accepted: Sequence[int], is_chain: bool) -> dict[str, Any] | None:
        """After a verify chunk of ``seq_id``: the snapshot of the last accepted candidate becomes the
        state of every GDN layer; the others are dropped.

        Args:
            accepted: chunk-local accepted nodes, root 0 first (a path down the tree).
            is_chain: the chunk was a chain (then ``accepted == 0..a``).

        Returns:
            None when ``seq_id`` ran no verify chunk since the last select (nothing to choose), else the
            JSON-ready record: ``convention``, ``slot``, ``snapshots`` (T kept by the verify),
            ``kept_node``, ``kept_snapshot`` and ``index_name`` (what the runtime calls the index:
            llama.cpp ``rs_idx`` = tokens rolled back for a chain on cells, TensorRT-LLM
            ``num_accepted_draft_tokens`` for a chain / ``accepted_leaf_positions`` for a tree on paged;
            a tree on cells is indexed by its node), ``dropped_nodes``, and per shown GDN layer the
            L2 norm / sum of the conv and recurrent state ``before`` (the state before the chunk) and
            ``after`` (the kept snapshot).

        Mirrors TensorRT-LLM ``MambaCacheManager.update_mamba_states`` (``_torch/pyexecutor/
        mamba_cache_manager.py``: ``ssm_states[:, state_indices_d] = intermediate_ssm[:, src, accepted]``)
        and llama.cpp ``llama_memory_recurrent::seq_rm`` (``set_rs_idx(seq_id, rollback)``).
        """
        got = self.pending.pop(seq_id, None)
        if got is None:
            return None
        slot, parents = got
        T = len(parents)
        node = int(accepted[-1])
        shown = self._shown_layers()
        before = {il: self._stats(slot, il) for il in shown}
        sc, sr = self.snap[slot]
        for il in self.layers:
            self.conv[il][slot].copy_(sc[il][node])  # [conv_dim, K-1]
            self.rec[il][slot].copy_(sr[il][node])  # [Hv, dk, dv]
        if self.convention == "cells":
            name, idx = ("rs_idx", T - len(accepted)) if is_chain else ("node", node)
        else:
            name, idx = ("num_accepted_draft_tokens", node) if is_chain else ("accepted_leaf_positions", node)
        return {"convention": self.convention, "slot": slot, "snapshots": T, "kept_node": node, "kept_snapshot": idx,
                "index_name": name, "dropped_nodes": [i for i in range(T) if i != node],
                "layers": [{"layer": il, "before": before[il], "after": self._stats(slot, il)} for il in shown]}

    def checkpoint(self, seq_id: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """A copy of ``seq_id``'s conv ``[conv_dim, K-1]`` and recurrent ``[Hv, dk, dv]`` state per GDN layer
        (llama.cpp server's speculative checkpoint: ``llama_state_seq_get_data`` of the recurrent part).

        Raises:
            InfertraceError: ``seq_id`` holds no state.
        """
        slot = self.owner.get(seq_id)
        if slot is None:
            raise InfertraceError(f"checkpoint: seq {seq_id} holds no recurrent state")
        return {il: (self.conv[il][slot].clone(), self.rec[il][slot].clone()) for il in self.layers}

    def restore(self, seq_id: int, ckpt: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put a :meth:`checkpoint` back into ``seq_id``'s slot (``llama_state_seq_set_data``).

        Raises:
            InfertraceError: ``seq_id`` holds no state, or the checkpoint is of other layers.
        """
        slot = self.owner.get(seq_id)
        if slot is None or set(ckpt) != set(self.layers):
            raise InfertraceError(f"restore: seq {seq_id} holds no recurrent state or the checkpoint is of other layers")
        for il, (c, r) in ckpt.items():
            self.conv[il][slot].copy_(c)  # [conv_dim, K-1]
            self.rec[il][slot].copy_(r)  # [Hv, dk, dv]

    # --- reading ------------------------------------------------------------------
    def state_of(self, il: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Conv ``[conv_dim, K-1]`` and recurrent ``[Hv, dk, dv]`` state of ``seq_id`` in layer ``il``."""
        slot = self.owner[seq_id]
        return self.conv[il][slot], self.rec[il][slot]

    def describe_state(self, active: bool = True) -> dict[str, Any]:
        """JSON-ready view for traces and ``dump-kv``: convention, slots, shapes, dtype (GGUF-style name),
        bytes per request, ``state_indices`` / ``rs_z`` of the last step (when ``active``) and, per
        request holding a slot, the L2 norm and sum (checksum) of the conv and recurrent state of the
        first two and the last GDN layer; with speculative verify snapshots also ``snapshots_per_slot``
        and ``snapshot_bytes_per_seq``."""
        per = []
        shown = self.layers[:2] + ([self.layers[-1]] if len(self.layers) > 2 else [])
        for sid, slot in sorted(self.owner.items()):
            rows = []
            for il in shown:
                c, r = self.conv[il][slot].float(), self.rec[il][slot].float()
                rows.append({"layer": il, "conv_norm": round(float(c.norm()), 6), "conv_sum": round(float(c.sum()), 6),
                             "rec_norm": round(float(r.norm()), 6), "rec_sum": round(float(r.sum()), 6)})
            per.append({"seq_id": sid, "slot": slot, "layers": rows})
        any_rec = next(iter(self.rec.values()), None)
        size = self.conv_shape[0] * self.conv_shape[1] + self.rec_shape[0] * self.rec_shape[1] * self.rec_shape[2]
        out = {"convention": self.convention, "n_slots": self.n_slots, "n_layers": len(self.layers),
               "conv_shape": list(self.conv_shape), "rec_shape": list(self.rec_shape),
               "dtype": _dt(any_rec) if any_rec is not None else "",
               "state_indices": list(self.last_indices) if active else [], "rs_z": self.rs_z if active else -1,
               "free": list(self.free)[:64], "per_seq": per,
               "bytes_per_seq": int(len(self.layers) * size * (any_rec.element_size() if any_rec is not None else 4))}
        if self.n_snap:  # speculative: verify snapshots per slot (only then, so other traces keep their bytes)
            out["snapshots_per_slot"] = self.n_snap
            out["snapshot_bytes_per_seq"] = out["bytes_per_seq"] * self.n_snap
        return out

    def summary(self) -> dict[str, Any]:
        """JSON-ready view: shapes, slots, owners and per (layer, seq) L2 norm + checksum (sum)."""
        per = []
        for sid, slot in sorted(self.owner.items()):
            for il in self.layers:
                c, r = self.conv[il][slot].float(), self.rec[il][slot].float()
                per.append({"seq_id": sid, "slot": slot, "layer": il, "conv_norm": round(float(c.norm()), 6),
                            "conv_sum": round(float(c.sum()), 6), "rec_norm": round(float(r.norm()), 6),
                            "rec_sum": round(float(r.sum()), 6)})
        return {"convention": self.convention, "n_slots": self.n_slots, "layers": list(self.layers),
                "conv_shape": list(self.conv_shape), "rec_shape": list(self.rec_shape),
                "dtype": str(next(iter(self.rec.values())).dtype).replace("torch.", "") if self.rec else "",
                "owners": {str(k): v for k, v in sorted(self.owner.items())}, "free": list(self.free),
                "state_indices": list(self.last_indices), "rs_z": self.rs_z, "per_seq": per}


def _partial(op: str, seq_id: int, p0: int, p1: int) -> str:
    return (f"{op} of positions {max(p0, 0)}..{'end' if p1 < 0 else p1 - 1} of seq {seq_id} on a hybrid model: its "
            "recurrent (GDN) state cannot drop or copy part of a sequence (llama.cpp's memory_recurrent refuses it too)")


class HybridKV(MemoryDefaults):
    """An attention memory plus recurrent state: llama.cpp ``llama_memory_hybrid`` (``mem_attn`` KV
    cache + ``mem_recr`` ``memory_recurrent``) / TensorRT-LLM ``MambaHybridCacheManager``
    (KVCacheManager + state slots), implementing the :class:`~infertrace.kv.base.Memory` protocol by
    composition: each operation runs on both parts, the recurrent part first where it may refuse (as
    ``llama_memory_hybrid::seq_rm`` does), so a refused operation changes nothing.

    ``attn`` stores K/V of the attention layers only (``kv_layers``, model layer indices; physical
    layer j holds model layer ``kv_layers[j]``), as llama.cpp's ``memory_hybrid`` gives its KV cache
    only the non-recurrent layers and TensorRT-LLM's KV pools cover the attention layers.
    ``write`` / ``attend`` / ``read`` take model layer indices; ``prepare`` adds each chunk's state
    slot (``inp.state_indices``). Prefix / block reuse is off (:data:`NO_REUSE_REASON`).
    """

    layout = "hybrid"  # what the views read (infertrace.capture.kv_views): its attention part

    def __init__(self, attn: Any, state: RecurrentState, kv_layers: Sequence[int]):
        self.attn = attn
        self.state = state
        self.kv_layers = list(kv_layers)
        self.kv_index = {il: j for j, il in enumerate(kv_layers)}
        self.kind = attn.kind
        self.capacity_tokens = attn.capacity_tokens

    def phys_layer(self, il: int) -> int:
        """Physical KV layer of model layer ``il``.

        Raises:
            InfertraceError: ``il`` is a GDN layer (it keeps state, no K/V).
        """
        j = self.kv_index.get(il)
        if j is None:
            raise InfertraceError(f"layer {il} is a Gated DeltaNet layer: it keeps a fixed-size state, no K/V "
                                  f"(K/V layers: {', '.join(map(str, self.kv_layers))})")
        return j

    def recurrent_state(self) -> RecurrentState:
        """The recurrent part (llama.cpp ``get_mem_recr``)."""
        return self.state

    # --- batch preparation and the forward ---------------------------------------------------------------
    def can_fit(self, plan: list[tuple[int, int]]) -> bool:
        return self.attn.can_fit(plan) and self.state.can_fit(plan)

    def prepare(self, chunks: Sequence[ChunkSpec]) -> AttnInputs:
        inp = self.attn.prepare(chunks)
        inp.state_indices = self.state.prepare(chunks)
        return inp

    def write(self, layer: int, k: Any, v: Any, inp: AttnInputs) -> None:
        self.attn.write(self.phys_layer(layer), k, v, inp)

    def attend(self, layer: int, q: Any, inp: AttnInputs, scale: float) -> Any:
        return self.attn.attend(self.phys_layer(layer), q, inp, scale)

    def release(self, seq_id: int) -> None:
        self.attn.release(seq_id)
        self.state.release(seq_id)

    def forget(self, seq_id: int) -> None:
        """Free the attention part without keeping it for reuse, and the state slot."""
        self.attn.forget(seq_id)
        self.state.release(seq_id)

    # --- sequence operations: recurrent part first (it may refuse), then the attention part ---------------
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> MemOp:
        if not self.state.seq_rm(seq_id, p0, p1, self.attn.seq_len(seq_id)):
            return MemOp.refused("seq_rm", _partial("seq_rm", seq_id, p0, p1))
        return self.attn.seq_rm(seq_id, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> MemOp:
        if not (p0 <= 0 and p1 < 0):
            return MemOp.refused("seq_cp", _partial("seq_cp", src, p0, p1))
        self.state.seq_cp(src, dst)
        return self.attn.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> MemOp:
        self.state.seq_keep(seq_id)
        return self.attn.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int, ropes: Sequence[Any]) -> MemOp:
        """Positions of the attention part move (a state has none); ``ropes`` per model layer."""
        return self.attn.seq_add(seq_id, p0, p1, delta, [ropes[il] for il in self.kv_layers])

    def seq_pos_min(self, seq_id: int) -> int:
        return self.attn.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.attn.seq_pos_max(seq_id)

    def shift_out(self, seq_id: int, p0: int, p1: int, ropes: Sequence[Any]) -> MemOp:
        return MemOp.refused("shift_out", _partial("shift_out", seq_id, p0, p1))

    def rewind(self, seq_id: int, C: int, T: int, accepted: Sequence[int], inp: AttnInputs, row: int,
               is_chain: bool) -> MemOp:
        """After a speculative verify chunk: the accepted candidate's state snapshot becomes the GDN
        state (:meth:`RecurrentState.select`), then the attention part rewinds its K/V as on a plain
        model. The answer is the attention rewind's record plus ``state`` (the snapshot kept, norms
        before / after); refused (nothing changed) when the chunk kept no snapshots."""
        sel = self.state.select(seq_id, accepted, is_chain)
        if sel is None:
            return MemOp.refused("rewind", _partial("rewind", seq_id, C + len(accepted), -1) +
                                 "; the verify chunk kept no per-candidate state snapshots")
        op = self.attn.rewind(seq_id, C, T, accepted, inp, row, is_chain)
        op["state"] = sel
        return op

    def lookup(self, seq_id: int, prompt: Sequence[int]) -> dict[str, Any]:
        return {"hit": 0, "refused": NO_REUSE_REASON}

    def checkpoint(self, seq_id: int) -> dict[str, Any]:
        """``{"n": cached tokens, "state": RecurrentState.checkpoint}`` of ``seq_id``: what llama.cpp server's
        speculative checkpointing saves of a hybrid context before drafting (``tools/server``,
        ``llama_state_seq_get_data_ext`` with ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``)."""
        return {"n": self.attn.seq_len(seq_id), "state": self.state.checkpoint(seq_id)}

    def restore(self, seq_id: int, ckpt: dict[str, Any]) -> MemOp:
        """Back to a :meth:`checkpoint`: its GDN state restored, the attention part's positions from
        ``ckpt["n"]`` on removed (``seq_rm(seq, n, -1)``); then the tokens accepted since are re-evaluated
        by the caller."""
        self.state.restore(seq_id, ckpt["state"])
        return self.attn.seq_rm(seq_id, int(ckpt["n"]), -1)

    # --- state read ----------------------------------------------------------------------------------------
    def seq_len(self, seq_id: int) -> int:
        return self.attn.seq_len(seq_id)

    def read(self, layer: int, seq_id: int) -> Any:
        return self.attn.read(self.phys_layer(layer), seq_id)

    def logical_mask(self, inp: AttnInputs, swa: bool = False) -> list[Any]:
        return self.attn.logical_mask(inp, swa)

    def snapshot(self) -> dict[str, Any]:
        return self.attn.snapshot()

    def describe(self) -> dict[str, Any]:
        return {**self.attn.describe(), "kv_layers": list(self.kv_layers)}

    def written_blocks(self, inp: AttnInputs, row: int, T: int) -> list[int]:
        return self.attn.written_blocks(inp, row, T)
