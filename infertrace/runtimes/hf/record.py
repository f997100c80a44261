"""One HF forward turned into an ordinary :class:`~infertrace.trace.records.StepTrace` (backend ``dense``) plus
the step's ``hf`` section in HF's own names.

The ordinary records hold the real tokens only, packed in batch-row order (``N`` = real tokens computed; a
request's ``rows`` are its packed rows, its ``positions`` the ``position_ids`` HF was fed at its real columns,
its ``visible`` keys the real positions HF's own mask keeps). The dense layout — which columns are pads, what
they hold and what the mask gives them — is in ``kv.physical`` (kind ``dense``) and in ``step.hf``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from infertrace.ranges import ranges_text
from infertrace.trace.check.dense import MASK_MAX_KV, MASK_MAX_Q
from infertrace.runtimes.hf.capture import ForwardCapture, cache_layers, keep_matrix
from infertrace.trace.records import DecodeRec, HiddenRec, KVRec, MaskRec, PositionsRec, ReqStep, RowStat, StepTrace

#: the mask rows recorded per batch row: at most this many queries and key columns (longer runs are cut, said so);
#: one bound shared with the dense check, which holds a record to it
MAX_Q, MAX_KV = MASK_MAX_Q, MASK_MAX_KV


def _r(x: float, nd: int = 6) -> float:
    return float(round(float(x), nd))


@dataclass
class RowStep:
    """One batch row in one forward: request ``seq_id`` in row ``b``; ``C`` real tokens cached before, ``T``
    computed; ``q_cols`` the forward's query columns holding them (0..q-1), ``logit_col`` the column whose logits
    chose its next token (None: nothing sampled); ``finished`` (its stop reason after this step)."""

    b: int
    seq_id: int
    C: int
    T: int
    token_ids: list[int]
    q_cols: list[int]
    logit_col: int | None
    sample: Any = None
    finished: str | None = None


@dataclass
class StepInputs:
    """What HF was fed and what it built: ``input_ids`` ``[B, q]``, ``attention_mask`` ``[B, L]`` (L = columns
    after the step), ``position_ids`` ``[B, q]``, ``past`` = ``past_key_values.get_seq_length()`` before the step
    (the first written column), the capture, the cache after the step, ``logits`` ``[B, q, V]`` float32."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    past: int
    cap: ForwardCapture
    cache: Any
    logits: torch.Tensor


def _pos_of_col(am_row: list[int]) -> dict[int, int]:
    """Absolute cache column -> real position, for one row's 2-D mask (pads have none)."""
    out, n = {}, 0
    for j, m in enumerate(am_row):
        if m:
            out[j] = n
            n += 1
    return out


def _mask_text(keep: torch.Tensor) -> list[str]:
    return ["".join("1" if x else "0" for x in row[:MAX_KV].tolist()) for row in keep[:MAX_Q]]


def visible_of(inp: StepInputs, r: RowStep, layer_type: str) -> tuple[list[str], list[list[int]]]:
    """Per query of ``r``: the real positions HF's ``layer_type`` mask keeps (range text), and the logical
    keep matrix ``[T][C + T]`` over real positions."""
    q, L = inp.input_ids.shape[1], inp.attention_mask.shape[1]
    name_mask = inp.cap.masks.get(layer_type)
    mask = name_mask[1] if name_mask else None
    kv = mask.shape[-1] if mask is not None else L
    keep = keep_matrix(mask, r.b, q, kv)  # [q, kv], columns L - kv .. L - 1
    off = L - kv
    pos = _pos_of_col(inp.attention_mask[r.b].tolist())
    vis, logical = [], []
    for c in r.q_cols:
        kept = [pos[off + j] for j in range(kv) if bool(keep[c, j]) and (off + j) in pos]
        vis.append(ranges_text(kept))
        ks = set(kept)
        logical.append([1 if p in ks else 0 for p in range(r.C + r.T)])
    return vis, logical


