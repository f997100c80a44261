"""Rich rendering of a :class:`~infertrace.trace.records.RunTrace`.

A pure function of the records: a trace loaded from JSON renders exactly like the live one.
Layout, top to bottom:

1. header: model file, config summary, backend / attention, load notes (RoPE pairing, theta);
2. the worked-example table of ``seed/inference-variables.zh.md`` ("一个具体的逻辑示例"):
   step | phase | seq | current tokens | positions | visible keys | cache after | output;
3. per step, one panel per variable in ``show`` (hidden, positions, mask, kv, decode);
4. the generated text and stop reason of every request.

Everything that comes from the model (token pieces, prompts, generated text) is put into
``rich.text.Text`` objects, never into markup, so ``[``, newlines and control bytes print
literally (newline as ``⏎``, tab as ``⇥``).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from rich import box
from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from infertrace.fmt import human_bytes  # noqa: F401 - also imported from here by older code
from infertrace.ranges import ranges_text
from infertrace.trace.records import VARIABLES, DecodeRec, HiddenRec, KVRec, MaskRec, PositionsRec, RunTrace, StepTrace
from infertrace.safe_text import visible
from infertrace.present.text import piece_text  # noqa: F401 - used here and re-exported
from infertrace.present.render_lanes import render_composition
from infertrace.present.render_serving import render_audit_summary, serving_mark, serving_view
from infertrace.present.render_streams import stream_mask_grids, streams_line, streams_state
from infertrace.present.render_spec import (render_spec_summary, spec_kv_view, spec_mask_view, spec_mtp_view, spec_output_text,
                                            spec_tokens_text, with_extra)

KEEP_STYLE, DROP_STYLE, DIM = "bold green", "red", "dim"
#: what an idle step (nothing scheduled, N = 0) shows
IDLE_TEXT = "nothing scheduled (waiting for arrivals)"


# ----------------------------------------------------------------------------- small formatters


def short(items: Sequence[str], head: int = 3, tail: int = 1, sep: str = " ") -> str:
    """Join ``items``, eliding the middle when there are more than ``head + tail + 1``."""
    items = list(items)
    if len(items) <= head + tail + 1:
        return sep.join(items)
    return sep.join(items[:head] + ["…"] + items[-tail:])


def fit(items: Sequence[str], width: int, sep: str = " ") -> str:
    """Longest of ``short(items, head, 1)`` (head = all, 3, 2, 1, 0) that fits ``width`` characters."""
    for head in (len(items), 3, 2, 1, 0):
        text = short(items, head=head, tail=1, sep=sep) if head < len(items) else sep.join(items)
        if len(text) <= width:
            return text
    return text


def int_list(xs: Sequence[int], head: int = 6, tail: int = 2) -> str:
    """``[0, 1, 2, 3, 4]``, or ``[0, 1, …, 9] (10)`` when long."""
    xs = list(xs)
    if len(xs) <= head + tail + 1:
        return "[" + ", ".join(str(x) for x in xs) + "]"
    return "[" + ", ".join([str(x) for x in xs[:head]] + ["…"] + [str(x) for x in xs[-tail:]]) + f"] ({len(xs)})"


def floats(xs: Iterable[float], nd: int = 4) -> str:
    return "[" + ", ".join(f"{x:+.{nd}f}" for x in xs) + "]"


def _kv(label: str, value: str | Text, style: str = "bold") -> Table:
    """One ``label value`` line; a wrapped value stays indented under itself."""
    return _facts([(label, value)], label_style=style)


def _facts(rows: Sequence[tuple[str, str | Text]], label_style: str = "bold") -> Table:
    """Two-column grid ``label | value``; wrapped values stay indented under their column."""
    g = Table.grid(padding=(0, 1))
    g.add_column(style=label_style, no_wrap=True)
    g.add_column(overflow="fold")
    for k, v in rows:
        g.add_row(k, v if isinstance(v, Text) else Text(str(v)))
    return g


def _table(*cols: str, title: str | None = None, **kw: Any) -> Table:
    t = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left", title_style="italic", pad_edge=False,
              show_edge=False, padding=(0, 1), **kw)
    for c in cols:
        t.add_column(c)
    return t


# ----------------------------------------------------------------------------- header and summary


def render_header(console: Console, trace: RunTrace) -> None:
    """Model file, config summary, backend, attention implementation and load notes."""
    m, c, o = trace.model, trace.config, trace.options
    eng = o.get("settings", {})
    lines = [
        ("model", Text.assemble(Text(str(m.get("file", "?")), style="cyan"),
                                     f"  ({human_bytes(int(m.get('size', 0)))}, {m.get('source', '?')}"
                                     f", header sha256 {m.get('metadata_sha256', '?')})",
                                     Text(f"  {m['name']!r}" if m.get("name") else "", style="dim"))),  # no name: nothing
        ("config", f"{c['arch']} · {c['n_layer']} layers · H={c['n_embd']} · heads {c['n_head']} "
                       f"(kv {c['n_head_kv']}, GQA ×{c['n_head'] // max(1, c['n_head_kv'])}) · head_dim {c['head_dim']} · "
                       f"ffn {c['n_ff']} · vocab {c['vocab_size']} · n_ctx_train {c['n_ctx_train']}"),
        ("rope", f"theta {c['rope_theta']:g}{' (default)' if c.get('rope_theta_is_default') else ''} · "
                       f"rotary dims {c['rope_dim']}/{c['head_dim']} · scaling {c['rope_scaling']['type']}"
                       f"{' ×%g' % c['rope_scaling']['factor'] if c['rope_scaling']['type'] != 'none' else ''} · "
                       f"pairing in file: {c['rope_pairing_in_file']} → at run time: neox (half-split)"),
    ]
    lines += family_lines(c)
    be = o.get("backend", "?")
    conv = ("llama.cpp-style cells + kq_mask" if be == "cells" else "HF-style padded [B, T] batch + 2-D attention_mask"
            if be == "dense" else "TensorRT-LLM/vLLM-style paged pool + metadata")
    detail = f"ctx {eng.get('ctx_size')}"
    if be == "paged":
        nb = eng.get('num_blocks') or -(-int(eng.get('ctx_size') or 0) // int(eng.get('tokens_per_block') or 1))
        usable = (f"block 0 vLLM's null block: {nb - 1} usable" if isinstance(o.get("vllm"), dict)  # vLLM's own header
                  and isinstance(nb, int) else "every block usable")
        detail += f" · tokens_per_block {eng.get('tokens_per_block')} · num_blocks {nb} ({usable})"
    if eng.get("prefill_chunk"):
        detail += f" · prefill_chunk {eng['prefill_chunk']}"
    if eng.get("kv_dtype"):  # --kv-dtype (absent: the cache is in the model dtype)
        detail += f" · K/V cache {eng['kv_dtype']}"
    extra = " · ".join(f"{k} {o[k]}" for k in ("dtype", "device") if k in o)
    wq = o.get("weights")
    if isinstance(wq, dict) and wq.get("weights") == "quant":  # --weights quant: the kernel of each GGUF type
        ks = wq.get("kernels") if isinstance(wq.get("kernels"), dict) else {}
        extra += " · weights quant (" + ", ".join(f"{t} {k}" for t, k in list(ks.items())[:16]) + ")"
    elif isinstance(wq, dict) and wq.get("weights") == "float":  # --weights float given: every tensor dequantised at load
        extra += " · weights float (every tensor dequantised at load, one float matmul per matrix)"
    lc, vl = o.get("llama_cpp"), o.get("vllm")  # the runtime's own section of the header, when one computed
    if isinstance(lc, dict):
        conv = (f"computed by llama.cpp itself (llama-cpp-python {lc.get('version', '?')}, n_ctx {lc.get('n_ctx', '?')}"
                f"{', teacher-forced' if lc.get('teacher_forced') else ''}, flash attention "
                f"{lc.get('flash_attn') or 'not recorded'}, K/V cache {lc.get('type_k', '?')}/{lc.get('type_v', '?')}, "
                f"n_ubatch {lc.get('n_ubatch', '?')}, threads {lc.get('n_threads', '?')}): every variable read from its graph")
    elif isinstance(vl, dict):
        conv = (f"computed and scheduled by vLLM itself ({vl.get('version', '?')}, {str(vl.get('backend', '?')).rsplit('.', 1)[-1]} "
                f"ISA {vl.get('isa', '?')}, block {vl.get('block_size', '?')}, {vl.get('num_blocks', '?')} blocks, null block 0, "
                f"dtype {vl.get('dtype', '?')}, TP {vl.get('tensor_parallel_size', 1)}): scheduler output, block tables, "
                "slot mapping, K/V and logits read from its objects")
    elif isinstance(o.get("hf"), dict):  # HF transformers' own section of the header
        hf = o["hf"]
        conv = (f"computed by HF transformers itself ({hf.get('version', '?')}, {hf.get('model_class', '?')}, "
                f"{hf.get('padding', '?')} padding, pad id {hf.get('pad_token_id', '?')}, batch {hf.get('batch_size', '?')} x "
                f"{hf.get('padded_len', '?')}): input_ids, attention_mask, position_ids, masks and DynamicCache read from its objects")
    lines.append(("runtime", f"{trace.runtime} · backend {be} ({conv}) · attention {o.get('attention', '?')} · {detail}"
                                f" · max_batch_tokens {eng.get('max_batch_tokens')}{' · ' + extra if extra else ''}"
                                f" · evidence layer {o.get('layer', 0)}"))
    if trace.threads.get("n"):
        n = trace.threads["n"]
        other = isinstance(lc, dict) or isinstance(vl, dict) or isinstance(o.get("hf"), dict)  # another runtime computed
        lines.append(("cpu", ("infertrace's torch: " if other else "") + f"{n} thread{'s' if n != 1 else ''} "
                             f"({trace.threads.get('reason', '')})" + ("; the computing runtime's own are on its line" if other else "")))
    for n in trace.notes:
        lines.append(("note", Text(n, style="yellow")))
    console.print(Panel(_facts(lines), title=Text("infertrace run", style="bold"), title_align="left", box=box.ROUNDED))


def family_lines(c: dict[str, Any]) -> list[tuple[str, str | Text]]:
    """Header lines for the family features a config switches on (biases, QK-norm, windows ...)."""
    feats = []
    if c.get("attn_bias"):
        feats.append("q/k/v biases" + (" + o bias" if c.get("attn_out_bias") else ""))
    if c.get("mlp_bias"):
        feats.append("MLP biases")
    if c.get("qk_norm"):
        feats.append("QK-norm")
    if c.get("post_norms"):
        feats.append("pre/post attn+FFN norms")
    if c.get("embed_scale"):
        feats.append(f"embeddings ×{c['embed_scale']:.4g} (√H)")
    if c.get("act", "silu") != "silu":
        feats.append("GeGLU (gelu tanh)")
    if c.get("attn_scale") is not None:
        feats.append(f"softmax scale {c['attn_scale']:.4g}")
    if c.get("final_logit_softcap"):
        feats.append(f"logit soft-cap {c['final_logit_softcap']:g}")
    out: list[tuple[str, str | Text]] = []
    if feats or c.get("family", "llama") != "llama":
        out.append(("family", f"{c.get('family', 'llama')}: " + (" · ".join(feats) if feats else "Llama layer")))
    lt = c.get("layer_types") if isinstance(c.get("layer_types"), list) else []
    lin = [i for i, t in enumerate(lt) if t == "linear_attention"]
    if lin:  # hybrid (Qwen3.5): GDN layers beside gated full attention (render_hybrid.py shows the state)
        full = [i for i in range(len(lt)) if i not in lin]
        out.append(("hybrid", Text(f"{len(lin)} Gated DeltaNet layers {ranges_text(lin)} (conv {c.get('ssm_conv_kernel')}, "
                                   f"state [{c.get('ssm_n_v_heads')}, {c.get('ssm_k_head_dim')}, {c.get('ssm_v_head_dim')}]) + "
                                   f"{len(full)} gated full-attention layers {ranges_text(full) or '-'}", style="magenta")))
    swa = [i for i, x in enumerate(c.get("swa_layers") or []) if x]
    if swa and c.get("sliding_window"):
        glob = [i for i in range(c["n_layer"]) if i not in swa]
        base = f" · RoPE base {c['rope_theta_swa']:g} on windowed layers" if c.get("rope_theta_swa") else ""
        out.append(("window", Text(f"sliding window W={c['sliding_window']} on layers {ranges_text(swa)}; global layers "
                                   f"{ranges_text(glob) if glob else '-'} · query at p sees keys p-W+1..p (as HF and llama.cpp)"
                                   f"{base}", style="magenta")))
    return out


def visible_text(r: Any, width: int = 26) -> str:
    """``q0:0 q1:0..1 … q4:0..4``: per query (labelled by its position) the visible key positions;
    with windowed layers ``q600:89..600|0..600`` (windowed | global)."""
    if getattr(r, "visible_swa", None):
        return fit([f"q{p}:{w}|{v}" if w != v else f"q{p}:{v}" for p, v, w in zip(r.positions, r.visible, r.visible_swa)], width)
    return fit([f"q{p}:{v}" for p, v in zip(r.positions, r.visible)], width)


def tokens_text(r: Any, width: int = 34) -> Text:
    """Current token ids (first line) and their quoted pieces (second line), shortened to ``width``."""
    if len(r.token_ids) == 1:
        return Text.assemble((str(r.token_ids[0]), "cyan"), " ", piece_text(r.pieces[0]))
    return Text.assemble((fit([str(t) for t in r.token_ids], width), "cyan"), "\n",
                         fit([piece_text(p) for p in r.pieces], width))


def positions_text(ps: Sequence[int], width: int = 16) -> str:
    """``[0, 1, 2, 3, 4]``, or ``[0..20] (21)`` when the list is wider than ``width``."""
    text = "[" + ", ".join(str(p) for p in ps) + "]"
    return text if len(text) <= width or len(ps) < 2 else f"[{ps[0]}..{ps[-1]}] ({len(ps)})"


def worked_example_table(trace: RunTrace, width: int = 120) -> Table:
    """The study's worked-example table, one row per request per step, fitted to ``width`` columns:
    the fixed columns take what they need, current tokens and visible keys share the rest."""
    heads = ("step", "phase", "seq", "current tokens", "positions", "visible keys", "cache after", "output")
    rows = []
    for st in trace.steps:
        if not st.batch:  # idle step: nothing scheduled
            rows.append((st, 0, None, [str(st.step), Text("idle", style=DIM), "-", None, "-", None, "-", Text("-", style=DIM)]))
        for i, r in enumerate(st.batch):
            out = Text(piece_text(r.sampled_piece), style="bold") if r.sampled is not None else Text("(no logits)", style=DIM)
            if r.finished:
                out.append(f"\n({r.finished})", style="yellow")
            pos_cell = serving_mark(positions_text(r.positions), r)  # prefix hit / context shift marks (render_serving.py)
            rows.append((st, i, r, [str(st.step) if i == 0 else "", Text(r.phase, style="magenta" if r.phase == "prefill" else "blue"),
                                    str(r.seq_id), None, pos_cell, None, r.cache_after, out]))
    fixed = 0
    for c in (0, 1, 2, 4, 6, 7):
        cells = [Text(row[3][c]) if isinstance(row[3][c], str) else row[3][c] for row in rows]
        fixed += max([len(heads[c])] + [max(len(x) for x in t.plain.split("\n")) for t in cells])
    rest = max(24, width - fixed - 3 * len(heads) + 1)  # one space of padding each side plus the column divider
    tok_w = rest * 3 // 5
    vis_w = rest - tok_w
    windowed = any(getattr(r, "visible_swa", None) for st in trace.steps for r in st.batch)
    if windowed:
        heads = heads[:5] + ("visible keys (windowed|global)",) + heads[6:]
    t = Table(title="worked example (step by step, as in the study's 一个具体的逻辑示例)", title_justify="left",
              title_style="bold", box=box.MINIMAL_HEAVY_HEAD, border_style="bright_black", padding=(0, 1), show_edge=False)
    for h in heads:
        t.add_column(h, justify="right" if h in ("step", "seq") else "left", overflow="fold")
    sections = any(len(st.batch) > 1 for st in trace.steps)  # separate steps only when they hold several rows
    for st, i, r, cells in rows:
        if r is None:
            cells[3], cells[5] = Text("nothing scheduled", style=DIM), Text("waiting for arrivals", style=DIM)
        else:
            cells[3], cells[5] = spec_tokens_text(r, [piece_text(p) for p in r.pieces]) or tokens_text(r, tok_w), visible_text(r, vis_w)
            cells[7] = spec_output_text(r, piece_text) or cells[7]  # a verify row: every emitted token
        t.add_row(*cells, end_section=sections and i == max(0, len(st.batch) - 1))
    return t


def render_outputs(console: Console, trace: RunTrace) -> None:
    """One line per request: prompt → generated text, stop reason, token count."""
    for r in trace.requests:
        line = Text.assemble(("output ", "bold"), f"seq {r['seq_id']}: ", (piece_text(r.get("prompt", "")), DIM), " → ",
                             (piece_text(r.get("text", "")), "bold green"),
                             f"  (stop: {r.get('stop_reason')}, {len(r.get('output_ids', []))} tokens"
                             f"{', preempted %d×' % r['num_preemptions'] if r.get('num_preemptions') else ''})")
        console.print(line)


# ----------------------------------------------------------------------------- per-variable panels


def hidden_view(st: StepTrace, h: HiddenRec) -> RenderableType:
    """Initial hidden states: shapes in both conventions and per-row statistics."""
    N, H = h.packed_shape
    per = " + ".join(f"seq {r.seq_id} [T={r.T}, H={H}]" for r in st.batch)
    head = _facts([
        ("logical", f"X = token_embd[current ids]: {per} {h.dtype}  (only the N={N} tokens computed this step)"),
        ("llama.cpp", f"inpL ne = {h.ggml_ne}  (ggml: ne0 = H fastest)"),
        ("TensorRT-LLM", f"hidden_states packed {h.packed_shape} (N×H, requests back to back)"),
    ])
    t = _table("seq", "pos", "token", "piece", "mean", "std", "min", "max", "l2", "first values")
    for c in ("pos", "token", "mean", "std", "min", "max", "l2"):
        t.columns[[x.header for x in t.columns].index(c)].justify = "right"
    for r in h.rows[:12]:
        t.add_row(str(r.seq_id), str(r.pos), str(r.token_id), Text(piece_text(r.piece)), f"{r.mean:+.4f}", f"{r.std:.4f}",
                  f"{r.min:+.3f}", f"{r.max:+.3f}", f"{r.l2:.3f}", floats(r.first, 3))
    if len(h.rows) > 12:
        t.add_row("…", f"{len(h.rows) - 12} more", "", "", "", "", "", "", "", "")
    cached = sum(r.C for r in st.batch)
    tail = Text(f"cached tokens recomputed: {h.cached_tokens_recomputed}", style="green")
    if cached:
        tail.append(f"  ({cached} cached token(s) enter only through the KV cache)", style=DIM)
    return Group(head, t, tail)


def positions_view(st: StepTrace, p: PositionsRec) -> RenderableType:
    """Position ids in both conventions, the RoPE setup, cos/sin, and the rotation evidence."""
    half = p.rope_dim // 2
    pair_desc = {"neox": f"half-split: dim i pairs with i+{half}", "norm": "adjacent: dims 2i, 2i+1"}
    sc = p.scaling
    scaling = sc.get("type", "none") + (f" ×{sc['factor']:g}" if sc.get("type") != "none" else "")
    if sc.get("freq_factors"):
        scaling += f" + per-pair divisors from {sc['freq_factors']}"
    per = " · ".join(f"seq {r.seq_id}: {int_list(r.positions, 3, 1)}" for r in st.batch)
    head = _facts([
        ("llama.cpp", f"inp_pos I32 [{len(p.inp_pos)}] = {int_list(p.inp_pos)}"),
        ("TensorRT-LLM", f"position_ids [{len(p.position_ids)}] = {int_list(p.position_ids)}   ({per}: C .. C+T-1)"),
        ("RoPE", f"pairing at run time {p.pairing} ({pair_desc.get(p.pairing, '?')}); in the file {p.pairing_in_file}"
                    f" ({pair_desc.get(p.pairing_in_file, '?')}) · theta {p.theta:g}{' (default)' if p.theta_is_default else ''}"
                    f" · rotary dims {p.rope_dim} / head_dim {p.head_dim} · scaling {scaling}"),
        ("inv_freq", f"theta^(-2i/{p.rope_dim}) for pairs i = 0..{len(p.inv_freq_first) - 1}: "
                        + ", ".join(f"{x:.6g}" for x in p.inv_freq_first) + " …  (angle = pos × inv_freq)"),
    ])
    ev = p.evidence or {}
    rows = {e["pos"]: e for e in ev.get("rows", [])}
    npair = len(p.inv_freq_first)
    t = _table("pos", *[f"cos/sin pair {i}" for i in range(npair)], "max|Δq|", "max|Δk|", "‖q‖ before → after",
               title=f"per token: cos/sin of the first pairs; layer {ev.get('layer', '?')}, Δ = rotated − unrotated")
    for cs in p.cos_sin:
        e = rows.get(cs["pos"], {})
        norm = f"{e['q_norm_before']:.4f} → {e['q_norm_after']:.4f}" if e else "-"
        t.add_row(str(cs["pos"]), *[f"{c:+.4f} / {s:+.4f}" for c, s in zip(cs["cos"], cs["sin"])],
                  f"{e['dq_max']:.4f}" if e else "-", f"{e['dk_max']:.4f}" if e else "-", norm)
    if len(p.inp_pos) > len(p.cos_sin):
        t.add_row("…", *[""] * (npair + 3))
    parts: list[RenderableType] = [head, t]
    if "v_cache_minus_v_proj_max" in ev:
        dv, dk = ev["v_cache_minus_v_proj_max"], ev["k_cache_minus_k_rot_max"]
        parts.append(Text(f"V in cache − V projection: max |Δ| = {dv:g} (V is not rotated); K in cache − rotated K: {dk:g}",
                          style="green" if dv == 0 and dk == 0 else "bold red"))
        zero = "position 0 rotates by angle 0 (Δ = 0); " if 0 in p.inp_pos else ""
        parts.append(Text(zero + "rotation keeps ‖q‖: RoPE changes direction, not length", style=DIM))
    return Group(*parts)


def _mask_grid(kq: dict[str, Any], st: StepTrace, owners: dict[int, list[int]] | None) -> Table:
    """Slice of the real kq_mask: cells as columns (with pos and owner), query rows as rows."""
    rows = kq["rows"]
    ncol = len(rows[0]) if rows else 0
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False, pad_edge=False,
              title=f"rows 0..{len(rows) - 1} of {kq['ne'][1]}{' (pad rows all -inf)' if kq['ne'][1] > st.N else ''} × cells "
                    f"0..{ncol - 1} of {kq['n_kv']};"
                    " row sN qP = query of seq N at pos P", title_justify="left", title_style="italic")
    t.add_column(Text("cell\npos" + ("\nseq" if owners is not None else ""), justify="right"), justify="right", no_wrap=True)
    for c in range(ncol):
        pos = kq["cell_pos"][c] if c < len(kq["cell_pos"]) else -1
        head = f"{c}\n{pos if pos >= 0 else '·'}"
        if owners is not None:
            head += "\n" + (",".join(str(s) for s in owners.get(c, [])) or "·")
        t.add_column(Text(head, justify="right"), justify="right", min_width=5)
    labels = [(r.seq_id, p) for r in st.batch for p in r.positions]
    for i, row in enumerate(rows):
        sid, pos = labels[i] if i < len(labels) else ("?", "?")
        t.add_row(f"s{sid} q{pos} ", *[Text(x, style=KEEP_STYLE if x == "0" else DROP_STYLE) for x in row])
    return t


def swa_slice_text(kq: dict[str, Any], st: StepTrace, n_swa: Any) -> str:
    """``cells 0..15 (pos 0..4; 11 empty), no query reaches its window edge (…)`` or ``…, around the first
    query's window edge``: what the printed ``kq_mask_swa`` slice covers (empty cells hold pos -1)."""
    cs, cp, n = kq.get("col_start", 0), kq.get("cell_pos") or [], len(kq["rows"][0])
    held = [p for p in cp if isinstance(p, int) and p >= 0]
    text = f"cells {cs}..{cs + n - 1}"
    if held:
        text += f" (pos {min(held)}..{max(held)}" + (f"; {len(cp) - len(held)} empty)" if len(held) < len(cp) else ")")
    elif cp:
        text += " (all empty)"
    qs = [p for r in st.batch for p in r.positions]
    if isinstance(n_swa, int) and held and qs and max(qs) - min(held) < n_swa:
        return text + f", no query reaches its window edge yet (pos_q - pos_cell < n_swa = {n_swa} for every key)"
    return text + ", around the first query's window edge"


