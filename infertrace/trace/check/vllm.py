"""``run --runtime vllm``: the per-step ``vllm`` section recomputed from the batch rows and the cache.
"""

from __future__ import annotations

from typing import Any

from infertrace.runtimes.api import native_of
from infertrace.trace.check.base import _d, _int, _l

#: the native section these rules read (``RuntimeInfo.native`` of the runtime that writes it)
SECTION = "vllm"


# ----------------------------------------------------------------------------- run --runtime vllm
def vllm_rules(c: Any, s: int, st: dict, reqs: list[dict]) -> None:
    """The per-step ``vllm`` section recomputed from the batch rows and the cache (module docstring)."""
    v = st.get("vllm")
    opts = _d(c.m.get("options"))
    vo = opts.get("vllm")
    c.n_checks += 1
    if v is None:
        if native_of(c.m.get("runtime")) == SECTION and reqs:
            c.fail(s, None, "vllm", "the runtime named in the header", "the header names the runtime vllm but this computed "
                   "step has no vllm section (run --runtime vllm records vLLM's own metadata every step)")
        return
    if native_of(c.m.get("runtime")) != SECTION or not isinstance(vo, dict):
        c.fail(s, None, "vllm", "the runtime named in the header", f"the step has a vllm section but the header names the runtime "
               f"{c.m.get('runtime')!r}" + ("" if isinstance(vo, dict) else " and options.vllm is missing"))
    _vllm_scheduler(c, s, st, reqs, _d(v.get("scheduler")))
    _vllm_metadata(c, s, st, reqs, _d(v.get("attn_metadata")), vo.get("block_size"))
    _vllm_logits(c, s, st, reqs, v)
    _vllm_ranks(c, s, v, vo)


def _spec_tokens(sched: dict) -> dict[Any, list]:
    return {x.get("seq_id"): _l(x.get("spec_tokens")) for x in _l(sched.get("scheduled")) if isinstance(x, dict)}


def _vllm_scheduler(c: Any, s: int, st: dict, reqs: list[dict], sch: dict) -> None:
    N = sum(r["T"] for r in reqs)
    got = [(x.get("seq_id"), x.get("num_scheduled_tokens"), x.get("num_computed_tokens")) for x in _l(sch.get("scheduled"))
           if isinstance(x, dict)]
    want = [(r["seq_id"], r["T"], r["C"]) for r in reqs]
    c.n_checks += 1
    # scheduled is in the scheduler's order, the batch rows in the forward's: vLLM's model runner packs its own
    # persistent batch (gpu_input_batch.py:698 condense; gpu_model_runner.py:1101 _may_reorder_batch), so the
    # two are compared per sequence, not per position
    if sorted(got, key=repr) != sorted(want, key=repr):
        c.fail(s, None, "vllm", "scheduler counts", f"vllm.scheduler.scheduled (seq, num_scheduled_tokens, num_computed_tokens) "
               f"{str(got)[:60]} but the batch rows give (seq, T, C) {str(want)[:60]}")
    tot = sch.get("total_num_scheduled_tokens")
    if tot is not None and tot != N:
        c.fail(s, None, "vllm", "scheduler counts", f"total_num_scheduled_tokens {tot!r} but the batch holds N = {N} tokens")
    spec = _spec_tokens(sch)
    for r in reqs:
        d = spec.get(r["seq_id"], [])
        want_d = _l(r.get("token_ids"))[1:] if r.get("spec") else []
        # vLLM's placeholder draft -1 (scheduler.py:1371-1375, a new request padded to 1 + K rows) is embedded
        # as id 0: its forward clamps input_ids to min 0 (gpu_model_runner.py:3310-3311)
        fed = [0 if t == -1 else t for t in d]
        c.n_checks += 1
        if fed != want_d:
            c.fail(s, r["seq_id"], "vllm", "scheduler counts", f"scheduled spec_tokens {str(d)[:40]} (a placeholder -1 "
                   f"is fed as id 0) but the row verifies the drafts {str(want_d)[:40]}")
    ph = _d(_d(st.get("kv")).get("physical"))
    free, nb = sch.get("free_blocks"), ph.get("num_blocks")
    if _int(free):
        c.n_checks += 1
        if ph.get("free_blocks") is not None and ph["free_blocks"] != free:
            c.fail(s, None, "vllm", "free blocks of the pool", f"vllm.scheduler.free_blocks {free} but kv.physical.free_blocks "
                   f"{ph['free_blocks']!r}")
        held = {b for t in _d(ph.get("requests")).values() if isinstance(t, dict) for b in _l(t.get("block_table"))}
        if _int(nb) and (free > nb - 1 or len(held) > nb - 1 - free):
            c.fail(s, None, "vllm", "free blocks of the pool", f"free_blocks {free} of num_blocks {nb} (block 0 is vLLM's null "
                   f"block) leaves {nb - 1 - free} blocks held, but the tables hold {len(held)} distinct blocks")
    tables = {r["seq_id"]: _l(_d(_d(ph.get("requests")).get(str(r["seq_id"]))).get("block_table")) for r in reqs}
    md_bt = _l(_d(st.get("vllm")).get("attn_metadata", {}).get("block_table") if isinstance(st.get("vllm"), dict) else [])
    for k, blocks in _d(sch.get("new_block_ids")).items():
        sid = int(k) if str(k).isdigit() else None
        i = next((j for j, r in enumerate(reqs) if r["seq_id"] == sid), None)
        own = set(tables.get(sid, [])) | (set(_l(md_bt[i])) if i is not None and i < len(md_bt) else set())
        c.n_checks += 1
        bad = [b for b in _l(blocks) if b not in own]
        if bad:
            c.fail(s, sid, "vllm", "new blocks owned by their sequence", f"new_block_ids of seq {k} include block {bad[0]}, "
                   f"which is not in its block table {str(sorted(own))[:40]}")


