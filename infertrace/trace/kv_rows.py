"""K/V of a saved trace per (request, sequence position), for comparisons across requests and runtimes.

Two sources, best first:

* the kept tensors (``run --save``, ``--keep tensors``): ``step{s}/layer{l}/seq{id}/k_cache`` /
  ``v_cache`` ``[len, n_kv, head_dim]`` after the last step holding the request, read back by position
  through the request's own cells or block table -- so a position served from the prefix cache holds
  the K/V of the request that wrote it;
* the summary every trace has: ``kv.layer_view`` rows (head 0, the first few dims, the first 8
  positions each chunk wrote) of the evidence layer.

Torch-free (numpy only when tensors are read).
"""

from __future__ import annotations

import re
from typing import Any

#: relative rounding of one stored value, by K/V storage dtype (half an ulp: 2^-(mantissa bits + 1))
DTYPE_EPS = {"float32": 2.0 ** -24, "f32": 2.0 ** -24, "float16": 2.0 ** -11, "f16": 2.0 ** -11,
             "bfloat16": 2.0 ** -8, "bf16": 2.0 ** -8, "q8_0": 2.0 ** -8, "fp8": 2.0 ** -4, "fp8_e4m3": 2.0 ** -4}


def kv_rows(m: dict[str, Any], tensors: Any, sid: int, layer: int | None = None) -> tuple[dict[int, tuple[Any, Any]], str]:
    """``({j: (k, v)}, source)``: the K and V the trace holds for request ``sid`` at sequence index ``j``
    (numpy float32 arrays ``[n_kv, head_dim]`` from tensors, or lists ``[n]`` from ``kv.layer_view``),
    and a sentence saying which source was used. Layer: ``layer`` or the trace's evidence layer."""
    import numpy as np

    opts = m.get("options") if isinstance(m.get("options"), dict) else {}
    L = layer if layer is not None else opts.get("layer", 0)
    if tensors is not None:
        pat = re.compile(rf"step(\d+)/layer{L}/seq{sid}/k_cache$")
        steps = sorted(int(mt.group(1)) for n in tensors.names() if (mt := pat.match(n)))
        if steps:
            s = steps[-1]
            k = np.asarray(tensors.array(f"step{s}/layer{L}/seq{sid}/k_cache"), dtype=np.float32)  # [len, n_kv, hd]
            v = np.asarray(tensors.array(f"step{s}/layer{L}/seq{sid}/v_cache"), dtype=np.float32)  # [len, n_kv, hd]
            return ({j: (k[j], v[j]) for j in range(min(len(k), len(v)))},
                    f"kept tensors: layer {L}, every K/V head and dim, the request's cache after its last step")
    out: dict[int, tuple[Any, Any]] = {}
    for st in m.get("steps", []) or []:
        kv = st.get("kv") if isinstance(st, dict) and isinstance(st.get("kv"), dict) else {}
        lv = kv.get("layer_view") if isinstance(kv.get("layer_view"), dict) else {}
        for rq in lv.get("requests", []) or []:
            if not isinstance(rq, dict) or rq.get("seq_id") != sid:
                continue
            for row in rq.get("rows", []) or []:
                if isinstance(row, dict) and isinstance(row.get("pos"), int) and isinstance(row.get("k"), list):
                    out[row["pos"]] = (np.asarray(row["k"], dtype=np.float32), np.asarray(row.get("v") or [], dtype=np.float32))
        L = lv.get("layer", L)
    return out, f"summary kv.layer_view: layer {L}, K/V head 0, the first dims, the first 8 positions each chunk wrote"


def kv_dtype(m: dict[str, Any]) -> str:
    """The K/V storage dtype of a trace: llama.cpp's ``type_k``, else the steps' ``kv.dtype`` (``float32`` if none)."""
    opts = m.get("options") if isinstance(m.get("options"), dict) else {}
    lc = opts.get("llama_cpp") if isinstance(opts.get("llama_cpp"), dict) else {}
    if isinstance(lc.get("type_k"), str):
        return lc["type_k"].lower()
    for st in m.get("steps", []) or []:
        kv = st.get("kv") if isinstance(st, dict) else None
        if isinstance(kv, dict) and isinstance(kv.get("dtype"), str):
            return kv["dtype"].lower().replace("torch.", "")
    return "float32"


