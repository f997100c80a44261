"""Text of ``infertrace bisect``: the report of :func:`infertrace.trace.bisect.bisect` as lines."""

from __future__ import annotations

from typing import Any

from infertrace.safe_text import visible


def _g(x: Any) -> str:
    return "n/a" if x is None else (f"{x:.3g}" if isinstance(x, float) else str(x))


def _batch(b: dict[str, Any] | None) -> str:
    if b is None:
        return "(position not computed in this trace's saved steps)"
    parts = [f"seq {r['seq_id']} {r['kind']} ({r['T']} token{'s' if r['T'] != 1 else ''})" for r in b["requests"]]
    return f"step {b['step']}, N={b['N']}: " + "; ".join(parts)


def bisect_lines(res: dict[str, Any]) -> list[str]:
    """The report, most important first: floor, first token / logits divergence, first tap, batch, verdict."""
    fl, tok = res["floor"], res["tokens"]
    out = [f"bisect A={visible(res['a'])} (seq {res['seq_id_a']})  B={visible(res['b'])} (seq {res['seq_id_b']})",
           f"floor: relative L2 {_g(fl['logits_rel_l2'])} for logits rows, "
           + ("per layer/tap as measured (default " + _g(fl["taps_default_rel_l2"]) + ")" if fl["per_tap"]
              else _g(fl["taps_default_rel_l2"]) + " for taps") + f"; {visible(fl['source'])}",
           f"tokens: prompt {tok['prompt']}, comparable positions {tok['compared_positions']}"
           + (f" (generated tokens differ from position {tok['first_token_differs_at']})" if tok["first_token_differs_at"] is not None else "")
           + f", {tok['positions_with_logits']} with logits in both"]
    t1, lg = res["first_top1"], res["first_logits"]
    out.append("first top-1 difference: " + ("none" if t1 is None else
               f"position {t1['pos']}: A {t1['top1_a']} vs B {t1['top1_b']} (logits rel L2 {_g(t1['rel_l2'])}, cosine {_g(t1['cosine'])})"))
    out.append("first logits row above the floor: " + (f"none (largest rel L2 {_g(res['max_logits_rel_l2'])})" if lg is None else
               f"position {lg['pos']}: rel L2 {_g(lg['rel_l2'])}, cosine {_g(lg['cosine'])} "
               f"(on the {lg['shared_topk']} of top-{lg['k']} ids both kept)"))
    if res["position"] is None:
        out.append("no divergence above the floor")
        return out
    out.append(f"layers at position {res['position']} (rel L2 / cosine per tap; * = above the floor):")
    by_layer: dict[int, list[str]] = {}
    for e in res["taps"]:
        by_layer.setdefault(e["layer"], []).append(f"{e['tap']} {_g(e['rel_l2'])}/{_g(e['cosine'])}{'*' if e['above'] else ''}")
    for layer, cells in by_layer.items():
        out.append(f"  {'embed' if layer < 0 else f'layer {layer:>2}'}: " + "  ".join(cells))
    if not res["taps"]:
        out.append("  (no layer tensors saved in both traces at this position)")
    ft = res["first_tap"]
    out.append("first tap above the floor: " + ("none" if ft is None else
               f"{'embedding' if ft['layer'] < 0 else 'layer ' + str(ft['layer'])} {ft['tap']} ({ft['branch']}): "
               f"rel L2 {_g(ft['rel_l2'])} > floor {_g(ft['floor'])}, cosine {_g(ft['cosine'])}"))
    out.append(f"batch A: {_batch(res['batch']['a'])}")
    out.append(f"batch B: {_batch(res['batch']['b'])}")
    out.append("diverged above the floor" if res["diverged"] else
               "no divergence above the floor (a top-1 flip inside the floor: a near tie)")
    return out
