"""The hybrid section of a step record (Qwen3.5: GDN + full attention), built from run-time values.

What a hybrid step adds to the five variables, each measured in the run (shapes and dtypes read
from the tensors the forward tapped, never derived from the config):

* layer map: which layers are GDN (``linear_attention``) and which full attention;
* positions: M-RoPE ``position_ids [3, 1, N]`` (TensorRT-LLM / HF: three axes t/h/w, all equal for
  text) beside llama.cpp's flat ``inp_pos`` of ``n_tokens * n_pos_per_embd`` int32 (``n_pos_per_embd``
  = 4 for M-RoPE: axes t, h, w then a zero axis; ``llm_graph_input_pos::set_input``); who consumes
  them (full-attention layers only) and which dims rotate;
* projections of one full-attention layer: ``qkv_proj [N, H] -> [N, 2*nh*hd + 2*nkv*hd]`` split
  into Q / gate / K / V, attention output ``* sigmoid(gate)`` -> ``o_proj``;
* memory: per GDN layer the conv state ``[conv_dim, K-1]`` and recurrent state ``[Hv, dk, dv]`` of
  each request (shape constant; L2 norm and checksum per step show the values advance), the
  slots / cells holding them (``state_indices``, ``rs_z``), and why prefix reuse is off.

Mirrors TensorRT-LLM ``_torch/pyexecutor/model_engine.py`` (mRoPE position ids),
``mamba_cache_manager.py`` (state slots) and llama.cpp ``src/llama-graph.cpp`` /
``llama-memory-recurrent.cpp``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from infertrace.kv.base import Memory

#: tokens whose positions are listed (the rest are counted)
MAX_POS = 16
#: llama.cpp ``n_pos_per_embd()`` for M-RoPE / interleaved M-RoPE
N_POS_PER_EMBD = 4


def _dt(t: torch.Tensor) -> str:
    return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
            torch.int32: "I32"}.get(t.dtype, str(t.dtype).replace("torch.", ""))


def _shape(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": [int(x) for x in t.shape], "dtype": _dt(t)}


def hybrid_record(cfg: Any, inp: Any, kv: Memory, taps: dict[str, dict[str, Any]], layer: int, reason: str) -> dict[str, Any]:
    """JSON-ready hybrid section of one step (see the module docstring).

    Args:
        cfg: the :class:`ModelConfig` (``is_hybrid``). inp: the step's AttnInputs (None when idle).
        kv: the :class:`~infertrace.kv.recurrent.HybridKV`. taps: this step's ``attn_proj`` /
            ``attn_out`` / ``gdn`` taps. layer: the full-attention layer shown. reason: why prefix
            reuse is off.
    """
    lin = [i for i in range(cfg.n_layer) if cfg.is_linear(i)]
    full = [i for i in range(cfg.n_layer) if not cfg.is_linear(i)]
    rec: dict[str, Any] = {"layer_map": {"linear_attention": lin, "full_attention": full,
                                         "types": ["GDN" if cfg.is_linear(i) else "attn" for i in range(cfg.n_layer)]},
                           "prefix_reuse": reason, "layer": layer}
    if inp is not None:
        pos = inp.positions.tolist()
        n = len(pos)
        rec["positions"] = {
            "position_ids_shape": [3, 1, n], "position_ids": [pos[:MAX_POS]] * 3, "dtype": _dt(inp.positions),
            "n_pos_per_embd": N_POS_PER_EMBD, "inp_pos_len": n * N_POS_PER_EMBD,
            "inp_pos": (pos[:MAX_POS] + pos[:MAX_POS] + pos[:MAX_POS] + [0] * min(n, MAX_POS)) if n <= MAX_POS else [],
            "consumers": full, "ignored_by": lin, "rope_dim": cfg.rope_dim, "head_dim": cfg.head_dim,
            "sections": list(cfg.mrope_sections),
        }
    e = taps.get("embed")
    if e is not None:
        rec["hidden"] = _shape(e["hidden"])
        if e.get("ids") is not None:
            rec["input_ids"] = _shape(e["ids"])
    a, o = taps.get("attn_proj"), taps.get("attn_out")
    if a is not None:
        rec["projection"] = {"layer": int(a["layer"]), "h": _shape(a["h"]), "qkv": _shape(a["qkv"]), "q": _shape(a["q"]),
                             "gate": _shape(a["gate"]), "k": _shape(a["k"]), "v": _shape(a["v"]),
                             "heads": [cfg.n_head, cfg.n_head_kv, cfg.head_dim]}
        if o is not None:
            rec["projection"].update(attn_out=_shape(o["o"]), gated=_shape(o["gated"]), o_proj=_shape(o["out"]))
    st = kv.recurrent_state()
    if st is not None:
        g = taps.get("gdn")
        rec["state"] = state_summary(st, inp is not None)
        if g is not None:
            rec["state"]["gdn_layer"] = int(g["layer"])
            rec["state"]["qkv"] = _shape(g["qkv"])
    return rec


def state_summary(st: Any, active: bool = True) -> dict[str, Any]:
    """JSON-ready view of a :class:`~infertrace.kv.recurrent.RecurrentState` (its ``describe_state``)."""
    return st.describe_state(active)
