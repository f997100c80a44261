"""Gemma 3 (text): scaled embeddings, Gemma RMSNorm, pre/post norms, QK-norm, GeGLU, and
interleaved sliding-window layers with their own RoPE base.

llama.cpp ``src/models/gemma3.cpp`` + ``load_hparams`` (``LLM_ARCH_GEMMA3``: SWA pattern 6,
i.e. every 6th layer global; ``rope_freq_base_train_swa = 10000``; attention scale
``1/sqrt(key_length)``; ``final_logit_softcapping`` key) and HF ``Gemma3ForCausalLM`` /
``Gemma3TextConfig`` (``layer_types`` from ``sliding_window_pattern``, ``query_pre_attn_scalar``,
``rope_parameters`` per layer type, ``embed_scale = sqrt(hidden_size)`` in the model dtype).

Gemma RMSNorm multiplies by ``(1 + w)``. llama.cpp's converter stores ``w + 1`` in the GGUF
(HF's GGUF loader subtracts 1 again), so GGUF norm weights are used as they are and HF
checkpoints get ``+1`` folded in at load (see :mod:`infertrace.loading.weights`).
"""

from __future__ import annotations

import math
from typing import Any

from infertrace.model.families.base import Family, Ledger, gguf_common, gguf_unknown_keys, hf_act, hf_common, hf_rope_params, hf_rope_scaling, hf_window_layers, refuse_zero_window
from infertrace.model.families.qwen3 import QK_NORM_NAMES

#: llama.cpp ``hparams.set_swa_pattern(6)`` / HF ``sliding_window_pattern`` default.
SWA_PATTERN = 6
#: RoPE base of the sliding-window layers (llama.cpp ``rope_freq_base_train_swa``, HF ``rope_local_base_freq``).
LOCAL_THETA = 10000.0

LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    **QK_NORM_NAMES,
}


def _pattern(n_layer: int, pattern: int) -> tuple[bool, ...]:
    """Layer il is windowed unless ``(il + 1) % pattern == 0`` (llama.cpp ``set_swa_pattern``, HF ``layer_types``)."""
    return tuple(bool((i + 1) % pattern) for i in range(n_layer))


def _common_features(led: Ledger) -> dict[str, Any]:
    led.honour("(family) embeddings x sqrt(H)", True, "in the model dtype, as HF's Gemma3TextScaledWordEmbedding")
    led.honour("(family) pre/post attention and FFN norms", True, "attn_norm, post_attention_norm, ffn_norm, post_ffw_norm")
    led.honour("(family) q_norm / k_norm", True, "RMSNorm over head_dim on each Q/K head before RoPE")
    return {"family": "gemma3", "qk_norm": True, "post_norms": True}


def from_gguf(meta: dict[str, Any], led: Ledger, names: set[str]) -> dict[str, Any]:
    """``gemma3.*`` keys -> ModelConfig kwargs (llama.cpp ``LLM_ARCH_GEMMA3``)."""
    kw, f = gguf_common(meta, "gemma3", led)
    w = f.num("attention.sliding_window", 0, int) or 0
    if f.has("attention.sliding_window"):
        refuse_zero_window(led, f.key("attention.sliding_window"), f.get("attention.sliding_window"))
    pattern = f.num("attention.sliding_window_pattern", SWA_PATTERN, int)
    if pattern is None or pattern < 1:
        led.refuse(f.key("attention.sliding_window_pattern"), pattern, "must be >= 1")
        pattern = SWA_PATTERN
    swa = _pattern(kw["n_layer"], pattern) if w else tuple(False for _ in range(kw["n_layer"]))
    led.honour(f.key("attention.sliding_window"), w, f"layers {_ranges(swa, True)} windowed (pattern {pattern}: every "
               f"{pattern}th layer global), query at p sees keys p-{w}+1..p")
    if f.has("attention.sliding_window_pattern"):
        led.honour(f.key("attention.sliding_window_pattern"), pattern)
    cap = f.num("final_logit_softcapping")
    if cap is not None:
        led.honour(f.key("final_logit_softcapping"), cap, "logits = cap * tanh(logits / cap)")
    if f.has("attn_logit_softcapping"):
        led.refuse(f.key("attn_logit_softcapping"), f.get("attn_logit_softcapping"), "attention logit soft-capping is not implemented (Gemma 2)")
    gguf_unknown_keys(meta, "gemma3", led)
    feats = _common_features(led)
    led.honour("(llama.cpp) RoPE base of windowed layers", LOCAL_THETA, "rope_freq_base_train_swa; global layers use rope.freq_base")
    led.honour("(llama.cpp) attention scale", f"1/sqrt({kw['head_dim']})", "1/sqrt(key_length)")
    led.honour("(llama.cpp) FFN activation", "gelu (tanh)", "GeGLU: down(gelu_tanh(gate) * up)")
    return dict(kw, **feats, act="gelu_tanh", embed_scale=math.sqrt(kw["n_embd"]), attn_scale=kw["head_dim"] ** -0.5,
                final_logit_softcap=cap, sliding_window=w, swa_layers=swa, rope_theta_swa=LOCAL_THETA, rope_scaling_swa=False)


