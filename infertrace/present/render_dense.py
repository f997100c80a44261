"""Terminal views of the dense convention (``--runtime hf``): the padded ``[B, L]`` grid of a step with its pad
columns, the ``position_ids`` per row, HF's masks per layer type and the ``DynamicCache`` lengths.

Reads only the step's ``hf`` section and ``kv.physical`` (kind ``dense``), as validated by the schema.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from infertrace.trace.records import KVRec, StepTrace

PAD_STYLE, KEEP, DIM = "red", "bold green", "dim"
#: grids wider or taller than this are summarised, not drawn
MAX_COLS, MAX_Q = 32, 8


def _cut(x: Any, n: int = 100) -> str:
    t = str(x)
    return t if len(t) <= n else t[: n - 1] + "…"


def dense_grid_view(st: StepTrace) -> RenderableType | None:
    """This forward's ``input_ids`` ``[B, q]`` over its cache columns, pads in red, with the ``position_ids`` HF was
    fed and the 2-D ``attention_mask`` ``[B, L]`` so far; None when the step has no ``hf`` section."""
    hf = st.hf if isinstance(st.hf, dict) else None
    if not hf:
        return None
    ids, am, pos = hf["input_ids"], hf["attention_mask"], hf["position_ids"]
    past = hf["past_seen_tokens"]
    seqs = hf.get("row_seq_ids") or list(range(len(ids)))
    done = {f["row"] for f in hf.get("finished_rows") or []}
    q = len(ids[0]) if ids else 0
    head = Text.assemble(("dense batch ", "bold"), f"[B={len(ids)}, q={q}] over cache columns {past}..{past + q - 1} · ",
                         (f"{hf['padding']} padding", "magenta"), f" · pad_token_id {hf.get('pad_token_id')} · "
                         f"attention_mask [B={len(am)}, L={len(am[0]) if am else 0}] · cache_position {_cut(hf['cache_position'], 60)}")
    if q > MAX_COLS:
        return Group(head, Text(f"(grid of {q} columns not drawn; step.hf holds it)", style=DIM))
    t = Table(box=None, padding=(0, 1), show_header=True, header_style=DIM)
    t.add_column("row")
    t.add_column("seq")
    t.add_column("")
    for j in range(q):
        t.add_column(str(past + j), justify="right")
    for b, row in enumerate(ids):
        mrow = am[b][past:past + q]
        state = " (finished: fed pad, mask 1)" if b in done else ""
        t.add_row(str(b), str(seqs[b]) + state, "input_ids",
                  *[Text(str(x), style=PAD_STYLE if not m else "") for x, m in zip(row, mrow)])
        t.add_row("", "", "mask", *[Text(str(m), style=KEEP if m else PAD_STYLE) for m in mrow])
        t.add_row("", "", "position_ids", *[Text(str(p), style=DIM if not m else "cyan") for p, m in zip(pos[b], mrow)])
    parts: list[RenderableType] = [head, t]
    gen = hf.get("generate_position_ids")
    if gen is not None and [p[-1] for p in pos] != gen:
        parts.append(Text(f"generate() would feed position_ids {gen} here (position_ids[..., -1:] + 1: a right-padded row's "
                          "last column is a pad at 0); this run feeds cumsum(mask) - 1", style="yellow"))
    return Group(*parts)


def dense_mask_parts(st: StepTrace) -> list[RenderableType]:
    """Per layer type, the mask HF's mask function returned (or ``none: is_causal``), drawn per batch row over
    the key columns when small: ■ keep, · drop, pad columns in red."""
    hf = st.hf if isinstance(st.hf, dict) else None
    if not hf:
        return []
    out: list[RenderableType] = []
    am = hf["attention_mask"]
    for lt, m in hf["masks"].items():
        out.append(Text.assemble((f"HF {lt}", "bold"), f": {m['function']} returned {m['returned']}",
                                 f" {m['shape']}" if m.get("shape") else " (sdpa runs is_causal: no pad column to drop)"))
        rows = m.get("rows") or []
        off = m.get("kv_offset", 0)
        for b, qrows in enumerate(rows):
            if len(qrows) > MAX_Q or (qrows and len(qrows[0]) > MAX_COLS):
                out.append(Text(f"  row {b}: [{len(qrows)} queries x {len(qrows[0]) if qrows else 0} keys] not drawn", style=DIM))
                continue
            g = Text(f"  row {b}:\n", style=DIM)
            for i, line in enumerate(qrows):
                g.append(f"    q{i:<3}")
                for j, x in enumerate(line):
                    pad = off + j < len(am[b]) and not am[b][off + j]
                    g.append(" ■" if x == "1" else " ·", style=KEEP if x == "1" else (PAD_STYLE if pad else DIM))
                g.append("\n")
            g.rstrip()
            out.append(g)
    return out


def dense_kv_view(st: StepTrace, kv: KVRec) -> RenderableType:
    """The DynamicCache of a dense step: keys/values per layer ``[B, n_kv, L, head_dim]``, per request its batch row,
    the cache columns written, each row's real / pad columns and every layer type's length."""
    ph, s = kv.physical, kv.physical_shape
    parts: list[RenderableType] = [Text.assemble(("physical ", "bold"), f"{kv.dtype} · {kv.layers} layers · DynamicCache "
                                                 f"keys / values per layer [B={s[0]}, n_kv={s[1]}, L={s[2]}, head_dim={s[3]}] "
                                                 f"· padded_len {ph['padded_len']} · {ph['padding']} padding")]
    t = Table(box=None, padding=(0, 1), header_style="bold")
    for c in ("seq", "row", "K/V logical before → after", "written pos", "cache columns"):
        t.add_column(c)
    for d in kv.per_request:
        t.add_row(str(d["seq_id"]), str(d.get("row", "?")), f"{d['shape_before']} → {d['shape_after']}", d["written_pos"],
                  str(d.get("columns", "?")))
    parts.append(t)
    g = Table(box=None, padding=(0, 1), header_style="bold")
    for c in ("row", "seq", "real columns", "pad columns", "fed pad (finished)", "len"):
        g.add_column(c)
    for r in ph["rows"]:
        g.add_row(str(r["row"]), str(r["seq_id"]), r["real_cols"], Text(r["pad_cols"], style=PAD_STYLE),
                  r.get("fed_pad_cols", "-"), str(r["len"]))
    parts.append(g)
    parts.append(Text("cache lengths: " + " · ".join(f"{lt} get_seq_length() {v['seq_length']}, stored {v['stored']}"
                                                     for lt, v in ph["cache"].items()), style="cyan"))
    lv = kv.layer_view
    vt = Table(box=None, padding=(0, 1), header_style="bold",
               title=f"layer {lv.get('layer')}, kv head 0, written real positions (read from the DynamicCache)")
    for c in ("seq", "pos", "K (rotated) first values", "V first values"):
        vt.add_column(c)
    for rq in lv.get("requests", []):
        for r in rq["rows"]:
            vt.add_row(str(rq["seq_id"]), str(r["pos"]), " ".join(f"{x:+.4f}" for x in r["k"]),
                       " ".join(f"{x:+.4f}" for x in r["v"]))
    parts.append(vt)
    return Group(*parts)
