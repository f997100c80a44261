"""Qwen2: the Llama layer with Q/K/V biases and half-split (NEOX) RoPE in the file.

llama.cpp ``src/models/qwen2.cpp`` (``bq/bk/bv`` required, ``LLAMA_ROPE_TYPE_NEOX``: the
converter does not permute Q/K) and HF ``Qwen2ForCausalLM`` (q/k/v ``bias=True``, o without;
``use_sliding_window`` + ``max_window_layers`` -> ``layer_types``).
"""

from __future__ import annotations

from typing import Any

from infertrace.model.families.base import (
    LLAMA_LAYER_NAMES, Family, Ledger, gguf_common, gguf_unknown_keys, hf_act, hf_common, hf_window_layers,
    refuse_zero_window,
)
from infertrace.model.families.llama import gguf_biases, refuse_gguf_window


def hf_sliding(cfg: dict[str, Any], led: Ledger, n_layer: int) -> dict[str, Any]:
    """Qwen's window: off unless ``use_sliding_window``; then layers ``>= max_window_layers``
    (HF ``Qwen2Config.__post_init__``), or ``layer_types`` when the config lists them."""
    use = bool(cfg.get("use_sliding_window", False))
    w = cfg.get("sliding_window", 4096) if use else None
    if "use_sliding_window" in cfg:
        led.honour("use_sliding_window", use)
    if not use:
        if cfg.get("sliding_window") is not None:
            led.na("sliding_window", cfg["sliding_window"], "use_sliding_window is false")
        if cfg.get("layer_types") and any(t == "sliding_attention" for t in cfg["layer_types"]):
            led.refuse("layer_types", "sliding layers", "sliding_attention layers while use_sliding_window is false (HF drops the window)")
        return {"sliding_window": 0, "swa_layers": tuple(False for _ in range(n_layer))}
    refuse_zero_window(led, "sliding_window", w)
    mwl = int(cfg.get("max_window_layers", 28))
    led.honour("max_window_layers", mwl)
    default = ["sliding_attention" if (w is not None and i >= mwl) else "full_attention" for i in range(n_layer)]
    swa = hf_window_layers(cfg, n_layer, led, default)
    led.honour("sliding_window", w, f"layers {[i for i, s in enumerate(swa) if s]}: query at p sees keys p-W+1..p")
    return {"sliding_window": int(w or 0), "swa_layers": swa}


def from_gguf(meta: dict[str, Any], led: Ledger, names: set[str]) -> dict[str, Any]:
    """``qwen2.*`` keys -> ModelConfig kwargs (llama.cpp ``LLM_ARCH_QWEN2``)."""
    kw, _ = gguf_common(meta, "qwen2", led)
    refuse_gguf_window(meta, "qwen2", led)
    feats = gguf_biases(names, led, "qwen2", qkv_required=True)
    gguf_unknown_keys(meta, "qwen2", led)
    return dict(kw, family="qwen2", act="silu", **feats)


def from_hf(cfg: dict[str, Any], led: Ledger, names: set[str]) -> dict[str, Any]:
    """HF ``Qwen2Config`` -> ModelConfig kwargs."""
    kw = hf_common(cfg, led)
    act = hf_act(cfg, led, "silu", ("silu",))
    led.honour("(family) q/k/v biases", True, "Qwen2Attention: q/k/v bias=True, o_proj bias=False")
    return dict(kw, family="qwen2", act=act, attn_bias=True, **hf_sliding(cfg, led, kw["n_layer"]))


FAMILY = Family(
    name="qwen2", gguf_archs=("qwen2",), hf_archs=("Qwen2ForCausalLM",), hf_model_types=("qwen2",),
    gguf_rope_pairing="neox", hf_layer_names=LLAMA_LAYER_NAMES, from_gguf=from_gguf, from_hf=from_hf,
    features=("the Llama layer + q/k/v biases", "GGUF Q/K not permuted (NEOX RoPE)",
              "optional sliding window on layers >= max_window_layers"),
)