def swa_parts(st: StepTrace, swa: dict[str, Any]) -> list[RenderableType]:
    """The sliding-window side of the mask panel: layers, convention, visible keys per query on the
    windowed layers, and llama.cpp's ``kq_mask_swa`` slice (cells) or the window metadata (paged)."""
    parts: list[RenderableType] = [
        _kv("sliding window", Text(f"layers {ranges_text(swa['layers'])} windowed (W={swa['n_swa']}), global layers "
                                   f"{ranges_text(swa['global_layers']) if swa['global_layers'] else '-'}: {swa['convention']}",
                                   style="magenta")),
    ]
    for v in swa["visible"]:
        qs = [f"q{q['pos']}: {q['keys']}" for q in v["queries"]]
        parts.append(_kv(f"seq {v['seq_id']} (windowed)", "visible keys: " + short(qs, head=4, tail=2, sep="  "), style="bold magenta"))
    if swa.get("kq_mask_swa"):
        kq = swa["kq_mask_swa"]
        parts.append(_kv("llama.cpp kq_mask_swa", f"{kq['dtype']} ne = {kq['ne']}: kq_mask with is_masked_swa "
                                                  "(pos_q - pos_cell >= n_swa → -inf), read by the windowed layers"))
        rows = kq["rows"]
        if rows and len(rows[0]) <= 64:
            g = Text(f"  {swa_slice_text(kq, st, swa.get('n_swa'))}; ■ 0 keep, · -inf\n", style=DIM)
            labels = [(r.seq_id, p) for r in st.batch for p in r.positions]
            for i, row in enumerate(rows):
                sid, pos = labels[i] if i < len(labels) else ("?", "?")
                g.append(f"  s{sid} q{pos:<5}", style=DIM)
                for x in row:
                    g.append(" ■" if x == "0" else " ·", style=KEEP_STYLE if x == "0" else DIM)
                g.append("\n")
            g.rstrip()
            parts.append(g)
    if swa.get("pool"):  # llama.cpp's iSWA cache: the SWA pool kq_mask_swa is built over (kv/iswa.py)
        pl = swa["pool"]
        parts.append(_kv("SWA pool", f"{pl['size']} cells (llama_kv_cache_iswa: GGML_PAD(min(n_ctx, n_swa·n_seq_max + n_ubatch), "
                                     f"256)), n_kv {pl['n_kv']}; this step's cells (k_idxs_swa) {pl.get('k_idxs', '-')}, head "
                                     f"{pl.get('head_before', '?')}→{pl.get('head_after', '?')}; reused (left every window) "
                                     f"{pl.get('reused', '-')}; purged {pl.get('purged', '-')}"))
    if swa.get("attention_window"):
        parts.append(_kv("paged window", f"attention_window_size per layer {{{', '.join(f'{k}: {v}' for k, v in list(swa['attention_window'].items())[:6])}"
                                         f"{', …' if len(swa['attention_window']) > 6 else ''}}} (TensorRT-LLM attention_window_size, "
                                         "vLLM sliding_window): the kernel skips KV tiles left of each query's window"))
    return parts


