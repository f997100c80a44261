"""One self-contained HTML page for a saved trace (``infertrace report DIR -o report.html``).

Inline CSS, JS and SVG only: it opens from a file with no network. Top to bottom: run facts,
the worked-example table, the cache over time (llama.cpp cell map and paged block tables, one
recorded and one derived, see :mod:`infertrace.trace.report_views`), then one section per step
(its table rows, hidden, positions, the masks side by side, kv, top-k bars), then outputs.
A pure function of the records, like :func:`infertrace.trace.render.render_run`.
"""

from __future__ import annotations

from html import escape
from typing import Any

from infertrace.trace import report_views as v
from infertrace.trace.records import RunTrace, StepTrace
from infertrace.trace.render import _sampler_text, _step_title, human_bytes, piece_text
from infertrace.trace.report_assets import BODY_JS, CSS, HEAD_JS

M = v.Markup


def _tag(recorded: bool) -> str:
    return '<span class="tag recorded">recorded</span>' if recorded else '<span class="tag derived">derived</span>'


def _facts(pairs: list[tuple[str, str]]) -> str:
    return '<dl class="facts">' + "".join(f"<dt>{escape(k)}</dt><dd>{escape(val)}</dd>" for k, val in pairs) + "</dl>"


def _rows_of(st: StepTrace) -> list[list[Any]]:
    out = []
    for i, r in enumerate(st.batch):
        tokens = " ".join(str(t) for t in r.token_ids) + "\n" + " ".join(piece_text(p) for p in r.pieces)
        vis = "  ".join(f"q{p}:{x}" for p, x in zip(r.positions, r.visible))
        res = piece_text(r.sampled_piece) if r.sampled is not None else "(no logits)"
        if r.finished:
            res += f"\n({r.finished})"
        out.append([st.step if i == 0 else "", r.phase, r.seq_id, tokens, str(r.positions), vis, r.cache_after, res])
    if not st.batch:
        out.append([st.step, "idle", "-", "(nothing scheduled: waiting for an arrival)", "", "", "", ""])
    return out


HEADS = ["step", "phase", "seq", "current tokens", "positions", "visible keys", "cache after", "output"]


# ----------------------------------------------------------------------------- per variable


def _hidden(st: StepTrace) -> str:
    h = st.hidden
    if h is None:
        return ""
    rows = [[r.seq_id, r.pos, r.token_id, piece_text(r.piece), f"{r.mean:+.4f}", f"{r.std:.4f}", f"{r.min:+.3f}",
             f"{r.max:+.3f}", f"{r.l2:.3f}", "[" + ", ".join(f"{x:+.3f}" for x in r.first) + "]"] for r in h.rows[:32]]
    return (f'<div class="var var-hidden"><h3>hidden</h3><p>X = token_embd[current ids] {h.dtype}: llama.cpp inpL ne = '
            f'{h.ggml_ne} · TensorRT-LLM hidden_states {h.packed_shape} · cached tokens recomputed: {h.cached_tokens_recomputed}</p>'
            + v.table(["seq", "pos", "token", "piece", "mean", "std", "min", "max", "l2", "first values"], rows) + "</div>")


def _positions(st: StepTrace) -> str:
    p = st.positions
    if p is None:
        return ""
    ev = p.evidence or {}
    by = {e["pos"]: e for e in ev.get("rows", [])}
    rows = []
    for cs in p.cos_sin:
        e = by.get(cs["pos"], {})
        rows.append([cs["pos"], *[f"{c:+.4f} / {s:+.4f}" for c, s in zip(cs["cos"], cs["sin"])],
                     f"{e['dq_max']:.4f}" if e else "-", f"{e['dk_max']:.4f}" if e else "-",
                     f"{e['q_norm_before']:.4f} → {e['q_norm_after']:.4f}" if e else "-"])
    heads = ["pos", *[f"cos/sin pair {i}" for i in range(len(p.inv_freq_first))], "max|Δq|", "max|Δk|", "‖q‖ before → after"]
    extra = ""
    if "v_cache_minus_v_proj_max" in ev:
        extra = (f'<p class="ok">V in cache − V projection: max |Δ| = {ev["v_cache_minus_v_proj_max"]:g} (V is not rotated); '
                 f'K in cache − rotated K: {ev["k_cache_minus_k_rot_max"]:g} (layer {ev.get("layer")})</p>')
    return (f'<div class="var var-positions"><h3>positions</h3><p>llama.cpp inp_pos I32 {p.inp_pos} · TensorRT-LLM '
            f'position_ids {p.position_ids} · RoPE {p.pairing} (file: {p.pairing_in_file}) · theta {p.theta:g} · '
            f'rotary dims {p.rope_dim}/{p.head_dim}</p>' + v.table(heads, rows) + extra + "</div>")


