"""Rich rendering of speculative decoding (per verify chunk :attr:`ReqStep.spec`, per step
:attr:`StepTrace.spec`, per run :attr:`RunTrace.spec`): the worked-example cell marking each
candidate as the pending token, an accepted draft (✓) or a rejected one (✗); the verify mask as
an ancestor grid with its llama.cpp (kq_mask rows over the candidates' cells) and TensorRT-LLM
(``spec_decoding_position_offsets``, ``spec_decoding_packed_mask``) forms; the KV rewind; the
run's tokens per target forward and acceptance by draft position.

Values come from traces (untrusted when loaded): rendered as rich ``Text``, never markup, shortened.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from infertrace.present.render_serving import _s

_DIM = "bright_black"
#: candidates drawn in a grid at most
MAX_GRID = 24


def spec_tokens_text(r: Any, pieces: list[str]) -> Text | None:
    """Worked-example ``current tokens`` cell of a verify row: ``id 'piece'`` per candidate, the
    root plain, accepted drafts green ✓, rejected red ✗ (struck). None for other rows."""
    sp = getattr(r, "spec", None)
    if not isinstance(sp, dict):
        return None
    acc = set(sp.get("accepted_nodes") or [])
    t = Text()
    for i, (tid, pc) in enumerate(zip(r.token_ids, pieces)):
        if i:
            t.append(" ")
        if i == 0:
            t.append(f"{tid} {pc}", style="cyan")
        elif i in acc:
            t.append(f"✓{tid} {pc}", style="green")
        else:
            t.append(f"✗{tid} {pc}", style="red strike")
    par = sp.get("parents") or []
    if par != list(range(-1, len(par) - 1)):
        t.append(f"\ntree parents {_s(par)}", style=_DIM)
    return t


def spec_output_text(r: Any, piece: Any = None) -> Text | None:
    """Worked-example ``output`` cell of a verify row: every emitted token (``piece``: the renderer's
    piece quoting, else ids), ``+n`` of them."""
    sp = getattr(r, "spec", None)
    if not isinstance(sp, dict):
        return None
    em = sp.get("emitted") or []
    pcs = sp.get("emitted_pieces") if isinstance(sp.get("emitted_pieces"), list) else None
    t = Text(" ".join(piece(x) for x in pcs[:12]) if pcs and piece else " ".join(_s(x) for x in em[:12]), style="bold")
    t.append(f"\n+{len(em)} · acc {sp.get('accepted')}/{sp.get('drafted')}", style="green")
    if getattr(r, "finished", None):
        t.append(f"\n({_s(r.finished)})", style="yellow")
    return t


def _grid(rows: list[str], acc: set[int]) -> Table:
    n = min(len(rows), MAX_GRID)
    g = Table(box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False)
    g.add_column("node", justify="right")
    for j in range(n):
        g.add_column(str(j), justify="center", style="green" if j in acc else "")
    for i in range(n):
        row = str(rows[i])[:n]
        g.add_row(Text(str(i), style="green" if i in acc else "red"), *[("■" if c == "1" else "·") for c in row])
    return g


def spec_mask_view(st: Any) -> RenderableType | None:
    """The verify mask of every verify chunk of the step (None when the step verifies nothing)."""
    parts: list[RenderableType] = []
    for r in st.batch:
        sp = r.spec if isinstance(getattr(r, "spec", None), dict) else None
        if not sp or not isinstance(sp.get("verify_mask"), list):
            continue
        acc = set(sp.get("accepted_nodes") or [])
        parents = sp.get("parents") or []
        chain = parents == list(range(-1, len(parents) - 1))
        parts.append(Text.assemble(("verify mask ", "bold"), f"seq {r.seq_id}: {len(parents)} candidates at positions ",
                                   (_s(r.positions), "cyan"),
                                   " — a causal block (chain)" if chain else " — the ancestor relation (tree)",
                                   ("; every candidate also sees the past 0..", _DIM), (f"{r.C - 1}", _DIM)))
        parts.append(_grid([str(x) for x in sp["verify_mask"]], acc))
        if "kq_mask_block" in sp:
            parts.append(Text(f"llama.cpp kq_mask rows of these {len(parents)} queries over their cells {_s(sp.get('cells'))}: "
                              "0 where ■, -inf where ·", style=_DIM))
        if "packed_mask" in sp:
            words = [w[0] if isinstance(w, list) and w else w for w in sp["packed_mask"]]
            parts.append(Text.assemble("TensorRT-LLM ", ("spec_decoding_position_offsets", "bold"), f" = {_s(sp.get('position_offsets'))}  ",
                                       ("spec_decoding_packed_mask", "bold"), f" (int32, bit j = sees node j) = {_s(words)}"))
    return Group(*parts) if parts else None


def spec_kv_view(st: Any) -> RenderableType | None:
    """The rewind of every verify chunk: positions kept, removed, cells freed / slots moved / blocks released."""
    parts: list[RenderableType] = []
    for r in st.batch:
        sp = r.spec if isinstance(getattr(r, "spec", None), dict) else None
        rw = sp.get("rewind") if sp else None
        if not isinstance(rw, dict):
            continue
        t = Text.assemble(("rewind ", "bold"), f"seq {r.seq_id}: ", (f"{_s(rw.get('op'))}", "yellow"),
                          f" {_s(rw.get('range') or '')} · kept pos {_s(rw.get('kept_pos'))} · removed pos {_s(rw.get('removed_pos'))}")
        if "freed" in rw:
            t.append(f" · cells freed {_s(rw.get('freed'))}")
        if rw.get("moved_slots"):
            t.append(f" · accepted K/V moved slot→slot {_s(rw.get('moved_slots'))}")
        if "freed_blocks" in rw:
            t.append(f" · blocks released {_s(rw.get('freed_blocks'))}")
        parts.append(t)
        gs = rw.get("state")
        if isinstance(gs, dict):
            parts.append(state_select_text(gs))
    return Group(*parts) if parts else None


def spec_mtp_view(st: Any) -> RenderableType | None:
    """``--speculative mtp``: what each MTP row of the step's drafts read -- its position, the token
    embedded, which hidden state (the target's after ``output_norm``, or the MTP's own after
    ``shared_head_norm`` for a chained draft) from which position, its L2 norm -- and the draft it gave."""
    parts: list[RenderableType] = []
    for r in st.batch:
        sp = r.spec if isinstance(getattr(r, "spec", None), dict) else None
        mt = sp.get("mtp") if sp else None
        if not isinstance(mt, dict) or not isinstance(mt.get("rows"), list):
            continue
        cu = mt.get("catch_up") if isinstance(mt.get("catch_up"), dict) else None
        head = Text.assemble(("MTP draft inputs ", "bold"), f"seq {r.seq_id}")
        if cu:
            head.append(f" · catch-up rows at positions {_s(cu.get('positions'))} (target hidden at p + token at p+1)", style=_DIM)
        parts.append(head)
        for row in mt["rows"][:32]:
            if not isinstance(row, dict):
                continue
            parts.append(Text.assemble(
                f"  node {_s(row.get('node'))} @ pos {_s(row.get('position'))}: embed(token {_s(row.get('token'))}) + hidden[",
                (f"{_s(row.get('hidden_from'))} pos {_s(row.get('hidden_position'))}, after {_s(row.get('hidden_norm'))}", "cyan"),
                f"] |h| {_s(row.get('hidden_l2'))} -> draft ", (f"{_s(row.get('argmax'))}", "bold"),
                f" (logit {_s(row.get('logit_max'))})"))
    return Group(*parts) if parts else None


def _num(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) and not isinstance(x, bool) else _s(x)


def state_select_text(gs: dict[str, Any]) -> Text:
    """A hybrid verify's GDN state: the snapshot kept (its index as the convention names it: llama.cpp
    ``rs_idx``, TensorRT-LLM ``num_accepted_draft_tokens`` / ``accepted_leaf_positions``), the ones
    dropped, and per shown GDN layer the conv / recurrent state's L2 norm and sum before -> after."""
    where = ("llama.cpp rollback snapshot" if gs.get("convention") == "cells"
             else "TensorRT-LLM intermediate state (update_mamba_states)")
    t = Text.assemble(("  GDN state ", "bold"), f"slot {_s(gs.get('slot'))}: kept snapshot of node ",
                      (_s(gs.get("kept_node")), "green"), f" of {_s(gs.get('snapshots'))} ({where}, ",
                      (f"{_s(gs.get('index_name'))} = {_s(gs.get('kept_snapshot'))}", "cyan"),
                      f") · dropped nodes {_s(gs.get('dropped_nodes'))}")
    for ly in (gs.get("layers") or [])[:3]:
        if not isinstance(ly, dict):
            continue
        b = ly.get("before") if isinstance(ly.get("before"), dict) else {}
        a = ly.get("after") if isinstance(ly.get("after"), dict) else {}
        t.append(f"\n    layer {_s(ly.get('layer'))}: conv ‖·‖ {_num(b.get('conv_norm'))} → {_num(a.get('conv_norm'))}"
                 f" Σ {_num(b.get('conv_sum'))} → {_num(a.get('conv_sum'))} · recurrent ‖·‖ {_num(b.get('rec_norm'))} → "
                 f"{_num(a.get('rec_norm'))} Σ {_num(b.get('rec_sum'))} → {_num(a.get('rec_sum'))}", style=_DIM)
    return t


