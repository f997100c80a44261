"""Prefix caching on both backends: shared blocks with reference counts and content hashes (paged),
shared cells through ``seq_cp`` (cells).

paged -- :class:`SharedPagedKV` mirrors vLLM v1 ``core/kv_cache_utils.py`` / ``block_pool.py``:
every full block is named by ``hash(parent_hash, its token ids)``; blocks carry a ``ref_cnt``; a
block whose last owner finished goes to the tail of the free queue *keeping its hash*, so a later
request can still hit it until the block is handed out again (least recently freed first: the LRU
eviction of vLLM's ``FreeKVCacheBlockQueue``; a request's blocks are freed tail first, so its
prefix survives longest). Lookup walks the prompt block by block and stops at the first block whose
hash is unknown (or was evicted). The tokens past the last matched full block are matched inside
one more block by content (TensorRT-LLM's partial block reuse, ``copy_on_partial_reuse``): the
matching slots are *copied* into a fresh block of the new request, never shared. A full hit still
evaluates the last prompt token (its logits are needed; vLLM caps the hit at ``len - 1``).

cells -- :class:`CachingCellsKV` mirrors llama.cpp's server prompt cache: a finished sequence keeps
its cells (a *retained* sequence) until the space is needed (least recently released first); a new
request that shares a prefix with a live or retained sequence gets those cells through ``seq_cp``
(its seq_id is added to each cell's set) and evaluates only the rest.

With caching off, :class:`SharedPagedKV` behaves exactly as :class:`~infertrace.kv.paged.PagedKV`
(free list sorted, lowest id first) and only adds reference counts, which :func:`fork` needs.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Sequence

from infertrace.errors import InfertraceError
from infertrace.kv.base import MemOp, ranges_text
from infertrace.kv.cells import CellsKV
from infertrace.kv.paged import PagedKV


def block_hash(parent: str | None, tokens: Sequence[int]) -> str:
    """Hash of one full block: sha256 of the parent block's hash and the block's token ids
    (vLLM ``hash_block_tokens``; here hex, 16 characters, stable across runs)."""
    h = hashlib.sha256(f"{parent or ''}|{','.join(str(int(t)) for t in tokens)}".encode())
    return h.hexdigest()[:16]


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class SharedPagedKV(PagedKV):
    """:class:`PagedKV` with reference-counted blocks and (``caching=True``) prefix caching.

    Extra state: ``ref[block]`` (owners), ``hash_of[block]`` / ``cached[hash] -> block`` (full
    blocks that can be hit), ``tokens_of[block]`` and ``parent_of[block]`` (content, for partial
    matches), ``evicted`` (hashes pushed out of the pool), ``events`` (evictions since the engine
    last drained them).
    """

    def __init__(self, *args: Any, caching: bool = False, **kw: Any):
        super().__init__(*args, **kw)
        self.caching = caching
        self.ref: dict[int, int] = {}
        self.hash_of: dict[int, str] = {}
        self.cached: dict[str, int] = {}
        self.tokens_of: dict[int, list[int]] = {}
        self.parent_of: dict[int, str | None] = {}
        self.evicted: set[str] = set()
        self.events: list[dict[str, Any]] = []

    # --- allocation ----------------------------------------------------------------
    def take_events(self) -> list[dict[str, Any]]:
        """Evictions since the last call."""
        out, self.events = self.events, []
        return out

    def _pop_free(self) -> int:
        if not self.free:
            raise InfertraceError(f"KV pool exhausted: no free block for a copy (all {self.num_blocks} blocks in use); "
                                  "raise --num-blocks")
        b = self.free.pop(0)
        h = self.hash_of.pop(b, None)
        if h is not None:
            if self.cached.get(h) == b:
                del self.cached[h]
            self.evicted.add(h)
            self.events.append({"op": "evict", "block": b, "hash": h})
        self.tokens_of.pop(b, None)
        self.parent_of.pop(b, None)
        self.ref[b] = 1
        return b

    def _grow(self, seq_id: int, n_new: int) -> None:
        need = self.blocks_needed(seq_id, n_new)
        if need > len(self.free):
            super()._grow(seq_id, n_new)  # raises the pool-exhausted error
        tab = self.tables.setdefault(seq_id, [])
        for _ in range(need):
            tab.append(self._pop_free())
        self.lens[seq_id] = self.lens.get(seq_id, 0) + n_new

    def free_blocks(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each of ``blocks`` (given head to tail); a block reaching 0 goes to
        the free queue, tail block first (vLLM ``free_blocks`` order), hash kept when caching."""
        for b in reversed(list(blocks)):
            self.ref[b] = self.ref.get(b, 1) - 1
            if self.ref[b] > 0:
                continue
            del self.ref[b]
            if not self.caching:
                self.hash_of.pop(b, None)
                self.tokens_of.pop(b, None)
            self.free.append(b)
        if not self.caching:
            self.free.sort()

    def release(self, seq_id: int) -> None:
        """Release ``seq_id``'s blocks (reference counted; ``free_resources``)."""
        self.free_blocks(self.tables.pop(seq_id, []))
        self.lens.pop(seq_id, None)

    def _take_block(self, b: int) -> None:
        """One more owner of ``b`` (out of the free queue if it was there: a cache hit)."""
        if self.ref.get(b, 0) == 0:
            self.free.remove(b)
            self.ref[b] = 0
        self.ref[b] += 1

    def _copy_slots(self, src: int, dst: int, n: int) -> None:
        for pool in self.pool:
            pool[dst, :, :, :n, :] = pool[src, :, :, :n, :]

    def make_private(self, seq_id: int, first: int) -> list[dict[str, Any]]:
        """Before ``seq_id`` rewrites its blocks from table index ``first`` on: shared blocks are
        replaced by private copies (copy-on-write) and private ones lose their hash (content changes)."""
        out = []
        tab = self.tables.get(seq_id, [])
        for i in range(first, len(tab)):
            b = tab[i]
            if self.ref.get(b, 1) > 1:
                nb = self._pop_free()
                self._copy_slots(b, nb, self.B)
                self.ref[b] -= 1
                tab[i] = nb
                out.append({"op": "copy_on_write", "seq_id": seq_id, "block": b, "copy": nb})
            else:
                h = self.hash_of.pop(b, None)
                if h is not None and self.cached.get(h) == b:
                    del self.cached[h]
                self.tokens_of.pop(b, None)
        return out

    def fork(self, src: int, dst: int, n: int) -> dict[str, Any]:
        """``dst`` gets ``src``'s positions ``0..n-1``: full blocks shared (``ref_cnt`` + 1), the
        partial last block copied into a fresh block (vLLM / TensorRT-LLM fork)."""
        tab = self.tables[src]
        full, rest = divmod(n, self.B)
        new = []
        for b in tab[:full]:
            self._take_block(b)
            new.append(b)
        copied = None
        if rest:
            nb = self._pop_free()
            self._copy_slots(tab[full], nb, rest)
            new.append(nb)
            copied = [tab[full], nb, rest]
        self.tables[dst] = new
        self.lens[dst] = n
        return {"op": "fork", "src": src, "dst": dst, "shared_blocks": tab[:full], "copied": copied}

    # --- prefix caching ------------------------------------------------------------
    def note_tokens(self, seq_id: int, C: int, token_ids: Sequence[int], all_ids: Sequence[int]) -> None:
        """Record the token ids just written at ``C..C+T-1`` (``all_ids``: the sequence's cached ids
        ``0..C+T-1``); blocks that became full get their hash and become hittable."""
        if not self.caching:
            return
        tab = self.tables.get(seq_id, [])
        L = C + len(token_ids)
        for i in range(C // self.B, -(-L // self.B)):
            b = tab[i]
            if b in self.hash_of:
                continue
            parent = self.hash_of.get(tab[i - 1]) if i else None
            if i and parent is None:  # parent block not hashed (duplicate content): chain broken here
                return
            toks = list(all_ids[i * self.B : min(L, (i + 1) * self.B)])
            self.tokens_of[b], self.parent_of[b] = toks, parent
            if len(toks) == self.B:
                h = block_hash(parent, toks)
                self.hash_of[b] = h
                self.cached.setdefault(h, b)
                self.evicted.discard(h)

    def lookup(self, seq_id: int, prompt: Sequence[int]) -> dict[str, Any]:
        """Find and attach the cached prefix of ``prompt`` to ``seq_id`` (which holds nothing yet).

        Returns ``{"hit", "shared_blocks", "ref_cnt", "copied", "stop", "hashes"}``: ``hit`` tokens are
        cached (at most ``len(prompt) - 1``); ``stop`` says why the lookup ended there.
        """
        B, limit = self.B, len(prompt) - 1
        parent, blocks, hashes, stop = None, [], [], None
        for i in range(len(prompt) // B):
            h = block_hash(parent, prompt[i * B : (i + 1) * B])
            b = self.cached.get(h)
            if b is None:
                why = "evicted" if h in self.evicted else "not cached"
                stop = f"block {i} (positions {i * B}..{(i + 1) * B - 1}): {why}"
                break
            blocks.append(b)
            hashes.append(h)
            parent = h
        if stop is None:
            stop = (f"partial block {len(prompt) // B} (positions {len(prompt) // B * B}..{len(prompt) - 1}): "
                    "not a full block" if len(prompt) % B else "end of prompt")
        if len(blocks) * B > limit:  # whole prompt hit: the last block is copied, its last token recomputed
            blocks.pop()
            hashes.pop()
            parent = hashes[-1] if hashes else None
            stop = "last prompt token: recomputed for its logits"
        n_full = len(blocks) * B
        copied = None
        want = list(prompt[n_full : min(limit, n_full + B)])
        if want:  # partial reuse by content inside the next block
            best, best_m = None, 0
            for b, toks in self.tokens_of.items():
                if self.parent_of.get(b) == parent and b not in blocks:
                    m = _common(toks, want)
                    if m > best_m:
                        best, best_m = b, m
            if best is not None:
                copied = {"from_block": best, "tokens": best_m}
                if best_m == len(want) and n_full + best_m == limit:
                    stop = "last prompt token: recomputed for its logits"
                else:
                    stop = f"position {n_full + best_m}: first token differing from any cached block (partial block copied)"
        for b in blocks:
            self._take_block(b)
        tab = list(blocks)
        if copied is not None:
            src = copied["from_block"]
            self.ref[src] = self.ref.get(src, 0) + 1  # pin the source while we take a block
            if self.ref[src] == 1:
                self.free.remove(src)
            nb = self._pop_free() if self.free else None
            self.free_blocks([src])
            if nb is None:
                copied = None
            else:
                self._copy_slots(src, nb, copied["tokens"])
                copied["block"] = nb
                tab.append(nb)
        hit = n_full + (copied["tokens"] if copied else 0)
        if hit:
            self.tables[seq_id] = tab
            self.lens[seq_id] = hit
        return {"hit": hit, "shared_blocks": list(blocks), "ref_cnt": [self.ref[b] for b in blocks],
                "copied": copied, "stop": stop, "hashes": hashes}

    def snapshot(self) -> dict[str, Any]:
        """:meth:`PagedKV.snapshot` plus per block its ``ref_cnt`` and hash, and the cache size."""
        s = super().snapshot()
        for v in s["requests"].values():
            for blk in v["blocks"]:
                if self.caching or self.ref.get(blk["block"], 0) > 1:  # without caching: only forked blocks
                    blk["ref"] = self.ref.get(blk["block"], 0)
                if blk["block"] in self.hash_of:
                    blk["hash"] = self.hash_of[blk["block"]]
        if self.caching:
            s["prefix_cache"] = True
            s["cached_blocks"] = len(self.cached)
            s["cached_free_blocks"] = sum(1 for b in self.free if b in self.hash_of and self.cached.get(self.hash_of[b]) == b)
        return s


class CachingCellsKV(CellsKV):
    """:class:`CellsKV` whose released sequences stay in their cells (retained) for prefix reuse.

    ``retained``: seq_ids whose cells are kept after release, least recently released first;
    ``tokens[seq_id]``: token ids of each sequence's cached positions ``0..n-1``; a sequence marked
    ``tainted`` (its positions were shifted) is never a prefix source.
    """

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.retained: OrderedDict[int, None] = OrderedDict()
        self.tokens: dict[int, list[int]] = {}
        self.tainted: set[int] = set()
        self.events: list[dict[str, Any]] = []

    def release(self, seq_id: int) -> None:
        """Keep ``seq_id``'s cells as a retained sequence (evicted later, when space is needed)."""
        if seq_id in self.tainted or self.seq_len(seq_id) == 0:
            self._drop(seq_id)
            return
        self.retained[seq_id] = None
        self.retained.move_to_end(seq_id)

    def forget(self, seq_id: int) -> None:
        """Free ``seq_id``'s cells without retaining them (an admission undone: its prefix attachment
        through ``seq_cp`` is taken back, so nothing is cached under it that the trace never showed)."""
        self._drop(seq_id)

    def shift_out(self, seq_id: int, p0: int, p1: int, ropes: Sequence[Any]) -> MemOp:
        """A context shift, and ``seq_id`` is no prefix source any more (its positions moved)."""
        self.tainted.add(seq_id)
        return super().shift_out(seq_id, p0, p1, ropes)

    def note_rewind(self, seq_id: int, ids: Sequence[int]) -> None:
        """After a rewind ``seq_id`` holds exactly ``ids``."""
        self.tokens[seq_id] = list(ids)

    def take_events(self) -> list[dict[str, Any]]:
        """Evictions since the last call."""
        out, self.events = self.events, []
        return out

    def _drop(self, seq_id: int) -> None:
        super().release(seq_id)
        self.retained.pop(seq_id, None)
        self.tokens.pop(seq_id, None)
        self.tainted.discard(seq_id)

    def _reclaimable(self) -> int:
        if not self.retained:
            return 0
        live = [s for s in range(self.n_seq_max) if s not in self.retained]
        owned_live = self.seq[:, live].any(dim=1)  # [size]
        return int(((self.pos >= 0) & ~owned_live).sum())

    def can_fit(self, plan: list[tuple[int, int]]) -> bool:
        """Free cells plus cells only retained sequences hold."""
        return self.size - self.used + self._reclaimable() >= sum(n for _, n in plan)

    def find_slot(self, n_tokens: int) -> list[int]:
        """As :meth:`CellsKV.find_slot`, evicting retained sequences (least recent first) when needed."""
        while self.size - self.used < n_tokens and self.retained:
            s = next(iter(self.retained))
            cells = [c for c, _ in self.cells_of(s)]
            self._drop(s)
            freed = [c for c in cells if int(self.pos[c]) < 0]
            self.events.append({"op": "evict", "seq_id": s, "cells": ranges_text(cells), "freed": ranges_text(freed),
                                "still_shared": ranges_text(sorted(set(cells) - set(freed)))})
        return super().find_slot(n_tokens)

    def note_tokens(self, seq_id: int, C: int, token_ids: Sequence[int], all_ids: Sequence[int]) -> None:
        """Remember the token ids of ``seq_id``'s cached positions ``0..C+T-1``."""
        self.tokens[seq_id] = list(all_ids[: C + len(token_ids)])

    def lookup(self, seq_id: int, prompt: Sequence[int]) -> dict[str, Any]:
        """Longest common prefix of ``prompt`` with a live or retained sequence (at most
        ``len(prompt) - 1`` tokens); its cells are shared with ``seq_id`` through ``seq_cp``.

        Returns ``{"hit", "src", "cells", "stop", "src_state"}``.
        """
        limit = len(prompt) - 1
        best, best_n = None, 0
        for s, toks in self.tokens.items():
            if s in self.tainted:
                continue
            n = min(_common(toks, prompt), limit)
            if n > best_n or (n == best_n and n and s == seq_id):
                best, best_n = s, n
        if best is None:
            return {"hit": 0, "src": None, "cells": "-", "stop": "no cached sequence shares the first token"}
        src_len = len(self.tokens[best])
        if best_n == limit:
            stop = "last prompt token: recomputed for its logits"
        elif best_n == src_len:
            stop = f"position {best_n}: end of the cached sequence {best}"
        else:
            stop = f"position {best_n}: first token differing from sequence {best}"
        state = "retained" if best in self.retained else "live"
        if best == seq_id:  # own retained cells (after preemption): keep the prefix, drop the rest
            self.retained.pop(seq_id, None)
            CellsKV.seq_rm(self, seq_id, best_n, -1)
            op = {"cells": ranges_text([c for c, _ in self.cells_of(seq_id)])}
        else:
            op = CellsKV.seq_cp(self, best, seq_id, 0, best_n)
            if best in self.retained:
                self.retained.move_to_end(best)
        self.tokens[seq_id] = list(prompt[:best_n])
        return {"hit": best_n, "src": best, "src_state": state, "cells": op["cells"], "stop": stop}

    def snapshot(self) -> dict[str, Any]:
        """:meth:`CellsKV.snapshot` plus the retained sequences and, per cell, its owner count."""
        s = super().snapshot()
        s["prefix_cache"] = True
        s["retained"] = list(self.retained)
        for c in s["cells"]:
            c["ref"] = len(c["seq_ids"])
        return s
