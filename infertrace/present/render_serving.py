"""Rich rendering of the serving record of a step (:attr:`StepTrace.serving`, made by
:mod:`infertrace.engine.serving`): prefix-cache lookups (hit length, shared blocks or cells with
their reference counts, positions actually computed, where and why the lookup stopped), cache
evictions, context shifts (positions dropped and moved, K re-rotated) and the KV audit table.

Every string shown comes from a trace (untrusted when loaded): it is rendered as rich ``Text``
(never as markup) and shortened.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

_DIM = "bright_black"
_MAX = 160


def _s(x: Any) -> str:
    """``x`` as bounded terminal-safe text: control characters (ESC, BEL, C1, ...) shown as ``\\xNN``."""
    t = str(x)[: _MAX * 2]
    t = "".join(ch if ch.isprintable() or ch == "\n" else f"\\x{ord(ch):02x}" for ch in t)
    return t if len(t) <= _MAX else t[: _MAX - 1] + "…"


def _list(x: Any) -> list[dict[str, Any]]:
    return [e for e in x if isinstance(e, dict)] if isinstance(x, list) else []


def serving_mark(pos_text: str, r: Any) -> str | Text:
    """The worked-example ``positions`` cell with marks: ``hit 0..16←seq 0`` when a prefix hit supplied
    the cache before this chunk, ``shift −4`` when a context shift moved the cache just before."""
    marks = []
    p = getattr(r, "prefix", None)
    if isinstance(p, dict) and isinstance(p.get("hit"), int) and p["hit"] > 0:
        src = p.get("src")
        marks.append(f"hit 0..{p['hit'] - 1}" + (f"←seq {_s(src)}" if src is not None else ""))
    sh = getattr(r, "shift", None)
    if isinstance(sh, dict) and sh.get("n_discard"):
        marks.append(_s(f"shift −{sh['n_discard']} (dropped {sh.get('removed')})"))
    if not marks:
        return pos_text
    t = Text(pos_text)
    for m in marks:
        t.append("\n" + _s(m), style="green" if m.startswith("hit") else "yellow")
    return t


def _prefix_line(sid: str, p: dict[str, Any]) -> Text:
    t = Text()
    resumed = p.get("resumed") is True  # vLLM: a request resumed after preemption hits its own still-hashed blocks
    t.append(f"seq {_s(sid)} {'resumed after preemption, ' if resumed else ''}prefix lookup: ", style="bold")
    hit = p.get("hit") if isinstance(p.get("hit"), int) else 0
    t.append(f"hit {hit} of {_s(p.get('prompt_len', '?'))} tokens{' (prompt + output so far)' if resumed else ''}",
             style="green" if hit else "")
    if p.get("src") is not None:
        t.append(f" from request {_s(p['src'])}" + (f" ({_s(p['src_state'])})" if p.get("src_state") else ""))
    if p.get("shared_blocks"):
        t.append(f" · shared blocks {_s(p['shared_blocks'])}" + (f" ref_cnt {_s(p['ref_cnt'])}" if p.get("ref_cnt") is not None else ""))
    if isinstance(p.get("copied"), dict):
        c = p["copied"]
        t.append(f" · {_s(c.get('tokens'))} slots copied from block {_s(c.get('from_block'))} into block {_s(c.get('block'))}")
    if p.get("cells") not in (None, "-"):
        t.append(f" · cells {_s(p['cells'])} shared (seq_cp)")
    if p.get("computed") is not None:  # a vLLM hit records the hit and its blocks; the rest is in the batch row
        t.append(f" · computed {_s(p['computed'])}")
    if p.get("stop") is not None:
        t.append(f"\n    stopped at {_s(p['stop'])}", style=_DIM)
    return t


def _op_line(op: dict[str, Any]) -> Text:
    if op.get("op") == "context_shift" and all(k in op for k in ("seq_id", "n_past", "n_keep", "n_discard", "removed",
                                                                 "moved", "n_past_after")):
        return Text(f"context shift seq {op['seq_id']}: n_past {op['n_past']}, n_keep {op['n_keep']}, n_discard "
                    f"{op['n_discard']}: dropped {op['removed']}, moved {op['moved']} (K re-rotated by "
                    f"−{op['n_discard']}), n_past now {op['n_past_after']}" + (
                        f"; K-shift check: layer-0 K of the moved entries vs K computed fresh at their new positions, "
                        f"max |Δ| {_s(op['k_shift_max_abs_layer0'])}" if "k_shift_max_abs_layer0" in op else ""), style="yellow")
    return Text(_s(op), style="yellow")


def _evict_line(ev: dict[str, Any]) -> Text:
    if "block" in ev:
        return Text(f"evicted block {ev['block']} (hash {ev.get('hash')}): handed out again, its prefix is gone", style=_DIM)
    return Text(f"evicted retained seq {ev.get('seq_id')} to make room: cells {ev.get('freed')} freed, "
                f"{ev.get('still_shared')} kept (other owners)", style=_DIM)


def audit_table(a: dict[str, Any]) -> Table:
    """One row per provenance: entries and the largest |Δ| of K and V against a from-scratch recomputation."""
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False,
              title=Text(f"KV audit (cache vs recomputed from scratch): max |Δ| {_s(a.get('max_abs_exact', a.get('max_abs')))} "
                         "where it must match" + ("; shifted entries and those computed after a shift must match in "
                                                  "layer 0 only (deeper layers saw the dropped tokens)"
                                                  if any("shift" in str(g.get("provenance")) for g in
                                                         _list(a.get("by_provenance"))) else ""),
                         style="italic"),
              title_justify="left")
    for h in ("provenance", "entries", "max |ΔK|", "max |ΔV|", "layer 0 max |Δ|"):
        t.add_column(h, justify="left" if h == "provenance" else "right")
    for g in _list(a.get("by_provenance")):
        nums = [g.get(k) for k in ("max_abs_k", "max_abs_v", "max_abs_layer0")]
        t.add_row(Text(_s(g.get("provenance"))), _s(g.get("entries")),
                  *[f"{x:.3g}" if isinstance(x, (int, float)) else _s(x) for x in nums])
    return t


def serving_view(st: Any) -> RenderableType:
    """Lines for the step's serving record (prefix lookups, ops before the step, evictions, audit)."""
    sv = st.serving if isinstance(st.serving, dict) else {}  # a loaded trace is untrusted: skip what is malformed
    parts: list[RenderableType] = []
    for op in _list(sv.get("ops_before_step")):
        parts.append(_op_line(op))
    prefix = sv.get("prefix") if isinstance(sv.get("prefix"), dict) else {}
    for sid, p in prefix.items():
        if isinstance(p, dict):
            parts.append(_prefix_line(sid, p))
    for ev in _list(sv.get("evictions")):
        parts.append(_evict_line(ev))
    for sid, why in (sv.get("stopped") if isinstance(sv.get("stopped"), dict) else {}).items():
        parts.append(Text(f"seq {sid} stopped: {_s(why)} (the KV storage of {sv.get('pool_tokens')} tokens is full even with "
                          "every other request preempted)", style="yellow"))
    if isinstance(sv.get("audit"), dict):
        parts.append(audit_table(sv["audit"]))
    return Group(*parts) if parts else Text("")


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def audit_summary(trace: Any) -> dict[str, Any] | None:
    """The ``--audit-kv`` records of every step folded into one: per provenance the steps audited, the most
    entries in one step and the largest |ΔK|, |ΔV|, layer-0 |Δ|; ``max_abs_exact`` the largest |Δ| where the
    cache must match a from-scratch recomputation. None when no step was audited."""
    rows: dict[str, dict[str, Any]] = {}
    exact: list[float] = []
    steps = 0
    for st in trace.steps:
        sv = st.serving if isinstance(st.serving, dict) else {}
        a = sv.get("audit")
        if not isinstance(a, dict):
            continue
        steps += 1
        e = _num(a.get("max_abs_exact", a.get("max_abs")))
        if e is not None:
            exact.append(e)
        for g in _list(a.get("by_provenance")):
            r = rows.setdefault(_s(g.get("provenance")), {"steps": 0, "entries": 0, "max_abs_k": None, "max_abs_v": None,
                                                          "max_abs_layer0": None})
            r["steps"] += 1
            r["entries"] = max(r["entries"], int(_num(g.get("entries")) or 0))
            for k in ("max_abs_k", "max_abs_v", "max_abs_layer0"):
                x = _num(g.get(k))
                if x is not None:
                    r[k] = x if r[k] is None else max(r[k], x)
    if not steps:
        return None
    return {"steps": steps, "max_abs_exact": max(exact) if exact else None, "by_provenance": rows}