def _mask(st: StepTrace) -> str:
    if st.mask is None or not st.batch:
        return ""
    m, labels = st.mask, [f"s{s} q{p}" for s, p in v.query_labels(st)]
    figs = []
    # 1. llama.cpp's explicit kq_mask
    rec = v.kq_from_cells(st) if m.kq_mask is not None else None
    if rec is not None:
        rows, cols = rec
        sl, note = m.kq_mask.get("rows", []), ""
        same = all((x == "0") == bool(rows[i][j]) for i, r in enumerate(sl) for j, x in enumerate(r) if i < len(rows) and j < len(rows[i]))
        note = (f'recorded slice {len(sl)}×{len(sl[0]) if sl else 0} <span class="ok">matches</span>' if same
                else '<span class="bad">recorded slice differs from the cell map</span>')
        cap = (f"{_tag(True)}<b>llama.cpp kq_mask</b> (explicit, host-filled): ne = {m.kq_mask['ne']}; rows = queries, "
               f"columns = cells 0..{len(cols) - 1} (cell · pos · seq); 0 = keep, −∞ = drop; rebuilt from the recorded cell map, {note}")
    else:
        rows, cols = v.kq_contiguous(st)
        cap = (f"{_tag(False)}<b>llama.cpp kq_mask</b> this paged run never built: derived for a cache holding each request's "
               "positions in consecutive cells; keep iff the cell holds the query's seq_id and cell.pos ≤ query pos")
    heads = [[str(c["cell"]), str(c["pos"]) if c["pos"] >= 0 else "·", ",".join(map(str, c["seq_ids"])) or "·"] for c in cols]
    figs.append(f"<figure><figcaption>{cap}</figcaption>"
                + v.heatmap(rows, labels, heads, "kq-mask", "kq_mask", "0 (keep)", "-inf (drop)") + "</figure>")
    # 2. what a paged kernel derives from the metadata
    md, recorded = v.paged_metadata(st)
    parts = []
    for r, T, L in zip(st.batch, md["seq_lens"], md["kv_lens"]):
        mat = v.implied_mask(int(T), int(L))
        lg = m.logical[st.batch.index(r)] if st.batch.index(r) < len(m.logical) else None
        ok = '<span class="ok">= logical</span>' if lg == mat else '<span class="bad">≠ logical</span>'
        parts.append(f"<div><span class='dim'>seq {r.seq_id}: seq_len {T}, kv_len {L}</span> {ok}"
                     + v.heatmap(mat, [f"q{p}" for p in r.positions], [[str(j)] for j in range(int(L))], "paged-mask",
                                 f"seq {r.seq_id} causal from lengths") + "</div>")
    src = "recorded metadata" if recorded else "derived metadata (this cells run passes no lengths)"
    cap = (f"{_tag(recorded)}<b>paged: mask implied by metadata</b> ({src}): mask_type {md['mask_type']}, seq_lens "
           f"{md['seq_lens']}, kv_lens {md['kv_lens']}, cu_seqlens {md['cu_seqlens']}; no dense tensor, each request reads "
           "only its own block-table row")
    figs.append(f"<figure><figcaption>{cap}</figcaption><div class='figs'>{''.join(parts)}</div></figure>")
    # 3. the logical keep-matrix the backend materialised
    parts = []
    for r, lg in zip(st.batch, m.logical):
        parts.append(f"<div><span class='dim'>seq {r.seq_id} [T={len(lg)}, kv_len={len(lg[0]) if lg else 0}]</span>"
                     + v.heatmap(lg, [f"q{p}" for p in r.positions], [[str(j)] for j in range(len(lg[0]) if lg else 0)],
                                 "logical-mask", f"seq {r.seq_id} logical keep-matrix") + "</div>")
    figs.append(f"<figure><figcaption>{_tag(True)}<b>logical keep-matrix</b> per request [T, C+T], materialised by the "
                f"{m.backend} backend (both conventions must agree on it)</figcaption><div class='figs'>{''.join(parts)}</div></figure>")
    return (f'<div class="var var-mask"><h3>mask</h3><p>{escape(m.rule)}</p><div class="figs">{"".join(figs)}</div>'
            '<p class="legend dim"><span style="background:var(--keep)"></span>keep (0)<span style="background:var(--drop)"></span>'
            'drop (−∞)</p></div>')


