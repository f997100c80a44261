"""Compare two traces and name the first place they diverge.

Walk order is the order of the run: header (schema, model, config, options), then step by
step (schedule, then hidden, positions, mask, kv, decode, then the step's saved tensors when
both traces kept them), then the final requests. Floats compare with a tolerance
(``|a - b| <= atol + rtol * |b|``, numpy ``isclose``); ints, strings, bools and None exactly.
Timing fields and the ``store`` section (what was kept, not what ran) are not compared.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from infertrace.fmt import clip

#: step keys compared first, in this order (the rest follow sorted)
STEP_ORDER = ("step", "N", "backend", "attention", "admitted", "preempted", "batch",
              "hidden", "positions", "mask", "kv", "decode")
#: which of the five variables a worked-example row field belongs to
BATCH_VARIABLE = {"token_ids": "hidden", "pieces": "hidden", "positions": "positions", "visible": "mask",
                  "cache_before": "kv", "cache_after": "kv", "sampled": "decode", "sampled_piece": "decode",
                  "logits_row": "decode", "finished": "decode"}
SKIP_TOP = {"store"}
SKIP_STEP = {"time_ms"}
DEFAULT_ATOL = 1e-4
DEFAULT_RTOL = 1e-4


@dataclass
class Divergence:
    """One difference: where (path, step, seq_id, variable, field) and what (A vs B)."""

    path: str  # full field path, e.g. steps[1].positions.inp_pos[0]
    variable: str  # hidden | positions | mask | kv | decode | schedule | header | requests
    field: str  # path inside the variable, e.g. inp_pos[0]
    a: Any
    b: Any
    kind: str = "value"  # value | length | missing | type | shape | tensor
    step: int | None = None
    seq_id: int | None = None
    context_a: Any = None  # the container holding the field, for the readable report
    context_b: Any = None
    note: str = ""


@dataclass
class DiffResult:
    first: Divergence | None
    count: int  # differing fields in all (a length mismatch counts once)
    atol: float
    rtol: float
    tensors_compared: int = 0
    tensors_note: str = ""
    cross_engine: bool = False  # structure projections of two engines' traces (floats summarised, not held to atol/rtol)
    differences: list[Divergence] = field(default_factory=list)  # the first few

    @property
    def equal(self) -> bool:
        return self.first is None


#: the five variables, in trace order (trace/records.py VARIABLES, repeated here: diff is torch- and records-free)
VARIABLE_NAMES = ("hidden", "positions", "mask", "kv", "decode")


def recorded_variables(m: dict[str, Any]) -> tuple[str, ...]:
    """The variables a saved trace recorded: ``options.show`` (``run --save --keep``; traces older than
    ``--keep`` variables: ``run --show``); all five when the trace does not say."""
    opts = m.get("options") if isinstance(m.get("options"), dict) else {}
    rec = opts.get("show")
    if not isinstance(rec, list):
        return VARIABLE_NAMES
    return tuple(v for v in VARIABLE_NAMES if v in rec)


def without_tap_sources(a: dict[str, Any], b: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``options.tap_sources`` describes a trace's tensors file: compared only when both traces kept tensors
    (a run saved with ``--keep summary`` beside the same run with tensors has none, and is the same run)."""
    def kept(m: dict[str, Any]) -> bool:
        return bool((m.get("store") or {}).get("tensors"))

    if kept(a) and kept(b):
        return a, b

    def drop(m: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(m.get("options"), dict) or "tap_sources" not in m["options"]:
            return m
        return {**m, "options": {k: v for k, v in m["options"].items() if k != "tap_sources"}}

    return drop(a), drop(b)


def without_variables(m: dict[str, Any], drop: Sequence[str]) -> dict[str, Any]:
    """A shallow copy of manifest ``m`` whose steps lack the variables ``drop`` (and whose
    ``options.show`` is gone): what two traces saved with different ``--keep`` can be compared on."""
    if not drop:
        return m
    out = dict(m)
    if isinstance(m.get("options"), dict):
        out["options"] = {k: v for k, v in m["options"].items() if k != "show"}
    out["steps"] = [{k: v for k, v in st.items() if k not in drop} if isinstance(st, dict) else st
                    for st in m.get("steps", []) or []]
    return out


def unrecorded_lines(a: dict[str, Any], b: dict[str, Any], name_a: str = "A", name_b: str = "B") -> tuple[list[str], tuple[str, ...]]:
    """``(lines, dropped)``: one line per trace saved without some variables ("B was saved without
    hidden, kv: ..."), and the variables left out of the comparison (recorded by one trace only)."""
    ra, rb = recorded_variables(a), recorded_variables(b)
    dropped = tuple(v for v in VARIABLE_NAMES if v not in ra or v not in rb)
    lines = []
    for name, rec in ((name_a, ra), (name_b, rb)):
        miss = [v for v in VARIABLE_NAMES if v not in rec]
        if miss:
            lines.append(f"{name} was saved without {', '.join(miss)} (run --save --keep {','.join(rec) or '-'}): "
                         f"{'it is' if len(miss) == 1 else 'they are'} not compared")
    return lines, dropped


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def close(a: float, b: float, atol: float, rtol: float) -> bool:
    """numpy-style isclose; NaN equals NaN, infinities equal only themselves."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= atol + rtol * abs(b)


class _Walker:
    def __init__(self, atol: float, rtol: float):
        self.atol, self.rtol = atol, rtol

    def walk(self, a: Any, b: Any, path: str, ctx: dict[str, Any], parent: tuple[Any, Any]) -> Iterator[Divergence]:
        def div(kind: str, va: Any, vb: Any, note: str = "") -> Divergence:
            return Divergence(path, ctx.get("variable", "header"), path[len(ctx.get("root", "")):].lstrip("."), va, vb,
                              kind, ctx.get("step"), ctx.get("seq_id"), parent[0], parent[1], note)

        if isinstance(a, dict) and isinstance(b, dict):
            if isinstance(a.get("seq_id"), int) and a.get("seq_id") == b.get("seq_id"):
                ctx = {**ctx, "seq_id": a["seq_id"]}
            for k in self.keys(a, b, ctx):
                sub = f"{path}.{k}" if path else k
                c = self.enter(ctx, path, k, a, b)
                if k not in b:
                    yield Divergence(sub, c.get("variable", "header"), sub[len(c.get("root", "")):].lstrip("."), a[k],
                                     "(missing)", "missing", c.get("step"), c.get("seq_id"), a, b)
                elif k not in a:
                    yield Divergence(sub, c.get("variable", "header"), sub[len(c.get("root", "")):].lstrip("."),
                                     "(missing)", b[k], "missing", c.get("step"), c.get("seq_id"), a, b)
                else:
                    yield from self.walk(a[k], b[k], sub, c, (a, b))
        elif isinstance(a, list) and isinstance(b, list):
            index = ctx.get("seq_index")  # "batch": item i is batch[i]'s; "packed": item i is packed row i's
            rows = ctx.get("seq_rows" if index == "batch" else "packed_seq", [])
            for i, (x, y) in enumerate(zip(a, b)):
                c = ctx
                if index:
                    c = {**ctx, "seq_id": rows[i] if i < len(rows) else ctx.get("seq_id"), "seq_index": None}
                yield from self.walk(x, y, f"{path}[{i}]", c, (a, b))
            if len(a) != len(b):
                yield div("length", len(a), len(b), f"A has {len(a)} items, B has {len(b)}")
        elif _num(a) and _num(b):
            if isinstance(a, int) and isinstance(b, int):
                if a != b:
                    yield div("value", a, b)
            elif not close(float(a), float(b), self.atol, self.rtol):
                yield div("value", a, b, f"|Δ| = {abs(float(a) - float(b)):.3g}")
        elif type(a) is not type(b) and not (a is None or b is None):
            yield div("type", a, b, f"{type(a).__name__} vs {type(b).__name__}")
        elif a != b:
            yield div("value", a, b)

    @staticmethod
    def keys(a: dict, b: dict, ctx: dict[str, Any]) -> list[str]:
        ks = set(a) | set(b)
        if ctx.get("level") == "top":
            ks -= SKIP_TOP
            order = ["schema_version", "model", "config", "options", "notes"]
        elif ctx.get("level") == "step":
            ks -= SKIP_STEP
            order = list(STEP_ORDER)
        else:
            order = []
        return [k for k in order if k in ks] + sorted(ks - set(order))

    @staticmethod
    def enter(ctx: dict[str, Any], path: str, key: str, a: dict, b: dict) -> dict[str, Any]:
        """Context for the child ``key``: which variable it belongs to, the path its field name
        starts after (``root``), and for ``mask.logical`` that row i belongs to batch[i]'s seq."""
        level = ctx.get("level")
        c = {k: v for k, v in ctx.items() if k not in ("level", "seq_index")}
        if level == "top":
            c.update(variable="header", root="")
        elif level == "step":
            if key in ("hidden", "positions", "mask", "kv", "decode"):
                c.update(variable=key, root=f"{path}.{key}", level=key)
            else:
                c.update(variable="schedule", root=path, level="batch" if key == "batch" else None)
        elif level == "batch":  # a worked-example row's field
            c["variable"] = BATCH_VARIABLE.get(key, "schedule")
        elif level == "mask" and key == "logical":
            c["seq_index"] = "batch"
        elif level == "mask" and key == "kq_mask":
            c["level"] = "kq_mask"
        elif (level == "positions" and key in ("inp_pos", "position_ids", "cos_sin")) or (level == "kq_mask" and key == "rows"):
            c["seq_index"] = "packed"
        return c


def _tensor_variable(name: str) -> str:
    leaf = name.rsplit("/", 1)[-1]
    if leaf.startswith("hidden"):
        return "hidden"
    if leaf.startswith(("q_", "k_pre", "k_post")):
        return "positions"
    if leaf.startswith("logits"):
        return "decode"
    return "kv"


def compare_tensors(names: Sequence[str], ta: Any, tb: Any, step: int, atol: float, rtol: float) -> Iterator[Divergence]:
    """Tensors ``names`` of one step, in name order; floats with tolerance, ints exactly
    (numpy, as ``torch.isclose``: ``|a - b| <= atol + rtol * |b|`` in float32, NaN equals NaN)."""
    import numpy as np

    for n in names:
        x, y = ta.array(n), tb.array(n)
        m = re.search(r"/seq(\d+)/", n)
        sid = int(m.group(1)) if m else None
        d = dict(path=f"tensors[{n}]", variable=_tensor_variable(n), field=n.split("/", 1)[1], step=step, seq_id=sid)
        if list(x.shape) != list(y.shape):
            yield Divergence(a=list(x.shape), b=list(y.shape), kind="shape", note="tensor shapes differ", **d)
            continue
        if np.issubdtype(x.dtype, np.floating) or np.issubdtype(y.dtype, np.floating):
            xf, yf = x.astype(np.float32), y.astype(np.float32)
            bad = ~np.isclose(xf, yf, atol=atol, rtol=rtol, equal_nan=True)
        else:
            xf, yf = x, y
            bad = x != y
        if bool(bad.any()):
            idx = tuple(int(i) for i in np.argwhere(bad)[0].tolist())
            mx = float(np.abs(xf.astype(np.float32) - yf.astype(np.float32)).max())
            yield Divergence(a=xf[idx].item(), b=yf[idx].item(), kind="tensor",
                             note=f"at index {list(idx)}; {int(bad.sum())} of {bad.size} elements differ, max |Δ| = {mx:.3g}",
                             **{**d, "field": f"{d['field']}{list(idx)}"})


def diff_traces(a: dict[str, Any], b: dict[str, Any], atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL,
                tensors_a: Any = None, tensors_b: Any = None, ignore: Sequence[str] = (), keep: int = 5) -> DiffResult:
    """Compare two trace manifests (``RunTrace.to_dict()`` or a loaded ``trace.json``).

    Args:
        a, b: the two traces as dicts.
        atol, rtol: float tolerances.
        tensors_a, tensors_b: :class:`~infertrace.trace.store.TraceTensors` or None; tensors
            are compared (per step, after the step's records) only when both are given, and
            only the names both hold.
        ignore: field paths (or prefixes, e.g. ``options.attention``) to leave out.
        keep: how many differences to keep in ``differences`` (all are counted).

    Returns:
        :class:`DiffResult` with the first divergence (None when equal within tolerance).
    """
    w = _Walker(atol, rtol)
    res = DiffResult(None, 0, atol, rtol)
    common: list[str] = []
    if tensors_a is not None and tensors_b is not None:
        na, nb = set(tensors_a.names()), set(tensors_b.names())
        common = sorted(na & nb)
        only = len(na ^ nb)
        res.tensors_compared = len(common)
        res.tensors_note = f"{len(common)} tensors compared" + (f" ({only} kept by only one trace, skipped)" if only else "")
    elif tensors_a is not None or tensors_b is not None:
        res.tensors_note = ("tensors not compared: only " + ("A" if tensors_a is not None else "B") + " kept them ("
                            + ("B" if tensors_a is not None else "A") + " was saved with --keep summary)")
    else:
        res.tensors_note = "tensors not compared: neither trace kept them"

    def ignored(dv: Divergence) -> bool:
        return any(dv.path == p or dv.path.startswith(p + ".") or dv.path.startswith(p + "[") for p in ignore)

    def add(it: Iterator[Divergence]) -> None:
        for dv in it:
            if ignored(dv):
                continue
            res.count += 1
            if res.first is None:
                res.first = dv
            if len(res.differences) < keep:
                res.differences.append(dv)

    top = {"level": "top"}
    head_a = {k: v for k, v in a.items() if k not in ("steps", "requests", "threads")}  # threads: machine facts
    head_b = {k: v for k, v in b.items() if k not in ("steps", "requests", "threads")}
    add(w.walk(head_a, head_b, "", top, (a, b)))
    sa, sb = a.get("steps", []), b.get("steps", [])
    for i in range(max(len(sa), len(sb))):
        path = f"steps[{i}]"
        if i >= len(sa) or i >= len(sb):
            have, side = (sa, "B") if i >= len(sb) else (sb, "A")
            st = have[i]
            add(iter([Divergence(path, "schedule", "", st.get("step") if side == "B" else "(missing)",
                                 "(missing)" if side == "B" else st.get("step"), "missing", st.get("step"),
                                 note=f"A has {len(sa)} steps, B has {len(sb)}")]))
            continue
        x, y = sa[i], sb[i]
        ctx = {"level": "step", "step": x.get("step", i), "variable": "schedule", "root": path,
               "seq_rows": [r.get("seq_id") for r in x.get("batch", [])],
               "packed_seq": [r.get("seq_id") for r in x.get("batch", []) for _ in range(int(r.get("T") or 0))]}
        add(w.walk(x, y, path, ctx, (x, y)))
        if common:
            pre = f"step{x.get('step', i)}/"
            add(compare_tensors([n for n in common if n.startswith(pre)], tensors_a, tensors_b, x.get("step", i), atol, rtol))
    add(w.walk(a.get("requests", []), b.get("requests", []), "requests", {"variable": "requests", "root": "requests"},
               (a.get("requests"), b.get("requests"))))
    return res


# ----------------------------------------------------------------------------- text


def _short(v: Any, width: int = 160) -> str:
    """A trace value as JSON (a ``(missing ...)`` note as is), :func:`~infertrace.fmt.clip`-ped to ``width``."""
    return clip(v if isinstance(v, str) and v.startswith("(missing") else json.dumps(v, ensure_ascii=False, sort_keys=True), width)


def _row_text(step: dict[str, Any] | None, seq_id: int | None) -> str:
    if not step:
        return "-"
    rows = [r for r in step.get("batch", []) if seq_id is None or r.get("seq_id") == seq_id]
    parts = [f"{r.get('phase')} seq {r.get('seq_id')} C={r.get('C')} T={r.get('T')} pos {_short(r.get('positions'), 40)} "
             f"tokens {_short(r.get('token_ids'), 40)} → {_short(r.get('sampled_piece'), 30)}" for r in rows[:3]]
    return f"step {step.get('step')} N={step.get('N')}: " + ("; ".join(parts) or "idle")


def format_diff(res: DiffResult, a: dict[str, Any], b: dict[str, Any], name_a: str = "A", name_b: str = "B") -> list[str]:
    """Readable lines: the first divergence (where, A vs B, context), counts, tolerances."""
    tol = f"atol {res.atol:g}, rtol {res.rtol:g}"
    if res.first is None and res.cross_engine:
        return [f"no structural difference between {name_a} and {name_b} (structure compared exactly; floats differ "
                f"between engines and are summarised above, not held to --atol/--rtol; {res.tensors_note})"]
    if res.first is None:
        return [f"no difference between {name_a} and {name_b} (floats within {tol}; {res.tensors_note})"]
    d = res.first
    where = []
    if d.step is not None:
        where.append(f"step {d.step}")
    if d.seq_id is not None:
        where.append(f"seq {d.seq_id}")
    where.append(f"variable {d.variable}")
    lines = [f"first difference: {' · '.join(where)} · field {d.field or d.path}",
             f"  path   {d.path}",
             f"  A      {_short(d.a)}    ({name_a})",
             f"  B      {_short(d.b)}    ({name_b})"]
    if d.note:
        lines.append(f"  note   {d.note}")
    if d.kind not in ("tensor", "shape") and isinstance(d.context_a, (list, dict)) and d.context_a is not d.a:
        lines += [f"  in A   {_short(d.context_a)}", f"  in B   {_short(d.context_b)}"]
    if d.step is not None:
        find = lambda t: next((s for s in t.get("steps", []) if s.get("step") == d.step), None)  # noqa: E731
        lines += [f"  A row  {_row_text(find(a), d.seq_id)}", f"  B row  {_row_text(find(b), d.seq_id)}"]
    more = res.count - 1
    if more:
        nxt = "; ".join(f"{x.path}" for x in res.differences[1:4])
        lines.append(f"{more} more differing field(s) after it" + (f", next: {nxt}" if nxt else ""))
    lines.append(f"(floats compared within {tol}; {res.tensors_note})")
    return lines