def mask_view(st: StepTrace, m: MaskRec, kv: KVRec | None = None) -> RenderableType:
    """Visible keys per query; the kq_mask slice (cells) or the attention metadata (paged)."""
    parts: list[RenderableType] = [_kv("rule", m.rule)]
    if m.backend == "dense":  # --runtime hf: HF's own masks per layer type (render_dense.py)
        from infertrace.present.render_dense import dense_mask_parts

        parts += dense_mask_parts(st)
    for v in m.visible:
        qs = [f"q{q['pos']}→{q['keys']}" for q in v["queries"]]
        parts.append(_kv(f"seq {v['seq_id']}", "visible keys: " + short(qs, head=4, tail=2, sep="  "), style="bold cyan"))
    if m.swa:
        parts += swa_parts(st, m.swa)
    if m.kq_mask is not None:
        kq = m.kq_mask
        parts.append(_kv("llama.cpp kq_mask", f"{kq['dtype']} ne = [n_kv={kq['ne'][0]}, n_tokens_pad={kq['ne'][1]}, "
                                              f"{kq['ne'][2]}, n_stream={kq['ne'][3]}] (torch {kq['torch_shape']}); "
                                              "filled on the host, added to KQ before softmax: 0 keep, -inf drop"))
        owners = None  # cell owners: in the mask record if the recorder keeps them, else from the kv record
        if kq.get("cell_seq") is not None:
            owners = dict(enumerate(kq["cell_seq"]))
        elif kv is not None and kv.physical.get("kind") == "cells":
            owners = {c["cell"]: c["seq_ids"] for c in kv.physical.get("cells", [])}
        if kq.get("streams"):  # non-unified KV: one block per stream, over that stream's own cells
            parts.append(Text(streams_line(kq), style="magenta"))
            parts += stream_mask_grids(kq, st)
        elif kq["rows"]:
            parts.append(_mask_grid(kq, st, owners))
    if m.metadata is not None:
        md = m.metadata
        parts += [
            _kv("TensorRT-LLM", f"mask_type {md['mask_type']} · num_contexts {md['num_contexts']} · "
                                f"request_ids {md['request_ids']} · request_types {md['request_types']}"),
            _kv("lengths", f"seq_lens {md['seq_lens']} (T) · kv_lens {md['kv_lens']} (C+T) · cu_seqlens {md['cu_seqlens']}"),
            _kv("block_tables", " · ".join(f"seq {s}: {row}" for s, row in zip(md["request_ids"], md["block_tables"]))
                + "  (-1 = padding)"),
            Text("no dense mask tensor reaches attention: the kernel derives causality from the lengths and reads only "
                 "each request's own block-table row", style="green"),
        ]
        vl = st.vllm.get("attn_metadata") if isinstance(getattr(st, "vllm", None), dict) else None
        if isinstance(vl, dict):  # run --runtime vllm: the metadata as vLLM built it, in its own names
            sc = st.vllm.get("scheduler") or {}

            def cut(x: Any) -> str:  # validated ints and lists of ints
                t = str(x)
                return t if len(t) <= 120 else t[:117] + "…"

            parts.append(_kv(f"vLLM {visible(vl.get('class', ''))}",
                             f"query_start_loc {cut(vl.get('query_start_loc'))} · seq_lens {cut(vl.get('seq_lens'))} "
                             f"(kv length) · block_table {cut(vl.get('block_table'))} (0 = null block) · slot_mapping "
                             f"{cut(vl.get('slot_mapping'))} · logits_indices {cut(st.vllm.get('logits_indices'))} · "
                             f"free blocks {cut(sc.get('free_blocks'))}"))
        for v, lg in zip(m.visible, m.logical):
            if len(lg) <= 8 and lg and len(lg[0]) <= 24:
                g = Text(f"seq {v['seq_id']} materialised for display [T={len(lg)}, kv_len={len(lg[0])}]:\n", style=DIM)
                for q, row in zip(v["queries"], lg):
                    g.append(f"  q{q['pos']:<4}")
                    for x in row:
                        g.append(" ■" if x else " ·", style=KEEP_STYLE if x else DIM)
                    g.append("\n")
                g.rstrip()
                parts.append(g)
    return Group(*parts)


