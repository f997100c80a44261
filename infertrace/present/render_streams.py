"""How the non-unified KV cache (``--kv-unified off``, llama.cpp ``kv_unified = false``) is shown: the
kq_mask one stream block at a time (terminal panel and HTML report), and each stream's head / used /
n_kv for the kv panel and ``dump-kv``. Reads only the trace record (kv/streams.py writes it)."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup
from rich import box
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

#: as present/render.py (not imported from it: render.py imports this module)
KEEP_STYLE, DROP_STYLE, DIM = "bold green", "red", "dim"


def _labels(st: Any) -> list[tuple[Any, Any]]:
    return [(r.seq_id, p) for r in st.batch for p in r.positions]


def streams_line(kq: dict[str, Any]) -> str:
    """One line: ``ne`` read as the non-unified layout (tokens per stream, streams of the ubatch / of the cache)."""
    ne = kq["ne"]
    return (f"non-unified: {ne[3]} of {kq.get('n_stream', '?')} streams in this ubatch ({kq.get('stream_size', '?')} cells "
            f"each), {ne[1]} tokens per stream; n_kv = {ne[0]}, the largest padded used_max_p1 of the ubatch's streams; "
            "each stream block masks its own cells only")


def stream_mask_grids(kq: dict[str, Any], st: Any) -> list[RenderableType]:
    """Per ubatch stream: a grid of its block of ``kq_mask`` (rows = its queries, columns = its cells
    with pos and owner), titled with the stream, its sequences and its head before → after."""
    out: list[RenderableType] = []
    labels = _labels(st)
    n_tps = kq["ne"][1]
    for j, blk in enumerate(kq.get("streams") or []):
        rows = blk["rows"]
        ncol = len(rows[0]) if rows else 0
        t = Table(box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False, pad_edge=False, title_justify="left",
                  title_style="italic",
                  title=(f"stream {blk['stream']} (seq {','.join(str(s) for s in blk['seq_ids'])}) · head "
                         f"{blk['head_before']} → {blk['head_after']} · rows 0..{len(rows) - 1} of {n_tps} × its cells "
                         f"0..{ncol - 1} of {kq['n_kv']}"))
        t.add_column(Text("cell\npos\nseq", justify="right"), justify="right", no_wrap=True)
        for c in range(ncol):
            pos = blk["cell_pos"][c] if c < len(blk["cell_pos"]) else -1
            own = blk["cell_seq"][c] if c < len(blk["cell_seq"]) else []
            t.add_column(Text(f"{c}\n{pos if pos >= 0 else '·'}\n{','.join(str(s) for s in own) or '·'}", justify="right"),
                         justify="right", min_width=5)
        for i, row in enumerate(rows):
            sid, pos = labels[j * n_tps + i] if j * n_tps + i < len(labels) else ("?", "?")
            t.add_row(f"s{sid} q{pos} ", *[Text(x, style=KEEP_STYLE if x == "0" else DROP_STYLE) for x in row])
        out.append(t)
    return out


def streams_state(ph: dict[str, Any]) -> Text:
    """The kv panel's / ``dump-kv``'s cells line for a non-unified snapshot: per stream head, used,
    used_max_p1, n_kv and the sequences it holds (global rows = stream × stream_size + cell)."""
    per = ph.get("streams") or []
    g = Text(f"{ph.get('n_stream')} streams × {ph.get('stream_size')} cells (row = stream × {ph.get('stream_size')} + cell) · "
             f"used {ph.get('used')} in all · n_kv {ph.get('n_kv')}\n")
    for s in per:
        g.append(f"  stream {s['stream']}: seq {','.join(str(x) for x in s['seq_ids']) or '-'} · head {s['head']} · used "
                 f"{s['used']} · used_max_p1 {s['used_max_p1']} · n_kv {s['n_kv']}\n", style=DIM if not s["used"] else "")
    g.rstrip()
    return g


def stream_report_figs(st: Any, kq: dict[str, Any], heatmap: Any, tag: Markup) -> list[Markup]:
    """HTML report: one heatmap per ubatch stream from the recorded rows over that stream's cells
    (``heatmap`` is :func:`infertrace.present.report_views.heatmap`)."""
    figs = []
    labels = [f"s{s} q{p}" for s, p in _labels(st)]
    n_tps = kq["ne"][1]
    for j, blk in enumerate(kq.get("streams") or []):
        rows = [[int(x == "0") for x in r] for r in blk["rows"]]
        heads = [[str(c), str(p) if p >= 0 else "·", ",".join(map(str, q)) or "·"]
                 for c, (p, q) in enumerate(zip(blk["cell_pos"], blk["cell_seq"]))][: len(rows[0]) if rows else 0]
        cap = Markup("{}<b>llama.cpp kq_mask, stream {}</b> (non-unified: seq {}; head {} → {}): ne = {}; block {} of the "
                     "ubatch, rows = its queries, columns = its own cells (cell · pos · seq)").format(
            tag, blk["stream"], ",".join(map(str, blk["seq_ids"])), blk["head_before"], blk["head_after"], str(kq["ne"]), j)
        figs.append(Markup("<figure><figcaption>{}</figcaption>{}</figure>").format(
            cap, heatmap(rows, labels[j * n_tps : (j + 1) * n_tps], heads, "kq-mask", f"kq_mask stream {blk['stream']}",
                         "0 (keep)", "-inf (drop)")))
    return figs
