"""``infertrace diff A B`` when A and B were computed by different engines (a ``run --runtime llama.cpp``
trace against a ``cells`` trace of ours): structure exactly, floats as agreement statistics.

The structural projection keeps every integer and text field of the five variables -- schedule,
token ids, positions (``inp_pos``, cos/sin of the positions), the mask (visible keys, logical
keep-matrix, kq_mask ``ne``, ``n_kv``, rows as 0/-inf, each cell's pos and seq_ids; on windowed models
``kq_mask_swa`` and llama.cpp's iSWA SWA pool: size, ``n_kv``, ``k_idxs``, heads, reuse), the cache
(cells written, ownership, head, used, ``n_kv``), the rows that produce logits -- and is compared
with :func:`infertrace.trace.diff.diff_traces` (exactly: no float is left in it). Float fields
(hidden statistics, RoPE evidence, K/V values, logits and probabilities) and what depends on
them (the chosen tokens) are summarised instead: same-top-token rate and max |Δ| where both
traces hold the same value. Storage dtypes (llama.cpp: F16 mask with flash attention, F16 KV
cache) are listed as representation notes, not differences.
"""

from __future__ import annotations

from typing import Any

from infertrace.trace.diff import DiffResult, diff_traces

_HIDDEN = ("logical_shape", "ggml_ne", "packed_shape", "cached_tokens_recomputed")
_POS = ("inp_pos", "position_ids", "pairing", "pairing_in_file", "rope_dim", "head_dim", "theta", "scaling",
        "inv_freq_first", "cos_sin")
_KQ = ("ne", "n_kv", "n_tokens", "rows", "cell_pos", "cell_seq", "n_stream", "stream_size", "streams")  # streams: --kv-unified off
_BATCH_FLOATY = ("sampled", "sampled_piece")
#: physical fields owned by a runtime's allocator policy, not by the convention: llama.cpp's memory-API
#: ranges (checked by `check` / diff-backends), and the free pool of a paged cache (vLLM's free queue
#: also counts freed blocks that keep their prefix hash; a --replay run places nothing itself)
_POLICY = ("llama_memory_seq_pos", "recurrent_cells", "free_blocks", "used_blocks", "free_list_head", "cached_blocks", "cached_free_blocks")


def _pick(d: Any, keys: tuple[str, ...]) -> Any:
    return {k: d[k] for k in keys if k in d} if isinstance(d, dict) else d


def structure(m: dict[str, Any]) -> dict[str, Any]:
    """The structural projection of a manifest (see the module docstring)."""
    steps = []
    for st in m.get("steps", []) if isinstance(m.get("steps"), list) else []:
        if not isinstance(st, dict):
            steps.append(st)
            continue
        s = {k: st.get(k) for k in ("step", "N", "admitted", "preempted")}
        s["batch"] = [{k: v for k, v in r.items() if k not in _BATCH_FLOATY} if isinstance(r, dict) else r
                      for r in st.get("batch", []) or []]
        if isinstance(st.get("hidden"), dict):
            s["hidden"] = _pick(st["hidden"], _HIDDEN)
        if isinstance(st.get("positions"), dict):
            s["positions"] = _pick(st["positions"], _POS)
        mk = st.get("mask")
        if isinstance(mk, dict):
            s["mask"] = {"visible": mk.get("visible"), "logical": mk.get("logical"), "kq_mask": _pick(mk.get("kq_mask"), _KQ),
                         "metadata": mk.get("metadata")}
            sw = mk.get("swa")
            if isinstance(sw, dict) and (sw.get("kq_mask_swa") or sw.get("pool")):  # iSWA: kq_mask_swa over the SWA pool
                s["mask"]["swa"] = {"visible": sw.get("visible"), "pool": sw.get("pool"),
                                    "kq_mask_swa": _pick(sw.get("kq_mask_swa"), ("ne", "rows", "col_start", "cell_pos"))}
        kv = st.get("kv")
        if isinstance(kv, dict):
            phys = kv.get("physical")
            if isinstance(phys, dict):  # llama.cpp's memory-API ranges: checked by `check`/diff-backends, not ours to hold
                phys = {k: v for k, v in phys.items() if k not in _POLICY}
            s["kv"] = {"backend": kv.get("backend"), "layers": kv.get("layers"), "per_request": kv.get("per_request"),
                       "physical": phys, "physical_shape": kv.get("physical_shape")}
        dc = st.get("decode")
        if isinstance(dc, dict):
            s["decode"] = {"logits_shape": dc.get("logits_shape"), "logits_rows": dc.get("logits_rows"),
                           "per_request": [_pick(p, ("seq_id", "row", "next_pos", "note")) for p in dc.get("per_request", []) or []]}
        steps.append(s)
    reqs = [_pick(r, ("seq_id", "prompt", "prompt_ids", "arrival_step", "params")) for r in m.get("requests", []) or []]
    return {"schema_version": m.get("schema_version"), "model": m.get("model"), "config": m.get("config"),
            "steps": steps, "requests": reqs}


def _dtypes(m: dict[str, Any]) -> dict[str, list[str]]:
    out: dict[str, set] = {"kq_mask": set(), "kv": set()}
    for st in m.get("steps", []) or []:
        if not isinstance(st, dict):
            continue
        km = (st.get("mask") or {}).get("kq_mask") if isinstance(st.get("mask"), dict) else None
        if isinstance(km, dict) and isinstance(km.get("dtype"), str):
            out["kq_mask"].add(km["dtype"])
        if isinstance(st.get("kv"), dict) and isinstance(st["kv"].get("dtype"), str):
            out["kv"].add(st["kv"]["dtype"])
    return {k: sorted(v) for k, v in out.items()}


