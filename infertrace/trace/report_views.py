"""Pictures for the HTML report: mask heatmaps, cell map and block tables over time, top-k bars.

Pure functions of the records (:class:`~infertrace.trace.records.StepTrace`) returning
inline SVG/HTML text. A trace holds one backend; the other convention's view is *derived*
here and labelled so:

* masks: the explicit llama.cpp ``kq_mask`` (cells: rebuilt from the recorded cell map and
  checked against the recorded slice; paged: derived for a hypothetical cache holding each
  request in consecutive cells) and the mask a paged kernel implies from ``seq_lens`` /
  ``kv_lens`` (paged: recorded metadata; cells: derived ``seq_lens = T``, ``kv_lens = C+T``);
* cache over time: :func:`simulate_cells` replays llama.cpp ``find_slot`` (free cells from
  ``head``, wrapping) and :func:`simulate_paged` replays the block pool (lowest free block
  first, freed blocks back in sorted order) from the step records alone (preempted requests
  freed before the step, finished ones after it), so either view exists for either trace.
"""

from __future__ import annotations

from html import escape
from typing import Any, Sequence

from infertrace.trace.records import StepTrace
from infertrace.trace.render import piece_text

MAX_COLS, MAX_ROWS = 128, 64


def seq_color(seq_id: int) -> str:
    """A distinct fill per seq_id (golden-angle hues)."""
    return f"hsl({(seq_id * 137.508 + 210) % 360:.0f},60%,55%)"


def _attr(s: Any) -> str:
    return escape(str(s), quote=True)


# ----------------------------------------------------------------------------- derived data (pure)


def query_labels(st: StepTrace) -> list[tuple[int, int]]:
    """Packed rows as ``(seq_id, pos)`` in batch order."""
    return [(r.seq_id, p) for r in st.batch for p in r.positions]


def kq_from_cells(st: StepTrace) -> tuple[list[list[int]], list[dict[str, Any]]] | None:
    """The full kq_mask keep-matrix ``[N, n_kv]`` rebuilt from the recorded cell map (the cell
    state when llama.cpp filled the mask: nothing changes between ``prepare`` and the record).
    Columns: ``{"cell", "pos", "seq_ids"}``. None without a cells kv record."""
    if st.kv is None or st.kv.physical.get("kind") != "cells":
        return None
    ph = st.kv.physical
    by = {c["cell"]: c for c in ph.get("cells", [])}
    n_kv = min(int(ph.get("n_kv", 0)), MAX_COLS)
    cols = [{"cell": i, "pos": by[i]["pos"] if i in by else -1, "seq_ids": by[i]["seq_ids"] if i in by else []}
            for i in range(n_kv)]
    rows = [[int(s in c["seq_ids"] and 0 <= c["pos"] <= p) for c in cols] for s, p in query_labels(st)[:MAX_ROWS]]
    return rows, cols


