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

from markupsafe import Markup
from typing import Any, Sequence

from infertrace.trace.records import StepTrace
from infertrace.present.text import int_list_text, piece_text  # noqa: F401 - int_list_text re-exported

MAX_COLS, MAX_ROWS = 128, 64


def seq_color(seq_id: int) -> str:
    """A distinct fill per seq_id (golden-angle hues)."""
    return f"hsl({(seq_id * 137.508 + 210) % 360:.0f},60%,55%)"


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
    cells, requests one after another (the layout a fresh llama.cpp cache gives); the first
    :data:`MAX_COLS` cells and :data:`MAX_ROWS` queries."""
    cols: list[dict[str, Any]] = []
    for r in st.batch:
        for p in range(min(r.C + r.T, MAX_COLS - len(cols))):
            cols.append({"cell": len(cols), "pos": p, "seq_ids": [r.seq_id]})
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
    """Causal keep-matrix a paged kernel derives: query i sees keys ``0..kv_len-T+i``; the drawn
    window ``[min(T, MAX_ROWS), min(kv_len, MAX_COLS)]`` only."""
    return [[int(j <= kv_len - T + i) for j in range(min(kv_len, MAX_COLS))] for i in range(min(T, MAX_ROWS))]


def logical_is_causal(lg: Sequence[Sequence[int]], T: int, kv_len: int) -> bool:
    """True when the recorded logical matrix is exactly the ``[T, kv_len]`` causal one
    (checked element by element over the recorded data, nothing materialised)."""
    if len(lg) != T:
        return False
    for i, row in enumerate(lg):
        if len(row) != kv_len:
            return False
        edge = kv_len - T + i
        for j, x in enumerate(row):
            if x != (1 if j <= edge else 0):
                return False
    return True


def clipped_note(n_rows: int, n_cols: int) -> Markup:
    """"drawn R×C of N×K" under a heatmap cut to MAX_ROWS × MAX_COLS (empty when nothing was cut)."""
    if n_rows <= MAX_ROWS and n_cols <= MAX_COLS:
        return Markup("")
    return Markup('<span class="dim more">drawn {}×{} of {}×{} (… {} more rows, {} more columns)</span>').format(
        min(n_rows, MAX_ROWS), min(n_cols, MAX_COLS), n_rows, n_cols, max(0, n_rows - MAX_ROWS), max(0, n_cols - MAX_COLS))


def simulate_cells(trace: Any, n_steps: int | None = None) -> list[dict[int, tuple[int, list[int]]]]:
    """Per step, the cell map ``{cell: (pos, seq_ids)}`` a llama.cpp cache of ``ctx_size`` cells
    would hold right after the step (``find_slot`` from ``head`` with wrap-around); the first
    ``n_steps`` steps. Work per step is O(cells used + tokens placed), never O(ctx_size)."""
    size = int(trace.options.get("settings", {}).get("ctx_size") or 2048)
    cells: dict[int, tuple[int, list[int]]] = {}
    head, out = 0, []

    def release(seq_id: int) -> dict[int, tuple[int, list[int]]]:
        nonlocal head
        freed = [c for c, v in cells.items() if seq_id in v[1]]
        if freed and min(freed) < head:  # llama_kv_cache::seq_rm: head back to the first freed cell
            head = min(freed)
        return {c: v for c, v in cells.items() if seq_id not in v[1]}

    for st in trace.steps[:n_steps]:
        for s in st.preempted:
            cells = release(s)
        n_tokens = sum(len(r.positions) for r in st.batch)
        if head > len(cells) + 2 * n_tokens:  # llama.cpp find_slot: plenty of unused cells before head -> restart at 0
            head = 0
        c = head
        for r in st.batch:
            for p in r.positions:
                if len(cells) >= size:
                    break  # full: the record shows what the engine did
                scanned = 0
                while c in cells and scanned < size:  # next free cell, wrapping (bounded by cells used)
                    c, scanned = (c + 1) % size, scanned + 1
                cells[c] = (p, [r.seq_id])
                head = (c + 1) % size
        out.append(dict(cells))
        for r in st.batch:
            if r.finished:
                cells = release(r.seq_id)
    return out


def simulate_paged(trace: Any, n_steps: int | None = None) -> tuple[list[dict[int, list[int]]], int, int]:
    """Per step, the block tables ``{seq_id: [block, ...]}`` a paged pool would hold right after
    the step (lowest free block first; freed blocks return sorted). Returns ``(tables per step,
    tokens_per_block, num_blocks)``; B and the pool size come from the run's engine options.
    The free list is a heap of returned blocks plus a counter of never-used ones, so the work
    is O(blocks handed out), never O(num_blocks)."""
    import heapq

    eng = trace.options.get("settings", {})
    B = int(eng.get("tokens_per_block") or 32)
    nb = int(eng.get("num_blocks") or -(-int(eng.get("ctx_size") or 2048) // B))
    returned: list[int] = []
    fresh = 0  # blocks fresh..nb-1 were never handed out
    tables: dict[int, list[int]] = {}
    out: list[dict[int, list[int]]] = []

    def take() -> int | None:
        nonlocal fresh
        if returned and (fresh >= nb or returned[0] < fresh):
            return heapq.heappop(returned)
        if fresh < nb:
            fresh += 1
            return fresh - 1
        return None

    def release(s: int) -> None:
        for b in tables.pop(s, []):
            heapq.heappush(returned, b)

    for st in trace.steps[:n_steps]:
        for s in st.preempted:
            release(s)
        for r in st.batch:
            tab = tables.setdefault(r.seq_id, [])
            need = -(-(r.C + r.T) // B) - len(tab)
            for _ in range(max(0, need)):
                b = take()
                if b is None:
                    break
                tab.append(b)
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
# Every piece of HTML/SVG below is built with markupsafe.Markup: a Markup template's
# ``.format(...)`` arguments, ``Markup + str`` and ``Markup("").join(...)`` escape any plain str
# (text and attribute context alike, quotes included), so a value from the trace can never
# become markup. Only Markup values (built here) pass unescaped.


def heatmap(rows: Sequence[Sequence[int | None]], row_labels: Sequence[str], col_heads: Sequence[Sequence[str]],
            cls: str, title: str, keep_text: str = "keep", drop_text: str = "drop", cell: int | None = None) -> Markup:
    """Keep/drop grid as inline SVG: 1 = keep (green), 0 = drop, None = padding.

    At most :data:`MAX_ROWS` rows and :data:`MAX_COLS` columns are drawn (``data-rows`` /
    ``data-cols`` give what was drawn; the caller states the full size).

    Args:
        rows: ``[R][C]`` values.
        row_labels: one per row (left).
        col_heads: per column, up to 3 short label lines drawn above it.
        cls: extra CSS class (``kq-mask``, ``paged-mask``, ``logical-mask``).
    """
    rows = [list(r[:MAX_COLS]) for r in rows[:MAX_ROWS]]
    R, C = len(rows), (len(rows[0]) if rows else 0)
    cw = int(cell or max(6, min(18, 560 // max(1, C))))
    lw = 8 + 6 * max([len(x) for x in row_labels[:MAX_ROWS]] + [1])
    nhead = max([len(h) for h in col_heads[:MAX_COLS]] + [0])
    th = 11 * nhead + 4
    W, H = lw + C * cw + 2, th + R * cw + 2
    out = [Markup('<svg class="heatmap {}" width="{}" height="{}" viewBox="0 0 {} {}" role="img" data-rows="{}" '
                  'data-cols="{}"><title>{}</title>').format(cls, W, H, W, H, R, C, title)]
    if cw >= 10:
        for j, head in enumerate(col_heads[:C]):
            for k, line in enumerate(head):
                out.append(Markup('<text class="ch" x="{:.1f}" y="{}">{}</text>').format(lw + j * cw + cw / 2, 11 * (k + 1), line))
    for i, row in enumerate(rows):
        y = th + i * cw
        out.append(Markup('<text class="rl" x="{}" y="{:.1f}">{}</text>').format(
            lw - 4, y + cw * 0.75, row_labels[i] if i < len(row_labels) else ""))
        for j, v in enumerate(row):
            k = "p" if v is None else ("k" if v else "d")
            tip = f"{row_labels[i] if i < len(row_labels) else i} × {' '.join(col_heads[j]) if j < len(col_heads) else j}: " + (
                "padding" if v is None else keep_text if v else drop_text)
            out.append(Markup('<rect class="{}" x="{}" y="{}" width="{}" height="{}"><title>{}</title></rect>').format(
                k, lw + j * cw, y, cw - 1, cw - 1, tip))
    out.append(Markup("</svg>"))
    return Markup("").join(out)


def occupancy(grid: Sequence[dict[int, tuple[str, int | None, str]]], n_cols: int, row_labels: Sequence[str],
              cls: str, title: str, col_prefix: str, marks: Sequence[int | None] = ()) -> Markup:
    """Steps × physical units (cells or blocks) as SVG; each filled unit is coloured by its owner.

    Args:
        grid: per row ``{column: (label, seq_id or None for several owners, tooltip)}``.
        n_cols: columns drawn (at most :data:`MAX_COLS`).
        marks: per row, a column to mark with a bar underneath (the llama.cpp ``head``), or None.
    """
    n_cols = min(int(n_cols), MAX_COLS)
    cw = max(8, min(22, 760 // max(1, n_cols)))
    rh, lw, th = 20, 70, 14
    W, H = lw + n_cols * cw + 2, th + len(grid) * rh + 2
    out = [Markup('<svg class="occupancy {}" width="{}" height="{}" viewBox="0 0 {} {}" role="img" data-rows="{}" '
                  'data-cols="{}"><title>{}</title>').format(cls, W, H, W, H, len(grid), n_cols, title)]
    step_every = 1 if cw >= 18 else 4 if cw >= 10 else 8
    for j in range(0, n_cols, step_every):
        out.append(Markup('<text class="ch" x="{:.1f}" y="10">{}</text>').format(lw + j * cw + cw / 2, j))
    for i, row in enumerate(grid):
        y = th + i * rh
        out.append(Markup('<text class="rl" x="{}" y="{}">{}</text>').format(lw - 4, y + 14, row_labels[i]))
        for j in range(n_cols):
            lab, sid, tip = row.get(j, ("", None, f"{col_prefix} {j}: free"))
            fill = "#eceff1" if j not in row else (seq_color(sid) if sid is not None else "#9e9e9e")
            out.append(Markup('<rect class="{}" x="{}" y="{}" width="{}" height="{}" fill="{}"><title>{}</title></rect>').format(
                "u" if j in row else "f", lw + j * cw, y, cw - 1, rh - 2, fill, tip))
            if lab and cw >= 14:
                out.append(Markup('<text class="cl" x="{:.1f}" y="{}">{}</text>').format(lw + j * cw + cw / 2, y + 13, lab))
        if i < len(marks) and marks[i] is not None and 0 <= marks[i] < n_cols:
            x = lw + marks[i] * cw
            out.append(Markup('<rect class="head" x="{}" y="{}" width="{}" height="2"><title>head → cell {}</title></rect>').format(
                x, y + rh - 3, cw - 1, marks[i]))
    out.append(Markup("</svg>"))
    return Markup("").join(out)


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


def topk_bars(top: Sequence[dict[str, Any]], chosen: int | None) -> Markup:
    """Sampling candidates as horizontal bars (width = probability); the chosen one marked."""
    out = [Markup('<div class="topk">')]
    for c in top:
        ch = " chosen" if c.get("id") == chosen else ""
        prob = float(c.get("prob", 0.0))
        w = (max(0.0, min(1.0, prob)) if prob == prob else 0.0) * 100  # NaN draws no bar
        out.append(Markup('<div class="topk-row{}"><span class="tid">{}</span><span class="tok">{}</span>'
                          '<span class="topk-track"><span class="topk-bar" style="width:{:.2f}%"></span></span>'
                          '<span class="num">{:.4f}</span><span class="num dim">logit {:.3f}</span></div>').format(
            ch, str(c.get("id")), piece_text(c.get("piece")), w, prob, float(c.get("logit", 0.0))))
    out.append(Markup("</div>"))
    return Markup("").join(out)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> Markup:
    """A plain HTML table; cells are escaped unless they are ``Markup`` (pre-built HTML)."""
    h = Markup("").join(Markup("<th>{}</th>").format(x) for x in headers)
    body = Markup("").join(Markup("<tr>{}</tr>").format(Markup("").join(Markup("<td>{}</td>").format(
        c if isinstance(c, Markup) else str(c)) for c in r)) for r in rows)
    return Markup('<table class="{}"><thead><tr>{}</tr></thead><tbody>{}</tbody></table>').format(cls, h, body)