def _maxabs(a: Any, b: Any) -> float:
    """max |a - b| over the numbers two equally shaped JSON values share (0 when none)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return 0.0
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(float(a) - float(b))
    if isinstance(a, list) and isinstance(b, list):
        return max((_maxabs(x, y) for x, y in zip(a, b)), default=0.0)
    if isinstance(a, dict) and isinstance(b, dict):
        return max((_maxabs(a[k], b[k]) for k in a.keys() & b.keys()), default=0.0)
    return 0.0


def floats(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Agreement of the float fields of two traces with the same schedule (steps paired by index)."""
    same = total = 0
    mx = {"hidden": 0.0, "kv": 0.0, "logits": 0.0}
    first_diff_token = None
    for x, y in zip(a.get("steps", []) or [], b.get("steps", []) or []):
        if not (isinstance(x, dict) and isinstance(y, dict)):
            continue
        if isinstance(x.get("hidden"), dict) and isinstance(y.get("hidden"), dict):
            mx["hidden"] = max(mx["hidden"], _maxabs([r.get("first") for r in x["hidden"].get("rows", []) if isinstance(r, dict)],
                                                     [r.get("first") for r in y["hidden"].get("rows", []) if isinstance(r, dict)]))
        if isinstance(x.get("kv"), dict) and isinstance(y.get("kv"), dict):
            mx["kv"] = max(mx["kv"], _maxabs(x["kv"].get("layer_view"), y["kv"].get("layer_view")))
        dx, dy = x.get("decode"), y.get("decode")
        if not (isinstance(dx, dict) and isinstance(dy, dict)):
            continue
        for px, py in zip(dx.get("per_request", []) or [], dy.get("per_request", []) or []):
            if not (isinstance(px, dict) and isinstance(py, dict)) or not px.get("top") or not py.get("top"):
                continue
            tx, ty = px["top"], py["top"]
            if not (isinstance(tx[0], dict) and isinstance(ty[0], dict)):
                continue
            total += 1
            if tx[0].get("id") == ty[0].get("id"):
                same += 1
            elif first_diff_token is None:
                first_diff_token = {"step": x.get("step"), "seq_id": px.get("seq_id"), "a": tx[0].get("id"), "b": ty[0].get("id")}
            lx = {t.get("id"): t.get("logit") for t in tx if isinstance(t, dict)}
            ly = {t.get("id"): t.get("logit") for t in ty if isinstance(t, dict)}
            mx["logits"] = max(mx["logits"], _maxabs([lx[k] for k in lx.keys() & ly.keys()], [ly[k] for k in lx.keys() & ly.keys()]))
    return {"same_top": same, "rows": total, "same_top_rate": same / total if total else None,  # None: no row to rate (never 0/0 as 100 %)
            "max_abs": mx, "first_different_top": first_diff_token}


#: llama.cpp context settings a ``run --runtime llama.cpp`` header records (``options.llama_cpp``) that
#: change its numbers (:meth:`infertrace.runtimes.llamacpp.capture.LlamaCppContext.settings`)
LLAMACPP_SETTINGS = ("version", "flash_attn", "flash_attn_type", "type_k", "type_v", "n_ctx", "n_batch", "n_ubatch",
                     "n_seq_max", "n_threads", "n_threads_batch", "kv_unified", "offload_kqv", "op_offload", "swa_full",
                     "n_gpu_layers", "gpu_offload", "use_extra_bufts", "system_info")


def llamacpp_settings(m: dict[str, Any]) -> dict[str, Any] | None:
    """The recorded llama.cpp settings of a trace (``None``: not computed by llama.cpp); a key an
    older trace did not record is absent."""
    lc = (m.get("options") or {}).get("llama_cpp") if isinstance(m.get("options"), dict) else None
    if not isinstance(lc, dict):
        return None
    return {k: lc[k] for k in LLAMACPP_SETTINGS if k in lc}


def settings_differences(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """The llama.cpp settings two traces differ in: ``[{"setting", "a", "b"}]`` (``None`` = not recorded,
    or not a llama.cpp trace). Empty when neither trace was computed by llama.cpp."""
    sa, sb = llamacpp_settings(a), llamacpp_settings(b)
    if sa is None and sb is None:
        return []
    sa, sb = sa or {}, sb or {}
    return [{"setting": k, "a": sa.get(k), "b": sb.get(k)} for k in LLAMACPP_SETTINGS if sa.get(k) != sb.get(k)]


def cross_engine_diff(a: dict[str, Any], b: dict[str, Any], ignore: tuple[str, ...] = ()) -> tuple[DiffResult, dict[str, Any]]:
    """Structure of ``a`` and ``b`` exactly (a :class:`DiffResult` over the projections, tolerance 0)
    plus the float summary and representation notes."""
    res = diff_traces(structure(a), structure(b), 0.0, 0.0, ignore=ignore)
    res.cross_engine = True
    kept = [m.get("store", {}).get("keep") == "tensors" for m in (a, b)]
    res.tensors_note = "tensors not compared across engines (" + (
        "both traces kept them" if all(kept) else "A kept them, B did not" if kept[0] else
        "B kept them, A did not" if kept[1] else "neither trace kept them") + ")"
    info = {"engines": [a.get("runtime", "infertrace"), b.get("runtime", "infertrace")], "floats": floats(a, b),
            "dtypes": {"a": _dtypes(a), "b": _dtypes(b)}}
    return res, info