def with_extra(body: RenderableType | None, extra: RenderableType | None) -> RenderableType | None:
    """``body`` followed by ``extra`` (either may be None)."""
    if extra is None:
        return body
    return extra if body is None else Group(body, extra)


def render_spec_summary(console: Console, trace: Any) -> None:
    """Per run: tokens per target forward; per request: acceptance by draft position."""
    sp = getattr(trace, "spec", None)
    if not isinstance(sp, dict):
        return
    console.print(Text.assemble(("speculative ", "bold"), f"{_s(sp.get('method'))} · tree {_s(sp.get('tree'))} · ",
                                ("tokens per target forward ", "bold"), f"{_s(sp.get('tokens_per_target_forward'))}",
                                f" ({_s(sp.get('decode_tokens'))} tokens / {_s(sp.get('target_forwards'))} decode forwards)"))
    kv = sp.get("draft_kv")
    if isinstance(kv, dict):
        console.print(Text(f"  draft KV: {_s(kv.get('kind'))}, {_s(kv.get('cells'))} cells, {_s(kv.get('bytes'))} bytes · "
                           f"{_s(kv.get('mtp_forwards'))} MTP forwards", style=_DIM))
    reqs = sp.get("requests") if isinstance(sp.get("requests"), dict) else {}
    for sid, st in list(reqs.items())[:64]:
        if not isinstance(st, dict):
            continue
        rates = " ".join(f"d{i + 1}:{'-' if x is None else f'{x:.2f}' if isinstance(x, (int, float)) else _s(x)}"
                         for i, x in enumerate((st.get("acceptance_by_pos") or [])[:16]))
        console.print(Text(f"  seq {_s(sid)}: acceptance by draft position {rates or '-'} · "
                           f"{_s(st.get('tokens_per_forward'))} tokens per forward", style=_DIM))
