"""One self-contained HTML page for a saved trace (``infertrace report DIR -o report.html``).

Inline CSS, JS and SVG only: it opens from a file with no network. Top to bottom: run facts,
the request lanes of a multi-request run (:mod:`infertrace.present.report_lanes`), the worked-example table, the cache over time (llama.cpp cell map and paged block tables, one
recorded and one derived, see :mod:`infertrace.present.report_views`), then one section per step
(its table rows, hidden, positions, the masks side by side, a speculative step's verify rows -- mask
grid with accepted ✓ / rejected ✗ nodes, its llama.cpp / TensorRT-LLM forms, the rewind --, kv,
top-k bars), then outputs.
A pure function of the records, like :func:`infertrace.present.render.render_run`.
"""

from __future__ import annotations

from infertrace.safe_text import visible

from typing import Any

from markupsafe import Markup

from infertrace.present import report_views as v
from infertrace.trace.records import RunTrace, StepTrace
from infertrace.fmt import human_bytes
from infertrace.present.render import _sampler_text, _step_title, piece_text
from infertrace.present.render_serving import prefix_hits, serving_lines, serving_mark
from infertrace.present.report_assets import BODY_JS, CSS, HEAD_JS
from infertrace.present.report_lanes import CSS as LANES_CSS, lanes_section

# Autoescape discipline: every fragment is a markupsafe.Markup built from a literal template;
# values enter only as ``.format`` arguments (or ``Markup + value``, ``Markup("").join``), which
# escape them for text and attribute context alike. No value from the trace is ever
# concatenated into HTML as a plain str. The page holds no inline JSON: the scripts are
# constants (report_assets) and read the DOM only.
M = Markup
J = Markup("").join
#: rows of the worked-example table and steps drawn before "… N more" (the page stays small for long runs)
MAX_TABLE_ROWS, MAX_STEP_SECTIONS = 2000, 200
#: speculative candidates drawn per verify row (tokens, verify-mask grid)
MAX_SPEC_NODES = 64


def _tag(recorded: bool) -> Markup:
    return M('<span class="tag recorded">recorded</span>') if recorded else M('<span class="tag derived">derived</span>')


def _facts(pairs: list[tuple[str, str]]) -> Markup:
    """The header facts as ``<dl>``; a plain string value (model file, notes: from the trace) has its control
    and bidi characters made visible (:func:`visible`), then is HTML-escaped; Markup passes as is."""
    return M('<dl class="facts">{}</dl>').format(J(M("<dt>{}</dt><dd>{}</dd>").format(
        k, val if isinstance(val, Markup) else visible(val)) for k, val in pairs))


def _spec_of(r: Any) -> dict[str, Any] | None:
    sp = getattr(r, "spec", None)
    return sp if isinstance(sp, dict) and isinstance(sp.get("accepted_nodes"), list) else None


def _rows_of(st: StepTrace) -> list[list[Any]]:
    out = []
    for i, r in enumerate(st.batch):
        sp = _spec_of(r)
        if sp is None:
            tokens = " ".join(str(t) for t in r.token_ids) + "\n" + " ".join(piece_text(p) for p in r.pieces)
        else:  # speculative verify row: node 0 the pending token, ✓ an accepted draft, ✗ a rejected one
            acc = set(sp["accepted_nodes"])
            tokens = " ".join(("" if j == 0 else "✓" if j in acc else "✗") + f"{t} {piece_text(p)}"
                              for j, (t, p) in enumerate(zip(r.token_ids[:MAX_SPEC_NODES], r.pieces)))
        vis = "  ".join(f"q{p}:{x}" for p, x in zip(r.positions, r.visible))
        res = piece_text(r.sampled_piece) if r.sampled is not None else "(no logits)"
        if sp is not None:
            em = sp.get("emitted") if isinstance(sp.get("emitted"), list) else []
            res = " ".join(str(x) for x in em[:MAX_SPEC_NODES]) + f"\n+{len(em)} · acc {sp.get('accepted')}/{sp.get('drafted')}"
        if r.finished:
            res += f"\n({r.finished})"
        pos = serving_mark(str(r.positions), r)  # "hit 0..11←seq 0" under the positions, as the terminal table
        out.append([st.step if i == 0 else "", r.phase, r.seq_id, tokens, pos if isinstance(pos, str) else pos.plain, vis,
                    r.cache_after, res])
    if not st.batch:
        out.append([st.step, "idle", "-", "(nothing scheduled: waiting for an arrival)", "", "", "", ""])
    return out


