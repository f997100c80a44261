"""``infertrace diff DIR --seq 0 --seq 1``: two requests of one trace (or request X of A and Y of B), compared
per position of their sequences (``prompt_ids + output_ids``, index ``j``).

The question it answers: *why did the second identical request answer differently?* Per request and
position it lines up what each request computed -- or was served from the prefix cache, and by whom --
and compares:

=====================  ==========================================================  ==========
what                   per position j                                              how
=====================  ==========================================================  ==========
tokens                 prompt ids, output ids (first differing index)              exact
positions              the position id fed with token j                            exact
visible keys           the key positions query j attended to                       exact
served                 whether j came from the prefix cache, written by which      listed
                       request at which step (paged: slot of ``table[j // B]``)
blocks / cells read    each request's block-table row (vLLM ``block_table``,       listed,
                       ``block_tables``) or cells (``kq_mask`` cells); shared ones  shared
                                                                                    named
logits                 the rows predicting the same position: top-1, max |Δ|       summary
K/V                    at each position both hold (tensors, else kv.layer_view)   noise floor
=====================  ==========================================================  ==========

Torch-free.
"""

from __future__ import annotations

from typing import Any

from infertrace.ranges import ranges_text
from infertrace.trace.kv_rows import compare_kv, kv_floor, kv_rows
from infertrace.trace.runtime_diff import _per_request, resolve


def _reads(m: dict[str, Any], sid: int) -> dict[str, Any]:
    """What request ``sid`` read at its last chunk: block-table row (paged) or cells (cells)."""
    last: dict[str, Any] = {}
    for st in m.get("steps", []) or []:
        if not isinstance(st, dict):
            continue
        rows = [r for r in st.get("batch", []) or [] if isinstance(r, dict)]
        for i, r in enumerate(rows):
            if r.get("seq_id") != sid:
                continue
            vl = st.get("vllm")
            am = vl.get("attn_metadata") if isinstance(vl, dict) else None
            if isinstance(am, dict) and isinstance(am.get("block_table"), list) and i < len(am["block_table"]):
                last = {"kind": "blocks", "ids": list(am["block_table"][i]), "step": st.get("step")}
                continue
            kv = st.get("kv") if isinstance(st.get("kv"), dict) else {}
            per = next((p for p in kv.get("per_request", []) or [] if isinstance(p, dict) and p.get("seq_id") == sid), {})
            md = (st.get("mask") or {}).get("metadata") if isinstance(st.get("mask"), dict) else None
            phys = kv.get("physical") if isinstance(kv.get("physical"), dict) else {}
            held = (phys.get("seqs") or {}).get(str(sid)) if isinstance(phys.get("seqs"), dict) else None
            if isinstance(md, dict) and isinstance(md.get("block_tables"), list) and i < len(md["block_tables"]):
                last = {"kind": "blocks", "ids": list(md["block_tables"][i]), "step": st.get("step")}
            elif isinstance(held, dict) and held.get("cells") is not None:  # the cells it owns = the keys its kq_mask rows keep
                last = {"kind": "cells", "ids": held["cells"], "step": st.get("step")}
            elif per.get("cells") is not None:
                last = {"kind": "cells written", "ids": per.get("cells"), "step": st.get("step")}
    return last


def _first_diff(x: list[int], y: list[int]) -> int | None:
    k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
    if k is None and len(x) != len(y):
        return min(len(x), len(y))
    return k


