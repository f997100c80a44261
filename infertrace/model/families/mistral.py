"""Mistral: the Llama layer with a sliding window on every layer (HF ``MistralForCausalLM``).

HF ``MistralConfig.sliding_window`` (default 4096 when the key is absent, ``null`` = full
attention) windows every layer: the query at position p sees keys p-W+1..p. llama.cpp
converts Mistral checkpoints to the ``llama`` GGUF architecture (no window), so GGUF files
load through :mod:`infertrace.model.families.llama`.
"""

from __future__ import annotations

from typing import Any

from infertrace.model.families.base import LLAMA_LAYER_NAMES, Family, Ledger, hf_act, hf_common, refuse_zero_window

#: HF ``MistralConfig`` default when ``sliding_window`` is absent from config.json.
HF_DEFAULT_WINDOW = 4096


def from_hf(cfg: dict[str, Any], led: Ledger, names: set[str]) -> dict[str, Any]:
    """HF ``MistralConfig`` -> ModelConfig kwargs (no biases: HF's Mistral has none)."""
    kw = hf_common(cfg, led)
    act = hf_act(cfg, led, "silu", ("silu",))
    w = cfg.get("sliding_window", HF_DEFAULT_WINDOW)
    if w is None:
        led.honour("sliding_window", None, "full attention on every layer")
        w = 0
    else:
        refuse_zero_window(led, "sliding_window", w)
        w = int(w)
        led.honour("sliding_window", w if "sliding_window" in cfg else f"absent (HF default {w})",
                   f"every layer: query at p sees keys p-{w}+1..p")
    if cfg.get("layer_types") is not None:
        led.refuse("layer_types", "set", "per-layer attention types belong to Ministral; not implemented for Mistral")
    for k in ("attention_bias", "mlp_bias"):
        if cfg.get(k):
            led.na(k, cfg[k], "MistralForCausalLM has no biases (HF ignores the key); bias tensors would be refused")
    return dict(kw, family="mistral", act=act, sliding_window=w, swa_layers=tuple(bool(w) for _ in range(kw["n_layer"])))


FAMILY = Family(
    name="mistral", gguf_archs=(), hf_archs=("MistralForCausalLM",), hf_model_types=("mistral",),
    gguf_rope_pairing="norm", hf_layer_names=LLAMA_LAYER_NAMES, from_gguf=None, from_hf=from_hf,
    features=("the Llama layer", "sliding_window on every layer (kq_mask_swa / paged window_left)"),
)