HEADS = ["step", "phase", "seq", "current tokens", "positions", "visible keys", "cache after", "output"]


def _more(n: int, what: str) -> Markup:
    return M('<p class="dim more">… {} more {} not drawn</p>').format(n, what) if n > 0 else M("")


# ----------------------------------------------------------------------------- per variable


def _hidden(st: StepTrace) -> Markup:
    h = st.hidden
    if h is None:
        return M("")
    rows = [[r.seq_id, r.pos, r.token_id, piece_text(r.piece), f"{r.mean:+.4f}", f"{r.std:.4f}", f"{r.min:+.3f}",
             f"{r.max:+.3f}", f"{r.l2:.3f}", "[" + ", ".join(f"{x:+.3f}" for x in r.first[:64]) + "]"] for r in h.rows[:32]]
    return M('<div class="var var-hidden"><h3>hidden</h3><p>X = token_embd[current ids] {}: llama.cpp inpL ne = '
             '{} · TensorRT-LLM hidden_states {} · cached tokens recomputed: {}</p>{}</div>').format(
        h.dtype, str(h.ggml_ne), str(h.packed_shape), h.cached_tokens_recomputed,
        v.table(["seq", "pos", "token", "piece", "mean", "std", "min", "max", "l2", "first values"], rows))


def _positions(st: StepTrace) -> Markup:
    p = st.positions
    if p is None:
        return M("")
    ev = p.evidence or {}
    by = {e["pos"]: e for e in ev.get("rows", [])}
    rows = []
    npair = min(len(p.inv_freq_first), 64)
    for cs in p.cos_sin[:v.MAX_ROWS]:
        e = by.get(cs["pos"], {})
        rows.append([cs["pos"], *[f"{c:+.4f} / {s:+.4f}" for c, s in list(zip(cs["cos"], cs["sin"]))[:npair]],
                     f"{e['dq_max']:.4f}" if "dq_max" in e else "-", f"{e['dk_max']:.4f}" if "dk_max" in e else "-",
                     f"{e['q_norm_before']:.4f} → {e['q_norm_after']:.4f}" if "q_norm_after" in e and "q_norm_before" in e else "-"])
    heads = ["pos", *[f"cos/sin pair {i}" for i in range(npair)], "max|Δq|", "max|Δk|", "‖q‖ before → after"]
    extra = M("")
    if "v_cache_minus_v_proj_max" in ev and "k_cache_minus_k_rot_max" in ev:
        extra = M('<p class="ok">V in cache − V projection: max |Δ| = {:g} (V is not rotated); '
                  'K in cache − rotated K: {:g} (layer {})</p>').format(
            ev["v_cache_minus_v_proj_max"], ev["k_cache_minus_k_rot_max"], str(ev.get("layer")))
    return M('<div class="var var-positions"><h3>positions</h3><p>llama.cpp inp_pos I32 {} · TensorRT-LLM '
             'position_ids {} · RoPE {} (file: {}) · theta {:g} · rotary dims {}/{}</p>{}{}</div>').format(
        v.int_list_text(p.inp_pos), v.int_list_text(p.position_ids), p.pairing, p.pairing_in_file, p.theta, p.rope_dim,
        p.head_dim, v.table(heads, rows), extra)


