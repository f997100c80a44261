"""Rich rendering of the hybrid section of a step (:attr:`StepTrace.hybrid`, made by
:mod:`infertrace.capture.hybrid_rec`) and of the study's appendix B tables (Qwen3.5, TensorRT-LLM
convention) filled with the run's measured shapes and dtypes.

The kv panel shows what grows (K/V of the full-attention layers); the hybrid panel beside it
shows what does not (the GDN conv / recurrent state: same shape every step, values advanced:
norm and checksum per step). Strings from a loaded trace are rendered as ``Text``, never markup.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from infertrace.present.text import int_list_text
from infertrace.ranges import ranges_text

_DIM = "bright_black"


def _dn(name: Any) -> str:
    """torch dtype names of the older records (``float32``) in the short form the hybrid records use (``F32``)."""
    return {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}.get(str(name), str(name))


def _sh(x: Any) -> str:
    return "[" + ", ".join(str(int(v)) for v in x) + "]" if isinstance(x, list) else "?"


def _t(d: Any) -> str:
    """``[shape] DTYPE`` of a ``{"shape", "dtype"}`` entry."""
    return f"{_sh(d.get('shape'))} {d.get('dtype', '')}" if isinstance(d, dict) else "-"


def hybrid_view(st: Any) -> RenderableType:
    """Layer map, M-RoPE positions, one full-attention layer's projection split, GDN state per request."""
    h = st.hybrid
    lm = h.get("layer_map", {})
    lin, full = lm.get("linear_attention", []), lm.get("full_attention", [])
    parts: list[RenderableType] = [Text(f"layers: {len(lin)} GDN (linear_attention) {ranges_text(lin)} + {len(full)} full "
                                        f"attention {ranges_text(full)}; {h.get('prefix_reuse', '')}")]
    p = h.get("positions")
    if isinstance(p, dict):
        parts.append(Text(
            f"positions   TensorRT-LLM/HF position_ids {_sh(p.get('position_ids_shape'))} {p.get('dtype')} (t/h/w axes, equal "
            f"for text: {p.get('position_ids', [[]])[0]}) · llama.cpp inp_pos I32 [{p.get('inp_pos_len')}] = n_tokens × "
            f"n_pos_per_embd {p.get('n_pos_per_embd')} (t, h, w, then zeros){': ' + str(p.get('inp_pos')) if p.get('inp_pos') else ''}"
            f" · consumed by full-attention layers {ranges_text(p.get('consumers', []))}; GDN layers "
            f"{ranges_text(p.get('ignored_by', []))} ignore positions · RoPE rotates dims 0..{int(p.get('rope_dim', 0)) - 1} of "
            f"{p.get('head_dim')} per head (sections {p.get('sections')})"))
    pr = h.get("projection")
    if isinstance(pr, dict):
        nh, nkv, hd = (pr.get("heads") or [0, 0, 0])[:3]
        parts.append(Text(
            f"layer {pr.get('layer')} qkv_proj {_t(pr.get('h'))} -> {_t(pr.get('qkv'))} split: Q {_t(pr.get('q'))} -> "
            f"[.., {nh}, {hd}] · gate {_t(pr.get('gate'))} · K {_t(pr.get('k'))} / V {_t(pr.get('v'))} -> [.., {nkv}, {hd}]"
            + (f" · attn out {_t(pr.get('attn_out'))} * sigmoid(gate) -> o_proj {_t(pr.get('o_proj'))}" if pr.get("o_proj") else "")))
    s = h.get("state")
    if isinstance(s, dict):
        parts += state_view(s)
    return Group(*parts)


def _row(t: Table, *cells: str) -> None:
    t.add_row(*[Text(c) for c in cells])


def appendix_b_tables(trace: Any) -> list[RenderableType]:
    """The study's appendix B tables (prefill, decode step 1) with the run's values, for the first request.

    Needs a trace of a hybrid model; returns ``[]`` otherwise. Every shape / dtype comes from the
    step records (measured), none from the config.
    """
    steps = [st for st in trace.steps if st.batch and st.hybrid]
    pre = next((st for st in steps if st.batch[0].phase == "prefill" and st.batch[0].C == 0), None)
    dec = next((st for st in steps if st.batch[0].phase == "decode"), None)
    out: list[RenderableType] = []
    if pre is not None:
        out.append(_table_prefill(pre))
    if dec is not None:
        out.append(_table_decode(dec))
    return out


