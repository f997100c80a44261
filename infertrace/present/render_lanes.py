"""The batch composition per step, for ``run`` and ``show`` of a multi-request trace (rich, torch-free).

One row per step (runs of plain decode steps of the same requests folded into one row), one column per
request (:mod:`infertrace.trace.lanes`): which requests shared the step, how many tokens each, prefill
chunk / decode / verify, preempted, finished, prefix-hit tokens. A trace of one request does not get
the table (its worked-example table already is one row per step).

Every value from the trace goes into ``rich.text.Text`` (never markup) through
:func:`infertrace.safe_text.visible`, so ``[``, ANSI escapes and control bytes print literally.
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from infertrace.safe_text import visible
from infertrace.trace.lanes import Lanes, Slot, build_lanes
from infertrace.trace.records import RunTrace

#: rows (after folding) and request columns drawn before "… N more"
MAX_ROWS, MAX_LANES = 200, 16
STYLE = {"prefill": "magenta", "chunk": "magenta", "decode": "blue", "verify": "cyan", "preempted": "bold red"}
LEGEND = ("T = tokens computed [at positions] · prefill = whole prompt in one step · chunk k/n = k-th of n prefill "
          "steps · decode @p · verify acc a/d = drafts accepted · hit H = tokens from the prefix cache · ■ finished · "
          "blank = not scheduled")


def slot_text(s: Slot, span: int = 1, last_pos: int | None = None) -> Text:
    """One cell: the slot's label, its positions (prefill, chunk, verify), prefix hit and stop reason;
    ``span`` > 1 folds that many decode steps ending at ``last_pos``."""
    if span > 1:
        return Text(f"decode ×{span} @{s.C}..{last_pos}", style=STYLE["decode"])
    t = Text(s.label(), style=STYLE.get(s.kind, ""))
    if s.kind in ("prefill", "chunk", "verify") and s.positions:
        t.append(f" [{s.positions}]", style="dim")
    if s.hit:
        t.append(f" hit {s.hit}", style="green")
    if s.finished:
        t.append(f" ■ {visible(s.finished)[:40]}", style="yellow")
    return t


def _plain_decode(lanes: Lanes, step: int) -> tuple[int, ...] | None:
    """The lanes of a step made only of decode slots with no event (foldable), else None."""
    slots = lanes.at(step)
    if not slots or any(s.kind != "decode" or s.finished or s.hit for s in slots):
        return None
    return tuple(s.seq_id for s in slots)


def folded_rows(lanes: Lanes) -> list[tuple[int, int]]:
    """``[(first step, last step)]``: consecutive plain decode steps of the same requests folded into one row."""
    rows: list[tuple[int, int]] = []
    key_prev = None
    for st in lanes.steps:
        key = _plain_decode(lanes, st)
        if key is not None and key == key_prev and rows:
            rows[-1] = (rows[-1][0], st)
        else:
            rows.append((st, st))
        key_prev = key
    return rows


def composition_table(lanes: Lanes) -> Table:
    """The table (see the module docstring); at most :data:`MAX_ROWS` rows and :data:`MAX_LANES` request columns."""
    shown = lanes.seqs[:MAX_LANES]
    t = Table(title="batch composition per step", title_justify="left", title_style="bold", box=box.SIMPLE_HEAD,
              show_edge=False, pad_edge=False, padding=(0, 1))
    t.add_column("step", justify="right", no_wrap=True)
    t.add_column("N", justify="right", no_wrap=True)
    for sid in shown:
        t.add_column(f"seq {sid}", overflow="fold")
    if lanes.unmarked:  # a collected served trace: what the server ran beside the marked requests
        t.add_column("unmarked", no_wrap=True)
    rows = folded_rows(lanes)
    index = {st: i for i, st in enumerate(lanes.steps)}
    for a, b in rows[:MAX_ROWS]:
        n, span = lanes.n_tokens.get(a, 0), index[b] - index[a] + 1
        cells: list[Text | str] = [str(a) if a == b else f"{a}..{b}", str(n) if a == b else f"{n}/step"]
        if not lanes.at(a):
            cells[1] = Text("0 idle" if a not in lanes.unmarked else "0 marked", style="dim")
        for sid in shown:
            s = lanes.by_seq.get(sid, {}).get(a)
            if s is None:
                cells.append("")
            elif a != b:
                cells.append(slot_text(s, span=span, last_pos=lanes.by_seq[sid][b].C))
            else:
                cells.append(slot_text(s))
        if lanes.unmarked:
            u = [lanes.unmarked[st] for st in lanes.steps[index[a]:index[b] + 1] if st in lanes.unmarked]
            cells.append(f"{max(n for n, _ in u)} req, {sum(k for _, k in u)} tok" if u else "")
        t.add_row(*cells)
    return t


def composition_notes(lanes: Lanes) -> str:
    """The line under the table: what was not drawn (rows past :data:`MAX_ROWS`, requests past
    :data:`MAX_LANES`) and the legend."""
    rows = folded_rows(lanes)
    more = []
    if len(rows) > MAX_ROWS:
        more.append(f"{len(rows) - MAX_ROWS} more rows (steps {rows[MAX_ROWS][0]}..{lanes.steps[-1]})")
    if len(lanes.seqs) > MAX_LANES:
        more.append(f"{len(lanes.seqs) - MAX_LANES} more requests")
    cut = "… " + ", ".join(more) + " not drawn: infertrace export DIR --format perfetto has every lane. " if more else ""
    return cut + LEGEND


def render_composition(console: Console, trace: RunTrace) -> None:
    """Print the batch composition table when the trace holds more than one request (else nothing)."""
    lanes = build_lanes(trace)
    if len(lanes.seqs) < 2 or not lanes.steps:
        return
    console.print(composition_table(lanes))
    console.print(Text(composition_notes(lanes), style="dim"))
