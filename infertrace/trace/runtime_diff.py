"""``infertrace diff A B`` across conventions: a ``cells`` trace (llama.cpp, ``run --runtime llama.cpp``)
against a ``paged`` trace (vLLM, ``run --runtime vllm``) of the same requests.

The two runtimes may schedule differently (infertrace and llama.cpp here run infertrace's scheduler, vLLM its own:
token budget, ``long_prefill_token_threshold``, speculative lookahead), so their steps do not pair
one to one, and their physical memories are different conventions (cells + ``kq_mask`` vs block
tables + metadata). What both must agree on is logical, and is compared **per request and per
position of the request's sequence** (``prompt_ids + output_ids``, index ``j``), never per step:

==================  =====================================================================  ======
variable            per request, per position j                                            how
==================  =====================================================================  ======
tokens              prompt ids, output ids, the token fed at j                             exact
positions           the position id fed with token j (llama.cpp ``inp_pos``, vLLM           exact
                    ``positions``)
visible keys        the key positions query j attends to (llama.cpp: read back from its    exact
                    ``kq_mask`` and cells; vLLM: its metadata, causal over the block-table
                    row up to ``seq_lens``)
logits rows         the row predicting position j+1: top-k ids overlap, max |Δ logit|      summary
                    over the ids both recorded
next token          top-1 id of that row in A vs B                                         rate
==================  =====================================================================  ======

A position is taken from the last chunk that computed it and kept it (a preempted request's
recomputation replaces the first; a verify chunk contributes its accepted nodes only). Every
position ``0 .. len(prompt)+len(output)-2`` must have been computed by both runtimes (to
generate the next token); positions one runtime computed beyond that (accepted drafts past the
last output) are a note. The convention-specific fields of each request's chunks are listed side
by side, in each runtime's own steps, and never compared: llama.cpp ``inp_pos``, the cells its
``kq_mask`` rows cover (``k_idxs``), ``n_kv``, the ubatch (one step = one ubatch here); vLLM
``query_start_loc``, ``seq_lens``, the ``block_table`` row and ``slot_mapping``.

Torch-free (trace/ reads JSON only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infertrace.ranges import ranges_text
from infertrace.trace.diff import DiffResult, Divergence

#: how the comparison is described in the output (text and --json)
NOTE = ("compared per request and per position of its sequence, not per step: the two sides may schedule "
        "differently (infertrace and llama.cpp here run infertrace's scheduler, vLLM its own)")
#: at most this many chunks per request in the side-by-side listing (per runtime)
MAX_CHUNKS = 64
#: at most this many differences / disagreements kept for display (all are counted)
KEEP = 8


def _engine(m: dict[str, Any]) -> str:
    return str(m.get("runtime", "infertrace"))


def _convention(m: dict[str, Any]) -> str | None:
    opts = m.get("options")
    b = opts.get("backend") if isinstance(opts, dict) else None
    return b if isinstance(b, str) else None


def needs_logical_diff(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True when ``a`` and ``b`` were computed by different engines with different KV conventions
    (``cells`` vs ``paged``): their steps and memories cannot be paired, only the logical variables."""
    ca, cb = _convention(a), _convention(b)
    return _engine(a) != _engine(b) and ca is not None and cb is not None and ca != cb


def _ints(x: Any) -> list[int]:
    return [v for v in x if isinstance(v, int) and not isinstance(v, bool)] if isinstance(x, list) else []


