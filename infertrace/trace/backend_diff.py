"""``infertrace diff A B`` of a saved ``cells`` trace and a saved ``paged`` trace of this engine: the logical
comparison ``diff-backends`` runs live (:mod:`infertrace.compare.backends`), on the saved records.

Both traces come from the same deterministic scheduler, so their steps pair one to one. Each step is
compared on the LOGICAL variables, the physical layouts are listed side by side and never compared:

* ``schedule``  -- (seq_id, phase, C, T) of every chunk, in packed order;
* ``positions`` -- the packed position ids;
* ``mask``      -- the visible keys of every query (and of windowed layers, ``visible_swa``);
* ``kv``        -- K and V of every kept layer for every request holding cache (the kept tensors
  ``seq{id}/k_cache``/``v_cache``; without tensors the ``kv.layer_view`` summary), max |Δ| <= atol;
* ``tokens``    -- sampled tokens;
* ``logits``    -- the recorded top logits of each sampling row (ids both hold), max |Δ| <= atol.

Torch-free (numpy when tensors are compared).
"""

from __future__ import annotations

import re
from typing import Any

from infertrace.trace.diff import DiffResult, Divergence

LOGICAL = ("schedule", "positions", "mask", "kv", "tokens", "logits")


def needs_backend_diff(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True for two traces of one runtime whose cache conventions differ (``cells`` vs ``paged``: only
    infertrace's engine runs both, ``runtimes/api.py`` ``RuntimeInfo.conventions``)."""
    ea, eb = a.get("runtime", "infertrace"), b.get("runtime", "infertrace")
    ba = (a.get("options") or {}).get("backend") if isinstance(a.get("options"), dict) else None
    bb = (b.get("options") or {}).get("backend") if isinstance(b.get("options"), dict) else None
    return ea == eb and {ba, bb} == {"cells", "paged"}


def _rows(st: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in st.get("batch", []) or [] if isinstance(r, dict)]


def _physical(st: dict[str, Any]) -> str:
    """The step's physical layout in the backend's own terms (listed, not compared)."""
    mk = st.get("mask") if isinstance(st.get("mask"), dict) else {}
    kv = st.get("kv") if isinstance(st.get("kv"), dict) else {}
    per = [p for p in kv.get("per_request", []) or [] if isinstance(p, dict)]
    km = mk.get("kq_mask")
    if isinstance(km, dict):
        return (f"kq_mask ne {km.get('ne')} n_kv {km.get('n_kv')}; cells " +
                "; ".join(f"seq {p.get('seq_id')} {p.get('cells')}" for p in per))
    md = mk.get("metadata") if isinstance(mk.get("metadata"), dict) else {}
    return (f"block_tables {md.get('block_tables')} kv_lens {md.get('kv_lens')}; slot_mapping " +
            "; ".join(f"seq {p.get('seq_id')} {p.get('slot_mapping')}" for p in per))


def _top(st: dict[str, Any]) -> dict[int, dict[int, float]]:
    dc = st.get("decode") if isinstance(st.get("decode"), dict) else {}
    return {p["seq_id"]: {t.get("id"): t.get("logit") for t in p.get("top") or [] if isinstance(t, dict)}
            for p in dc.get("per_request", []) or [] if isinstance(p, dict) and p.get("top")}


def _kv_pairs(x: dict[str, Any], y: dict[str, Any], step: int, ta: Any, tb: Any) -> tuple[list[tuple[str, Any, Any]], str]:
    """``[(label, a, b)]`` of the step's K/V both traces hold: kept tensors of every layer, else layer_view rows."""
    import numpy as np

    if ta is not None and tb is not None:
        pat = re.compile(rf"step{step}/layer\d+/seq\d+/[kv]_cache$")
        names = sorted(n for n in set(ta.names()) & set(tb.names()) if pat.match(n))
        if names:
            return [(n, np.asarray(ta.array(n), np.float32), np.asarray(tb.array(n), np.float32)) for n in names], "tensors"
    out = []
    lv = [((s.get("kv") or {}).get("layer_view") or {}) if isinstance(s.get("kv"), dict) else {} for s in (x, y)]
    ra = {r.get("seq_id"): r.get("rows") or [] for r in lv[0].get("requests", []) or [] if isinstance(r, dict)}
    rb = {r.get("seq_id"): r.get("rows") or [] for r in lv[1].get("requests", []) or [] if isinstance(r, dict)}
    for sid in sorted(set(ra) & set(rb), key=str):
        for u, v in zip(ra[sid], rb[sid]):
            for f in ("k", "v"):
                if isinstance(u, dict) and isinstance(v, dict) and len(u.get(f) or []) == len(v.get(f) or []):
                    out.append((f"seq {sid} pos {u.get('pos')} {f}", np.asarray(u.get(f) or [], np.float32),
                                np.asarray(v.get(f) or [], np.float32)))
    return out, "layer_view"


def compare_step(x: dict[str, Any], y: dict[str, Any], ta: Any, tb: Any, atol: float) -> dict[str, dict[str, Any]]:
    """The logical checks of one step pair: ``{variable: {"ok", "detail", "max_abs"?}}``."""
    import numpy as np

    checks: dict[str, dict[str, Any]] = {}
    ca = [(r.get("seq_id"), r.get("phase"), r.get("C"), r.get("T")) for r in _rows(x)]
    cb = [(r.get("seq_id"), r.get("phase"), r.get("C"), r.get("T")) for r in _rows(y)]
    checks["schedule"] = {"ok": ca == cb, "detail": "same chunks" if ca == cb else f"A {ca} vs B {cb}"}
    if ca != cb:
        return checks
    pa = [p for r in _rows(x) for p in r.get("positions") or []]
    pb = [p for r in _rows(y) for p in r.get("positions") or []]
    checks["positions"] = {"ok": pa == pb, "detail": f"{len(pa)} position ids" if pa == pb else f"A {pa} vs B {pb}"}
    bad = [f"seq {r.get('seq_id')} query {k}: A sees {u} B sees {v}" for r, s in zip(_rows(x), _rows(y))
           for f in ("visible", "visible_swa") for k, (u, v) in enumerate(zip(r.get(f) or [], s.get(f) or [])) if u != v]
    checks["mask"] = {"ok": not bad, "detail": f"{len(pa)} queries, same visible keys" if not bad else "; ".join(bad[:3])}
    pairs, src = _kv_pairs(x, y, x.get("step"), ta, tb)
    worst, why = 0.0, []
    for label, u, v in pairs:
        if u.shape != v.shape:
            why.append(f"{label}: shape {list(u.shape)} vs {list(v.shape)}")
            continue
        d = float(np.abs(u - v).max(initial=0.0))
        worst = max(worst, d)
        if d > atol:
            why.append(f"{label}: max |Δ| {d:.3g}")
    checks["kv"] = {"ok": not why, "max_abs": worst, "source": src,
                    "detail": (f"{len(pairs)} K/V arrays ({src}), max |Δ| {worst:.3g}" if not why else "; ".join(why[:3]))}
    sa = [r.get("sampled") for r in _rows(x)]
    sb = [r.get("sampled") for r in _rows(y)]
    checks["tokens"] = {"ok": sa == sb, "detail": "" if sa == sb else f"A {sa} vs B {sb}"}
    la, lb = _top(x), _top(y)
    lw, lwhy = 0.0, []
    for sid in sorted(set(la) | set(lb), key=str):
        if sid not in la or sid not in lb:
            lwhy.append(f"seq {sid}: logits in only one trace")
            continue
        ids = [i for i in la[sid] if i in lb[sid] and isinstance(la[sid][i], (int, float)) and isinstance(lb[sid][i], (int, float))]
        d = max((abs(float(la[sid][i]) - float(lb[sid][i])) for i in ids), default=0.0)
        lw = max(lw, d)
        if d > atol:
            lwhy.append(f"seq {sid}: max |Δ logit| {d:.3g}")
    checks["logits"] = {"ok": not lwhy, "max_abs": lw, "rows": len(la),
                        "detail": f"{len(la)} row(s), max |Δ| {lw:.3g}" if not lwhy else "; ".join(lwhy)}
    return checks


def backend_diff(a: dict[str, Any], b: dict[str, Any], ta: Any = None, tb: Any = None, atol: float = 1e-4,
                 ignore: tuple[str, ...] = ()) -> tuple[DiffResult, dict[str, Any]]:
    """Compare a saved cells trace with a saved paged trace of the same requests (see the module docstring).

    Returns:
        ``(DiffResult, info)``; ``info = {"mode": "backends", "backends", "atol", "steps": [{"step", "checks",
        "physical": {"a", "b"}}], "summary": {variable: {"compared", "mismatched_steps", "max_abs"?}}, "header": [...]}``.
    """
    diffs: list[Divergence] = []
    header = []
    for k in ("model", "config"):
        if a.get(k) != b.get(k):
            header.append(k)
            diffs.append(Divergence(k, "header", k, "(A's)", "(B's)", note=f"not the same {k}: the traces are of different models"))
    pa = [(r.get("seq_id"), r.get("prompt_ids")) for r in a.get("requests", []) or [] if isinstance(r, dict)]
    pb = [(r.get("seq_id"), r.get("prompt_ids")) for r in b.get("requests", []) or [] if isinstance(r, dict)]
    if pa != pb:
        diffs.append(Divergence("requests", "requests", "prompt_ids", len(pa), len(pb), note="not the same requests"))
    sa, sb = a.get("steps", []) or [], b.get("steps", []) or []
    steps = []
    for x, y in zip(sa, sb):
        if not (isinstance(x, dict) and isinstance(y, dict)):
            continue
        checks = compare_step(x, y, ta, tb, atol)
        steps.append({"step": x.get("step"), "checks": checks, "physical": {"a": _physical(x), "b": _physical(y)}})
        for var, c in checks.items():
            if not c["ok"] and var not in ignore:
                diffs.append(Divergence(f"steps[{x.get('step')}].{var}", var, var, "A", "B", step=x.get("step"), note=c["detail"]))
        if not checks["schedule"]["ok"]:
            break
    if len(sa) != len(sb) and all(s["checks"]["schedule"]["ok"] for s in steps):
        diffs.append(Divergence("steps", "schedule", "steps", len(sa), len(sb), "length", note=f"A has {len(sa)} steps, B {len(sb)}"))
    summary = {}
    for var in LOGICAL:
        cs = [s["checks"][var] for s in steps if var in s["checks"]]
        summary[var] = {"compared": len(cs), "mismatched_steps": [s["step"] for s in steps if var in s["checks"] and not s["checks"][var]["ok"]]}
        if var in ("kv", "logits"):
            summary[var]["max_abs"] = max((c["max_abs"] for c in cs), default=0.0)
    summary["kv"]["source"] = sorted({s["checks"]["kv"]["source"] for s in steps if "kv" in s["checks"]})
    res = DiffResult(diffs[0] if diffs else None, len(diffs), atol, 0.0, differences=diffs[:8],
                     tensors_note="K/V from " + ("the kept tensors" if summary["kv"]["source"] == ["tensors"] else "kv.layer_view"))
    ba, bb = a["options"].get("backend"), b["options"].get("backend")
    info = {"mode": "backends", "backends": [ba, bb], "atol": atol, "steps": steps, "summary": summary, "header": header}
    return res, info


def backend_lines(res: DiffResult, info: dict[str, Any], name_a: str, name_b: str) -> list[str]:
    """Plain lines: what was compared, one line per logical variable, the physical layouts of the first
    step side by side, the mismatches, a verdict (as ``diff-backends`` prints them live)."""
    ba, bb = info["backends"]
    sm = info["summary"]
    lines = [f"backends differ (A: {ba}, B: {bb}), same engine: the logical comparison diff-backends runs, step by step "
             f"(atol {info['atol']:g}); physical layouts listed, not compared"]
    for var in LOGICAL:
        s = sm[var]
        extra = f", max |Δ| {s['max_abs']:.3g}" if "max_abs" in s else ""
        if var == "kv" and s.get("source"):
            extra += f" ({'/'.join(s['source'])})"
        lines.append(f"  {var:<9} {s['compared']} steps compared{extra}: " +
                     ("identical" if not s["mismatched_steps"] else f"differs at step(s) {s['mismatched_steps'][:8]}"))
    if info["steps"]:
        st = info["steps"][0]
        lines += [f"physical, step {st['step']}: A {ba}: {st['physical']['a']}"[:400],
                  f"{'':>17}B {bb}: {st['physical']['b']}"[:400]]
    for d in res.differences[:5]:
        lines.append(f"  step {d.step} · {d.variable}: {d.note}")
    lines.append(f"no logical difference between {name_a} and {name_b} ({ba} vs {bb})" if res.equal else
                 f"{name_a} and {name_b} differ logically ({res.count} difference(s); first: {res.first.variable}"
                 + (f" at step {res.first.step}" if res.first.step is not None else "") + ")")
    return lines
