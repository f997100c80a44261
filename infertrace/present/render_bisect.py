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


#: taps shown per layer after the first diverging one (the full list is in --json)
BRANCH_TAPS = ("attn_out", "mlp_out", "resid_post")


def _span(layers: list[int]) -> str:
    name = lambda x: "embed" if x < 0 else str(x)  # noqa: E731
    return f"layer {name(layers[0])}" if len(layers) == 1 else f"layers {name(layers[0])}..{name(layers[-1])}"


def _layer_lines(taps: list[dict[str, Any]]) -> list[str]:
    """Clean layers collapsed into one line; the first diverging layer with every tap, the next two with
    the branch taps, the rest collapsed with their largest error."""
    by: dict[int, list[dict[str, Any]]] = {}
    for e in taps:
        by.setdefault(e["layer"], []).append(e)
    if not by:
        return ["  (no layer tensors saved in both traces at this position)"]
    out: list[str] = []
    clean: list[int] = []
    shown = 0
    layers = list(by)
    for i, layer in enumerate(layers):
        es = by[layer]
        if not any(e["above"] for e in es) and shown == 0:
            clean.append(layer)
            continue
        if clean:
            out.append(f"  {_span(clean)}: every tap below the floor (largest rel L2 "
                       f"{_g(max(e['rel_l2'] for c in clean for e in by[c]))})")
            clean = []
        if shown >= 3:
            rest = [e for x in layers[i:] for e in by[x]]
            worst = max(rest, key=lambda e: e["rel_l2"])
            out.append(f"  {_span(layers[i:])}: {sum(e['above'] for e in rest)} of {len(rest)} taps above the floor "
                       f"(largest rel L2 {_g(worst['rel_l2'])} at layer {worst['layer']} {worst['tap']})")
            return out
        cells = [e for e in es if shown == 0 or e["tap"] in BRANCH_TAPS]
        out.append(f"  layer {layer:>2}: " + "  ".join(
            f"{e['tap']} {_g(e['rel_l2'])}/{_g(e['cosine'])}{'*' if e['above'] else ''}" for e in cells))
        shown += 1
    if clean:
        out.append(f"  {_span(clean)}: every tap below the floor (largest rel L2 "
                   f"{_g(max(e['rel_l2'] for c in clean for e in by[c]))})")
    return out


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
    for note in res.get("notes", []):
        out.append(f"note: {visible(note)}")
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
    out.extend(_layer_lines(res["taps"]))
    ft = res["first_tap"]
    out.append("first tap above the floor: " + ("none" if ft is None else
               f"{'embedding' if ft['layer'] < 0 else 'layer ' + str(ft['layer'])} {ft['tap']} ({ft['branch']}): "
               f"rel L2 {_g(ft['rel_l2'])} > floor {_g(ft['floor'])}, cosine {_g(ft['cosine'])}"))
    if ft is not None and ft.get("layers_not_compared_before"):
        miss = ft["layers_not_compared_before"]
        out.append(f"  (layers {miss[0]}..{miss[-1]} were not saved in both traces: {len(miss)} earlier layer"
                   f"{'s' if len(miss) != 1 else ''} not compared, the divergence may start there; save them where the runtime can, --layers)")
    out.append(f"batch A: {_batch(res['batch']['a'])}")
    out.append(f"batch B: {_batch(res['batch']['b'])}")
    out.append("diverged above the floor" if res["diverged"] else
               "no divergence above the floor (a top-1 flip inside the floor: a near tie)")
    return out