def kq_contiguous(st: StepTrace) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Derived kq_mask for a cache holding each request's positions ``0..C+T-1`` in consecutive
    cells, requests one after another (the layout a fresh llama.cpp cache gives)."""
    cols: list[dict[str, Any]] = []
    for r in st.batch:
        for p in range(r.C + r.T):
            cols.append({"cell": len(cols), "pos": p, "seq_ids": [r.seq_id]})
    cols = cols[:MAX_COLS]
    rows = [[int(s in c["seq_ids"] and c["pos"] <= p) for c in cols] for s, p in query_labels(st)[:MAX_ROWS]]
    return rows, cols


def paged_metadata(st: StepTrace) -> tuple[dict[str, Any], bool]:
    """``(metadata, recorded)``: the paged attention metadata of the step, recorded (paged
    trace) or derived from the batch rows (cells trace: ``seq_lens = T``, ``kv_lens = C+T``)."""
    if st.mask is not None and st.mask.metadata is not None:
        return st.mask.metadata, True
    seq_lens = [r.T for r in st.batch]
    cu = [0]
    for t in seq_lens:
        cu.append(cu[-1] + t)
    return {"mask_type": "causal", "seq_lens": seq_lens, "kv_lens": [r.C + r.T for r in st.batch], "cu_seqlens": cu,
            "request_ids": [r.seq_id for r in st.batch]}, False


def implied_mask(T: int, kv_len: int) -> list[list[int]]:
    """Causal keep-matrix ``[T, kv_len]`` a paged kernel derives: query i sees keys ``0..kv_len-T+i``."""
    return [[int(j <= kv_len - T + i) for j in range(kv_len)] for i in range(T)]


def simulate_cells(trace: Any) -> list[dict[int, tuple[int, list[int]]]]:
    """Per step, the cell map ``{cell: (pos, seq_ids)}`` a llama.cpp cache of ``ctx_size`` cells
    would hold right after the step (``find_slot`` from ``head`` with wrap-around)."""
    size = int(trace.options.get("engine", {}).get("ctx_size") or 2048)
    cells: dict[int, tuple[int, list[int]]] = {}
    head, out = 0, []
    for st in trace.steps:
        for s in st.preempted:
            cells = {c: v for c, v in cells.items() if s not in v[1]}
        free = [i for i in range(size) if i not in cells]
        order = [i for i in free if i >= head] + [i for i in free if i < head]
        k = 0
        for r in st.batch:
            for p in r.positions:
                if k < len(order):
                    cells[order[k]] = (p, [r.seq_id])
                    head = (order[k] + 1) % size
                    k += 1
        out.append(dict(cells))
        for r in st.batch:
            if r.finished:
                cells = {c: v for c, v in cells.items() if r.seq_id not in v[1]}
    return out


def simulate_paged(trace: Any) -> tuple[list[dict[int, list[int]]], int, int]:
    """Per step, the block tables ``{seq_id: [block, ...]}`` a paged pool would hold right after
    the step (lowest free block first; freed blocks return sorted). Returns ``(tables per step,
    tokens_per_block, num_blocks)``; B and the pool size come from the run's engine options."""
    eng = trace.options.get("engine", {})
    B = int(eng.get("tokens_per_block") or 32)
    nb = int(eng.get("num_blocks") or -(-int(eng.get("ctx_size") or 2048) // B))
    free, tables, lens, out = list(range(nb)), {}, {}, []

    def release(s: int) -> None:
        free.extend(tables.pop(s, []))
        free.sort()
        lens.pop(s, None)

    for st in trace.steps:
        for s in st.preempted:
            release(s)
        for r in st.batch:
            tab = tables.setdefault(r.seq_id, [])
            need = -(-(r.C + r.T) // B) - len(tab)
            for _ in range(max(0, need)):
                if free:
                    tab.append(free.pop(0))
            lens[r.seq_id] = r.C + r.T
        out.append({s: list(t) for s, t in sorted(tables.items())})
        for r in st.batch:
            if r.finished:
                release(r.seq_id)
    return out, B, nb


def recorded_cells(st: StepTrace) -> dict[int, tuple[int, list[int]]] | None:
    if st.kv is None or st.kv.physical.get("kind") != "cells":
        return None
    return {c["cell"]: (c["pos"], list(c["seq_ids"])) for c in st.kv.physical.get("cells", [])}


def recorded_tables(st: StepTrace) -> dict[int, list[int]] | None:
    if st.kv is None or st.kv.physical.get("kind") != "paged":
        return None
    return {int(s): list(v["block_table"]) for s, v in st.kv.physical.get("requests", {}).items()}


# ----------------------------------------------------------------------------- SVG


def heatmap(rows: Sequence[Sequence[int | None]], row_labels: Sequence[str], col_heads: Sequence[Sequence[str]],
            cls: str, title: str, keep_text: str = "keep", drop_text: str = "drop", cell: int | None = None) -> str:
    """Keep/drop grid as inline SVG: 1 = keep (green), 0 = drop, None = padding.

    Args:
        rows: ``[R][C]`` values.
        row_labels: one per row (left).
        col_heads: per column, up to 3 short label lines drawn above it.
        cls: extra CSS class (``kq-mask``, ``paged-mask``, ``logical-mask``).
    """
    R, C = len(rows), (len(rows[0]) if rows else 0)
    cw = cell or max(6, min(18, 560 // max(1, C)))
    lw = 8 + 6 * max([len(x) for x in row_labels] + [1])
    nhead = max([len(h) for h in col_heads] + [0])
    th = 11 * nhead + 4
    W, H = lw + C * cw + 2, th + R * cw + 2
    out = [f'<svg class="heatmap {cls}" width="{W}" height="{H}" '
           f'viewBox="0 0 {W} {H}" role="img" data-rows="{R}" data-cols="{C}"><title>{escape(title)}</title>']
    if cw >= 10:
        for j, head in enumerate(col_heads):
            for k, line in enumerate(head):
                out.append(f'<text class="ch" x="{lw + j * cw + cw / 2:.1f}" y="{11 * (k + 1)}">{escape(line)}</text>')
    for i, row in enumerate(rows):
        y = th + i * cw
        out.append(f'<text class="rl" x="{lw - 4}" y="{y + cw * 0.75:.1f}">{escape(row_labels[i] if i < len(row_labels) else "")}</text>')
        for j, v in enumerate(row):
            k = "p" if v is None else ("k" if v else "d")
            tip = f"{row_labels[i] if i < len(row_labels) else i} × {' '.join(col_heads[j]) if j < len(col_heads) else j}: " + (
                "padding" if v is None else keep_text if v else drop_text)
            out.append(f'<rect class="{k}" x="{lw + j * cw}" y="{y}" width="{cw - 1}" height="{cw - 1}"><title>{escape(tip)}</title></rect>')
    out.append("</svg>")
    return "".join(out)


def occupancy(grid: Sequence[dict[int, tuple[str, int | None, str]]], n_cols: int, row_labels: Sequence[str],
              cls: str, title: str, col_prefix: str, marks: Sequence[int | None] = ()) -> str:
    """Steps × physical units (cells or blocks) as SVG; each filled unit is coloured by its owner.

    Args:
        grid: per row ``{column: (label, seq_id or None for several owners, tooltip)}``.
        n_cols: columns drawn.
        marks: per row, a column to mark with a bar underneath (the llama.cpp ``head``), or None.
    """
    cw = max(8, min(22, 760 // max(1, n_cols)))
    rh, lw, th = 20, 70, 14
    W, H = lw + n_cols * cw + 2, th + len(grid) * rh + 2
    out = [f'<svg class="occupancy {cls}" width="{W}" height="{H}" '
           f'viewBox="0 0 {W} {H}" role="img" data-rows="{len(grid)}" data-cols="{n_cols}"><title>{escape(title)}</title>']
    step_every = 1 if cw >= 18 else 4 if cw >= 10 else 8
    for j in range(0, n_cols, step_every):
        out.append(f'<text class="ch" x="{lw + j * cw + cw / 2:.1f}" y="10">{j}</text>')
    for i, row in enumerate(grid):
        y = th + i * rh
        out.append(f'<text class="rl" x="{lw - 4}" y="{y + 14}">{escape(row_labels[i])}</text>')
        for j in range(n_cols):
            lab, sid, tip = row.get(j, ("", None, f"{col_prefix} {j}: free"))
            fill = "#eceff1" if j not in row else (seq_color(sid) if sid is not None else "#9e9e9e")
            out.append(f'<rect class="{"u" if j in row else "f"}" x="{lw + j * cw}" y="{y}" width="{cw - 1}" height="{rh - 2}" '
                       f'fill="{fill}"><title>{escape(tip)}</title></rect>')
            if lab and cw >= 14:
                out.append(f'<text class="cl" x="{lw + j * cw + cw / 2:.1f}" y="{y + 13}">{escape(lab)}</text>')
        if i < len(marks) and marks[i] is not None and marks[i] < n_cols:
            x = lw + marks[i] * cw
            out.append(f'<rect class="head" x="{x}" y="{y + rh - 3}" width="{cw - 1}" height="2"><title>head → cell {marks[i]}</title></rect>')
    out.append("</svg>")
    return "".join(out)


def cell_grid(maps: Sequence[dict[int, tuple[int, list[int]]]]) -> tuple[list[dict[int, tuple[str, int | None, str]]], int]:
    grid, width = [], 1
    for m in maps:
        g = {}
        for c, (pos, seqs) in m.items():
            if c >= MAX_COLS:
                continue
            g[c] = (str(pos), seqs[0] if len(seqs) == 1 else None, f"cell {c}: pos {pos}, seq {','.join(map(str, seqs))}")
            width = max(width, c + 1)
        grid.append(g)
    return grid, width


def block_grid(tables: Sequence[dict[int, list[int]]], B: int, nb: int) -> tuple[list[dict[int, tuple[str, int | None, str]]], int]:
    grid, width = [], 1
    for t in tables:
        g = {}
        for s, tab in t.items():
            for i, b in enumerate(tab):
                if b < MAX_COLS:
                    g[b] = (str(i), s, f"block {b}: seq {s} logical block {i} (positions {i * B}..{(i + 1) * B - 1})")
                    width = max(width, b + 1)
        grid.append(g)
    return grid, min(max(width, min(nb, 16)), MAX_COLS)


# ----------------------------------------------------------------------------- HTML bits


def topk_bars(top: Sequence[dict[str, Any]], chosen: int | None) -> str:
    """Sampling candidates as horizontal bars (width = probability); the chosen one marked."""
    out = ['<div class="topk">']
    for c in top:
        ch = " chosen" if c.get("id") == chosen else ""
        w = max(0.0, min(1.0, float(c.get("prob", 0.0)))) * 100
        out.append(f'<div class="topk-row{ch}"><span class="tid">{escape(str(c.get("id")))}</span>'
                   f'<span class="tok">{escape(piece_text(c.get("piece")))}</span>'
                   f'<span class="topk-track"><span class="topk-bar" style="width:{w:.2f}%"></span></span>'
                   f'<span class="num">{float(c.get("prob", 0.0)):.4f}</span><span class="num dim">logit {float(c.get("logit", 0.0)):.3f}</span></div>')
    out.append("</div>")
    return "".join(out)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    """A plain HTML table; cells are escaped unless they are ``Markup`` (pre-built HTML)."""
    h = "".join(f"<th>{escape(x)}</th>" for x in headers)
    body = "".join("<tr>" + "".join(f"<td>{c if isinstance(c, Markup) else escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>'


class Markup(str):
    """HTML text that :func:`table` inserts as is."""