def hf_section(inp: StepInputs, rows: list[RowStep], padding: str, layer: int, n_first: int, pad_id: int,
               next_tokens: list[int] | None, generate_pos: list[int] | None, finished_rows: dict[int, int],
               row_seq: list[int], attn: str) -> dict[str, Any]:
    """The step in HF's names (the schema's ``HF_STEP``): the forward's ``input_ids`` / ``attention_mask`` /
    ``position_ids`` as fed, ``cache_position`` (``arange(q) + get_seq_length()``: transformers 5.x no longer
    passes it, the cache appends at those columns), each layer type's mask as the mask function returned it,
    the cache's per-layer lengths, K/V of ``layer`` at the computed real columns, logits shape and columns."""
    q = inp.input_ids.shape[1]
    masks = {}
    for lt, (fn, m) in sorted(inp.cap.masks.items()):
        if m is None:
            masks[lt] = {"function": fn, "returned": "none: is_causal", "shape": None}
            continue
        kv = m.shape[-1]
        masks[lt] = {"function": fn, "returned": "bool" if m.dtype == torch.bool else str(m.dtype).replace("torch.", ""),
                     "shape": list(m.shape), "kv_offset": inp.attention_mask.shape[1] - kv,
                     "rows": [_mask_text(keep_matrix(m, b, q, kv)) for b in range(m.shape[0])],
                     "truncated": q > MAX_Q or kv > MAX_KV}
    lay = inp.cache.layers[layer]
    stored = lay.keys.shape[-2]  # [B, n_kv, stored, hd]
    total = inp.attention_mask.shape[1]
    kv_rows = []
    for r in rows:
        cols = []
        for c in r.q_cols[:8]:
            col = inp.past + c
            j = col - (total - stored)
            if 0 <= j < stored:
                cols.append({"col": col, "k": [_r(a) for a in lay.keys[r.b, 0, j, :n_first].tolist()],
                             "v": [_r(a) for a in lay.values[r.b, 0, j, :n_first].tolist()]})
        kv_rows.append({"row": r.b, "columns": cols})
    return {
        "padding": padding, "attn_implementation": attn, "pad_token_id": pad_id,
        "row_seq_ids": list(row_seq),
        "finished_rows": [{"row": b, "fed_pad_from_col": c} for b, c in sorted(finished_rows.items())],
        "input_ids": inp.input_ids.tolist(), "attention_mask": inp.attention_mask.tolist(),
        "position_ids": inp.position_ids.tolist(), "generate_position_ids": generate_pos,
        "cache_position": [inp.past + i for i in range(q)], "past_seen_tokens": inp.past,
        "masks": masks, "cache": {"class": type(inp.cache).__name__, "layers": cache_layers(inp.cache)},
        "kv_layer": {"layer": layer, "rows": kv_rows},
        "logits": {"shape": list(inp.logits.shape), "columns": [[r.b, r.logit_col] for r in rows if r.logit_col is not None]},
        "next_tokens": next_tokens,
    }


def build_step(step: int, inp: StepInputs, rows: list[RowStep], tok: Any, cfg: Any, show: set[str], layer: int,
               padding: str, padded_len: int, params: dict[int, Any], inv_freq: torch.Tensor | None, attn: str,
               finished_rows: dict[int, int], row_seq: list[int], n_first: int = 4, top_k: int = 5) -> StepTrace:
    """The ordinary step record of one dense forward (module docstring): real tokens only, packed in row order."""
    reqs, start, packed = [], 0, []
    swa = bool(getattr(cfg, "windowed_layers", None))
    for r in rows:
        vis, _ = visible_of(inp, r, "full_attention")
        vis_swa = visible_of(inp, r, "sliding_attention")[0] if swa else None
        rows_packed = list(range(start, start + r.T))
        start += r.T
        packed += [(r, c) for c in r.q_cols]
        s = r.sample
        reqs.append(ReqStep(
            seq_id=r.seq_id, phase="prefill" if r.C == 0 else "decode", C=r.C, T=r.T, token_ids=list(r.token_ids),
            pieces=[tok.piece(t) for t in r.token_ids], positions=[int(inp.position_ids[r.b, c]) for c in r.q_cols],
            visible=vis, cache_before=ranges_text(range(r.C)), cache_after=ranges_text(range(r.C + r.T)),
            rows=rows_packed, logits_row=None,
            sampled=s.token if s else None, sampled_piece=tok.piece(s.token) if s else None, finished=r.finished,
            visible_swa=vis_swa))
    j = 0  # logits_row: the index into the step's logits rows (DecodeRec.logits_rows), as every convention has it
    for r, rq in zip(rows, reqs):
        if r.logit_col is not None:
            rq.logits_row, j = j, j + 1
    st = StepTrace(step=step, backend="dense", attention=attn, N=start, batch=reqs)
    if "hidden" in show and inp.cap.embed is not None:
        st.hidden = _hidden(inp, packed, tok)
    if "positions" in show:
        st.positions = _positions(inp, packed, cfg, inv_freq, layer)
    if "mask" in show:
        st.mask = _mask(inp, rows, reqs, cfg)
    if "kv" in show:
        st.kv = _kv(inp, rows, cfg, layer, padding, padded_len, finished_rows, row_seq, n_first)
    if "decode" in show:
        st.decode = _decode(inp, rows, reqs, tok, params, top_k)
    return st


