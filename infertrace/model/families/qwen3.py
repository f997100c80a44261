"""Qwen3: the Llama layer with per-head RMSNorm on Q and K before RoPE (QK-norm).

llama.cpp ``src/models/qwen3.cpp`` (``attn_q_norm`` / ``attn_k_norm`` over ``head_dim``,
NEOX RoPE, no biases) and HF ``Qwen3ForCausalLM`` (``q_norm`` / ``k_norm``,
``attention_bias`` for q/k/v/o, the Qwen sliding-window rule).
"""

from __future__ import annotations

from typing import Any

from infertrace.model.families.base import (
    LLAMA_LAYER_NAMES, Family, Ledger, gguf_common, gguf_unknown_keys, hf_act, hf_common,
)
from infertrace.model.families.llama import gguf_biases, hf_biases, refuse_gguf_window
from infertrace.model.families.qwen2 import hf_sliding

QK_NORM_NAMES = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def from_gguf(meta: dict[str, Any], led: Ledger, names: set[str]) -> dict[str, Any]:
    """``qwen3.*`` keys -> ModelConfig kwargs (llama.cpp ``LLM_ARCH_QWEN3``)."""
    kw, _ = gguf_common(meta, "qwen3", led)
    refuse_gguf_window(meta, "qwen3", led)
    feats = gguf_biases(names, led, "qwen3")
    led.honour("tensor blk.N.attn_{q,k}_norm", "required", "RMSNorm over head_dim on each Q/K head before RoPE")
    gguf_unknown_keys(meta, "qwen3", led)
    return dict(kw, family="qwen3", act="silu", qk_norm=True, **feats)


def from_hf(cfg: dict[str, Any], led: Ledger, names: set[str]) -> dict[str, Any]:
    """HF ``Qwen3Config`` -> ModelConfig kwargs."""
    kw = hf_common(cfg, led)
    act = hf_act(cfg, led, "silu", ("silu",))
    feats = hf_biases(cfg, led, mlp=False)
    led.honour("(family) q_norm / k_norm", True, "RMSNorm over head_dim on each Q/K head before RoPE")
    return dict(kw, family="qwen3", act=act, qk_norm=True, **feats, **hf_sliding(cfg, led, kw["n_layer"]))


FAMILY = Family(
    name="qwen3", gguf_archs=("qwen3",), hf_archs=("Qwen3ForCausalLM",), hf_model_types=("qwen3",),
    gguf_rope_pairing="neox", hf_layer_names={**LLAMA_LAYER_NAMES, **QK_NORM_NAMES}, from_gguf=from_gguf,
    from_hf=from_hf,
    features=("the Llama layer + QK-norm (RMSNorm per head before RoPE)", "GGUF Q/K not permuted (NEOX RoPE)"),
)