def compare_seqs(ma: dict[str, Any], sa: int, mb: dict[str, Any], sb: int, ta: Any = None, tb: Any = None) -> dict[str, Any]:
    """Request ``sa`` of trace ``ma`` against request ``sb`` of ``mb`` (the same manifest for two requests of one trace).

    Returns:
        ``{"equal", "tokens", "positions", "served", "reads", "logits", "kv", "differences"}``: ``differences``
        lists the exact ones (tokens, positions, visible keys; at most 16 kept, ``n_differences`` counts all).

    Raises:
        KeyError: a seq id the trace does not hold (the caller names the seq ids it has).
    """
    pa, pb = _per_request(ma), _per_request(mb)
    x, y = pa[sa], pb[sb]
    diffs: list[dict[str, Any]] = []
    n_diff = 0
    tokens = {}
    for f in ("prompt_ids", "output_ids"):
        k = _first_diff(x[f], y[f])
        tokens[f] = {"a": len(x[f]), "b": len(y[f]), "first_diff": k,
                     "at": None if k is None else [x[f][k] if k < len(x[f]) else None, y[f][k] if k < len(y[f]) else None]}
        if k is not None:
            n_diff += 1
            diffs.append({"what": f"{f}[{k}]", "a": tokens[f]["at"][0], "b": tokens[f]["at"][1]})
    seq_a, seq_b = x["prompt_ids"] + x["output_ids"], y["prompt_ids"] + y["output_ids"]
    n = min(len(seq_a), len(seq_b)) - 1  # positions both fed (the last output token is never fed)
    compared, served = [], {"a": [], "b": []}
    for j in range(max(n, 0)):
        u, v = resolve(x, j), resolve(y, j)
        if u is None or v is None:
            continue
        compared.append(j)
        for side, w in (("a", u), ("b", v)):
            if w.get("served"):
                served[side].append((j, w["by_seq"], w["step"]))
        for key in ("token", "pos", "visible"):
            if u[key] != v[key]:
                n_diff += 1
                if len(diffs) < 16:
                    diffs.append({"what": f"at[{j}].{key}", "a": u[key], "b": v[key]})
    logits = {"rows": 0, "same_top": 0, "max_abs_logit": 0.0, "first_different": None}
    for p in sorted(set(x["next"]) & set(y["next"])):
        ta_, tb_ = x["next"][p]["top"], y["next"][p]["top"]
        if not ta_ or not tb_:
            continue
        logits["rows"] += 1
        if ta_[0].get("id") == tb_[0].get("id"):
            logits["same_top"] += 1
        elif logits["first_different"] is None:
            logits["first_different"] = {"next_pos": p, "a": ta_[0], "b": tb_[0]}
        la = {t.get("id"): t.get("logit") for t in ta_}
        lb = {t.get("id"): t.get("logit") for t in tb_}
        for i in la.keys() & lb.keys():
            if isinstance(la[i], (int, float)) and isinstance(lb[i], (int, float)):
                logits["max_abs_logit"] = max(logits["max_abs_logit"], abs(float(la[i]) - float(lb[i])))
    ra, src_a = kv_rows(ma, ta, sa)
    rb, src_b = kv_rows(mb, tb, sb)
    rel, how = kv_floor(ma, mb)
    kv = compare_kv(ra, rb, [(j, j) for j in compared], rel)
    kv["floor"] = how
    kv["source"] = src_a if src_a == src_b else f"A {src_a}; B {src_b}"
    reads = {"a": _reads(ma, sa), "b": _reads(mb, sb)}
    ia, ib = reads["a"].get("ids"), reads["b"].get("ids")
    if reads["a"].get("kind") == "blocks" and reads["b"].get("kind") == "blocks" and ma is mb:
        reads["shared"] = [b for b in ia if b in set(ib)]
    equal = n_diff == 0 and logits["rows"] == logits["same_top"] and kv["n_over"] == 0
    return {"equal": equal, "seqs": [sa, sb], "tokens": tokens, "positions": {"compared": len(compared), "fed": max(n, 0),
            "ranges": ranges_text(compared)},
            "served": {k: _served_text(v) for k, v in served.items()}, "reads": reads, "logits": logits, "kv": kv,
            "n_differences": n_diff, "differences": diffs}


