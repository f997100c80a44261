"""Llama: RMSNorm, RoPE (GGUF Q/K rows permuted for adjacent pairs), SwiGLU, optional biases.

llama.cpp ``src/models/llama.cpp`` (optional ``bq/bk/bv/bo`` and ``ffn_*_b`` tensors,
``TENSOR_NOT_REQUIRED``) and HF ``LlamaForCausalLM`` (``attention_bias`` -> q/k/v/o biases,
``mlp_bias`` -> gate/up/down biases). Mistral GGUF files also use this architecture.
"""

from __future__ import annotations

from typing import Any

from infertrace.model.families.base import (
    LLAMA_LAYER_NAMES, Family, Ledger, gguf_common, gguf_unknown_keys, hf_act, hf_common,
)


def gguf_biases(names: set[str], led: Ledger, arch: str, qkv_required: bool = False) -> dict[str, bool]:
    """Bias features from the tensors present (llama.cpp loads them when they exist)."""
    qkv = [f"blk.0.attn_{x}.bias" in names for x in "qkv"]
    ffn = [f"blk.0.ffn_{x}.bias" in names for x in ("gate", "up", "down")]
    out = {"attn_bias": qkv_required or any(qkv), "attn_out_bias": "blk.0.attn_output.bias" in names, "mlp_bias": any(ffn)}
    if out["attn_bias"]:
        led.honour("tensor blk.N.attn_{q,k,v}.bias", "present", "added after the Q/K/V projections (Q/K un-permuted with the rows)")
    if out["attn_out_bias"]:
        led.honour("tensor blk.N.attn_output.bias", "present", "added after the output projection")
    if out["mlp_bias"]:
        led.honour("tensor blk.N.ffn_{gate,up,down}.bias", "present", "added after each FFN projection")
    return out


def refuse_gguf_window(f_meta: dict[str, Any], arch: str, led: Ledger) -> None:
    """llama.cpp's graph for ``arch`` has no sliding window: a window key is refused, not dropped."""
    k = f"{arch}.attention.sliding_window"
    if f_meta.get(k) is not None:
        led.refuse(k, f_meta[k], f"llama.cpp's {arch} graph has no sliding window, so the file's intent is unclear; "
                   "use the HF directory (Mistral / Qwen read sliding_window there)")


def from_gguf(meta: dict[str, Any], led: Ledger, names: set[str]) -> dict[str, Any]:
    """``llama.*`` keys + tensor presence -> ModelConfig kwargs (llama.cpp ``LLM_ARCH_LLAMA``)."""
    kw, _ = gguf_common(meta, "llama", led)
    refuse_gguf_window(meta, "llama", led)
    feats = gguf_biases(names, led, "llama")
    gguf_unknown_keys(meta, "llama", led)
    return dict(kw, family="llama", act="silu", **feats)


def hf_biases(cfg: dict[str, Any], led: Ledger, mlp: bool = True) -> dict[str, bool]:
    """``attention_bias`` (q/k/v/o) and ``mlp_bias`` (gate/up/down) of HF Llama-style configs;
    ``mlp=False`` for families whose MLP has no bias option (the key is then not applicable)."""
    ab, mb = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False)) and mlp
    if "attention_bias" in cfg:
        led.honour("attention_bias", ab, "q/k/v/o projection biases" if ab else "no biases")
    if "mlp_bias" in cfg and not mlp:
        led.na("mlp_bias", cfg["mlp_bias"], "this family's MLP has no biases (HF ignores the key)")
    elif "mlp_bias" in cfg:
        led.honour("mlp_bias", mb, "gate/up/down projection biases" if mb else "no biases")
    return {"attn_bias": ab, "attn_out_bias": ab, "mlp_bias": mb}


def from_hf(cfg: dict[str, Any], led: Ledger, names: set[str]) -> dict[str, Any]:
    """HF ``LlamaConfig`` -> ModelConfig kwargs."""
    kw = hf_common(cfg, led)
    feats = hf_biases(cfg, led)
    act = hf_act(cfg, led, "silu", ("silu",))
    if cfg.get("sliding_window") is not None:
        led.na("sliding_window", cfg["sliding_window"], "LlamaForCausalLM has no sliding window (HF ignores the key)")
    return dict(kw, family="llama", act=act, **feats)


FAMILY = Family(
    name="llama", gguf_archs=("llama",), hf_archs=("LlamaForCausalLM",), hf_model_types=("llama",),
    gguf_rope_pairing="norm", hf_layer_names=LLAMA_LAYER_NAMES, from_gguf=from_gguf, from_hf=from_hf,
    features=("RMSNorm, SwiGLU, RoPE (GGUF Q/K rows and biases un-permuted at load)",
              "optional q/k/v/o and gate/up/down biases (attention_bias / mlp_bias; GGUF *.bias tensors)"),
)