def _kv_parts(st: Any) -> tuple[str, str, str]:
    kv = st.kv
    if kv is None or not kv.per_request:
        return "-", "-", "-"
    r = kv.per_request[0]
    phys = _sh(kv.physical_shape) if kv.physical_shape else "-"
    return _sh(r.get("shape_before")), _sh(r.get("shape_after")), phys


def _mask_text(st: Any) -> str:
    m = st.mask
    if m is None:
        return "-"
    md = m.metadata if isinstance(m.metadata, dict) else None
    if md and md.get("kv_lens") is not None:
        return f"no dense tensor; kv_lens={md.get('kv_lens')}"
    kq = m.kq_mask if isinstance(m.kq_mask, dict) else {}
    return f"kq_mask ne={kq.get('ne')} {kq.get('dtype', '')} (llama.cpp, host-filled 0/-inf)"


def _table_prefill(st: Any) -> Table:
    h = st.hybrid
    r = st.batch[0]
    t = Table(title=Text(f"Prefill (T = {r.T}, C = {r.C}) · step {st.step} · measured", style="bold"), box=box.SIMPLE_HEAD,
              title_justify="left")
    for c in ("variable", "shape", "dtype", "note"):
        t.add_column(c)
    p = h.get("positions", {})
    s = h.get("state", {})
    _, kv_after, phys = _kv_parts(st)
    _row(t, "input_ids", f"[{st.N}]", (h.get("input_ids") or {}).get("dtype", "-"), "the whole prompt")
    if h.get("hidden"):
        _row(t, "hidden (embedding)", _sh(h["hidden"]["shape"]), h["hidden"]["dtype"], "sequence axis = packed tokens")
    _row(t, "position_ids", _sh(p.get("position_ids_shape")), str(p.get("dtype", "")),
         f"M-RoPE axes t/h/w, all {ranges_text(r.positions)} for text")
    _row(t, "attention mask", "-", "-", _mask_text(st))
    _row(t, f"KV (per full-attn layer ×{len(h.get('layer_map', {}).get('full_attention', []))})", f"K/V {kv_after} each",
         _dn(st.kv.dtype) if st.kv else "-", f"physical {phys}")
    _row(t, f"GDN state (per GDN layer ×{s.get('n_layers')})", f"conv {_sh(s.get('conv_shape'))} / recurrent {_sh(s.get('rec_shape'))}",
         str(s.get("dtype", "")), f"after scanning {r.T} tokens")
    if st.decode is not None:
        _row(t, "logits", _sh(st.decode.logits_shape), _dn(st.decode.logits_dtype), "last token only")
    return t


def _table_decode(st: Any) -> Table:
    h = st.hybrid
    r = st.batch[0]
    t = Table(title=Text(f"Decode step (T = {r.T}, C = {r.C}, position = {r.positions[0]}) · step {st.step} · measured",
                         style="bold"), box=box.SIMPLE_HEAD, title_justify="left")
    for c in ("variable", "input", "computation", "output"):
        t.add_column(c)
    p, pr, s = h.get("positions", {}), h.get("projection", {}), h.get("state", {})
    nh, nkv, hd = (pr.get("heads") or [0, 0, 0])[:3]
    kv_before, kv_after, _ = _kv_parts(st)
    _row(t, "input_ids", f"[{st.N}] {(h.get('input_ids') or {}).get('dtype', '')} = {r.token_ids}", "last token only", "-")
    if h.get("hidden"):
        _row(t, "hidden", "-", "embedding lookup", _t(h["hidden"]))
    _row(t, "position_ids", f"{_sh(p.get('position_ids_shape'))} {p.get('dtype', '')} = {r.positions}", "RoPE on Q/K",
         f"first {p.get('rope_dim')} dims of {p.get('head_dim')} rotated")
    if pr:
        _row(t, "Q / gate / K / V", f"qkv_proj {_t(pr.get('h'))} -> {_t(pr.get('qkv'))}", "split",
             f"Q {_sh(pr['q']['shape'])}->[{r.T}, {nh}, {hd}]; gate {_sh(pr['gate']['shape'])}; "
             f"K/V {_sh(pr['k']['shape'])}->[{r.T}, {nkv}, {hd}]")
    _row(t, "attention mask", _mask_text(st), "implicit causal" if "kv_lens" in _mask_text(st) else "added to KQ", "-")
    _row(t, "KV cache", f"history {kv_before}", "read + write", f"logical {kv_after}")
    _row(t, "GDN state", f"recurrent {_sh(s.get('rec_shape'))} {s.get('dtype', '')}", "1 delta-rule step",
         "same shape, values advanced")
    if pr.get("o_proj"):
        _row(t, "attn out", _t(pr.get("attn_out")), "* sigmoid(gate) -> o_proj", _t(pr.get("o_proj")))
    if st.decode is not None:
        _row(t, "logits", "final hidden", "lm_head", f"{_sh(st.decode.logits_shape)} {_dn(st.decode.logits_dtype)}")
    _row(t, "sampled", "-", "sampler (greedy: argmax)", str(r.sampled))
    return t