def _conv_fields(m: dict[str, Any], st: dict[str, Any], i: int, r: dict[str, Any]) -> dict[str, Any]:
    """The convention-specific fields of batch row ``i`` (request ``r``) of step ``st``, in the
    runtime's own names (read, never compared)."""
    sid = r.get("seq_id")
    vl = st.get("vllm")
    if isinstance(vl, dict) and isinstance(vl.get("attn_metadata"), dict):  # vLLM's own metadata
        am = vl["attn_metadata"]
        qsl = _ints(am.get("query_start_loc"))
        out: dict[str, Any] = {"query_start_loc": qsl}
        if i + 1 < len(qsl):
            out["query_range"] = [qsl[i], qsl[i + 1]]
            out["slot_mapping"] = _ints(am.get("slot_mapping"))[qsl[i]:qsl[i + 1]]
        sl, bt = am.get("seq_lens"), am.get("block_table")
        if isinstance(sl, list) and i < len(sl):
            out["seq_lens"] = sl[i]
        if isinstance(bt, list) and i < len(bt):
            out["block_table"] = _ints(bt[i])
        return out
    mk = st.get("mask") if isinstance(st.get("mask"), dict) else {}
    km = mk.get("kq_mask")
    kv = st.get("kv") if isinstance(st.get("kv"), dict) else {}
    per = next((p for p in kv.get("per_request", []) or [] if isinstance(p, dict) and p.get("seq_id") == sid), {})
    if isinstance(km, dict):  # cells: llama.cpp's graph inputs (or infertrace's cells backend)
        pos = st.get("positions") if isinstance(st.get("positions"), dict) else {}
        inp = _ints(pos.get("inp_pos"))
        rows = _ints(r.get("rows"))
        out = {"inp_pos": [inp[k] for k in rows if k < len(inp)], "cells": per.get("cells"), "n_kv": km.get("n_kv"),
               "kq_mask_ne": km.get("ne")}
        opts = m.get("options") if isinstance(m.get("options"), dict) else {}
        lc = opts.get("llama_cpp") if isinstance(opts.get("llama_cpp"), dict) else {}
        out["ubatch"] = {"n_tokens": st.get("N"), "n_ubatch": lc.get("n_ubatch")}
        return out
    md = mk.get("metadata") if isinstance(mk.get("metadata"), dict) else {}  # paged: our TensorRT-LLM names
    out = {"cu_seqlens": md.get("cu_seqlens"), "slot_mapping": per.get("slot_mapping")}
    for k in ("kv_lens", "block_tables"):
        v = md.get(k)
        if isinstance(v, list) and i < len(v):
            out[k] = v[i]
    return out


def _predicted(p: dict[str, Any], r: dict[str, Any] | None) -> int | None:
    """The sequence position whose token a decode record's logits row chose: ``next_pos`` (where the
    chosen token is fed next); a request that stopped has none, then its batch row says: ``C + T``
    (a verify chunk: ``C`` + the tokens it emitted)."""
    if isinstance(p.get("next_pos"), int) and not isinstance(p.get("next_pos"), bool):
        return p["next_pos"]
    if not isinstance(r, dict) or not isinstance(r.get("C"), int) or not isinstance(r.get("T"), int):
        return None
    sp = r.get("spec")
    if isinstance(sp, dict) and isinstance(sp.get("emitted"), list):
        return r["C"] + len(sp["emitted"])
    return r["C"] + r["T"]