def kv_view(st: StepTrace, kv: KVRec) -> RenderableType:
    """Per request K/V shapes before → after and where the new entries went; physical state."""
    ph = kv.physical
    if kv.backend == "dense":  # --runtime hf: the padded grid and DynamicCache (render_dense.py)
        from infertrace.present.render_dense import dense_kv_view

        return dense_kv_view(st, kv)
    if kv.backend == "cells":
        shape_desc = f"k_l / v_l per layer [{kv.physical_shape[0]} cells, {kv.physical_shape[1]} kv heads, {kv.physical_shape[2]}]"
    else:
        s = kv.physical_shape
        shape_desc = f"pool per layer [{s[0]} blocks, 2 (K,V), {s[2]} kv heads, {s[3]} tokens/block, {s[4]}]"
    parts: list[RenderableType] = [_kv("physical", f"{kv.dtype} · {kv.layers} layers · {shape_desc}")]
    cols = ["seq", "K/V logical before → after", "written pos"]
    cols += ["cells"] if kv.backend == "cells" else ["slot_mapping", "block table"]
    t = _table(*cols)
    for d in kv.per_request:
        row = [str(d["seq_id"]), f"{d['shape_before']} → {d['shape_after']}", d["written_pos"]]
        row += [d.get("cells", "")] if kv.backend == "cells" else [int_list(d["slot_mapping"]), str(d["block_table"])]
        t.add_row(*row)
    parts.append(t)
    if kv.backend == "cells" and ph.get("streams") is not None:  # non-unified KV: a head per stream
        parts.append(_kv("streams", streams_state(ph)))
        cmap = " · ".join(f"seq {s}: rows {v['cells']} hold pos {v['pos']}" for s, v in ph.get("seqs", {}).items())
        parts.append(_kv("cell map", cmap or "-"))
    elif kv.backend == "cells":
        parts.append(_kv("cells", f"head {ph.get('head_before', '?')} → {ph.get('head_after', ph.get('head'))} · used {ph['used']}"
                                  f" / {ph['size']} · n_kv {ph['n_kv']} (cells the graph reads, padded)"))
        cmap = " · ".join(f"seq {s}: cells {v['cells']} hold pos {v['pos']}" for s, v in ph.get("seqs", {}).items())
        parts.append(_kv("cell map", cmap or "-"))
        sp = ph.get("swa_pool")
        if isinstance(sp, dict):  # llama.cpp's iSWA cache: the windowed layers' own pool (kv/iswa.py)
            parts.append(_kv("SWA pool", f"{sp['size']} cells · head {sp['head']} · used {sp['used']} · n_kv {sp['n_kv']} "
                                         "(windowed layers; a cell whose token left every window is reused)"))
        for r in ph.get("recurrent_cells") or []:  # --runtime llama.cpp, hybrid model: llama_memory_recurrent
            parts.append(_kv(f"recurrent cells (ubatch {r['ubatch']})",
                             f"cells {r.get('head', '?')}..{r.get('head', 0) + r.get('n_rs', 1) - 1} hold the ubatch's sequences "
                             f"in order · rs_z {r['rs_z']} (zeroed for new sequences; -1 none) · s_copy {r['s_copy']} "
                             "(the cell each reads its state from)", style="magenta"))
    else:
        parts.append(_kv("blocks", f"used {ph['used_blocks']} / free {ph['free_blocks']} of {ph['num_blocks']} · "
                                   f"tokens_per_block {ph['tokens_per_block']} · free list head {ph['free_list_head']}"))
        for s, v in ph.get("requests", {}).items():
            blocks = " ".join(f"{b['block']}:{b['pos']}" for b in v["blocks"])
            parts.append(_kv(f"seq {s}", f"block table {v['block_table']} · len {v['len']} · block:positions {blocks}"
                                         f" · slot(p) = table[p // B]·B + p % B", style="bold cyan"))
    lv = kv.layer_view
    vt = _table("seq", "pos", "K (rotated) first values", "V first values",
                title=f"layer {lv.get('layer')}, kv head 0, written positions (read back from the cache)")
    for rq in lv.get("requests", []):
        for r in rq["rows"]:
            vt.add_row(str(rq["seq_id"]), str(r["pos"]), floats(r["k"]), floats(r["v"]))
    parts.append(vt)
    return Group(*parts)