def compare_kv(ra: dict[int, tuple[Any, Any]], rb: dict[int, tuple[Any, Any]], pairs: list[tuple[int, int]],
               rel_floor: float, keep: int | None = 8) -> dict[str, Any]:
    """K/V at the position pairs ``(j in A, j in B)`` both hold: max |ΔK|, max |ΔV| and the positions whose
    |Δ| exceeds the noise floor ``rel_floor × max(|x|)`` of that position's vectors.

    Returns:
        ``{"positions", "max_abs_k", "max_abs_v", "floor_rel", "over_floor": [{"j", "dk", "dv", "floor"}] (the first
        ``keep``; None: all), "n_over"}``.
    """
    import numpy as np

    mk = mv = 0.0
    over: list[dict[str, Any]] = []
    n = n_over = 0
    for ja, jb in pairs:
        if ja not in ra or jb not in rb:
            continue
        (ka, va), (kb, vb) = ra[ja], rb[jb]
        if np.shape(ka) != np.shape(kb) or np.shape(va) != np.shape(vb):
            continue
        n += 1
        dk = float(np.abs(ka - kb).max(initial=0.0))
        dv = float(np.abs(va - vb).max(initial=0.0))
        mk, mv = max(mk, dk), max(mv, dv)
        scale = max(float(np.abs(ka).max(initial=0.0)), float(np.abs(kb).max(initial=0.0)),
                    float(np.abs(va).max(initial=0.0)), float(np.abs(vb).max(initial=0.0)))
        floor = rel_floor * scale
        if dk > floor or dv > floor:
            n_over += 1
            if keep is None or len(over) < keep:
                over.append({"j": ja if ja == jb else [ja, jb], "dk": dk, "dv": dv, "floor": floor})
    return {"positions": n, "max_abs_k": mk, "max_abs_v": mv, "floor_rel": rel_floor, "over_floor": over, "n_over": n_over}


#: llama.cpp's CPU matmuls with quantised weights quantise the activations to 8 bits first (ggml's
#: ``vec_dot_type`` q8_0 / q8_1 / q8_K): half a step of 8-bit rounding of each block's max
ACT_Q8_EPS = 2.0 ** -8
#: float32 products summed in a different order (576-wide dot products: a few ulps each)
ACCUM_EPS = 2.0 ** -17
#: floor = FACTOR x the sum of the roundings both traces' numerics carry
FACTOR = 4.0


def _quantised_activations(m: dict[str, Any]) -> bool:
    opts = m.get("options") if isinstance(m.get("options"), dict) else {}
    w = opts.get("weights")
    # llama.cpp's header section: its CPU kernels quantise activations (q8) as the quant path does
    return isinstance(opts.get("llama_cpp"), dict) or (isinstance(w, dict) and w.get("weights") == "quant")


def kv_floor(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, str]:
    """``(rel, how)``: the K/V noise floor between traces ``a`` and ``b`` relative to a position's largest
    |K|,|V|: :data:`FACTOR` x (each side's K/V storage rounding + 8-bit activation rounding of a llama.cpp
    quantised matmul, where one ran + float32 accumulation order)."""
    parts = [(f"{kv_dtype(m)} cache", DTYPE_EPS.get(kv_dtype(m), 2.0 ** -24)) for m in (a, b)]
    if any(_quantised_activations(m) for m in (a, b)):
        parts.append(("8-bit activations of quantised matmuls", ACT_Q8_EPS))
    parts.append(("float32 accumulation order", ACCUM_EPS))
    eps = sum(e for _, e in parts)
    how = f"{FACTOR:g} × ({' + '.join(f'{n} {e:.2g}' for n, e in parts)}) = {FACTOR * eps:.3g} × max |K|,|V| of the position"
    return FACTOR * eps, how