def _per_request(m: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per seq_id: prompt / output ids, per position j the token, position id and visible keys of
    the chunk that last computed and kept it, the logits rows by the position they predict, and
    the chunks (with their convention fields) in step order."""
    out: dict[int, dict[str, Any]] = {}
    for q in m.get("requests", []) or []:
        if isinstance(q, dict) and isinstance(q.get("seq_id"), int):
            out[q["seq_id"]] = {"prompt_ids": _ints(q.get("prompt_ids")), "output_ids": _ints(q.get("output_ids")),
                                "at": {}, "next": {}, "chunks": [], "n_chunks": 0, "hit": None, "served": {}}
    writes: dict[int, tuple[int, int, Any]] = {}  # physical slot -> (seq_id, position, step) of its last write
    writes_before: dict[int, tuple[int, int, Any]] = {}
    for st in m.get("steps", []) or []:
        if not isinstance(st, dict):
            continue
        for i, r in enumerate(st.get("batch", []) or []):
            if not isinstance(r, dict) or r.get("seq_id") not in out:
                continue
            q = out[r["seq_id"]]
            C, toks, poss, vis = r.get("C"), _ints(r.get("token_ids")), _ints(r.get("positions")), r.get("visible") or []
            if not isinstance(C, int):
                continue
            sp = r.get("spec") if isinstance(r.get("spec"), dict) else None
            if sp:  # a verify chunk keeps its accepted nodes; node k sits at sequence index C + depth(k)
                offs = _ints(sp.get("position_offsets"))
                nodes = [(k, C + offs[k]) for k in _ints(sp.get("accepted_nodes")) if k < len(offs)]
            else:
                nodes = [(k, C + k) for k in range(len(toks))]
            for k, j in nodes:
                if k < len(toks) and k < len(poss):
                    q["at"][j] = {"token": toks[k], "pos": poss[k], "visible": vis[k] if k < len(vis) else None,
                                  "step": st.get("step")}
            if C > 0 and not sp and not any(j < C for j in q["at"]):  # the first chunk starts past 0: a prefix hit
                q["hit"] = {"C": C, "step": st.get("step"), "slots": _hit_slots(m, st, i, C),
                            "src": _hit_src(st, r["seq_id"])}
            q["n_chunks"] += 1
            if len(q["chunks"]) < MAX_CHUNKS:
                q["chunks"].append({"step": st.get("step"), "phase": r.get("phase"), "C": C, "T": r.get("T"),
                                    "positions": ranges_text(poss), **_conv_fields(m, st, i, r)})
        _record_writes(writes, m, st)
        for q in out.values():  # a hit found in this step: who wrote the slots it reads (before this step)
            h = q["hit"]
            if h is not None and "writers" not in h:
                h["writers"] = _writers(h, writes_before)
        writes_before = dict(writes)
        dc = st.get("decode") if isinstance(st.get("decode"), dict) else {}
        by_seq = {r.get("seq_id"): r for r in st.get("batch", []) or [] if isinstance(r, dict)}
        for p in dc.get("per_request", []) or []:
            if not (isinstance(p, dict) and p.get("seq_id") in out and isinstance(p.get("top"), list) and p["top"]):
                continue
            j = _predicted(p, by_seq.get(p["seq_id"]))
            if j is not None:
                out[p["seq_id"]]["next"][j] = {"step": st.get("step"), "row": p.get("row"),
                                               "top": [t for t in p["top"] if isinstance(t, dict)]}
    for q in out.values():
        h = q["hit"]
        for j, w in ((h or {}).get("writers") or {}).items():
            if w is not None and w[0] in out and w[1] in out[w[0]]["at"]:
                q["served"][j] = {"seq_id": w[0], "j": w[1], "step": w[2], "rec": out[w[0]]["at"][w[1]]}
    return out


def _block_size(m: dict[str, Any]) -> int | None:
    opts = m.get("options") if isinstance(m.get("options"), dict) else {}
    vl = opts.get("vllm") if isinstance(opts.get("vllm"), dict) else {}
    eng = opts.get("settings") if isinstance(opts.get("settings"), dict) else {}
    for b in (vl.get("block_size"), eng.get("tokens_per_block")):
        if isinstance(b, int) and not isinstance(b, bool) and b > 0:
            return b
    return None


def _rows_slots(m: dict[str, Any], st: dict[str, Any]) -> list[tuple[dict[str, Any], list[int], list[int] | None]]:
    """Per batch row of a paged step: ``(row, slot_mapping of its tokens, its block-table row)`` (vLLM's
    ``attn_metadata``, or this engine's ``kv.per_request`` / ``mask.metadata``); empty for cells."""
    rows = [r for r in st.get("batch", []) or [] if isinstance(r, dict)]
    vl = st.get("vllm")
    am = vl.get("attn_metadata") if isinstance(vl, dict) else None
    out = []
    if isinstance(am, dict):
        qsl, sm, bt = _ints(am.get("query_start_loc")), _ints(am.get("slot_mapping")), am.get("block_table") or []
        for i, r in enumerate(rows):
            if i + 1 < len(qsl):
                out.append((r, sm[qsl[i]:qsl[i + 1]], _ints(bt[i]) if i < len(bt) else None))
        return out
    kv = st.get("kv") if isinstance(st.get("kv"), dict) else {}
    md = (st.get("mask") or {}).get("metadata") if isinstance(st.get("mask"), dict) else None
    bts = md.get("block_tables") if isinstance(md, dict) else None
    per = {p.get("seq_id"): p for p in kv.get("per_request", []) or [] if isinstance(p, dict)}
    for i, r in enumerate(rows):
        p = per.get(r.get("seq_id"))
        if p is not None and isinstance(p.get("slot_mapping"), list):
            out.append((r, _ints(p["slot_mapping"]), _ints(bts[i]) if isinstance(bts, list) and i < len(bts) else
                        _ints(p.get("block_table"))))
    return out


def _record_writes(writes: dict[int, tuple[int, int, Any]], m: dict[str, Any], st: dict[str, Any]) -> None:
    """Note which (request, position) each physical slot written in step ``st`` holds (paged conventions)."""
    for r, slots, _ in _rows_slots(m, st):
        C = r.get("C")
        if not isinstance(C, int) or r.get("spec"):
            continue
        for k, slot in enumerate(slots):
            writes[slot] = (r.get("seq_id"), C + k, st.get("step"))


def _hit_slots(m: dict[str, Any], st: dict[str, Any], i: int, C: int) -> list[int] | None:
    """The physical slots positions ``0..C-1`` of batch row ``i`` read from the cache: ``table[j // B] * B + j % B``."""
    B = _block_size(m)
    rows = st.get("batch", []) or []
    for r, _, table in _rows_slots(m, st):
        if r is rows[i] and table and B:
            return [table[j // B] * B + j % B for j in range(C) if j // B < len(table)]
    return None


def _hit_src(st: dict[str, Any], sid: int) -> int | None:
    """The source request a cells prefix hit copied from (``serving.prefix[sid].src``, ``seq_cp``), if recorded."""
    sv = st.get("serving") if isinstance(st.get("serving"), dict) else {}
    p = (sv.get("prefix") or {}).get(str(sid)) if isinstance(sv.get("prefix"), dict) else None
    src = p.get("src") if isinstance(p, dict) else None
    return src if isinstance(src, int) and not isinstance(src, bool) else None


def _writers(hit: dict[str, Any], writes: dict[int, tuple[int, int, Any]]) -> dict[int, tuple[int, int, Any] | None]:
    """Position j of a prefix hit -> (seq_id, position, step) that computed the K/V it reads: the last
    write of its slot before the hit's step (paged), or the same position of the source request (cells)."""
    if hit.get("slots") is not None:
        return {j: writes.get(slot) for j, slot in enumerate(hit["slots"])}
    if hit.get("src") is not None:
        return {j: (hit["src"], j, None) for j in range(hit["C"])}
    return {}


def _div(variable: str, sid: int, field: str, a: Any, b: Any, kind: str = "value", note: str = "") -> Divergence:
    return Divergence(f"requests[seq {sid}].{field}", variable, field, a, b, kind, None, sid, note=note)


def resolve(q: dict[str, Any], j: int) -> dict[str, Any] | None:
    """Position ``j`` of request ``q`` as computed: by ``q`` itself, or -- served from the prefix cache -- by the
    request that wrote the K/V it read (its record, marked ``served`` with the writer's seq_id and position)."""
    if j in q["at"]:
        return q["at"][j]
    w = q["served"].get(j)
    if w is None:
        return None
    return {**w["rec"], "served": True, "by_seq": w["seq_id"], "by_pos": w["j"]}


def where(u: dict[str, Any]) -> str:
    """``step 3`` or ``served from the prefix cache (computed by seq 0 at step 0)``."""
    if u.get("served"):
        return f"served from the prefix cache (computed by seq {u['by_seq']} at step {u['step']})"
    return f"step {u['step']}"


def served_info(p: dict[int, dict[str, Any]], sid: int, js: list[int]) -> dict[str, Any]:
    """What a request's prefix hit served: positions, the writers (seq ids), the hit's step and length."""
    q = p[sid]
    by = sorted({q["served"][j]["seq_id"] for j in js if j in q["served"]})
    return {"positions": ranges_text(js), "count": len(js), "by_seq": by, "hit": (q["hit"] or {}).get("C"),
            "step": (q["hit"] or {}).get("step")}


def _compare_positions(sid: int, x: dict[str, Any], y: dict[str, Any], need: int,
                       add: Any) -> tuple[list[int], dict[str, list[int]]]:
    """Positions ``0..need-1`` (and any both computed) of request ``sid``: token, position id and visible keys
    exactly, each taken where it was computed (:func:`resolve`: a served position where its writer computed it);
    a required position neither computed nor served is a difference. Returns ``(compared, served per side)``."""
    both: list[int] = []
    served: dict[str, list[int]] = {"a": [], "b": []}
    for j in sorted(set(range(max(need, 0))) | (set(x["at"]) & set(y["at"]))):
        u, v = resolve(x, j), resolve(y, j)
        if u is None or v is None:
            if j < need:
                add(_div("positions", sid, f"at[{j}]", "computed" if u else "(not computed)",
                         "computed" if v else "(not computed)", "missing",
                         "every position before the last output token must be computed or served from the prefix cache"))
            continue
        both.append(j)
        for side, w in (("a", u), ("b", v)):
            if w.get("served"):
                served[side].append(j)
        for key, var in (("token", "tokens"), ("pos", "positions"), ("visible", "visible keys")):
            if u[key] != v[key]:
                add(_div(var, sid, f"at[{j}].{key}", u[key], v[key], note=f"A {where(u)}, B {where(v)}"))
    return both, served


def _compare_kv(a: dict[str, Any], b: dict[str, Any], tensors_a: Any, tensors_b: Any, sid: int, both: list[int],
                rel: float, add: Any, kv_all: dict[str, Any]) -> dict[str, Any]:
    """K/V of request ``sid`` at the positions ``both`` compared (:func:`~infertrace.trace.kv_rows.compare_kv`):
    a position over the floor is a ``kv`` difference; folds the totals into ``kv_all``; returns the request's record."""
    from infertrace.trace.kv_rows import compare_kv, kv_rows

    (ra, sa_), (rb, sb_) = kv_rows(a, tensors_a, sid), kv_rows(b, tensors_b, sid)
    kvr = compare_kv(ra, rb, [(j, j) for j in both], rel, keep=None)
    for k in ("positions", "n_over"):
        kv_all[k] += kvr[k]
    for k in ("max_abs_k", "max_abs_v"):
        kv_all[k] = max(kv_all[k], kvr[k])
    kv_all["sources"] = sorted(set(kv_all["sources"]) | {sa_.split(":")[0], sb_.split(":")[0]})
    for o in kvr["over_floor"]:
        add(_div("kv", sid, f"at[{o['j']}].kv", f"|ΔK| {o['dk']:.3g}", f"|ΔV| {o['dv']:.3g}",
                 note=f"over the noise floor {o['floor']:.3g}"))
    return {**kvr, "over_floor": kvr["over_floor"][:KEEP], "source": {"a": sa_, "b": sb_}}


def _compare_ids(sid: int, x: dict[str, Any], y: dict[str, Any], add: Any) -> None:
    """``prompt_ids`` / ``output_ids`` of request ``sid`` in A (``x``) and B (``y``): the first index where
    they differ (or where one ends) is a ``tokens`` difference, passed to ``add``."""
    for f in ("prompt_ids", "output_ids"):
        if x[f] != y[f]:
            k = next((i for i, (u, v) in enumerate(zip(x[f], y[f])) if u != v), min(len(x[f]), len(y[f])))
            add(_div("tokens", sid, f"{f}[{k}]", x[f][k] if k < len(x[f]) else "(missing)",
                     y[f][k] if k < len(y[f]) else "(missing)", note=f"A {len(x[f])} ids, B {len(y[f])}"))


@dataclass
class _NextTokenTotals:
    """The logits-row agreement over all requests (``info["next_token"]``): rows both runtimes recorded,
    those with the same top-1 id, the sum of top-k overlaps (fraction of ``min(k_a, k_b)``), the largest
    |Δ logit| over ids both recorded, rows only one side recorded, the first :data:`KEEP` disagreements."""

    rows: int = 0
    same: int = 0
    overlap_sum: float = 0.0
    max_dlogit: float = 0.0
    disagree: list[dict[str, Any]] = field(default_factory=list)
    only_rows: dict[str, int] = field(default_factory=lambda: {"a": 0, "b": 0})

    def info(self) -> dict[str, Any]:
        rows, same = self.rows, self.same
        return {"rows": rows, "same_top": same, "same_top_rate": same / rows if rows else None,  # None: no row both recorded
                "topk_overlap_mean": self.overlap_sum / rows if rows else None, "max_abs_logit": self.max_dlogit,
                "rows_only_a": self.only_rows["a"], "rows_only_b": self.only_rows["b"], "disagreements": self.disagree}


def _compare_logits_rows(sid: int, x: dict[str, Any], y: dict[str, Any], nt: _NextTokenTotals) -> dict[str, int]:
    """The logits rows of request ``sid``, the row that predicts position p (``next_pos`` p) in A (``x``) against
    B (``y``): folds each into the totals ``nt``; returns the request's ``{"rows", "same_top"}``."""
    nr = {"rows": 0, "same_top": 0}
    for p in sorted(set(x["next"]) | set(y["next"])):
        if p not in x["next"] or p not in y["next"]:
            nt.only_rows["a" if p in x["next"] else "b"] += 1
            continue
        ta, tb = x["next"][p]["top"], y["next"][p]["top"]
        ia, ib = [t.get("id") for t in ta], [t.get("id") for t in tb]
        k = min(len(ia), len(ib))
        nt.rows += 1
        nr["rows"] += 1
        nt.overlap_sum += len(set(ia[:k]) & set(ib[:k])) / k if k else 0.0
        la = {t.get("id"): t.get("logit") for t in ta}
        lb = {t.get("id"): t.get("logit") for t in tb}
        for i in la.keys() & lb.keys():
            if isinstance(la[i], (int, float)) and isinstance(lb[i], (int, float)):
                nt.max_dlogit = max(nt.max_dlogit, abs(float(la[i]) - float(lb[i])))
        if ia and ib and ia[0] == ib[0]:
            nt.same += 1
            nr["same_top"] += 1
        elif len(nt.disagree) < KEEP:
            nt.disagree.append({"seq_id": sid, "next_pos": p, "a": ta[0] if ta else None, "b": tb[0] if tb else None,
                                "a_step": x["next"][p]["step"], "b_step": y["next"][p]["step"]})
    return nr


def logical_diff(a: dict[str, Any], b: dict[str, Any], ignore: tuple[str, ...] = (), tensors_a: Any = None,
                 tensors_b: Any = None) -> tuple[DiffResult, dict[str, Any]]:
    """Compare the logical variables of two traces of the same requests computed by runtimes with
    different conventions (see the module docstring).

    Args:
        a, b: validated manifests (``read_manifest``); ``ignore``: variable names (``tokens``,
            ``positions``, ``visible keys``) or path prefixes to leave out.

    Returns:
        ``(DiffResult, info)``: the exact differences (tokens, positions, visible keys), and
        ``info`` = ``{"mode": "logical", "engines", "conventions", "note", "requests": [...],
        "next_token": {...}, "kv": {...}}`` with per request the positions compared, the chunks of each runtime
        side by side, the logits-row agreement and the K/V at each position both hold (``tensors_a/b``: the
        kept tensors, else the ``kv.layer_view`` summary) against the noise floor
        (:func:`infertrace.trace.kv_rows.kv_floor`); a position over it is a ``kv`` difference.
    """
    from infertrace.trace.kv_rows import kv_floor

    rel, how = kv_floor(a, b)
    layer_a, layer_b = (m.get("options", {}).get("layer", 0) if isinstance(m.get("options"), dict) else 0 for m in (a, b))
    kv_all = {"positions": 0, "max_abs_k": 0.0, "max_abs_v": 0.0, "n_over": 0, "floor": how, "floor_rel": rel,
              "layer": layer_a if layer_a == layer_b else None, "sources": []}
    pa, pb = _per_request(a), _per_request(b)
    diffs: list[Divergence] = []

    def add(d: Divergence) -> None:
        if d.variable in ignore or any(d.path == p or d.path.startswith(p + ".") for p in ignore):
            return
        diffs.append(d)

    reqs_info = []
    nt = _NextTokenTotals()
    for sid in sorted(set(pa) | set(pb)):
        if sid not in pa or sid not in pb:
            add(_div("tokens", sid, "request", "present" if sid in pa else "(missing)", "present" if sid in pb else "(missing)",
                     "missing"))
            continue
        x, y = pa[sid], pb[sid]
        _compare_ids(sid, x, y, add)
        need = len(x["prompt_ids"]) + min(len(x["output_ids"]), len(y["output_ids"])) - 1
        n_before = len(diffs)
        both, served = _compare_positions(sid, x, y, need, add)
        extra = {"a": sorted(set(x["at"]) - set(range(need))), "b": sorted(set(y["at"]) - set(range(need)))}
        kvr = None
        if layer_a == layer_b and "kv" not in ignore:  # the K/V each holds at (request, position), served ones where written
            kvr = _compare_kv(a, b, tensors_a, tensors_b, sid, both, rel, add, kv_all)
        nr = _compare_logits_rows(sid, x, y, nt)
        reqs_info.append({"seq_id": sid, "positions_compared": len(both), "required": max(need, 0),
                          "differences": len(diffs) - n_before, "kv": kvr,
                          "served": {k: served_info(pa if k == "a" else pb, sid, v) for k, v in served.items() if v},
                          "only_a": ranges_text(extra["a"]) if extra["a"] else None,
                          "only_b": ranges_text(extra["b"]) if extra["b"] else None,
                          "logits_rows": nr, "chunks": {"a": x["chunks"], "b": y["chunks"]},
                          "chunks_total": {"a": x["n_chunks"], "b": y["n_chunks"]}})
    res = DiffResult(diffs[0] if diffs else None, len(diffs), 0.0, 0.0, cross_engine=True,
                     tensors_note="K/V compared against the noise floor; other tensors not compared across runtimes", differences=diffs[:KEEP])
    info = {"mode": "logical", "engines": [_engine(a), _engine(b)], "conventions": [_convention(a), _convention(b)],
            "note": NOTE, "requests": reqs_info,
            "next_token": nt.info(),
            "kv": kv_all}
    return res, info