def _sampler_text(s: dict[str, Any]) -> str:
    if s.get("temperature", 0) == 0:
        desc = "greedy (temperature 0: argmax, lowest id on ties)"
    else:
        desc = f"temperature {s['temperature']:g} · top_k {s['top_k'] or 'off'} · top_p {s['top_p']:g} · min_p {s['min_p']:g} · seed {s['seed']}"
        if s.get("order") == "llama.cpp":
            desc += " · order llama.cpp (top-k/top-p/min-p on unscaled logits, then temperature)"
        elif s.get("order") == "hf":
            desc += " · order hf (temperature, then top-k/top-p/min-p)"
    if s.get("repetition_penalty", 1.0) != 1.0:
        desc += f" · repetition_penalty {s['repetition_penalty']:g}"
    for k in ("frequency_penalty", "presence_penalty"):
        if s.get(k, 0.0) != 0.0:
            desc += f" · {k} {s[k]:g}"
    if "penalty_last_n" in s:  # recorded only when a penalty is on
        n = s["penalty_last_n"]
        desc += f" · penalty window {'whole context' if n == -1 else 'off' if n == 0 else f'last {n} tokens'}"
    return desc + f" · max_new_tokens {s['max_new_tokens']}" + (" · ignore_eos" if s.get("ignore_eos") else "")