def _ranges(flags: tuple[bool, ...], want: bool) -> str:
    from infertrace.ranges import ranges_text

    return ranges_text([i for i, s in enumerate(flags) if s == want])


def from_hf(cfg: dict[str, Any], led: Ledger, names: set[str]) -> dict[str, Any]:
    """HF ``Gemma3TextConfig`` -> ModelConfig kwargs."""
    kw = hf_common(cfg, led, eps_default=1e-6)
    act = hf_act(cfg, led, "gelu_pytorch_tanh", ("gelu_tanh",))
    n = kw["n_layer"]
    pattern = int(cfg.get("sliding_window_pattern", SWA_PATTERN) or SWA_PATTERN)
    default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    swa = hf_window_layers(cfg, n, led, default)
    w = cfg.get("sliding_window", 4096)
    refuse_zero_window(led, "sliding_window", w)
    w = int(w) if w is not None else 0
    led.honour("sliding_window", w, f"layers {_ranges(swa, True)}: query at p sees keys p-W+1..p")
    if "sliding_window_pattern" in cfg:
        led.honour("sliding_window_pattern", pattern)
    qpas = float(cfg.get("query_pre_attn_scalar", 256))
    led.honour("query_pre_attn_scalar", qpas, f"softmax scale {qpas:g}^-0.5")
    rs_local, lkey = hf_rope_params(cfg, "sliding_attention")
    local_theta = float(cfg.get("rope_local_base_freq", rs_local.get("rope_theta", LOCAL_THETA)))
    led.honour("rope_local_base_freq", local_theta, "RoPE base of the sliding-window layers")
    if lkey.startswith("rope_parameters.") and str(rs_local.get("rope_type", "default")) not in ("default", "none"):
        led.refuse(f"{lkey}.rope_type", rs_local.get("rope_type"), "scaling on the sliding-window layers is not implemented")
    rs_glob, gkey = hf_rope_params(cfg, "full_attention")
    if "rope_theta" not in cfg and "rope_theta" not in rs_glob:
        kw["rope_theta"], kw["rope_theta_is_default"] = 1_000_000.0, False
        led.add("rope_theta", "absent (Gemma 3 default 1e6)", "honoured")
    cap = cfg.get("final_logit_softcapping")
    if cap is not None:
        led.honour("final_logit_softcapping", cap, "logits = cap * tanh(logits / cap)")
    feats = _common_features(led)
    return dict(kw, **feats, act=act, embed_scale=math.sqrt(kw["n_embd"]), attn_scale=qpas ** -0.5,
                final_logit_softcap=float(cap) if cap is not None else None, sliding_window=w, swa_layers=swa,
                rope_theta_swa=local_theta, rope_scaling_swa=False)


def hf_weights(cfg: Any, w: dict[str, Any]) -> dict[str, Any]:
    """Gemma RMSNorm multiplies by ``(1 + w)``: fold the 1 into every ``*norm`` weight once (float32),
    as llama.cpp's converter does, so the decoder always uses ``x_hat * w``."""
    return {k: (v.float() + 1.0 if k.split(".")[-1].endswith("norm") else v) for k, v in w.items()}


def load_notes(cfg: Any, source: str, raw: dict[str, Any]) -> list[str]:
    """Where the Gemma norm's ``+1`` comes from in this file."""
    if source == "gguf":
        return ["Gemma RMSNorm (1 + w): llama.cpp's converter stored w + 1 in every *norm.weight; used as stored"]
    return ["Gemma RMSNorm (1 + w): +1 folded into every *norm weight at load (llama.cpp's converter does the same)"]


FAMILY = Family(
    name="gemma3", gguf_archs=("gemma3",), hf_archs=("Gemma3ForCausalLM",), hf_model_types=("gemma3_text",),
    gguf_rope_pairing="neox", hf_layer_names=LAYER_NAMES, from_gguf=from_gguf, from_hf=from_hf,
    features=("embeddings x sqrt(H) (model dtype)", "Gemma RMSNorm (1 + w; +1 already in GGUF)",
              "pre/post attention and FFN norms", "QK-norm", "GeGLU (gelu tanh)", "query_pre_attn_scalar",
              "5 sliding-window layers : 1 global, local RoPE base 10000", "final logit soft-cap when set"),
    hf_tie_default=True, hf_weights=hf_weights, load_notes=load_notes,
)
