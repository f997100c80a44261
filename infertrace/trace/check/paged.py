"""The paged convention (vLLM / TensorRT-LLM): one owner per block unless shared through a prefix hit,
``slot = table[p // B] * B + p % B``, the write-time block table against ``kv.physical``.
"""

from __future__ import annotations

from typing import Any

from infertrace.trace.check.base import _d, _int, kept_len, _l


class PagedRules:
    """Paged ownership and the slot mapping (rule 5, paged)."""

    def _paged(self, s: int, kv: dict, phys: dict, reqs: list[dict]) -> None:
        B = phys.get("tokens_per_block")
        reqmap = phys.get("requests")
        self.need(_int(B) and B > 0 and isinstance(reqmap, dict), s, None, "kv", "paged physical malformed")
        owner: dict[int, int] = {}
        where: dict[int, int] = {}  # block -> its index in the tables holding it
        tables: dict[int, set[int]] = {}
        refs: dict[int, Any] = {}
        for k, d in reqmap.items():
            self.need(isinstance(d, dict) and isinstance(d.get("block_table"), list), s, None, "kv", "block table malformed")
            sid = int(k) if str(k).isdigit() else -1
            if sid in self.finished:
                self.fail(s, sid, "kv", "freed when finished", "a finished request still has a block table")
            for b in d.get("blocks") if isinstance(d.get("blocks"), list) else ():
                if isinstance(b, dict) and _int(b.get("block")):
                    refs[b["block"]] = b.get("ref")
            for i, b in enumerate(d["block_table"]):
                self.n_checks += 1
                self.need(_int(b), s, sid, "kv", "a block table entry is not an int")
                tables.setdefault(b, set()).add(sid)
                if b in owner:
                    # a shared prefix block (vLLM prefix caching): same table index, joined through a hit
                    h = self.hits.get(sid)
                    shared = h.get("shared_blocks") if isinstance(h, dict) else None
                    joined = (isinstance(shared, list) and b in shared) or (  # unknown without the previous step's tables
                        sid in self.prev_blocks.get(b, set()) if self.prev_kv_step == s - 1 else True)
                    if phys.get("prefix_cache") is not True or where[b] != i or not joined:
                        self.fail(s, sid, "kv", "one owner per block",
                                  f"block {b} is in the tables of seq {owner[b]} and {sid}"
                                  + (" (not a prefix block this sequence shares through a hit)" if phys.get("prefix_cache") is True else ""))
                    continue
                owner[b], where[b] = sid, i
        for b, sids in tables.items():
            self.n_checks += 1
            if len(sids) > 1 and b in refs and refs[b] != len(sids):
                self.fail(s, min(sids), "kv", "one owner per block", f"block {b} is in {len(sids)} tables but its ref_cnt is {refs[b]!r}")
        self.prev_blocks, self.prev_kv_step = tables, s
        per = {d.get("seq_id"): d for d in kv.get("per_request", []) if isinstance(d, dict)}
        for r in reqs:
            d = per.get(r["seq_id"])
            if d is None or not isinstance(d.get("slot_mapping"), list) or not isinstance(d.get("block_table"), list):
                continue
            tab = d["block_table"]
            stored = range(r["C"], r["C"] + r["T"])  # storage order: a verify tree's node i sits at slot of C + i
            for p, slot in zip(stored if r.get("spec") else r["positions"], d["slot_mapping"]):
                self.n_checks += 1
                want = tab[p // B] * B + p % B if p // B < len(tab) else None
                if slot != want:
                    self.fail(s, r["seq_id"], "kv", "slot = table[p // B] * B + p % B", f"pos {p}: slot {slot}, expected {want}")


# ----------------------------------------------------------------------------- paged tables, prefix hits
def paged_table_rules(c: Any, s: int, st: dict, reqs: list[dict]) -> None:
    """A paged request's write-time block table against ``kv.physical`` (module docstring)."""
    kv = _d(st.get("kv"))
    ph = _d(kv.get("physical"))
    if ph.get("kind") != "paged" or not isinstance(ph.get("requests"), dict):
        return
    B = ph.get("tokens_per_block")
    per = {d.get("seq_id"): d for d in _l(kv.get("per_request")) if isinstance(d, dict)}
    for r in reqs:
        sid = r["seq_id"]
        d, p = per.get(sid), ph["requests"].get(str(sid))
        if not isinstance(d, dict) or not isinstance(p, dict) or not isinstance(d.get("block_table"), list):
            continue
        tab, after = d["block_table"], _l(p.get("block_table"))
        c.n_checks += 1
        if after != tab[:len(after)] or (not r.get("spec") and after != tab):
            c.fail(s, sid, "kv", "block table recorded once", f"kv.per_request block table {str(tab)[:40]} but "
                   f"kv.physical.requests[{sid}] holds {str(after)[:40]}")
        c.n_checks += 1
        if _int(B) and B > 0 and (p.get("len") != kept_len(r) or len(after) not in _held_blocks(c, r, B)):
            c.fail(s, sid, "kv", "block table recorded once", f"kv.physical.requests[{sid}] len {p.get('len')!r} with "
                   f"{len(after)} blocks, but the request holds {kept_len(r)} positions ({-(-kept_len(r) // B)} blocks of {B}"
                   + (f", up to {-(-(r['C'] + r['T']) // B)} under vLLM after a verify" if len(_held_blocks(c, r, B)) > 1 else "")
                   + ")")


def _held_blocks(c: Any, r: dict, B: int) -> range:
    """How many blocks a request's table may hold after its step: ``ceil(kept / B)``. Under ``--runtime vllm`` a
    verify step keeps the blocks of its rejected drafts too, up to ``ceil((C + T) / B)``: vLLM 0.32 allocates
    slots for every scheduled token (kv_cache_manager.py:541-543, ``total_computed_tokens + num_new_tokens``),
    its ``allocate_new_blocks`` only grows a table (single_type_kv_cache_manager.py:369-386, "at least
    num_tokens"), and a rejection rolls back ``num_computed_tokens`` only (n-gram drafting reserves no lookahead
    slots: config/vllm.py ``num_lookahead_tokens``)."""
    lo = -(-kept_len(r) // B)
    verify = isinstance(_d(r.get("spec")).get("accepted_nodes"), list)
    vllm_header = isinstance(_d(c.m.get("options")).get("vllm"), dict)  # vLLM's own allocation (its header section)
    hi = -(-(r["C"] + r["T"]) // B) if vllm_header and verify else lo
    return range(lo, max(lo, hi) + 1)