def decode_view(st: StepTrace, d: DecodeRec) -> RenderableType:
    """Logits rows, sampler settings, top candidates, chosen token and the next step's input."""
    if d.logits_rows:
        head = (f"{d.logits_shape} {d.logits_dtype}: only packed rows {d.logits_rows} of N={st.N}, the last computed "
                "token of each request that needs a next token (llama.cpp batch.logits flags; TensorRT-LLM last-token gather)"
                + ("; a verify chunk computes logits on every node, and the token is drawn from the accepted path's last node"
                   if any(r.spec for r in st.batch) else ""))
    else:
        head = f"none this step: no request finishes its prompt here (N={st.N} prefill-chunk tokens only fill the cache)"
    from infertrace.present.render_vllm import vllm_dropped_samples

    dropped = vllm_dropped_samples(st)  # run --runtime vllm: rows vLLM computed for partial prefills
    if dropped and not d.logits_rows:
        head = (f"vLLM computed packed rows {sorted(r for r, _ in dropped.values())} of N={st.N} (one per scheduled request, "
                "step.vllm.logits_indices); no request finishes its prompt here, so every sample is discarded")
    parts: list[RenderableType] = [_kv("logits", head)]
    for p in d.per_request:
        if p.get("row") is None and "top" not in p:
            note = p.get("note", "no logits")
            if p["seq_id"] in dropped:
                row, tok = dropped[p["seq_id"]]
                note = (f"vLLM computed logits row {row} and sampled {tok if tok is not None else '?'}: sample discarded "
                        "(partial prefill: the prompt is not finished)")
            parts.append(_kv(f"seq {p['seq_id']}", note, style="bold cyan"))
            continue
        vr = next((r for r in st.batch if r.seq_id == p["seq_id"] and r.spec), None)
        why = ""
        if vr is not None and vr.spec.get("accepted_nodes") and vr.spec.get("emitted"):
            acc, em = vr.spec["accepted_nodes"], vr.spec["emitted"]
            why = (f" (verify: node {acc[min(len(em), len(acc)) - 1]}, the accepted path's last node, "
                   "whose logits drew the last emitted token)")
        parts.append(_kv(f"seq {p['seq_id']}", f"logits row {p['row']}{why} · {_sampler_text(p['sampler'])}", style="bold cyan"))
        t = _table("id", "piece", "logit", "prob", "")
        for c in (0, 2, 3):
            t.columns[c].justify = "right"
        for c in p["top"]:
            bar = "█" * max(0, round(c["prob"] * 24))
            style = "bold green" if c["id"] == p["chosen"] else ""
            t.add_row(Text(str(c["id"]), style=style), Text(piece_text(c["piece"]), style=style), f"{c['logit']:.3f}",
                      f"{c['prob']:.4f}", Text(bar, style="green"))
        parts.append(t)
        nxt = (f"next input [{p['next_input']}] at position {p['next_pos']}" if p.get("next_input") is not None
               else "no next step for this request")
        line = Text.assemble(("chosen ", "bold"), (f"{p['chosen']} {piece_text(p['chosen_piece'])}", "bold green"), f" → {nxt}")
        line.append(f" · stop: {p['stop']}" if p.get("stop") else " · stop: not yet", style="yellow" if p.get("stop") else DIM)
        parts.append(line)
    return Group(*parts)