def _mask(st: StepTrace) -> Markup:
    if st.mask is None or not st.batch:
        return M("")
    m, labels = st.mask, [f"s{s} q{p}" for s, p in v.query_labels(st)]
    figs = []
    # 1. llama.cpp's explicit kq_mask (non-unified KV: one block per stream, from the recorded rows)
    streams = m.kq_mask.get("streams") if m.kq_mask is not None else None
    if streams:
        from infertrace.present.render_streams import stream_report_figs

        figs += stream_report_figs(st, m.kq_mask, v.heatmap, _tag(True))
    rec = v.kq_from_cells(st) if m.kq_mask is not None and not streams else None
    if rec is not None:
        rows, cols = rec
        sl = m.kq_mask.get("rows", [])
        same = all((x == "0") == bool(rows[i][j]) for i, r in enumerate(sl) for j, x in enumerate(r) if i < len(rows) and j < len(rows[i]))
        note = (M('recorded slice {}×{} <span class="ok">matches</span>').format(len(sl), len(sl[0]) if sl else 0) if same
                else M('<span class="bad">recorded slice differs from the cell map</span>'))
        cap = M("{}<b>llama.cpp kq_mask</b> (explicit, host-filled): ne = {}; rows = queries, "
                "columns = cells 0..{} (cell · pos · seq); 0 = keep, −∞ = drop; rebuilt from the recorded cell map, {}").format(
            _tag(True), str(m.kq_mask["ne"]), len(cols) - 1, note)
    elif not streams:
        rows, cols = v.kq_contiguous(st)
        cap = M("{}<b>llama.cpp kq_mask</b> this paged run never built: derived for a cache holding each request's "
                "positions in consecutive cells; keep iff the cell holds the query's seq_id and cell.pos ≤ query pos").format(_tag(False))
    if not streams:
        heads = [[str(c["cell"]), str(c["pos"]) if c["pos"] >= 0 else "·", ",".join(map(str, c["seq_ids"])) or "·"] for c in cols]
        figs.append(M("<figure><figcaption>{}</figcaption>{}</figure>").format(
            cap, v.heatmap(rows, labels, heads, "kq-mask", "kq_mask", "0 (keep)", "-inf (drop)")))
    # 2. what a paged kernel derives from the metadata
    md, recorded = v.paged_metadata(st)
    parts = []
    for idx, (r, T, L) in enumerate(zip(st.batch, md["seq_lens"], md["kv_lens"])):
        mat = v.implied_mask(int(T), int(L))  # at most MAX_ROWS × MAX_COLS
        lg = m.logical[idx] if idx < len(m.logical) else None
        same = lg is not None and v.logical_is_causal(lg, int(T), int(L))
        ok = M('<span class="ok">= logical</span>') if same else M('<span class="bad">≠ logical</span>')
        parts.append(M("<div><span class='dim'>seq {}: seq_len {}, kv_len {}</span> {}{}</div>").format(
            r.seq_id, T, L, ok, v.heatmap(mat, [f"q{p}" for p in r.positions[:v.MAX_ROWS]],
                                          [[str(j)] for j in range(min(int(L), v.MAX_COLS))], "paged-mask",
                                          f"seq {r.seq_id} causal from lengths")) + v.clipped_note(int(T), int(L)))
    src = "recorded metadata" if recorded else "derived metadata (this cells run passes no lengths)"
    cap = M("{}<b>paged: mask implied by metadata</b> ({}): mask_type {}, seq_lens "
            "{}, kv_lens {}, cu_seqlens {}; no dense tensor, each request reads "
            "only its own block-table row").format(_tag(recorded), src, md["mask_type"], v.int_list_text(md["seq_lens"]),
                                                   v.int_list_text(md["kv_lens"]), v.int_list_text(md["cu_seqlens"]))
    figs.append(M("<figure><figcaption>{}</figcaption><div class='figs'>{}</div></figure>").format(cap, J(parts)))
    # 3. the logical keep-matrix the backend materialised
    parts = []
    for r, lg in zip(st.batch, m.logical):
        n_kv = len(lg[0]) if lg else 0
        parts.append(M("<div><span class='dim'>seq {} [T={}, kv_len={}]</span>{}</div>").format(
            r.seq_id, len(lg), n_kv, v.heatmap(lg, [f"q{p}" for p in r.positions[:v.MAX_ROWS]],
                                             [[str(j)] for j in range(min(n_kv, v.MAX_COLS))], "logical-mask",
                                             f"seq {r.seq_id} logical keep-matrix")) + v.clipped_note(len(lg), n_kv))
    figs.append(M("<figure><figcaption>{}<b>logical keep-matrix</b> per request [T, C+T], materialised by the "
                  "{} backend (both conventions must agree on it)</figcaption><div class='figs'>{}</div></figure>").format(
        _tag(True), m.backend, J(parts)))
    return M('<div class="var var-mask"><h3>mask</h3><p>{}</p><div class="figs">{}</div>'
             '<p class="legend dim"><span style="background:var(--keep)"></span>keep (0)<span style="background:var(--drop)"></span>'
             'drop (−∞)</p></div>').format(m.rule, J(figs))