def _vllm_metadata(c: Any, s: int, st: dict, reqs: list[dict], md: dict, B: Any) -> None:
    N = sum(r["T"] for r in reqs)
    qsl = [0]
    for r in reqs:
        qsl.append(qsl[-1] + r["T"])
    for key, want in (("query_start_loc", qsl), ("seq_lens", [r["C"] + r["T"] for r in reqs]), ("num_actual_tokens", N),
                      ("max_query_len", max((r["T"] for r in reqs), default=0)),
                      ("max_seq_len", max((r["C"] + r["T"] for r in reqs), default=0))):
        c.n_checks += 1
        if key in md and md[key] != want:
            c.fail(s, None, "vllm", f"{key} from the batch", f"vllm.attn_metadata.{key} {str(md[key])[:60]} but the batch rows give "
                   f"{str(want)[:60]}" + (" (cumulative T)" if key == "query_start_loc" else " (C + T: vLLM's seq_lens are kv lengths)"
                                          if key == "seq_lens" else ""))
    bt, slots = md.get("block_table"), md.get("slot_mapping")
    if not (_int(B) and B > 0 and isinstance(bt, list) and isinstance(slots, list)):
        return
    c.n_checks += 1
    if len(bt) != len(reqs) or len(slots) != N:
        c.fail(s, None, "vllm", "slot = table[p // B] * B + p % B", f"{len(bt)} block-table rows and {len(slots)} slots for "
               f"{len(reqs)} requests of N = {N} tokens")
    per = {d.get("seq_id"): d for d in _l(_d(st.get("kv")).get("per_request")) if isinstance(d, dict)}
    k = 0
    for i, r in enumerate(reqs):
        row = _l(bt[i])
        mine = _l(_d(per.get(r["seq_id"])).get("block_table"))
        c.n_checks += 1
        if mine and row != mine[:len(row)]:
            c.fail(s, r["seq_id"], "vllm", "block table recorded once", f"vllm.attn_metadata.block_table[{i}] {str(row)[:40]} but "
                   f"kv.per_request's table is {str(mine)[:40]}")
        for p in range(r["C"], r["C"] + r["T"]):  # storage order: a draft at node j sits at C + j
            want = row[p // B] * B + p % B if p // B < len(row) and _int(row[p // B]) else None
            c.n_checks += 1
            if slots[k] != want:
                c.fail(s, r["seq_id"], "vllm", "slot = table[p // B] * B + p % B",
                       f"vllm.attn_metadata.slot_mapping[{k}] (pos {p}) is {slots[k]!r}, block_table[{i}][{p // B}] * {B} + "
                       f"{p % B} = {want!r}")
            k += 1


def _vllm_logits(c: Any, s: int, st: dict, reqs: list[dict], v: dict) -> None:
    spec = _spec_tokens(_d(v.get("scheduler")))
    N = sum(r["T"] for r in reqs)
    want, end = [], 0
    for r in reqs:
        end += r["T"]
        d = len(spec.get(r["seq_id"], []))
        want += list(range(end - 1 - d, end))
    li = v.get("logits_indices")
    c.n_checks += 1
    if isinstance(li, list) and (li != want or any(not (_int(x) and 0 <= x < N) for x in li)):
        c.fail(s, None, "vllm", "logits_indices", f"vllm.logits_indices {str(li)[:60]} but vLLM samples the last 1 + drafts rows of "
               f"each request: {str(want)[:60]} (inside 0..{N - 1})")
    sampled = v.get("sampled_token_ids")
    if not isinstance(sampled, list):
        return
    c.n_checks += 1
    if len(sampled) != len(reqs):
        c.fail(s, None, "vllm", "sampled tokens are the chosen ones", f"{len(sampled)} sampled_token_ids rows for {len(reqs)} requests")
    dec = {p.get("seq_id"): p for p in _l(_d(st.get("decode")).get("per_request")) if isinstance(p, dict)}
    for i, r in enumerate(reqs):
        p = dec.get(r["seq_id"])
        if not isinstance(p, dict) or not _int(p.get("chosen")):
            continue
        got = [t for t in _l(sampled[i]) if _int(t) and t >= 0]
        em = _l(_d(r.get("spec")).get("emitted")) if r.get("spec") else [p["chosen"]]
        c.n_checks += 1
        if got[:len(em)] != em:
            c.fail(s, r["seq_id"], "vllm", "sampled tokens are the chosen ones", f"vllm.sampled_token_ids[{i}] {str(got)[:40]} but "
                   f"the step emits {str(em)[:40]} for seq {r['seq_id']}")


def _vllm_ranks(c: Any, s: int, v: dict, vo: dict) -> None:
    tp = vo.get("tensor_parallel_size", 1)
    ranks = v.get("tp_ranks")
    c.n_checks += 1
    if ranks is None:
        if _int(tp) and tp > 1:
            c.fail(s, None, "vllm", "ranks = tensor_parallel_size", f"options.vllm.tensor_parallel_size {tp} but the step records no "
                   "tp_ranks")
        return
    n_kv = _d(c.m.get("config")).get("n_head_kv")
    got = [x.get("tp_rank") for x in _l(ranks) if isinstance(x, dict)]
    if got != list(range(tp if _int(tp) else -1)):
        c.fail(s, None, "vllm", "ranks = tensor_parallel_size", f"tp_ranks {str(got)[:40]} but tensor_parallel_size is {tp!r}")
    for x in ranks:
        held = x.get("kv_heads_held")
        if held is not None and _int(n_kv) and held != n_kv // tp:
            c.fail(s, None, "vllm", "ranks = tensor_parallel_size", f"rank {x.get('tp_rank')} holds {held} KV heads, "
                   f"n_head_kv / tensor_parallel_size = {n_kv} / {tp}")
        if x.get("metadata_equals_rank0") is False:
            c.fail(s, None, "vllm", "ranks = tensor_parallel_size", f"rank {x.get('tp_rank')} built other metadata than rank 0 "
                   "(every rank schedules the same batch)")