# ----------------------------------------------------------------------------- step and run


def packed_batch_view(st: StepTrace) -> RenderableType:
    """The packed batch of a step, one line per request: ``rows 1..3 → seq 1, pos 3..5 · prefill · C=3 T=3``
    (row = index in the packed ``[N, H]`` batch = llama.cpp ubatch token index)."""
    if not st.batch:
        return Text(f"packed batch N=0: {IDLE_TEXT}", style=DIM)
    g = Table.grid(padding=(0, 1))
    for _ in range(6):
        g.add_column(no_wrap=True)
    for i, r in enumerate(st.batch):
        rows = ranges_text(r.rows)
        g.add_row(Text(f"packed batch N={st.N}" if i == 0 else "", style="bold"),
                  f"{'rows' if len(r.rows) > 1 else 'row'} {rows}", "→", Text(f"seq {r.seq_id}, pos {ranges_text(r.positions)}", style="cyan"),
                  Text(r.phase, style="magenta" if r.phase == "prefill" else "blue"), f"C={r.C} T={r.T}")
    return g


def _step_title(st: StepTrace) -> str:
    if not st.batch:
        return f"step {st.step} · idle · N=0 · {IDLE_TEXT}"
    phases = sorted({r.phase for r in st.batch})
    seqs = ", ".join(f"{r.seq_id}" for r in st.batch)
    extra = ""
    if st.admitted:
        extra += f" · admitted {st.admitted}"
    if st.preempted:
        extra += f" · preempted {st.preempted}"
    return f"step {st.step} · {'+'.join(phases)} · seq {seqs} · N={st.N} tokens · {st.backend}/{st.attention}{extra}"


