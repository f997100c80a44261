"""TensorRT-LLM / vLLM-style paged KV cache: a block pool, free list, block tables, slot mapping.

Mirrors TensorRT-LLM ``_torch/pyexecutor/resource_manager.py`` (``KVCacheManager``: pools
``[num_blocks, 2, n_kv_heads, tokens_per_block, head_dim]`` per layer, ``add_token`` growth,
block offsets per request, ``free_resources``) and vLLM's block manager / ``slot_mapping``.
Attention gets no dense mask: mask type ``causal`` plus ``seq_lens``, ``kv_lens``,
``cu_seqlens`` and block tables (TensorRT-LLM ``attention_backend/trtllm.py``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from infertrace.attention.reference import paged_attention_torch
from infertrace.attention.select import paged_attention, write_kv_paged
from infertrace.errors import ConfigError, InfertraceError
from infertrace.kv.base import ChunkSpec, MemOp, MemoryDefaults, PagedInputs, ranges_text
from infertrace.kv import seq_ops

#: TensorRT-LLM's default ``tokens_per_block`` (vLLM uses 16).
DEFAULT_TOKENS_PER_BLOCK = 32


class PagedKV(MemoryDefaults):
    """Paged pool for ``n_layer`` layers (the :class:`~infertrace.kv.base.Memory` protocol).

    Args:
        n_layer, n_kv_heads, head_dim: model shape.
        num_blocks: blocks in the pool (shared by all requests).
        tokens_per_block: B, slots per block.
        dtype, device: pool dtype/device.
        attn_impl: ``"torch"`` or ``"triton"`` (see :mod:`infertrace.attention.select`).
        windows: per layer sliding window W (0 = full): the attention call of that layer gets
            it as metadata (TensorRT-LLM ``attention_window_size``, vLLM ``sliding_window``).

    Storage: ``pool[layer]``: ``[num_blocks, 2, n_kv_heads, B, head_dim]`` (0 = K, 1 = V).
    """

    kind = "paged"
    layout = "paged"  # what the views read (infertrace.capture.kv_views)

    def __init__(self, n_layer: int, n_kv_heads: int, head_dim: int, num_blocks: int,
                 tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", attn_impl: str = "torch", windows: Sequence[int] | None = None):
        if num_blocks < 1 or tokens_per_block < 1:
            raise ConfigError("cache.num_blocks" if num_blocks < 1 else "cache.tokens_per_block",
                              f"must be >= 1 (got {num_blocks if num_blocks < 1 else tokens_per_block})")
        self.n_layer = n_layer
        self.kv_layers = list(range(n_layer))  # model layers with K/V: all of them
        self.B = tokens_per_block
        self.num_blocks = num_blocks
        self.capacity_tokens = num_blocks * tokens_per_block
        self.pool = [torch.zeros(num_blocks, 2, n_kv_heads, tokens_per_block, head_dim, dtype=dtype, device=device)
                     for _ in range(n_layer)]  # [num_blocks, 2, n_kv_heads, B, hd]
        self.free: list[int] = list(range(num_blocks))  # free list, lowest id first
        self.tables: dict[int, list[int]] = {}  # seq_id -> block table
        self.lens: dict[int, int] = {}  # seq_id -> tokens stored
        self.device = device
        self.attn_impl = attn_impl
        self.windows = list(windows) if windows is not None else [0] * n_layer  # per layer, 0 = full attention

    # --- bookkeeping -------------------------------------------------------------
    def blocks_needed(self, seq_id: int, n_new: int) -> int:
        """New blocks ``seq_id`` needs to hold ``n_new`` more tokens."""
        have = len(self.tables.get(seq_id, []))
        need = -(-(self.lens.get(seq_id, 0) + n_new) // self.B)
        return max(0, need - have)

    def can_fit(self, plan: list[tuple[int, int]]) -> bool:
        """Whether every ``(seq_id, n_new)`` of ``plan`` fits at once (free blocks)."""
        return sum(self.blocks_needed(s, n) for s, n in plan) <= len(self.free)

    def seq_len(self, seq_id: int) -> int:
        return self.lens.get(seq_id, 0)

    def slot(self, seq_id: int, p: int) -> int:
        """Physical slot of logical position ``p``: ``table[p // B] * B + p % B``."""
        return self.tables[seq_id][p // self.B] * self.B + p % self.B

    def _grow(self, seq_id: int, n_new: int) -> None:
        need = self.blocks_needed(seq_id, n_new)
        if need > len(self.free):
            raise InfertraceError(
                f"KV pool exhausted: seq {seq_id} needs {need} blocks, {len(self.free)} free of {self.num_blocks}; raise --num-blocks"
            )
        tab = self.tables.setdefault(seq_id, [])
        for _ in range(need):
            tab.append(self.free.pop(0))
        self.lens[seq_id] = self.lens.get(seq_id, 0) + n_new

    # --- per step ----------------------------------------------------------------
    def prepare(self, chunks: Sequence[ChunkSpec]) -> PagedInputs:
        """Grow each request's block table for its current tokens and build the metadata.

        Returns :class:`~infertrace.kv.base.PagedInputs`: ``slot_mapping`` ``[N]`` int64, ``block_tables`` ``[num_seqs, max_blocks]``
        int32 (-1 padded), ``seq_lens``/``kv_lens`` ``[num_seqs]`` int32, ``cu_seqlens``
        ``[num_seqs+1]`` int32, ``num_contexts``, ``request_types``, ``mask_type="causal"``.
        Context requests (T > 1 or first chunk) are packed first as TensorRT-LLM does only
        by convention; here the packed order is the scheduler's.
        """
        positions, seq_ids, slots = [], [], []
        for c in chunks:
            if self.lens.get(c.seq_id, 0) != c.C:
                raise InfertraceError(f"internal: seq {c.seq_id} has {self.lens.get(c.seq_id, 0)} cached tokens, step expects C={c.C}")
            self._grow(c.seq_id, c.T)
            for p, d in zip(range(c.C, c.C + c.T), c.depths()):
                positions.append(c.C + d)  # past + depth(node) for a draft tree (TensorRT-LLM position offsets)
                seq_ids.append(c.seq_id)
                slots.append(self.slot(c.seq_id, p))  # storage order = packed order
        max_blocks = max(len(self.tables[c.seq_id]) for c in chunks)
        bt = torch.full((len(chunks), max_blocks), -1, dtype=torch.int32)  # [num_seqs, max_blocks]
        for i, c in enumerate(chunks):
            tab = self.tables[c.seq_id]
            bt[i, : len(tab)] = torch.tensor(tab, dtype=torch.int32)
        seq_lens = torch.tensor([c.T for c in chunks], dtype=torch.int32)  # [num_seqs]
        kv_lens = torch.tensor([c.C + c.T for c in chunks], dtype=torch.int32)  # [num_seqs]
        cu = torch.zeros(len(chunks) + 1, dtype=torch.int32)  # [num_seqs+1]
        cu[1:] = torch.cumsum(seq_lens, 0)
        types = ["generation" if c.parents is not None else "context" if (c.C == 0 or c.T > 1) else "generation"
                 for c in chunks]
        from infertrace.kv.spec_meta import spec_metadata

        spec = spec_metadata(chunks)  # {} unless the step verifies drafts
        return PagedInputs(
            list(chunks), torch.tensor(positions, dtype=torch.int64), torch.tensor(seq_ids, dtype=torch.int64), self.kind,
            **spec, slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=bt, seq_lens=seq_lens,
            kv_lens=kv_lens, cu_seqlens=cu, request_types=types, num_contexts=sum(t == "context" for t in types),
            mask_type="causal", tokens_per_block=self.B, attention_window={i: w for i, w in enumerate(self.windows) if w},
        )

    def _dev(self, inp: PagedInputs) -> dict[str, torch.Tensor]:
        if inp.dev is None:
            dev = self.device
            inp.dev = {"slot_mapping": inp.slot_mapping.to(dev), "block_tables": inp.block_tables.to(dev),
                       "seq_lens": inp.seq_lens.to(dev), "kv_lens": inp.kv_lens.to(dev), "cu_seqlens": inp.cu_seqlens.to(dev)}
        return inp.dev

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, inp: PagedInputs) -> None:
        """Scatter current K/V ``[N, n_kv_heads, hd]`` to ``slot_mapping`` (``update_kv_cache``)."""
        d = self._dev(inp)
        write_kv_paged(self.attn_impl, self.pool[layer], k, v, d["slot_mapping"])

    def attend(self, layer: int, q: torch.Tensor, inp: PagedInputs, scale: float) -> torch.Tensor:
        """Causal varlen attention read through block tables; no dense mask."""
        d = self._dev(inp)
        tree = inp.spec_tree_mask  # [S, T_max, T_max] bool, only when a step verifies a branching tree
        if tree is not None:
            if self.attn_impl != "torch":
                raise InfertraceError("tree verification needs --attention torch (the Triton kernel reads causal lengths only)")
            return paged_attention_torch(q, self.pool[layer], d["block_tables"], d["seq_lens"], d["kv_lens"],
                                         d["cu_seqlens"], scale, self.windows[layer], tree_mask=tree,
                                         q_pos=inp.spec_q_pos)
        return paged_attention(self.attn_impl, q, self.pool[layer], d["block_tables"], d["seq_lens"], d["kv_lens"],
                               d["cu_seqlens"], scale, self.windows[layer])

    def release(self, seq_id: int) -> None:
        """Return ``seq_id``'s blocks to the free list (``free_resources``)."""
        for b in self.tables.pop(seq_id, []):
            self.free.append(b)
        self.free.sort()
        self.lens.pop(seq_id, None)

    def free_blocks(self, blocks: Sequence[int]) -> None:
        """Return ``blocks`` to the free list (a pool that shares blocks counts references instead)."""
        self.free.extend(blocks)
        self.free.sort()

    def make_private(self, seq_id: int, first: int) -> list[dict[str, Any]]:
        """Copy-on-write of ``seq_id``'s shared blocks from block ``first`` on: nothing is shared here."""
        return []

    # --- sequence operations (vLLM / TensorRT-LLM block free and fork; K-shift math in kv/seq_ops.py) ---------
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> MemOp:
        """Remove positions ``p0..`` of ``seq_id``: a tail only (false for a middle range: a block table
        cannot hold a hole; a context shift closes the gap instead). Blocks no longer needed are released
        (reference counted when the pool shares blocks). Answers ``{"op", "seq_id", "range", "pos", "freed_blocks"}``."""
        L = self.lens.get(seq_id, 0)
        if 0 <= p1 < L:
            return MemOp.refused("seq_rm", f"paged seq_rm({seq_id}, {p0}, {p1}): only a tail can be removed from a block "
                                 f"table (sequence holds 0..{L - 1}); use a context shift to drop a middle range")
        a, _ = seq_ops.pos_range(p0, p1)
        if a >= L:
            return MemOp({"op": "seq_rm", "seq_id": seq_id, "range": f"[{a}, end)", "pos": "-", "freed_blocks": []})
        if a == 0:
            tab = list(self.tables.get(seq_id, []))
            self.release(seq_id)
            return MemOp({"op": "seq_rm", "seq_id": seq_id, "range": "[0, end)", "pos": ranges_text(range(L)),
                          "freed_blocks": tab})
        if a % self.B:
            self.make_private(seq_id, a // self.B)  # the kept partial block will be rewritten: copy-on-write / unhash
        keep_blocks = -(-a // self.B)
        tab = self.tables[seq_id]
        dropped = tab[keep_blocks:]
        self.tables[seq_id] = tab[:keep_blocks]
        self.lens[seq_id] = a
        self.free_blocks(dropped)  # reference counted when the pool shares blocks (kv/prefix_cache.py)
        return MemOp({"op": "seq_rm", "seq_id": seq_id, "range": f"[{a}, end)", "pos": ranges_text(range(a, L)),
                      "freed_blocks": dropped})

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> MemOp:
        """Fork ``dst`` from ``src``'s prefix ``0..p1-1`` (shared full blocks reference counted, the partial
        last block copied: vLLM / TensorRT-LLM fork; false unless ``p0 <= 0``: a table shares a prefix only)."""
        if p0 > 0:
            return MemOp.refused("seq_cp", "paged seq_cp copies a prefix: p0 must be 0 (or -1)")
        L = self.lens.get(src, 0)
        return MemOp(self.fork(src, dst, L if p1 < 0 else min(p1, L)))

    def seq_keep(self, seq_id: int) -> MemOp:
        """Release every sequence but ``seq_id``."""
        others = [s for s in list(self.tables) if s != seq_id]
        for s in others:
            self.release(s)
        return MemOp({"op": "seq_keep", "seq_id": seq_id, "released": others})

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int, ropes: Sequence[Any]) -> MemOp:
        """Positions are slot order in a block table: moving some alone is not representable (false);
        :meth:`shift_out` moves the K/V with them."""
        return MemOp.refused("seq_add", "paged memory: positions are block-table order, a shift moves the K/V "
                             "(shift_out), seq_add alone is not supported")

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest cached position of ``seq_id`` (0 for a paged sequence), -1 when it holds none."""
        return 0 if self.lens.get(seq_id, 0) else -1

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest cached position of ``seq_id`` (its length - 1), -1 when it holds none."""
        return self.lens.get(seq_id, 0) - 1

    def shift_out(self, seq_id: int, p0: int, p1: int, ropes: Sequence[Any]) -> MemOp:
        """Drop positions ``p0 <= p < p1`` of ``seq_id`` and close the gap: the K/V of ``p1..L-1`` move to
        ``p0..`` and their K is re-rotated by ``-(p1 - p0)`` with each layer's RoPE (``ropes``, one per layer:
        K-shift), then the tail is freed: llama.cpp's ``seq_rm`` + ``seq_add`` pair (server context shift) in
        block-table form. Blocks shared with another sequence are never written: they are replaced by private
        copies first. Answers ``{"op": "shift_out", "seq_id", "removed", "from", "to", "delta", "freed_blocks"}``."""
        tables = seq_ops.shift_tables(self, ropes)
        L = self.lens.get(seq_id, 0)
        p1 = min(p1, L)
        n = p1 - p0
        if n <= 0:
            return MemOp({"op": "shift_out", "seq_id": seq_id, "removed": "-", "delta": 0, "freed_blocks": []})
        self.make_private(seq_id, p0 // self.B)  # copy-on-write of shared blocks that will be rewritten
        src = torch.tensor([self.slot(seq_id, p) for p in range(p1, L)], dtype=torch.int64)  # [M]
        dst = torch.tensor([self.slot(seq_id, p) for p in range(p0, L - n)], dtype=torch.int64)  # [M]
        d = torch.full((src.numel(),), -n, dtype=torch.int64)  # [M]
        for pool, inv_freq in zip(self.pool, tables):
            sb, so, db, do = src // self.B, src % self.B, dst // self.B, dst % self.B
            k = pool[sb, 0, :, so, :].clone()  # [M, n_kv_heads, hd]
            v = pool[sb, 1, :, so, :].clone()  # [M, n_kv_heads, hd]
            pool[db, 0, :, do, :] = seq_ops.rotate_k(k, d, inv_freq)
            pool[db, 1, :, do, :] = v
        rm = PagedKV.seq_rm(self, seq_id, L - n, -1)
        return MemOp({"op": "shift_out", "seq_id": seq_id, "removed": ranges_text(range(p0, p1)),
                      "from": ranges_text(range(p1, L)), "to": ranges_text(range(p0, L - n)), "delta": -n,
                      "freed_blocks": rm["freed_blocks"]})

    def rewind(self, seq_id: int, C: int, T: int, accepted: Sequence[int], inp: PagedInputs, row: int,
               is_chain: bool) -> MemOp:
        """Speculative rollback after a verify chunk ``C, T`` of ``seq_id``: the accepted path's K/V move to
        positions ``C + depth`` (TensorRT-LLM ``update_kv_cache_draft_token_location``), then the tail is
        freed. Answers ``{"op", "seq_id", "kept_pos", "removed_pos", "n_removed", "moved_slots", "freed_blocks", ...}``."""
        keep = C + len(accepted)
        rec: dict[str, Any] = {"seq_id": seq_id, "kept_pos": ranges_text(range(C, keep)), "n_removed": T - len(accepted)}
        moves = []
        for depth, node in enumerate(accepted):
            if node != depth:  # candidate `node` was stored at position C + node; it belongs at C + depth
                src, dst = self.slot(seq_id, C + node), self.slot(seq_id, C + depth)
                for pool in self.pool:
                    pool[dst // self.B, :, :, dst % self.B, :] = pool[src // self.B, :, :, src % self.B, :]
                moves.append([src, dst])
        op = PagedKV.seq_rm(self, seq_id, keep, -1)
        return MemOp({**rec, "op": "seq_rm", "range": op["range"], "removed_pos": op["pos"], "moved_slots": moves,
                      "freed_blocks": list(op["freed_blocks"])})

    def written_blocks(self, inp: PagedInputs, row: int, T: int) -> list[int]:
        """Blocks of ``slot_mapping[row : row + T]``."""
        return [int(s) // self.B for s in inp.slot_mapping[row : row + T].tolist()]

    # --- description ---------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """``kind``, ``dtype``, ``n_layer`` (physical), ``kv_layers``, ``n_kv_heads``, ``head_dim``, ``block_size``
        B, ``n_seq_max`` None (no limit), ``physical_shape`` ``[num_blocks, 2, n_kv_heads, B, head_dim]`` per layer."""
        p = self.pool[0]
        return {"kind": self.kind, "dtype": str(p.dtype).replace("torch.", ""), "n_layer": self.n_layer,
                "kv_layers": list(self.kv_layers), "n_kv_heads": int(p.shape[2]), "head_dim": int(p.shape[4]),
                "block_size": self.B, "n_seq_max": None, "physical_shape": list(p.shape)}

    # --- state read ----------------------------------------------------------------
    def read(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        L = self.lens.get(seq_id, 0)
        slots = torch.tensor([self.slot(seq_id, p) for p in range(L)], dtype=torch.int64)
        pool = self.pool[layer]
        k = pool[slots // self.B, 0, :, slots % self.B, :]  # [L, n_kv_heads, hd]
        v = pool[slots // self.B, 1, :, slots % self.B, :]  # [L, n_kv_heads, hd]
        return k, v

    def logical_mask(self, inp: PagedInputs, swa: bool = False) -> list[torch.Tensor]:
        """Per request, the keep-matrix ``[T, kv_len]`` implied by mask type ``causal`` and
        the lengths: query j (position ``kv_len - T + j``) sees keys ``0..kv_len-T+j`` of its
        own block-table row (isolation by construction); with ``swa``, the windowed layers'
        view (keys ``p-W+1..p``)."""
        W = max(self.windows) if swa else 0
        out = []
        for c, T, L in zip(inp.chunks, inp.seq_lens.tolist(), inp.kv_lens.tolist()):
            q = (L - T + torch.tensor(c.depths())).unsqueeze(1)  # [T, 1] query positions (past + depth for a draft tree)
            k = torch.arange(L).unsqueeze(0)  # [1, L] key positions; a tree row sees its ancestors, one per position
            m = k <= q  # [T, L]
            out.append(m & (k > q - W) if W else m)  # [T, L]
        return out

    def snapshot(self) -> dict[str, Any]:
        """Pool usage, free blocks and each request's block table with the logical positions per block."""
        reqs = {}
        for sid, tab in sorted(self.tables.items()):
            L = self.lens[sid]
            reqs[str(sid)] = {
                "block_table": list(tab), "len": L,
                "blocks": [{"block": b, "pos": ranges_text(range(i * self.B, min(L, (i + 1) * self.B)))} for i, b in enumerate(tab)],
            }
        return {"kind": self.kind, "num_blocks": self.num_blocks, "tokens_per_block": self.B,
                "attention_window": {str(i): w for i, w in enumerate(self.windows) if w},
                "used_blocks": self.num_blocks - len(self.free), "free_blocks": len(self.free),
                "free_list_head": self.free[:8], "requests": reqs}