def _kv(st: StepTrace) -> Markup:
    kv = st.kv
    if kv is None:
        return M("")
    ph = kv.physical
    heads = ["seq", "K/V before → after", "written pos"] + (["cells"] if kv.backend == "cells" else ["slot_mapping", "block table"])
    rows = []
    for d in kv.per_request:
        r = [d["seq_id"], f"{d['shape_before']} → {d['shape_after']}", d["written_pos"]]
        r += [d.get("cells", "")] if kv.backend == "cells" else [v.int_list_text(d.get("slot_mapping") or []),
                                                                 v.int_list_text(d.get("block_table") or [])]
        rows.append(r)
    if kv.backend == "cells" and ph.get("streams") is not None:  # non-unified KV: a head per stream
        state = f"{ph.get('n_stream')} streams × {ph.get('stream_size')} cells · " + " · ".join(
            f"stream {s['stream']} head {s['head']} used {s['used']} n_kv {s['n_kv']}" for s in ph["streams"][:16])
    elif kv.backend == "cells":
        state = f"head {ph.get('head_before', '?')} → {ph.get('head_after', ph.get('head'))} · used {ph.get('used')} / {ph.get('size')} · n_kv {ph.get('n_kv')}"
    else:
        state = (f"blocks used {ph.get('used_blocks')} / free {ph.get('free_blocks')} of {ph.get('num_blocks')} · "
                 f"tokens_per_block {ph.get('tokens_per_block')} · free list head {ph.get('free_list_head')}")
    return M('<div class="var var-kv"><h3>kv</h3><p>{} · {} · {} layers · physical per layer {} · {}</p>{}</div>').format(
        kv.backend, kv.dtype, kv.layers, str(kv.physical_shape), state, v.table(heads, rows))


def _decode(st: StepTrace) -> Markup:
    d = st.decode
    if d is None:
        return M("")
    out = [M('<div class="var var-decode"><h3>decode</h3><p>logits {} {}, rows {} of N={}</p>').format(
        str(d.logits_shape), d.logits_dtype, v.int_list_text(d.logits_rows), st.N)]
    for p in d.per_request:
        if "top" not in p:
            out.append(M("<p>seq {}: {}</p>").format(p["seq_id"], p.get("note", "no logits")))
            continue
        nxt = f"next input [{p['next_input']}] at position {p['next_pos']}" if p.get("next_input") is not None else "no next step"
        out.append(M("<p><b>seq {}</b> · logits row {} · {}</p>{}<p>chosen <b>{} {}</b> → {}{}</p>").format(
            p["seq_id"], str(p.get("row")), _sampler_text(p.get("sampler") or {}), v.topk_bars(p["top"], p.get("chosen")),
            str(p.get("chosen")), piece_text(p.get("chosen_piece")), nxt,
            M(" · stop: {}").format(str(p["stop"])) if p.get("stop") else ""))
    out.append(M("</div>"))
    return J(out)


def _state_kept(gs: Any) -> str:
    """A hybrid verify's GDN state snapshot choice as one plain-text clause ('' when the row has none)."""
    if not isinstance(gs, dict):
        return ""
    ly = next((x for x in gs.get("layers") or [] if isinstance(x, dict)), {})
    b = ly.get("before") if isinstance(ly.get("before"), dict) else {}
    a = ly.get("after") if isinstance(ly.get("after"), dict) else {}
    return (f" · GDN state: kept snapshot of node {gs.get('kept_node')} of {gs.get('snapshots')} "
            f"({gs.get('index_name')} = {gs.get('kept_snapshot')}), dropped {str(gs.get('dropped_nodes'))[:200]}; "
            f"layer {ly.get('layer')} recurrent norm {b.get('rec_norm')} → {a.get('rec_norm')}, "
            f"sum {b.get('rec_sum')} → {a.get('rec_sum')}")


