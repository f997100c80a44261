"""Text of ``diff A B`` across conventions (:func:`infertrace.trace.runtime_diff.logical_diff`): a llama.cpp
trace against a vLLM trace compared per request and per position; each runtime's own fields side by side."""

from __future__ import annotations

from typing import Any

from infertrace.fmt import clip
from infertrace.ranges import ranges_text
from infertrace.safe_text import visible

#: chunk pairs printed per request (the JSON keeps more)
SHOW_CHUNKS = 6


def _ids(v: Any) -> str:
    """A list of ints as ranges (``32..36``) when it is one increasing run per range, else as a list."""
    if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v) \
            and all(b > a for a, b in zip(v, v[1:])):
        return ranges_text(v)
    return clip(str(v), 60)


def _chunk(c: dict[str, Any] | None) -> str:
    if c is None:
        return "-"
    head = f"step {c.get('step')} {c.get('phase')} pos {c.get('positions') or '-'}"
    if "query_start_loc" in c:  # vLLM's attention metadata
        qr = c.get("query_range")
        parts = [f"query_start_loc {clip(str(c['query_start_loc']), 40)}" + (f" (rows {qr[0]}..{qr[1] - 1})" if qr else ""),
                 f"seq_lens {c.get('seq_lens')}", f"block_table {c.get('block_table')}", f"slot_mapping {_ids(c.get('slot_mapping'))}"]
    elif "inp_pos" in c:  # llama.cpp's graph inputs (cells)
        ub = c.get("ubatch") or {}
        parts = [f"inp_pos {_ids(c.get('inp_pos'))}", f"kq_mask cells {c.get('cells')}", f"n_kv {c.get('n_kv')}",
                 f"ubatch {ub.get('n_tokens')} token{'' if ub.get('n_tokens') == 1 else 's'}"
                 + (f" (n_ubatch {ub['n_ubatch']})" if ub.get("n_ubatch") is not None else "")]  # infertrace's side has none
    else:  # infertrace's paged metadata
        parts = [f"cu_seqlens {clip(str(c.get('cu_seqlens')), 40)}", f"kv_lens {c.get('kv_lens')}",
                 f"block_tables {c.get('block_tables')}", f"slot_mapping {_ids(c.get('slot_mapping'))}"]
    return " · ".join([head, *parts])


def _tok(t: Any) -> str:
    if not isinstance(t, dict):
        return "-"
    return f"{t.get('id')} {clip(repr(t.get('piece', '')), 20)} (logit {t.get('logit')})"


def kv_line(kv: dict[str, Any] | None) -> str:
    """The K/V comparison of a cross-runtime diff in one line (what, where from, the floor, the verdict)."""
    if not kv:
        return "K/V: not compared"
    if kv.get("layer") is None:
        return "K/V: not compared (the traces kept different evidence layers: run both with the same --layer)"
    if not kv["positions"]:
        return f"K/V (layer {kv['layer']}): not compared (no position whose K/V both traces hold)"
    return (f"K/V (layer {kv['layer']}, {' / '.join(kv['sources'])}): {kv['positions']} (request, position) pairs; max |ΔK| "
            f"{kv['max_abs_k']:.3g}, max |ΔV| {kv['max_abs_v']:.3g}; noise floor {kv['floor']}: "
            + ("all within" if not kv["n_over"] else f"{kv['n_over']} over"))


def logical_lines(res: Any, info: dict[str, Any], name_a: str = "A", name_b: str = "B") -> list[str]:
    """Plain lines (terminal-safe) of the per-request, per-position comparison: what was compared and
    how, the next-token agreement, per request the positions compared and the chunks of each runtime
    side by side, then the differences and a verdict."""
    ea, eb = info["engines"]
    ca, cb = info["conventions"]
    nt = info["next_token"]
    lines = [f"runtimes differ (A: {ea}, {ca}; B: {eb}, {cb}): {info['note']}",
             "  exact: tokens (prompt, output, the token fed at each position), position ids, visible key positions of "
             "each query; against a noise floor: K/V at each (request, position) both hold; summarised: the logits rows "
             "that predict the same position (top-k overlap, max |Δ logit|), next-token agreement",
             (f"next token: same top-1 {nt['same_top']}/{nt['rows']} rows ({nt['same_top_rate']:.1%}); top-k overlap "
              f"{nt['topk_overlap_mean']:.2f}; max |Δ logit| {nt['max_abs_logit']:.3g} (ids both recorded); " if nt["rows"] else
              "next token: not compared (no logits row predicts the same position in both traces); ")
             + f"rows only in A {nt['rows_only_a']}, only in B {nt['rows_only_b']} (a partial prefill samples nothing)"]
    lines.append(kv_line(info.get("kv")))
    for d in nt["disagreements"][:4]:
        lines.append(f"  different top-1: seq {d['seq_id']} predicting position {d['next_pos']}: A {_tok(d['a'])} "
                     f"(step {d['a_step']}) vs B {_tok(d['b'])} (step {d['b_step']})")
    for r in info["requests"]:
        n_diff = r.get("differences", 0)
        extra = "".join(f"; computed only by {s} at {r['only_' + s.lower()]}" for s in ("A", "B") if r["only_" + s.lower()])
        lines.append(f"seq {r['seq_id']}: {r['positions_compared']} positions compared ({r['required']} required){extra}; "
                     f"logits rows {r['logits_rows']['rows']} (same top-1 {r['logits_rows']['same_top']})"
                     + (f"; {n_diff} difference(s)" if n_diff else ""))
        for side, sv in sorted((r.get("served") or {}).items()):
            by = ", ".join(f"seq {x}" for x in sv["by_seq"]) or "?"
            lines.append(f"  positions {sv['positions']} served from {side.upper()}'s prefix cache (hit {sv['hit']} tokens at "
                         f"step {sv['step']}): compared where {by} computed them")
        ch_a, ch_b = r["chunks"]["a"], r["chunks"]["b"]
        n = max(len(ch_a), len(ch_b))
        w = max(len(str(ea)), len(str(eb)))
        for k in range(min(n, SHOW_CHUNKS)):
            lines.append(f"  chunk {k:<3} A {str(ea):<{w}} {_chunk(ch_a[k] if k < len(ch_a) else None)}")
            lines.append(f"  {'':9} B {str(eb):<{w}} {_chunk(ch_b[k] if k < len(ch_b) else None)}")
        tot = r["chunks_total"]
        if max(tot["a"], tot["b"]) > SHOW_CHUNKS:
            lines.append(f"  ... {tot['a']} chunks in A, {tot['b']} in B (--json lists up to 64 each)")
    lines.append("logical variables: identical" if res.equal else f"logical variables: {res.count} difference(s)")
    for d in res.differences[:5]:
        lines.append(f"  seq {d.seq_id} · {d.variable} · {d.field}: A {clip(str(d.a), 60)} vs B {clip(str(d.b), 60)}"
                     + (f" ({d.note})" if d.note else ""))
    if res.count > 5:
        lines.append(f"  ... {res.count - 5} more")
    kv = info.get("kv")
    kv_said = ("K/V within the noise floor" if kv and kv.get("layer") is not None and kv.get("positions")
               else "K/V not compared")
    lines.append(f"no logical difference between {name_a} and {name_b} (tokens, positions and visible keys exact, per "
                 f"request and position; {kv_said}; logits summarised above; convention fields listed, "
                 "not compared)" if res.equal else
                 f"{name_a} and {name_b} differ in the logical variables (first: seq {res.first.seq_id} {res.first.variable})")
    return [visible(x) for x in lines]
