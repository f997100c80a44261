"""``--keep tensors``: the saved tensors agree with the records (names, shapes, quoted values; rule 9).
"""

from __future__ import annotations

import re
from typing import Any

from infertrace.trace.check.base import _int, kept_len, Violation


_TENSOR = re.compile(r"step([0-9]+)/(?:layer([0-9]+)/(?:seq([0-9]+)/)?)?([a-z0-9_]+)")


#: per-token tensors of a layer: [N, n_head, head_dim] (q), [N, n_head_kv, head_dim] (k, v), else [N, n_embd]
_HEADS = {"q_pre_rope": "n_head", "q_post_rope": "n_head", "k_pre_rope": "n_head_kv", "k_post_rope": "n_head_kv", "v": "n_head_kv"}


def check_tensors(manifest: dict[str, Any], tensors: Any) -> tuple[Violation | None, int]:
    """The saved tensors agree with the records of ``trace.json`` (``tensors``: a
    :class:`~infertrace.trace.store.TraceTensors` whose header :func:`~infertrace.trace.store.load_tensors`
    already checked against the manifest's index). Each name's step is a step of the trace and its layer
    one of ``store.tensor_layers``; per-token tensors have the step's N rows (``hidden`` / ``hidden_in`` /
    ``attn_out`` / ``mlp_out`` / ``resid_post`` ``[N, n_embd]``, ``q_*`` ``[N, n_head, head_dim]``, ``k_*`` / ``v``
    ``[N, n_head_kv, head_dim]``), ``seq{id}/k_cache`` / ``v_cache`` hold the positions the request holds
    after the step ``[C + kept, n_head_kv, head_dim]``, ``logits_topk_*`` one row per logits row; and the
    values the records quote are the tensors' values (``hidden.rows[k].first`` = ``step{s}/hidden[k, :n]``,
    ``kv.layer_view`` K/V rows = ``seq{id}/k_cache[pos, 0, :n]`` / ``v_cache``; stored rounded to 6 digits: 1e-5).

    Returns:
        ``(first violation or None, number of checks made)``.
    """
    n = 0
    cfg = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    steps = {st["step"]: st for st in manifest.get("steps", []) if isinstance(st, dict) and _int(st.get("step"))}
    layers = set((manifest.get("store") or {}).get("tensor_layers") or [])

    def bad(step: Any, sid: Any, rule: str, detail: str) -> tuple[Violation, int]:
        return Violation(step if _int(step) else None, sid if _int(sid) else None, "tensors", rule, detail), n

    def close(a: Any, b: Any) -> bool:
        return isinstance(b, (int, float)) and abs(float(a) - b) <= 1e-5 * max(1.0, abs(b))

    for name in sorted(tensors.index):
        m = _TENSOR.fullmatch(name)
        shape = list(tensors.index[name].get("shape") or [])
        n += 1
        if m is None:
            return bad(None, None, "tensor names", f"{name[:60]!r} is not stepN/[layerL/[seqS/]]name")
        s, il, sid, leaf = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        st = steps.get(s)
        if st is None:
            return bad(s, None, "tensors of the trace's steps", f"{name} names step {s}, which the trace does not have")
        if il is not None and int(il) not in layers:
            return bad(s, None, "tensors of the trace's steps", f"{name} names layer {il}, not one of store.tensor_layers")
        N = st.get("N")
        if sid is not None:
            r = next((r for r in st.get("batch", []) if r.get("seq_id") == int(sid)), None)
            want = [kept_len(r) if r is not None else None, cfg.get("n_head_kv"), cfg.get("head_dim")]
        elif leaf.startswith("logits_topk"):
            rows = (st.get("decode") or {}).get("logits_rows")
            want = [len(rows) if isinstance(rows, list) else None, None]
        elif leaf in _HEADS:
            want = [N, cfg.get(_HEADS[leaf]), cfg.get("head_dim")]
        else:
            want = [N, cfg.get("n_embd")]
        if len(shape) != len(want) or any(w is not None and x != w for x, w in zip(shape, want)):
            return bad(s, int(sid) if sid else None, "tensor shapes agree with the records",
                       f"{name} is {shape}, the step's records give {[w if w is not None else '*' for w in want]}")
    for s, st in steps.items():
        h = st.get("hidden")
        if isinstance(h, dict) and f"step{s}/hidden" in tensors.index:
            x = tensors.array(f"step{s}/hidden")  # [N, n_embd]
            for k, row in enumerate(h.get("rows") or []):
                for j, v in enumerate((row.get("first") or [])[: x.shape[1]] if k < x.shape[0] else []):
                    n += 1
                    if not close(x[k, j], v):
                        return bad(s, row.get("seq_id"), "recorded values are the tensors'",
                                   f"hidden.rows[{k}].first[{j}] = {v!r} but step{s}/hidden[{k}, {j}] = {float(x[k, j]):.6g}")
        lv = (st.get("kv") or {}).get("layer_view") if isinstance(st.get("kv"), dict) else None
        if not isinstance(lv, dict):
            continue
        for req in lv.get("requests") or []:
            for kind in ("k", "v"):
                name = f"step{s}/layer{lv.get('layer')}/seq{req.get('seq_id')}/{kind}_cache"
                if name not in tensors.index:
                    continue
                x = tensors.array(name)  # [len, n_head_kv, head_dim]
                for row in req.get("rows") or []:
                    p = row.get("pos")
                    for j, v in enumerate(row.get(kind) or []):
                        if not (_int(p) and p < x.shape[0] and j < x.shape[2]):
                            continue
                        n += 1
                        if not close(x[p, 0, j], v):
                            return bad(s, req.get("seq_id"), "recorded values are the tensors'",
                                       f"kv.layer_view {kind} of pos {p}[{j}] = {v!r} but {name}[{p}, 0, {j}] = {float(x[p, 0, j]):.6g}")
    return None, n