def layer_map_text(trace: Any) -> str:
    """``0 GDN 1 GDN 2 GDN 3 attn ...`` and the counts, from the first hybrid step record."""
    st = next((s for s in trace.steps if s.hybrid), None)
    if st is None:
        return ""
    lm = st.hybrid.get("layer_map", {})
    types = lm.get("types", [])
    return (f"layer map ({len(lm.get('linear_attention', []))} GDN + {len(lm.get('full_attention', []))} full-attention): "
            + " ".join(f"{i}:{t}" for i, t in enumerate(types)))


def render_appendix(console: Any, trace: Any) -> None:
    """The study's appendix B tables (Qwen3.5) from this run, after the step panels; nothing for other models."""
    tables = appendix_b_tables(trace)
    if not tables:
        return
    console.rule(Text("appendix B (Qwen3.5 hybrid) from this run: every shape and dtype measured", style="bold"), align="left")
    console.print(Text(layer_map_text(trace)))
    for t in tables:
        console.print(t)
    notes = [n for n in trace.notes if "random weights" in n]
    for n in notes:
        console.print(Text(n, style="yellow"))


def state_view(s: dict[str, Any]) -> list[RenderableType]:
    """The GDN state of a hybrid step or dump: one line of facts and a table of norms / checksums per request."""
    conv = "TensorRT-LLM MambaHybridCacheManager state slots, state_indices" if s.get("convention") == "paged" else \
        "llama.cpp memory_recurrent cells (one per seq), rs_z"
    parts: list[RenderableType] = [Text(
        f"state ({conv}) per GDN layer: conv {_sh(s.get('conv_shape'))} + recurrent {_sh(s.get('rec_shape'))} "
        f"{s.get('dtype')} × {s.get('n_layers')} layers = {s.get('bytes_per_seq')} bytes per request, constant · "
        f"slots {s.get('n_slots')} · state_indices {int_list_text(s.get('state_indices') or [])} · rs_z {s.get('rs_z')}"
        + (f" · speculative verify: {s.get('snapshots_per_slot')} state snapshots per slot "
           f"(+{s.get('snapshot_bytes_per_seq')} bytes per request)" if s.get("snapshots_per_slot") else ""))]
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for c in ("seq", "slot", "layer", "conv shape", "‖conv‖", "Σconv", "recurrent shape", "‖S‖", "ΣS"):
        t.add_column(c, justify="right" if c not in ("conv shape", "recurrent shape") else "left")
    for r in s.get("per_seq", [])[:16]:
        for i, lr in enumerate(r.get("layers", [])):
            t.add_row(str(r.get("seq_id")) if i == 0 else "", str(r.get("slot")) if i == 0 else "", str(lr.get("layer")),
                      _sh(s.get("conv_shape")), f"{lr.get('conv_norm', 0):.4f}", f"{lr.get('conv_sum', 0):+.4f}",
                      _sh(s.get("rec_shape")), f"{lr.get('rec_norm', 0):.4f}", f"{lr.get('rec_sum', 0):+.4f}")
    parts.append(t)
    return parts