def _hidden(inp: StepInputs, packed: list[tuple[RowStep, int]], tok: Any) -> HiddenRec:
    x = inp.cap.embed.float()  # [B, q, H]
    out = []
    for r, c in packed:
        v = x[r.b, c]  # [H]
        t = int(inp.input_ids[r.b, c])
        out.append(RowStat(r.seq_id, int(inp.position_ids[r.b, c]), t, tok.piece(t), _r(v.mean()), _r(v.std()),
                           _r(v.min()), _r(v.max()), _r(v.norm()), [_r(a) for a in v[:4].tolist()]))
    N, H = len(packed), x.shape[-1]
    return HiddenRec([N, H], str(inp.cap.embed.dtype).replace("torch.", ""), [H, N], [N, H], out, 0)


def _positions(inp: StepInputs, packed: list[tuple[RowStep, int]], cfg: Any, inv: torch.Tensor | None,
               layer: int) -> PositionsRec:
    """Positions of the real tokens as HF was fed them, and HF's own rotary cos/sin at them (first pairs)."""
    pos = [int(inp.position_ids[r.b, c]) for r, c in packed]
    npair = min(3, cfg.rope_dim // 2)
    cs = []
    if inp.cap.cos is not None:
        for (r, c), p in list(zip(packed, pos))[:16]:
            cs.append({"pos": p, "cos": [_r(a) for a in inp.cap.cos[r.b, c, :npair].tolist()],
                       "sin": [_r(a) for a in inp.cap.sin[r.b, c, :npair].tolist()]})
    sc = cfg.rope_scaling
    return PositionsRec(
        inp_pos=pos, position_ids=pos, pairing="neox", pairing_in_file=cfg.rope_pairing_in_file, theta=cfg.rope_theta,
        theta_is_default=cfg.rope_theta_is_default, rope_dim=cfg.rope_dim, head_dim=cfg.head_dim,
        scaling={"type": sc.type, "factor": sc.factor, "freq_factors": None},
        inv_freq_first=[_r(float(x), 9) for x in (inv[:npair].tolist() if inv is not None else [])], cos_sin=cs,
        evidence={"layer": layer, "source": "HF rotary_emb(hidden, position_ids) output, batch row and column of each token"})


def _mask(inp: StepInputs, rows: list[RowStep], reqs: list[ReqStep], cfg: Any) -> MaskRec:
    vis = [{"seq_id": r.seq_id, "queries": [{"pos": p, "keys": v} for p, v in zip(r.positions, r.visible)]} for r in reqs]
    logical = [visible_of(inp, r, "full_attention")[1] for r in rows]
    fn, m = inp.cap.masks.get("full_attention", ("create_causal_mask", None))
    kind = "none: is_causal" if m is None else ("bool keep mask" if m.dtype == torch.bool else "additive float mask")
    rule = (f"dense: HF {fn} over the [B, L] attention_mask ({kind}): query column i keeps key column j iff "
            "attention_mask[b, j] = 1 and j <= i; pad columns are dropped; visible keys are the real positions kept")
    rec = MaskRec("dense", rule, vis, None, None, logical)
    if getattr(cfg, "windowed_layers", None):
        W = cfg.sliding_window
        rec.swa = {"n_swa": W, "layers": list(cfg.windowed_layers),
                   "global_layers": [i for i in range(cfg.n_layer) if i not in cfg.windowed_layers],
                   "convention": f"HF create_sliding_window_causal_mask: query column i keeps key column j iff "
                                 f"i - W < j <= i (W = {W}, in columns: pads count) and attention_mask[b, j] = 1",
                   "visible": [{"seq_id": r.seq_id, "queries": [{"pos": p, "keys": v} for p, v in
                                                               zip(r.positions, r.visible_swa or [])]} for r in reqs],
                   "rope_theta_swa": cfg.rope_theta_swa}
    return rec


def dense_physical(inp: StepInputs, padding: str, padded_len: int, finished_rows: dict[int, int],
                   row_seq: list[int]) -> dict[str, Any]:
    """``kv.physical`` of the dense convention: the ``[B, L]`` grid after the step (L = ``padded_len`` + decode
    steps), per batch row its real and pad columns, and every layer type's cache length (``get_seq_length()``)
    and stored columns (a sliding layer stores at most ``sliding_window - 1``)."""
    am = inp.attention_mask.tolist()
    grid = []
    for b, row in enumerate(am):
        grid.append({"row": b, "seq_id": row_seq[b], "real_cols": ranges_text([j for j, m in enumerate(row) if m]),
                     "pad_cols": ranges_text([j for j, m in enumerate(row) if not m]), "len": sum(row),
                     "finished": b in finished_rows,
                     "fed_pad_cols": ranges_text(range(finished_rows[b], len(row))) if b in finished_rows else "-"})
    lens: dict[str, dict[str, int]] = {}
    for d in cache_layers(inp.cache):
        lens.setdefault("sliding_attention" if d["is_sliding"] else "full_attention",
                        {"seq_length": d["seq_length"], "stored": d["stored"]})
    return {"kind": "dense", "batch_size": len(am), "padded_len": padded_len, "columns": len(am[0]) if am else 0,
            "padding": padding, "rows": grid, "cache": lens}


def _kv(inp: StepInputs, rows: list[RowStep], cfg: Any, layer: int, padding: str, padded_len: int,
        finished_rows: dict[int, int], row_seq: list[int], n_first: int) -> KVRec:
    lay = inp.cache.layers[layer]
    keys, vals = lay.keys, lay.values  # [B, n_kv, stored, hd]
    total = inp.attention_mask.shape[1]
    off = total - keys.shape[-2]  # a sliding layer stores the last columns only
    per, view = [], {"layer": layer, "requests": []}
    for r in rows:
        cols = [inp.past + c for c in r.q_cols]
        per.append({"seq_id": r.seq_id, "shape_before": [r.C, cfg.n_head_kv, cfg.head_dim],
                    "shape_after": [r.C + r.T, cfg.n_head_kv, cfg.head_dim], "written_pos": ranges_text(range(r.C, r.C + r.T)),
                    "row": r.b, "columns": ranges_text(cols)})
        vrows = []
        for p, col in list(zip(range(r.C, r.C + r.T), cols))[:8]:
            j = col - off
            if 0 <= j < keys.shape[-2]:
                vrows.append({"pos": p, "k": [_r(a) for a in keys[r.b, 0, j, :n_first].tolist()],
                              "v": [_r(a) for a in vals[r.b, 0, j, :n_first].tolist()]})
        view["requests"].append({"seq_id": r.seq_id, "rows": vrows})
    phys = dense_physical(inp, padding, padded_len, finished_rows, row_seq)
    return KVRec("dense", str(keys.dtype).replace("torch.", ""), len(inp.cache.layers), per, view, phys, list(keys.shape))


def _decode(inp: StepInputs, rows: list[RowStep], reqs: list[ReqStep], tok: Any, params: dict[int, Any],
            top_k: int) -> DecodeRec:
    per, lrows = [], []
    for r, rq in zip(rows, reqs):
        s = r.sample
        if s is None:
            per.append({"seq_id": r.seq_id, "row": None, "note": "no logits needed"})
            continue
        lrows.append(rq.rows[r.q_cols.index(r.logit_col)])  # the packed row whose logits were sampled
        per.append({"seq_id": r.seq_id, "row": rq.logits_row, "sampler": params[r.seq_id].to_dict(),
                    "top": [{"id": i, "piece": tok.piece(i), "logit": _r(lg, 5), "prob": _r(p, 5)} for i, lg, p in s.top[:top_k]],
                    "chosen": s.token, "chosen_piece": tok.piece(s.token),
                    "next_input": None if r.finished else s.token,
                    "next_pos": None if r.finished else rq.positions[-1] + 1, "stop": r.finished})
    V = inp.logits.shape[-1]
    return DecodeRec([len(lrows), V], str(inp.logits.dtype).replace("torch.", ""), lrows, per)