def _spec(st: StepTrace) -> Markup:
    """Speculative verify rows of the step: the verify mask over the candidates (■ sees, · not;
    accepted nodes marked ✓, rejected ✗), each recorded form of it, and the KV rewind."""
    out = []
    for r in st.batch:
        sp = _spec_of(r)
        if sp is None:
            continue
        acc, T = set(sp["accepted_nodes"]), min(r.T, MAX_SPEC_NODES)
        mark = ["root" if j == 0 else "✓" if j in acc else "✗" for j in range(T)]
        vm = sp.get("verify_mask") if isinstance(sp.get("verify_mask"), list) else []
        rows = [[M('<span class="{}">{} {}</span>').format("ok" if i in acc else "bad", i, mark[i])]
                + ["■" if str(vm[i])[j : j + 1] == "1" else "·" for j in range(T)] for i in range(min(T, len(vm)))]
        forms = []
        if "kq_mask_block" in sp:
            forms.append(f"llama.cpp kq_mask rows over cells {v.int_list_text(sp.get('cells'))}: 0 where ■, -inf where ·")
        if "packed_mask" in sp:
            words = [w[0] if isinstance(w, list) and w else w for w in (sp.get("packed_mask") or [])[:MAX_SPEC_NODES]]
            forms.append(f"TensorRT-LLM spec_decoding_position_offsets = {str((sp.get('position_offsets') or [])[:MAX_SPEC_NODES])} · "
                         f"spec_decoding_packed_mask (int32, bit j = sees node j) = {str(words)}")
        rw = sp.get("rewind") if isinstance(sp.get("rewind"), dict) else {}
        rewind = (f"rewind: {rw.get('op')} {rw.get('range') or ''} · kept pos {rw.get('kept_pos')} · removed pos {rw.get('removed_pos')}"
                  + (f" · cells freed {rw.get('freed')}" if "freed" in rw else "")
                  + (f" · K/V moved slot→slot {str(rw.get('moved_slots'))[:400]}" if rw.get("moved_slots") else "")
                  + (f" · blocks released {str(rw.get('freed_blocks'))[:400]}" if "freed_blocks" in rw else "")
                  + _state_kept(rw.get("state"))) if rw else ""
        out.append(M('<div class="spec-row" data-seq="{}"><p><b>seq {}</b>: {} candidates at positions {} · tree parents {} · '
                     'accepted {} of {} drafts · emitted {}</p>{}{}<p class="dim">{}</p></div>').format(
            r.seq_id, r.seq_id, r.T, v.int_list_text(r.positions), v.int_list_text(sp.get("parents")), sp.get("accepted"),
            sp.get("drafted"), v.int_list_text(sp.get("emitted")), v.table(["node"] + [str(j) for j in range(T)], rows, "verify-mask"),
            J(M("<p>{}</p>").format(f) for f in forms), rewind))
    if not out:
        return M("")
    step_line = M("")
    if isinstance(st.spec, dict):
        step_line = M("<p>step: drafted {} · accepted {} · acceptance rate {}</p>").format(
            st.spec.get("drafted"), st.spec.get("accepted"), st.spec.get("acceptance_rate"))
    return M('<div class="var var-spec"><h3>speculative verify</h3>{}{}</div>').format(J(out), step_line)


def _hybrid(st: StepTrace) -> Markup:
    """Hybrid models: the layer map, M-RoPE positions and the fixed-size GDN state per request
    (norm / checksum), beside the growing KV (capture/hybrid_rec.py; every value escaped)."""
    h = st.hybrid
    if not h:
        return M("")
    from infertrace.ranges import ranges_text

    lm = h.get("layer_map") or {}
    lin, full = lm.get("linear_attention") or [], lm.get("full_attention") or []
    out = [M('<div class="var var-hybrid"><h3>hybrid state</h3><p>{} GDN layers {} + {} full-attention layers {} · {}</p>').format(
        len(lin), ranges_text(lin), len(full), ranges_text(full), h.get("prefix_reuse", ""))]
    p = h.get("positions")
    if p:
        out.append(M("<p>position_ids {} {} (equal on the t/h/w axes for text) · llama.cpp inp_pos [{}] · consumed by "
                     "full-attention layers only · RoPE dims 0..{} of {}</p>").format(
            str(p.get("position_ids_shape")), p.get("dtype"), p.get("inp_pos_len"), int(p.get("rope_dim", 0)) - 1, p.get("head_dim")))
    s = h.get("state")
    if s:
        out.append(M("<p>{} state per GDN layer: conv {} + recurrent {} {} × {} layers = {} bytes per request, constant · "
                     "slots {} · state_indices {} · rs_z {}</p>").format(
            s.get("convention"), str(s.get("conv_shape")), str(s.get("rec_shape")), s.get("dtype"), s.get("n_layers"),
            s.get("bytes_per_seq"), s.get("n_slots"), v.int_list_text(s.get("state_indices") or []), s.get("rs_z")))
        rows = [[r.get("seq_id"), r.get("slot"), lr.get("layer"), f"{lr.get('conv_norm', 0):.4f}", f"{lr.get('conv_sum', 0):+.4f}",
                 f"{lr.get('rec_norm', 0):.4f}", f"{lr.get('rec_sum', 0):+.4f}"]
                for r in (s.get("per_seq") or [])[:16] for lr in r.get("layers", [])]
        out.append(v.table(["seq", "slot", "layer", "‖conv‖", "Σconv", "‖S‖", "ΣS"], rows, "state"))
    out.append(M("</div>"))
    return J(out)


