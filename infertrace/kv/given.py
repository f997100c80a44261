"""A paged pool whose placement is given from outside: the block tables are decided elsewhere (a replayed
vLLM trace's scheduler and block pool; ``run --backend paged --replay DIR``), everything else is the paged
mechanism of :class:`~infertrace.kv.paged.PagedKV`.

Mirrors what vLLM's ``KVCacheManager`` hands the model runner each step: the block ids of every scheduled
request (``SchedulerOutput`` -> ``block_ids``), shared full prefix blocks included when prefix caching is on
(``enable_prefix_caching``), and ``num_computed_tokens`` for what stays cached after a verify step.
"""

from __future__ import annotations

from typing import Any, Sequence

from infertrace.errors import InfertraceError
from infertrace.kv.base import MemOp, ranges_text
from infertrace.kv.paged import PagedKV


class GivenTablesKV(PagedKV):
    """Our paged pool whose block tables are given (:meth:`set_table`) instead of taken from our free list
    (``_grow``); slot mapping, lengths, metadata, the writes and the paged attention are :class:`PagedKV`'s own.

    Args:
        *a, **k: as :class:`PagedKV` (``n_layer, n_kv_heads, head_dim, num_blocks, block_size, dtype, device,
            attn_impl``; block 0 is vLLM's null block, never given).
        prefix_cache: True when a table may hold another request's full prefix blocks (vLLM's
            ``enable_prefix_caching``; ``check`` then allows exactly those shared blocks).
    """

    kind = "paged"

    def __init__(self, *a: Any, prefix_cache: bool = False, **k: Any):
        super().__init__(*a, **k)
        self.free = list(range(1, self.num_blocks))  # not used for placement; block 0 is vLLM's null block
        self.given: dict[int, list[int]] = {}  # seq_id -> the block table given for its next writes
        self.prefix_cache = prefix_cache

    def set_table(self, seq_id: int, table: Sequence[int]) -> None:
        """Give ``seq_id``'s block table (physical block ids, in order) for this step's allocation."""
        self.given[seq_id] = [int(b) for b in table]

    def _grow(self, seq_id: int, n_new: int) -> None:
        """Take the given table's first ``ceil((len + n_new) / B)`` blocks.

        Raises:
            InfertraceError: no table given, one too short for the step, a block outside the pool, or (prefix
                cache off) a block another request's table holds.
        """
        tab = self.given.get(seq_id)
        need = -(-(self.lens.get(seq_id, 0) + n_new) // self.B)
        if tab is None or len(tab) < need:
            raise InfertraceError(f"replay: seq {seq_id} needs {need} blocks, the trace's table has {len(tab or [])}")
        if any(not 0 <= b < self.num_blocks for b in tab):
            raise InfertraceError(f"replay: seq {seq_id}'s block table {tab[:8]} lies outside the pool of {self.num_blocks}")
        if not self.prefix_cache:  # vLLM shares a block only through its prefix cache
            held = {b: sid for sid, t in self.tables.items() if sid != seq_id for b in t}
            shared = next((b for b in tab[:need] if b in held), None)
            if shared is not None:
                raise InfertraceError(f"replay: seq {seq_id}'s block table holds block {shared}, which seq {held[shared]} "
                                      "holds too, with the prefix cache off; the trace is not a consistent vLLM trace")
        self.tables[seq_id] = list(tab[:need])
        self.lens[seq_id] = self.lens.get(seq_id, 0) + n_new

    def attach_prefix(self, seq_id: int, C: int, table: list[int]) -> None:
        """A prefix hit at admission: the request starts with ``C`` cached tokens in the shared
        blocks ``table[:C // B]`` (their K/V were written by the request that computed them)."""
        self.tables[seq_id] = list(table[: -(-C // self.B)])
        self.lens[seq_id] = C

    def rewind(self, seq_id: int, C: int, T: int, accepted: Sequence[int], inp: Any, row: int, is_chain: bool) -> MemOp:
        """vLLM's rewind of a verify step ``C, T``: ``num_computed_tokens`` drops the rejected drafts (``C +
        len(accepted)`` kept; vLLM's drafts are a chain, nothing moves); the slots stay allocated (overwritten
        later). Answers ``{"op": "num_computed_tokens", "seq_id", "kept_pos"}`` (``kept_pos``: 0..kept-1)."""
        keep = C + len(accepted)
        self.lens[seq_id] = keep
        return MemOp({"op": "num_computed_tokens", "seq_id": seq_id, "kept_pos": ranges_text(range(keep))})

    def release(self, seq_id: int) -> None:
        """Forget ``seq_id``'s table and length (the blocks' owner, vLLM's block pool, frees them)."""
        self.tables.pop(seq_id, None)
        self.lens.pop(seq_id, None)

    def snapshot(self) -> dict[str, Any]:
        """As :meth:`PagedKV.snapshot`, with no free list of ours (placement is given: ``free_list_head`` empty)
        and, with prefix caching, each held block's ``ref`` = the tables holding it (vLLM's ``ref_cnt``)."""
        snap = super().snapshot()
        snap["free_list_head"] = []
        if self.prefix_cache:  # a table may hold another request's full prefix blocks (`check` allows exactly those)
            snap["prefix_cache"] = True
            held: dict[int, int] = {}
            for tab in self.tables.values():
                for blk in tab:
                    held[blk] = held.get(blk, 0) + 1
            for v in snap["requests"].values():
                for blk in v["blocks"]:
                    blk["ref"] = held[blk["block"]]
        return snap