def _served_text(rows: list[tuple[int, int, Any]]) -> dict[str, Any] | None:
    if not rows:
        return None
    return {"positions": ranges_text([j for j, _, _ in rows]), "count": len(rows),
            "by_seq": sorted({s for _, s, _ in rows}), "steps": sorted({st for _, _, st in rows if st is not None})}


def seq_lines(r: dict[str, Any], name_a: str, name_b: str) -> list[str]:
    """Plain lines of :func:`compare_seqs` (the caller makes them terminal-safe)."""
    sa, sb = r["seqs"]
    A, B = f"seq {sa}" + (f" of {name_a}" if name_a != name_b else ""), f"seq {sb}" + (f" of {name_b}" if name_a != name_b else "")
    lines = [f"{A} vs {B}" + (f" of {name_a}" if name_a == name_b else "") + ": compared per position of each request's "
             "sequence (prompt + output)"]
    for f, label in (("prompt_ids", "prompt"), ("output_ids", "output")):
        t = r["tokens"][f]
        lines.append(f"{label}: " + (f"identical ({t['a']} ids)" if t["first_diff"] is None else
                                     f"first differs at {f}[{t['first_diff']}]: {t['at'][0]} vs {t['at'][1]} "
                                     f"({A} {t['a']} ids, {B} {t['b']})"))
    p = r["positions"]
    lines.append(f"positions {p['ranges'] or '-'} ({p['compared']} of the {p['fed']} both fed): token ids, position ids and "
                 "visible keys " + ("identical" if not any(d["what"].startswith("at[") for d in r["differences"]) else "differ"))
    for side, who in (("a", A), ("b", B)):
        sv = r["served"][side]
        lines.append(f"served from the prefix cache for {who}: " + (
            f"positions {sv['positions']} ({sv['count']}), computed by " + ", ".join(f"seq {s}" for s in sv["by_seq"])
            + (f" at step {', '.join(map(str, sv['steps']))}" if sv["steps"] else "") if sv else "none (computed itself)"))
    ra, rb = r["reads"]["a"], r["reads"]["b"]
    if ra or rb:
        kind = ra.get("kind") or rb.get("kind")
        shared = r["reads"].get("shared")
        lines.append(f"{kind} read (last chunk): {A} {ra.get('ids', '-')} (step {ra.get('step', '-')}) · {B} {rb.get('ids', '-')} "
                     f"(step {rb.get('step', '-')})" + (f" · shared {shared}" if shared else ""))
    lg = r["logits"]
    if lg["rows"]:
        lines.append(f"logits: {lg['rows']} rows predict the same position; same top-1 {lg['same_top']}/{lg['rows']}; "
                     f"max |Δ logit| {lg['max_abs_logit']:.3g} (ids both recorded)")
        fd = lg["first_different"]
        if fd:
            lines.append(f"  first different top-1, predicting position {fd['next_pos']}: {fd['a'].get('id')} "
                         f"{fd['a'].get('piece')!r} ({fd['a'].get('logit')}) vs {fd['b'].get('id')} {fd['b'].get('piece')!r} "
                         f"({fd['b'].get('logit')})")
    else:
        lines.append("logits: not compared (no row predicts the same position in both)")
    kv = r["kv"]
    if kv["positions"]:
        lines.append(f"K/V ({kv['source']}): {kv['positions']} positions; max |ΔK| {kv['max_abs_k']:.3g}, max |ΔV| "
                     f"{kv['max_abs_v']:.3g}; noise floor {kv['floor_rel']:.2g} × max |x| per position: "
                     + ("all within" if not kv["n_over"] else f"{kv['n_over']} position(s) over, first {kv['over_floor'][0]}"))
    else:
        lines.append("K/V: not compared (no position whose K/V both hold)")
    for d in r["differences"][:5]:
        lines.append(f"  {d['what']}: {A} {d['a']} vs {B} {d['b']}")
    lines.append(f"{A} and {B} agree" if r["equal"] else f"{A} and {B} differ ({r['n_differences']} exact difference(s))")
    return lines