def _serving(st: StepTrace) -> Markup:
    """The step's prefix lookups (hit, source, shared blocks or cells, copied slots), context shifts, evictions."""
    lines = serving_lines(st)
    if not lines:
        return M("")
    return M('<div class="var serving"><h3>serving: prefix cache, shifts, evictions</h3>{}</div>').format(
        J(M('<p class="prefix">{}</p>').format(part) for x in lines for part in x.split("\n")))


def step_section(st: StepTrace) -> Markup:
    body = J([v.table(HEADS, _rows_of(st), "rows"), _serving(st), _hidden(st), _positions(st), _mask(st), _spec(st), _kv(st),
              _hybrid(st), _decode(st)])
    return M('<section class="step" id="step-{}" data-step="{}"><h2>{}</h2>{}</section>').format(
        st.step, st.step, _step_title(st), body)


# ----------------------------------------------------------------------------- cache over time


def cache_over_time(trace: RunTrace) -> Markup:
    """Cell map and block tables, one row per step: the run's backend recorded, the other derived."""
    steps = trace.steps[:MAX_STEP_SECTIONS]
    labels = [f"step {s.step}" for s in steps]
    sim_cells = v.simulate_cells(trace, len(steps))
    rec_cells = [v.recorded_cells(s) for s in steps]
    is_cells = any(x is not None for x in rec_cells)
    maps = [r if r is not None else {} for r in rec_cells] if is_cells else sim_cells
    grid, width = v.cell_grid(maps)
    heads = [s.kv.physical.get("head_after") if is_cells and s.kv is not None else None for s in steps]
    if is_cells:
        agree = all(r is None or r == sim for r, sim in zip(rec_cells, sim_cells))
        cap = M("{}<b>llama.cpp cell map</b> after each step (cell: pos inside, colour = seq_id, red bar = head). {}").format(
            _tag(True), M("<span class='ok'>find_slot replayed from the records gives the same map</span>") if agree
            else M("<span class='warn'>replaying find_slot gives a different map</span>"))
    else:
        cap = M("{}<b>llama.cpp cell map</b> this paged run never had: derived by replaying find_slot (free cells "
                "from head, wrapping) over {} cells from the step records").format(
            _tag(False), str(trace.options.get("settings", {}).get("ctx_size")))
    cells_svg = v.occupancy(grid, width, labels, "cellmap", "cell map over time", "cell", heads if is_cells else ())
    sim_tabs, B, nb = v.simulate_paged(trace, len(steps))
    rec_tabs = [v.recorded_tables(s) for s in steps]
    is_paged = any(x is not None for x in rec_tabs)
    tabs = [r if r is not None else {} for r in rec_tabs] if is_paged else sim_tabs
    bgrid, bwidth = v.block_grid(tabs, B, nb)
    if is_paged:
        agree = all(r is None or r == sim for r, sim in zip(rec_tabs, sim_tabs))
        cap2 = M("{}<b>paged block tables</b> after each step: physical blocks (colour = request, number = logical "
                 "block index), B = {}. {}").format(
            _tag(True), B, M("<span class='ok'>the allocation replayed from the records agrees</span>") if agree
            else M("<span class='warn'>the replayed allocation differs</span>"))
    else:
        cap2 = M("{}<b>paged block tables</b> this cells run never had: derived by replaying a pool of {} blocks "
                 "of B = {} (lowest free block first) from the step records").format(_tag(False), nb, B)
    blocks_svg = v.occupancy(bgrid, bwidth, labels, "blocktables", "block tables over time", "block")
    tables_txt = J(M("<tr><td>step {}</td><td>{}</td></tr>").format(
        s.step, " · ".join(f"seq {k}: {v.int_list_text(t)}" for k, t in tab.items()) or "-") for s, tab in zip(steps, tabs))
    return M('<section id="cache-over-time"><h2>KV cache over time</h2><div class="figs"><figure><figcaption>{}</figcaption>'
             '{}</figure><figure><figcaption>{}</figcaption>{}<table class="tables"><tbody>{}</tbody></table></figure></div>{}'
             '</section>').format(cap, cells_svg, cap2, blocks_svg, tables_txt, _more(len(trace.steps) - len(steps), "steps"))


