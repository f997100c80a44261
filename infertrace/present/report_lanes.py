"""The HTML report's request-lane timeline: one row per request, one column per step (torch-free).

Each cell is one :class:`infertrace.trace.lanes.Slot`: ``P`` prefill (the whole prompt in one step),
``C1``.. ``Cn`` the chunks of a chunked prefill, ``D`` decode, ``V`` speculative verify, ``✗`` preempted;
an empty cell is a step the request was not scheduled in (waiting, or done). A prefix hit is marked on
the admission cell (``+H`` and a green edge: H tokens and their blocks / cells from the cache), ``■``
marks the step a request finished in; the cell's ``title`` (hover) holds its facts (tokens, positions,
blocks or cells after the step, sampled piece, stop reason). Above the lanes: each step's packed batch
size N.

Every value enters HTML through ``markupsafe.Markup.format`` (escaped for text and attribute context);
at most :data:`MAX_LANE_STEPS` steps, :data:`MAX_LANE_ROWS` requests and :data:`MAX_LANE_CELLS` cells are
drawn ("… N more").
"""

from __future__ import annotations

from markupsafe import Markup

from infertrace.present.text import piece_text
from infertrace.safe_text import visible
from infertrace.trace.lanes import Lanes, Slot, build_lanes
from infertrace.trace.records import RunTrace

M = Markup
J = Markup("").join
MAX_LANE_STEPS, MAX_LANE_ROWS = 400, 256
#: cells drawn at most (requests × steps): many requests draw fewer steps, so the page stays a few MB
MAX_LANE_CELLS = 40_000
GLYPH = {"prefill": "P", "decode": "D", "verify": "V", "preempted": "✗"}
LEGEND = ("P prefill (whole prompt) · C1..Cn prefill chunks · D decode · V speculative verify · ✗ preempted · "
          "+H prefix hit of H tokens (green edge) · ■ finished · empty: not scheduled · hover a cell for its facts")

CSS = """
.lanes-wrap { overflow-x: auto; }
.lanes { border-collapse: collapse; font-size: 11px; }
.lanes th, .lanes td { border: 1px solid var(--line); padding: 1px 2px; min-width: 18px; text-align: center; white-space: nowrap; }
.lanes th.seq { text-align: right; padding-right: 6px; }
.lanes td.ln-prefill, .lanes td.ln-chunk { background: #e1bee7; } .lanes td.ln-decode { background: #bbdefb; }
.lanes td.ln-verify { background: #b2ebf2; } .lanes td.ln-preempted { background: #ffcdd2; color: #b71c1c; font-weight: 700; }
.lanes td.ln-hit { box-shadow: inset 0 0 0 2px var(--keep); } .lanes td.ln-fin { font-weight: 700; }
.lanes tr.ntok td { color: var(--dim); background: #fafbfc; }
"""


def slot_title(s: Slot) -> str:
    """The hover text of a cell: the slot's facts on separate lines (plain text; escaped by the caller)."""
    parts = [f"step {s.step} · seq {s.seq_id} · {s.label()}"]
    if s.positions:
        parts.append(f"tokens {s.T} · positions {s.positions} · num_computed_tokens before {s.C}")
    if s.hit:
        parts.append(f"prefix hit {s.hit} tokens" + (f" ({visible(s.hit_blocks)})" if s.hit_blocks else ""))
    if s.blocks:
        parts.append(f"blocks / cells after: {visible(s.blocks)}")
    if s.sampled is not None:
        parts.append(f"sampled {s.sampled} {piece_text(s.piece or '')}")
    if s.finished:
        parts.append(f"finished: {visible(s.finished)[:80]}")
    return "\n".join(parts)


def _cell(s: Slot | None) -> Markup:
    if s is None:
        return M("<td></td>")
    glyph = f"C{s.chunk}" if s.kind == "chunk" else GLYPH.get(s.kind, "?")
    cls = f"ln-{s.kind}" + (" ln-hit" if s.hit else "") + (" ln-fin" if s.finished else "")
    text = glyph + (f"+{s.hit}" if s.hit else "") + ("■" if s.finished else "")
    return M('<td class="{}" title="{}">{}</td>').format(cls, slot_title(s), text)


def drawn(lanes: Lanes) -> tuple[list[int], list[int]]:
    """The steps and requests the grid draws (within :data:`MAX_LANE_STEPS`, :data:`MAX_LANE_ROWS`, :data:`MAX_LANE_CELLS`)."""
    seqs = lanes.seqs[:MAX_LANE_ROWS]
    return lanes.steps[:min(MAX_LANE_STEPS, MAX_LANE_CELLS // max(1, len(seqs)))], seqs


def lane_grid(lanes: Lanes) -> Markup:
    """The lanes as one HTML table: a header of step numbers, a row of N per step, one row per request."""
    steps, seqs = drawn(lanes)
    head = J(M("<th>{}</th>").format(s) for s in steps)
    ntok = J(M("<td>{}</td>").format(lanes.n_tokens.get(s, 0)) for s in steps)
    rows = J(M('<tr data-seq="{}"><th class="seq">seq {}</th>{}</tr>').format(
        sid, sid, J(_cell(lanes.by_seq.get(sid, {}).get(s)) for s in steps)) for sid in seqs)
    return M('<table class="lanes"><thead><tr><th class="seq">step</th>{}</tr></thead><tbody>'
             '<tr class="ntok"><th class="seq">N</th>{}</tr>{}</tbody></table>').format(head, ntok, rows)


def lanes_section(trace: RunTrace) -> Markup:
    """The report section (empty for a trace of fewer than two requests: its worked-example table is the lane)."""
    lanes = build_lanes(trace)
    if len(lanes.seqs) < 2 or not lanes.steps:
        return M("")
    more = []
    steps, seqs = drawn(lanes)
    if len(lanes.steps) > len(steps):
        more.append(f"{len(lanes.steps) - len(steps)} more steps")
    if len(lanes.seqs) > len(seqs):
        more.append(f"{len(lanes.seqs) - len(seqs)} more requests")
    note = (M('<p class="dim more">… {} not drawn (infertrace export DIR --format perfetto has every lane)</p>')
            .format(", ".join(more)) if more else M(""))
    return M('<section id="lanes"><h2>request lanes (one row per request, one column per step)</h2>'
             '<p class="dim">{}</p><div class="lanes-wrap">{}</div>{}</section>').format(LEGEND, lane_grid(lanes), note)
