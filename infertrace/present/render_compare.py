"""Rich rendering of the ``diff-backends`` reports (pure functions of the JSON-ready dicts of
:mod:`infertrace.compare.backends` and :mod:`infertrace.compare.hf`).

Backends: a header with both storage layouts side by side, one table row per step with the
logical checks (``=`` equal / ``≠`` with the value) beside each backend's physical view,
the mismatches, and a one-line verdict. Reference: one row per sampled logits row.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from infertrace.present.render import DIM, _facts, piece_text
from infertrace.ranges import ranges_text

OK, BAD = "green", "bold red"
_CONV = {"cells": "llama.cpp", "paged": "TensorRT-LLM/vLLM"}


def _check(c: dict[str, Any] | None, value: str | None = None) -> Text:
    if c is None:
        return Text("-", style=DIM)
    if not c["ok"]:
        return Text("≠ " + (value or ""), style=BAD)
    return Text("=" + (" " + value if value else ""), style=OK)


def _ints(xs: list[int]) -> str:
    return "[" + ",".join(str(x) for x in xs) + "]"


def _cells_phys(p: dict[str, Any]) -> str:
    """``ne [32,64,1,1] · 0→3..4 1→5..7``: kq_mask shape, then seq → cell indices written."""
    if "kq_mask_ne" not in p:
        return f"used {p['used']} · head {p['head']}"
    return f"ne {_ints(p['kq_mask_ne'])} · " + " ".join(f"{s}→{c}" for s, c in p["cells"].items())


def _paged_phys(p: dict[str, Any]) -> str:
    """``kv_lens [5,3] · 0→3..4 1→8..10``: metadata lengths, then seq → slots written (slot mapping)."""
    if "kv_lens" not in p:
        return f"{p['used_blocks']} blocks used"
    return f"kv_lens {_ints(p['kv_lens'])} · " + " ".join(f"{s}→{c}" for s, c in p["slots"].items())


_PHYS = {"cells": _cells_phys, "paged": _paged_phys}


def _storage_text(s: dict[str, Any]) -> str:
    n_layer = s.get("n_layer", s["layers"])
    if s["layers"] == n_layer:
        return f"{s['tensors']} {s['shape']} × {s['layers']} layers · {s['mask']}"
    return (f"{s['tensors']} {s['shape']} × {s['layers']} KV layers of {n_layer} (layers "
            f"{ranges_text(s.get('kv_layers', []))}) · {s['mask']}")


def _state_text(s: dict[str, Any]) -> str:
    st = s["state"]
    return (f"GDN conv {st['conv']} + recurrent {st['recurrent']} per layer × {len(st['layers'])} layers "
            f"(layers {ranges_text(st['layers'])}), compared with K/V")


def _requests_facts(reqs: list[dict[str, Any]]) -> list[tuple[str, Text]]:
    rows = []
    for r in reqs:
        t = Text.assemble((piece_text(r.get("prompt", "")), DIM), " → ", (piece_text(r.get("text", "")), "bold"))
        if "prompt_len" in r:
            t.append(f"  ({r['prompt_len']} prompt token{'' if r['prompt_len'] == 1 else 's'}, arrives at step {r['arrival_step']})", style=DIM)
        rows.append((f"seq {r['seq_id']}", t))
    return rows


def render_backends_diff(console: Console, rep: dict[str, Any]) -> None:
    """Print a :func:`infertrace.compare.backends.diff_backends` report."""
    na, nb = rep["backends"]
    head = [(f"{na} ({_CONV.get(na, '?')})", _storage_text(rep["storage"][na])),
            (f"{nb} ({_CONV.get(nb, '?')})", _storage_text(rep["storage"][nb])),
            ("tolerance", f"atol {rep['atol']:g} on logits and K/V ({rep['dtype']}); positions, masks, tokens exact")]
    if "state" in rep["storage"][na]:  # hybrid: the recurrent state beside K/V
        head.insert(2, ("state", _state_text(rep["storage"][na])))
    console.print(Panel(_facts(head + _requests_facts(rep["requests"])), title=Text.assemble(("diff-backends", "bold"), f" · {na} vs {nb}, lockstep"),
                        title_align="left", box=box.ROUNDED))
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1),
              title="LOGICAL (must be equal)  |  PHYSICAL (expected to differ)   batch = seq:phase C+T, p prefill, d decode",
              title_justify="left", title_style="bold")
    for col, kw in (("step", {"justify": "right"}), ("batch", {"max_width": 15}), ("pos", {}), ("mask", {}),
                    ("K/V max|Δ|", {}), ("tok", {}), ("logits max|Δ|", {}), (f"{na}: kq_mask ne · seq→cells", {"overflow": "fold", "ratio": 1}),
                    (f"{nb}: kv_lens · seq→slots", {"overflow": "fold", "ratio": 1})):
        t.add_column(col, **kw)
    for s in rep["steps"]:
        c = s["checks"]
        batch = " ".join(f"{b['seq_id']}:{b['phase'][0]}{b['C']}+{b['T']}" for b in s["batch"]) or "idle"
        if not c["schedule"]["ok"]:
            batch = "≠ schedule"
        t.add_row(str(s["step"]), Text(batch, style=BAD if not c["schedule"]["ok"] else DIM if s["idle"] else ""),
                  _check(c.get("positions")), _check(c.get("mask")),
                  _check(c.get("kv"), f"{c['kv']['max_abs']:.1e}" if "kv" in c else None), _check(c.get("tokens")),
                  _check(c.get("logits"), f"{c['logits']['max_abs']:.1e}" if c.get("logits", {}).get("rows") else None),
                  _PHYS.get(na, str)(s["physical"][na]), _PHYS.get(nb, str)(s["physical"][nb]))
    console.print(t)
    _verdict_backends(console, rep)


def _state_line(console: Console, sm: dict[str, Any], style: str) -> None:
    """Hybrid models: the GDN state comparison (conv and recurrent max |Δ|) beside the K/V one."""
    if "state" in sm:
        console.print(Text(f"GDN state (every GDN layer, every request, every step): conv max |Δ| {sm['state']['conv']:.2g}, "
                           f"recurrent max |Δ| {sm['state']['recurrent']:.2g}", style=style))


def _verdict_backends(console: Console, rep: dict[str, Any]) -> None:
    sm = rep["summary"]
    if rep["identical"]:
        console.print(Text(
            f"logically identical: {sm['steps']} steps ({sm['idle_steps']} idle), {len(rep['requests'])} requests, "
            f"{sm['queries']} queries — same schedule, positions and visible keys; K/V max |Δ| {sm['kv']['max_abs']:.2g} "
            f"(all layers, every request, every step); sampled tokens equal; logits max |Δ| {sm['logits']['max_abs']:.2g} "
            f"over {sm['logits_rows']} rows (atol {rep['atol']:g}). The physical columns differ by design.", style="bold green"))
        _state_line(console, sm, "bold green")
        return
    _state_line(console, sm, "")
    console.print(Text(f"LOGICAL MISMATCH ({len(rep['mismatches'])}):", style=BAD))
    for m in rep["mismatches"][:20]:
        console.print(Text(f"  step {m['step']} · {m['variable']}: {m['detail']}", style="red"))
    if len(rep["mismatches"]) > 20:
        console.print(Text(f"  … {len(rep['mismatches']) - 20} more (see --json)", style="red"))


def render_reference_diff(console: Console, rep: dict[str, Any]) -> None:
    """Print a :func:`infertrace.compare.hf.compare_with_reference` report."""
    ref = rep["against"]
    who = rep.get("reference") or str(ref)  # the report says what the reference ran (compare/hf.py)
    head = [("ours", f"infertrace engine, backend {rep['backend']}, continuous batching"), ("reference", who),
            ("tolerance", f"atol {rep['atol']:g} on logits; greedy tokens (argmax) must be equal")]
    console.print(Panel(_facts(head + _requests_facts(rep["requests"])), title=Text(f"diff-runtimes {ref}", style="bold"),
                        title_align="left", box=box.ROUNDED))
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1))
    for col in ("step", "seq", "pos", "phase", "argmax ours", f"argmax {ref}", "sampled", "max|Δlogits|"):
        t.add_column(col, justify="right" if col not in ("phase",) else "left")
    for r in rep["rows"]:
        style = "" if r["ok"] else BAD
        t.add_row(str(r["step"]), str(r["seq_id"]), str(r["pos"]), r["phase"], Text(str(r["ours"]), style=style),
                  Text(str(r["ref"]), style=style), str(r["sampled"]), Text(f"{r['max_abs']:.2e}", style=style or OK))
    console.print(t)
    for r in rep["requests"]:
        console.print(Text(f"seq {r['seq_id']}: greedy tokens {'equal' if r['tokens_equal'] else 'DIFFER'} "
                           f"({len(r['greedy_ours'])} rows), logits max |Δ| {r['max_abs']:.2g}",
                           style=OK if r["tokens_equal"] else BAD))
    if rep["identical"]:
        console.print(Text(f"logically identical to {ref}: {len(rep['rows'])} logits rows, greedy tokens equal, "
                           f"max |Δlogits| {rep['max_abs']:.2g} (atol {rep['atol']:g})", style="bold green"))
        return
    console.print(Text(f"MISMATCH against {ref} ({len(rep['mismatches'])}):", style=BAD))
    for m in rep["mismatches"][:20]:
        console.print(Text(f"  step {m['step']} · {m['variable']}: {m['detail']}", style="red"))