def render_audit_summary(console: Any, trace: Any) -> None:
    """The whole-run ``--audit-kv`` table under the outputs (nothing when the run was not audited)."""
    sm = audit_summary(trace)
    if sm is None:
        return
    ex = sm["max_abs_exact"]
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), show_edge=False, title_justify="left",
              title=Text(f"KV audit, whole run ({sm['steps']} steps): max |Δ| "
                         f"{'-' if ex is None else f'{ex:.3g}'} where the cache must match its recomputation",
                         style="italic"))
    for h in ("provenance", "steps", "most entries", "max |ΔK|", "max |ΔV|", "layer 0 max |Δ|"):
        t.add_column(h, justify="left" if h == "provenance" else "right")
    for name, r in sm["by_provenance"].items():
        t.add_row(Text(name), str(r["steps"]), str(r["entries"]),
                  *["-" if r[k] is None else f"{r[k]:.3g}" for k in ("max_abs_k", "max_abs_v", "max_abs_layer0")])
    console.print(t)


def serving_lines(st: Any) -> list[str]:
    """The step's serving record as plain lines, as the terminal prints them (prefix lookups with hit
    length, source request, shared blocks / cells and copied slots; ops before the step; evictions):
    for the HTML report."""
    sv = st.serving if isinstance(st.serving, dict) else {}
    out = [_op_line(op).plain for op in _list(sv.get("ops_before_step"))]
    prefix = sv.get("prefix") if isinstance(sv.get("prefix"), dict) else {}
    out += [_prefix_line(sid, p).plain for sid, p in prefix.items() if isinstance(p, dict)]
    out += [_evict_line(ev).plain for ev in _list(sv.get("evictions"))]
    return out


def prefix_hits(trace: Any) -> list[str]:
    """One phrase per prefix hit of the run: ``seq 1 at step 3: 12 of 13 tokens from request 0, blocks [0, 1, 2] shared``."""
    out = []
    for st in trace.steps:
        sv = st.serving if isinstance(st.serving, dict) else {}
        prefix = sv.get("prefix") if isinstance(sv.get("prefix"), dict) else {}
        for sid, p in prefix.items():
            if not (isinstance(p, dict) and isinstance(p.get("hit"), int) and p["hit"] > 0):
                continue
            s = f"seq {_s(sid)} at step {st.step}: {p['hit']} of {_s(p.get('prompt_len', '?'))} tokens"
            if p.get("src") is not None:
                s += f" from request {_s(p['src'])}"
            if p.get("shared_blocks"):
                s += f", blocks {_s(p['shared_blocks'])} shared"
            if isinstance(p.get("copied"), dict):
                s += f", {_s(p['copied'].get('tokens'))} slots copied from block {_s(p['copied'].get('from_block'))}"
            if p.get("cells") not in (None, "-"):
                s += f", cells {_s(p['cells'])} shared (seq_cp)"
            out.append(s)
    return out
