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
  slots / cells holding them (``state_indices``, ``rs_z``), and why prefix reuse is off; a speculative
  run adds the verify snapshots per slot and their bytes (``snapshots_per_slot``).

Mirrors TensorRT-LLM ``_torch/pyexecutor/model_engine.py`` (mRoPE position ids),
``mamba_cache_manager.py`` (state slots) and llama.cpp ``src/llama-graph.cpp`` /
``llama-memory-recurrent.cpp``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from infertrace.model.taps import ATTN_IN, ATTN_OUT, EMBED, GATE, K, Q, QKV, SSM_STATE, V, Z

#: tokens whose positions are listed (the rest are counted)
MAX_POS = 16
#: llama.cpp ``n_pos_per_embd()`` for M-RoPE / interleaved M-RoPE
N_POS_PER_EMBD = 4


def _dt(t: torch.Tensor) -> str:
    return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
            torch.int32: "I32"}.get(t.dtype, str(t.dtype).replace("torch.", ""))


def _shape(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": [int(x) for x in t.shape], "dtype": _dt(t)}


def _flat(t: torch.Tensor) -> dict[str, Any]:
    """Shape of ``t`` with the head dims flattened (``[N, heads, hd]`` -> ``[N, heads*hd]``), as the projection
    output holds it."""
    return {"shape": [int(t.shape[0]), math.prod(int(x) for x in t.shape[1:])], "dtype": _dt(t)}


def hybrid_record(cfg: Any, positions: torch.Tensor | None, state: dict[str, Any] | None,
                  taps: Mapping[tuple[str, int | None], torch.Tensor], ids: torch.Tensor | None, layer: int,
                  reason: str) -> dict[str, Any]:
    """JSON-ready hybrid section of one step (see the module docstring).

    Args:
        cfg: the :class:`ModelConfig` (``is_hybrid``). positions: the step's ``[N]`` positions (the attention
            inputs'; None when idle). state: the memory's recurrent state summary (``RecurrentState.describe_state``,
            as the probe copied it; None when the memory holds none). taps: this step's tap tensors by
            ``(name, layer)`` (:mod:`infertrace.model.taps`; the embedding under layer None); ids: the
            embedding's input ids or None. layer: the full-attention layer shown. reason: why prefix reuse is off.
    """
    lin = [i for i in range(cfg.n_layer) if cfg.is_linear(i)]
    full = [i for i in range(cfg.n_layer) if not cfg.is_linear(i)]
    rec: dict[str, Any] = {"layer_map": {"linear_attention": lin, "full_attention": full,
                                         "types": ["GDN" if cfg.is_linear(i) else "attn" for i in range(cfg.n_layer)]},
                           "prefix_reuse": reason, "layer": layer}
    if positions is not None:
        pos = positions.tolist()
        n = len(pos)
        rec["positions"] = {
            "position_ids_shape": [3, 1, n], "position_ids": [pos[:MAX_POS]] * 3, "dtype": _dt(positions),
            "n_pos_per_embd": N_POS_PER_EMBD, "inp_pos_len": n * N_POS_PER_EMBD,
            "inp_pos": (pos[:MAX_POS] + pos[:MAX_POS] + pos[:MAX_POS] + [0] * min(n, MAX_POS)) if n <= MAX_POS else [],
            "consumers": full, "ignored_by": lin, "rope_dim": cfg.rope_dim, "head_dim": cfg.head_dim,
            "sections": list(cfg.mrope_sections),
        }
    e = taps.get((EMBED, None))
    if e is not None:
        rec["hidden"] = _shape(e)
        if ids is not None:
            rec["input_ids"] = _shape(ids)

    def val(name: str, il: int | None) -> Any:
        return taps.get((name, il))

    qkv = val(QKV, layer)
    if qkv is not None:  # Q / K / V as the projection yields them, flat per token; z * sigmoid(gate) has z's shape
        rec["projection"] = {"layer": layer, "h": _shape(val(ATTN_IN, layer)), "qkv": _shape(qkv), "q": _flat(val(Q, layer)),
                             "gate": _shape(val(GATE, layer)), "k": _flat(val(K, layer)), "v": _flat(val(V, layer)),
                             "heads": [cfg.n_head, cfg.n_head_kv, cfg.head_dim]}
        z = val(Z, layer)
        if z is not None:
            rec["projection"].update(attn_out=_shape(z), gated=_shape(z), o_proj=_shape(val(ATTN_OUT, layer)))
    if state is not None:
        gdn = [il for (name, il) in taps if name == SSM_STATE]
        rec["state"] = dict(state)
        if gdn:  # the last GDN layer tapped this step
            rec["state"]["gdn_layer"] = max(gdn)
            rec["state"]["qkv"] = _shape(val(QKV, max(gdn)))
    return rec