def _kv(st: StepTrace) -> str:
    kv = st.kv
    if kv is None:
        return ""
    ph = kv.physical
    heads = ["seq", "K/V before → after", "written pos"] + (["cells"] if kv.backend == "cells" else ["slot_mapping", "block table"])
    rows = []
    for d in kv.per_request:
        r = [d["seq_id"], f"{d['shape_before']} → {d['shape_after']}", d["written_pos"]]
        r += [d.get("cells", "")] if kv.backend == "cells" else [str(d.get("slot_mapping")), str(d.get("block_table"))]
        rows.append(r)
    if kv.backend == "cells":
        state = f"head {ph.get('head_before', '?')} → {ph.get('head_after', ph.get('head'))} · used {ph.get('used')} / {ph.get('size')} · n_kv {ph.get('n_kv')}"
    else:
        state = (f"blocks used {ph.get('used_blocks')} / free {ph.get('free_blocks')} of {ph.get('num_blocks')} · "
                 f"tokens_per_block {ph.get('tokens_per_block')} · free list head {ph.get('free_list_head')}")
    return (f'<div class="var var-kv"><h3>kv</h3><p>{escape(kv.backend)} · {escape(kv.dtype)} · {kv.layers} layers · '
            f'physical per layer {kv.physical_shape} · {escape(state)}</p>' + v.table(heads, rows) + "</div>")


def _decode(st: StepTrace) -> str:
    d = st.decode
    if d is None:
        return ""
    out = [f'<div class="var var-decode"><h3>decode</h3><p>logits {d.logits_shape} {d.logits_dtype}, rows {d.logits_rows} of N={st.N}</p>']
    for p in d.per_request:
        if "top" not in p:
            out.append(f"<p>seq {p['seq_id']}: {escape(p.get('note', 'no logits'))}</p>")
            continue
        nxt = f"next input [{p['next_input']}] at position {p['next_pos']}" if p.get("next_input") is not None else "no next step"
        out.append(f"<p><b>seq {p['seq_id']}</b> · logits row {p['row']} · {escape(_sampler_text(p['sampler']))}</p>"
                   + v.topk_bars(p["top"], p.get("chosen"))
                   + f"<p>chosen <b>{p['chosen']} {escape(piece_text(p['chosen_piece']))}</b> → {escape(nxt)}"
                   + (f" · stop: {escape(str(p['stop']))}" if p.get("stop") else "") + "</p>")
    out.append("</div>")
    return "".join(out)


def step_section(st: StepTrace) -> str:
    body = (v.table(HEADS, _rows_of(st), "rows") + _hidden(st) + _positions(st) + _mask(st) + _kv(st) + _decode(st))
    return f'<section class="step" id="step-{st.step}" data-step="{st.step}"><h2>{escape(_step_title(st))}</h2>{body}</section>'


# ----------------------------------------------------------------------------- cache over time