# ----------------------------------------------------------------------------- page


def build_report(trace: RunTrace, source: str = "") -> str:
    """The whole page as one string (UTF-8 HTML5, no external resources).

    Every value from the trace is HTML-escaped (markupsafe); long runs are drawn up to
    :data:`MAX_STEP_SECTIONS` steps and :data:`MAX_TABLE_ROWS` table rows, with "… N more".
    """
    mo, c, o = trace.model, trace.config, trace.options
    eng = o.get("settings", {})
    facts = [("model", f"{mo.get('file')} ({human_bytes(int(mo.get('size', 0)))}, {mo.get('source')}, header sha256 {mo.get('metadata_sha256')})"),
             ("config", f"{c.get('arch')} · {c.get('n_layer')} layers · H={c.get('n_embd')} · heads {c.get('n_head')} "
                        f"(kv {c.get('n_head_kv')}) · head_dim {c.get('head_dim')} · vocab {c.get('vocab_size')}"),
             ("rope", f"theta {c.get('rope_theta')} · rotary dims {c.get('rope_dim')} · pairing in file {c.get('rope_pairing_in_file')} → neox"),
             ("runtime", f"{trace.runtime} · backend {o.get('backend')} · attention {o.get('attention')} · ctx {eng.get('ctx_size')} · "
                        f"tokens_per_block {eng.get('tokens_per_block')} · max_batch_tokens {eng.get('max_batch_tokens')} · "
                        f"prefill_chunk {eng.get('prefill_chunk') or 'off'} · dtype {o.get('dtype')} · device {o.get('device')}")]
    if isinstance(trace.spec, dict):
        sp = trace.spec
        facts.append(("speculative", f"{sp.get('method')} · tree {v.int_list_text(sp.get('tree'))} · tokens per target forward "
                                      f"{sp.get('tokens_per_target_forward')} ({sp.get('decode_tokens')} tokens / "
                                      f"{sp.get('target_forwards')} decode forwards)"))
    hits = prefix_hits(trace)
    if eng.get("prefix_cache") or hits:
        facts.append(("prefix cache", "on · " + ("; ".join(hits[:16]) + (f"; … {len(hits) - 16} more" if len(hits) > 16 else "")
                                                 if hits else "no hit in this run")))
    facts += [("note", n) for n in trace.notes]
    if source:
        facts.append(("trace", source))
    table_rows = [row for st in trace.steps for row in _rows_of(st)]
    outputs = [[r["seq_id"], piece_text(r.get("prompt", "")), piece_text(r.get("text", "")), r.get("stop_reason"),
                len(r.get("output_ids", []))] for r in trace.requests]
    # control and bidi characters made visible (a model file name is untrusted: an RLO would reorder the title)
    title = visible(f"infertrace report · {mo.get('file', '?')} · {o.get('backend', '?')}")
    shown = trace.steps[:MAX_STEP_SECTIONS]
    return str(J([
        M('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'),
        M('<meta name="viewport" content="width=device-width, initial-scale=1">'),
        M("<title>{}</title><style>{}</style><script>{}</script></head>").format(title, M(CSS + LANES_CSS), M(HEAD_JS)),
        M('<body data-report="infertrace"><main>'),
        M("<h1>{}</h1>").format(title), _facts(facts),
        M('<pre id="console-errors"></pre><nav class="steps"></nav>'),
        lanes_section(trace),  # several requests: one row per request, one column per step (report_lanes.py)
        M('<section id="worked-example"><h2>worked example (step by step)</h2>'), v.table(HEADS, table_rows[:MAX_TABLE_ROWS], "worked"),
        _more(len(table_rows) - MAX_TABLE_ROWS, "rows"), M("</section>"),
        cache_over_time(trace),
        J(step_section(st) for st in shown), _more(len(trace.steps) - len(shown), "steps (show DIR --step N prints them)"),
        M('<section id="outputs"><h2>outputs</h2>'), v.table(["seq", "prompt", "generated", "stop", "tokens"], outputs), M("</section>"),
        M('</main><div id="report-status" data-state="loading">loading</div>'),
        M("<script>{}</script></body></html>\n").format(M(BODY_JS)),
    ]))