def render_step(console: Console, st: StepTrace, show: Sequence[str] = VARIABLES) -> None:
    """One rule line for the step, then one panel per recorded variable in ``show``."""
    console.rule(Text(_step_title(st), style="bold"), align="left")
    if not st.batch:  # idle: no variables to show
        if st.serving:  # a request stopped by the scheduler (kv_full)
            console.print(serving_view(st))
        return
    console.print(packed_batch_view(st))
    if st.hf:  # --runtime hf: the padded [B, L] grid HF computed (render_dense.py)
        from infertrace.present.render_dense import dense_grid_view

        console.print(dense_grid_view(st))
    if st.serving:
        console.print(serving_view(st))
    views = {
        "hidden": lambda: st.hidden and with_extra(hidden_view(st, st.hidden), spec_mtp_view(st)),
        "positions": lambda: st.positions and positions_view(st, st.positions),
        "mask": lambda: st.mask and with_extra(mask_view(st, st.mask, st.kv), spec_mask_view(st)),
        "kv": lambda: st.kv and with_extra(kv_view(st, st.kv), spec_kv_view(st)),
        "decode": lambda: st.decode and decode_view(st, st.decode),
    }
    for name in VARIABLES:
        if name not in show:
            continue
        body = views[name]()
        if body is None:
            continue
        console.print(Panel(body, title=Text.assemble((name, "bold"), f" · step {st.step}"), title_align="left", box=box.ROUNDED,
                            border_style="bright_black"))
    if st.hybrid and ("kv" in show or "positions" in show):  # hybrid models: state beside the KV (render_hybrid.py)
        from infertrace.present.render_hybrid import hybrid_view

        console.print(Panel(hybrid_view(st), title=Text.assemble(("hybrid state", "bold"), f" · step {st.step}"),
                            title_align="left", box=box.ROUNDED, border_style="bright_black"))


def render_run(console: Console, trace: RunTrace, show: Sequence[str] = VARIABLES,
               steps: Iterable[int] | None = None) -> None:
    """Render a whole run: header, worked-example table, per-step panels, outputs.

    Args:
        console: where to print (its width decides wrapping; 100-120 columns is the target).
        trace: the run, live or loaded from JSON.
        show: variables whose panels are printed (the worked-example table is always shown); empty:
            no per-step section, only the table and the summary (``run``'s default), with one line
            naming ``--show``.
        steps: step numbers whose panels are printed (None = all); the table lists every step.
    """
    render_header(console, trace)
    render_composition(console, trace)  # several requests: who shared each step (render_lanes.py)
    console.print(worked_example_table(trace, console.width))
    wanted = None if steps is None else set(steps)
    if show:
        for st in trace.steps:
            if wanted is None or st.step in wanted:
                render_step(console, st, show)
    console.rule(style="bright_black")
    render_outputs(console, trace)
    render_spec_summary(console, trace)
    render_audit_summary(console, trace)
    if not show:
        console.print(Text(run_summary(trace), style=DIM))


def run_summary(trace: RunTrace) -> str:
    """One line under the default output: steps, tokens computed and generated, and how to see the panels."""
    n_tok = sum(int(st.N or 0) for st in trace.steps)
    gen = sum(len(r.get("output_ids", []) or []) for r in trace.requests)
    return (f"{len(trace.steps)} steps · {n_tok} tokens computed · {gen} generated · per-step panels: --show "
            "hidden,positions,mask,kv,decode or all")