def cache_over_time(trace: RunTrace) -> str:
    """Cell map and block tables, one row per step: the run's backend recorded, the other derived."""
    labels = [f"step {s.step}" for s in trace.steps]
    sim_cells = v.simulate_cells(trace)
    rec_cells = [v.recorded_cells(s) for s in trace.steps]
    is_cells = any(x is not None for x in rec_cells)
    maps = [r if r is not None else {} for r in rec_cells] if is_cells else sim_cells
    grid, width = v.cell_grid(maps)
    heads = [s.kv.physical.get("head_after") if is_cells and s.kv is not None else None for s in trace.steps]
    if is_cells:
        agree = all(r is None or r == sim for r, sim in zip(rec_cells, sim_cells))
        cap = (f"{_tag(True)}<b>llama.cpp cell map</b> after each step (cell: pos inside, colour = seq_id, red bar = head). "
               + ("<span class='ok'>find_slot replayed from the records gives the same map</span>" if agree
                  else "<span class='warn'>replaying find_slot gives a different map</span>"))
    else:
        cap = (f"{_tag(False)}<b>llama.cpp cell map</b> this paged run never had: derived by replaying find_slot (free cells "
               f"from head, wrapping) over {trace.options.get('engine', {}).get('ctx_size')} cells from the step records")
    cells_svg = v.occupancy(grid, width, labels, "cellmap", "cell map over time", "cell", heads if is_cells else ())
    sim_tabs, B, nb = v.simulate_paged(trace)
    rec_tabs = [v.recorded_tables(s) for s in trace.steps]
    is_paged = any(x is not None for x in rec_tabs)
    tabs = [r if r is not None else {} for r in rec_tabs] if is_paged else sim_tabs
    bgrid, bwidth = v.block_grid(tabs, B, nb)
    if is_paged:
        agree = all(r is None or r == sim for r, sim in zip(rec_tabs, sim_tabs))
        cap2 = (f"{_tag(True)}<b>paged block tables</b> after each step: physical blocks (colour = request, number = logical "
                f"block index), B = {B}. " + ("<span class='ok'>the allocation replayed from the records agrees</span>" if agree
                                               else "<span class='warn'>the replayed allocation differs</span>"))
    else:
        cap2 = (f"{_tag(False)}<b>paged block tables</b> this cells run never had: derived by replaying a pool of {nb} blocks "
                f"of B = {B} (lowest free block first) from the step records")
    blocks_svg = v.occupancy(bgrid, bwidth, labels, "blocktables", "block tables over time", "block")
    tables_txt = "".join(f"<tr><td>step {s.step}</td><td>{escape(' · '.join(f'seq {k}: {t}' for k, t in tab.items()) or '-')}</td></tr>"
                         for s, tab in zip(trace.steps, tabs))
    return (f'<section id="cache-over-time"><h2>KV cache over time</h2><div class="figs"><figure><figcaption>{cap}</figcaption>'
            f'{cells_svg}</figure><figure><figcaption>{cap2}</figcaption>{blocks_svg}'
            f'<table class="tables"><tbody>{tables_txt}</tbody></table></figure></div></section>')


# ----------------------------------------------------------------------------- page


def build_report(trace: RunTrace, source: str = "") -> str:
    """The whole page as one string (UTF-8 HTML5, no external resources)."""
    mo, c, o = trace.model, trace.config, trace.options
    eng = o.get("engine", {})
    facts = [("model", f"{mo.get('file')} ({human_bytes(int(mo.get('size', 0)))}, {mo.get('source')}, header sha256 {mo.get('metadata_sha256')})"),
             ("config", f"{c.get('arch')} · {c.get('n_layer')} layers · H={c.get('n_embd')} · heads {c.get('n_head')} "
                        f"(kv {c.get('n_head_kv')}) · head_dim {c.get('head_dim')} · vocab {c.get('vocab_size')}"),
             ("rope", f"theta {c.get('rope_theta')} · rotary dims {c.get('rope_dim')} · pairing in file {c.get('rope_pairing_in_file')} → neox"),
             ("engine", f"backend {o.get('backend')} · attention {o.get('attention')} · ctx {eng.get('ctx_size')} · "
                        f"tokens_per_block {eng.get('tokens_per_block')} · max_batch_tokens {eng.get('max_batch_tokens')} · "
                        f"prefill_chunk {eng.get('prefill_chunk')} · dtype {o.get('dtype')} · device {o.get('device')}")]
    facts += [("note", n) for n in trace.notes]
    if source:
        facts.append(("trace", source))
    table_rows = [row for st in trace.steps for row in _rows_of(st)]
    outputs = [[r["seq_id"], piece_text(r.get("prompt", "")), piece_text(r.get("text", "")), r.get("stop_reason"),
                len(r.get("output_ids", []))] for r in trace.requests]
    title = f"infertrace report · {mo.get('file', '?')} · {o.get('backend', '?')}"
    return "".join([
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title><style>{CSS}</style><script>{HEAD_JS}</script></head>",
        '<body data-report="infertrace"><main>',
        f"<h1>{escape(title)}</h1>", _facts(facts),
        '<pre id="console-errors"></pre><nav class="steps"></nav>',
        '<section id="worked-example"><h2>worked example (step by step)</h2>', v.table(HEADS, table_rows, "worked"), "</section>",
        cache_over_time(trace),
        "".join(step_section(st) for st in trace.steps),
        '<section id="outputs"><h2>outputs</h2>', v.table(["seq", "prompt", "generated", "stop", "tokens"], outputs), "</section>",
        '</main><div id="report-status" data-state="loading">loading</div>',
        f"<script>{BODY_JS}</script></body></html>\n",
    ])
