"""The model-family layer: per family, GGUF keys and HF ``config.json`` fields -> :class:`ModelConfig`,
tensor names, and the decoder features it switches on (one decoder, named features).

Families: :mod:`.llama`, :mod:`.mistral`, :mod:`.qwen2`, :mod:`.qwen3`, :mod:`.gemma3`, :mod:`.qwen35`
(hybrid: Gated DeltaNet + gated full attention). The split
follows llama.cpp (``src/llama-model.cpp`` ``load_hparams`` / ``load_tensors`` per ``LLM_ARCH_*``,
``src/models/*.cpp``) and HF transformers (``models/*/configuration_*.py``, ``modeling_*.py``).
Every setting that changes the forward pass lands in the config's ledger (``ModelConfig.settings``)
as honoured / not applicable / refused; :func:`expected_tensors` is the full list of tensors the
decoder reads, so anything else in a file is refused by the loader.
"""

from __future__ import annotations

from typing import Any

from infertrace.errors import InfertraceError
from infertrace.model.config import ModelConfig
from infertrace.model.families import gemma3, llama, mistral, qwen2, qwen3, qwen35
from infertrace.model.families.base import Family, Ledger

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma3.FAMILY,
                                                qwen35.FAMILY)}
GGUF_ARCHS = {a: f for f in FAMILIES.values() for a in f.gguf_archs}
HF_ARCHS = {a: f for f in FAMILIES.values() for a in f.hf_archs}
HF_MODEL_TYPES = {t: f for f in FAMILIES.values() for t in f.hf_model_types}


def family_of(cfg: ModelConfig) -> Family:
    """The :class:`Family` a config was built by."""
    return FAMILIES[cfg.family]


def engine_name(gguf_name: str) -> str:
    """GGUF tensor name -> engine name (``.weight`` dropped, ``.bias`` kept)."""
    return gguf_name[: -len(".weight")] if gguf_name.endswith(".weight") else gguf_name


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str], freq_factors: tuple[float, ...] | None) -> ModelConfig:
    """Decoded GGUF header + tensor names -> validated :class:`ModelConfig` (refusals recorded, not raised).

    Raises:
        InfertraceError: unknown architecture, a required key missing, an inconsistent shape.
    """
    arch = meta.get("general.architecture")
    fam = GGUF_ARCHS.get(arch) if isinstance(arch, str) else None
    if fam is None or fam.from_gguf is None:
        raise InfertraceError(f"unsupported architecture {arch!r} in GGUF (supported: {', '.join(sorted(GGUF_ARCHS))})")
    names = {engine_name(n) for n in tensor_names}
    if "token_embd" not in names:
        raise InfertraceError("GGUF has no token_embd.weight tensor; the file is incomplete")
    led = Ledger()
    kw = fam.from_gguf(meta, led, names)
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(meta.get("tokenizer.ggml.tokens", []) or []) or None
    if vocab is None:
        raise InfertraceError(f"cannot tell the vocabulary size: no {arch}.vocab_size and no tokenizer.ggml.tokens")
    tie = "output" not in names
    led.honour("tensor output.weight", "absent: lm head tied to token_embd" if tie else "present")
    if freq_factors is not None:
        led.honour("tensor rope_freqs.weight", f"{len(freq_factors)} divisors", "per-pair RoPE frequency divisors (llama3)")
    return ModelConfig(
        arch=arch, source="gguf", vocab_size=int(vocab), tie_embeddings=tie, rope_pairing_in_file=fam.gguf_rope_pairing,
        rope_freq_factors=freq_factors, name=str(meta.get("general.name", "") or ""), settings=tuple(led.rows), **kw,
    ).validate()


def family_for_hf(cfg: dict[str, Any]) -> Family:
    """The family of an HF config by ``architectures`` (or ``model_type`` when that is absent).

    Raises:
        InfertraceError: an architecture no family handles.
    """
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    for a in archs:
        if a in HF_ARCHS:
            return HF_ARCHS[a]
    if not archs and cfg.get("model_type") in HF_MODEL_TYPES:
        return HF_MODEL_TYPES[cfg["model_type"]]
    raise InfertraceError(
        f"unsupported architecture {archs or cfg.get('model_type')!r} in config.json (supported: {', '.join(sorted(HF_ARCHS))})"
    )


def config_from_hf_dict(cfg: dict[str, Any], tie_default: bool) -> ModelConfig:
    """HF ``config.json`` dict -> validated :class:`ModelConfig` (refusals recorded, not raised)."""
    fam = family_for_hf(cfg)
    if fam.name == "qwen35":
        cfg = qwen35.text_config(cfg)
    led = Ledger()
    kw = fam.from_hf(cfg, led, set())
    tie = bool(cfg.get("tie_word_embeddings", fam.name == "gemma3")) or tie_default
    return ModelConfig(
        arch=fam.name, source="hf", tie_embeddings=tie, rope_pairing_in_file="neox", rope_freq_factors=None,
        name=str(cfg.get("_name_or_path", "")), settings=tuple(led.rows), **kw,
    ).validate()


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder reads, engine-named, with its torch shape ``[out, in]`` / ``[n]``.

    Global: ``token_embd [V, H]``, ``output_norm [H]``, ``output [V, H]`` unless tied. Per layer
    ``blk.{i}.``: norms, ``attn_q/k/v/output``, ``ffn_gate/up/down``, plus the family's biases,
    QK-norms (``[head_dim]``) and post norms.
    """
    if cfg.family == "qwen35":
        return qwen35.expected_tensors(cfg)
    H, V, ff, hd = cfg.n_embd, cfg.vocab_size, cfg.n_ff, cfg.head_dim
    q, kv = cfg.n_head * hd, cfg.n_head_kv * hd
    exp: dict[str, tuple[int, ...]] = {"token_embd": (V, H), "output_norm": (H,)}
    if not cfg.tie_embeddings:
        exp["output"] = (V, H)
    per = {"attn_norm": (H,), "attn_q": (q, H), "attn_k": (kv, H), "attn_v": (kv, H), "attn_output": (H, q),
           "ffn_norm": (H,), "ffn_gate": (ff, H), "ffn_up": (ff, H), "ffn_down": (H, ff)}
    if cfg.attn_bias:
        per.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
    if cfg.attn_out_bias:
        per["attn_output.bias"] = (H,)
    if cfg.mlp_bias:
        per.update({"ffn_gate.bias": (ff,), "ffn_up.bias": (ff,), "ffn_down.bias": (H,)})
    if cfg.qk_norm:
        per.update({"attn_q_norm": (hd,), "attn_k_norm": (hd,)})
    if cfg.post_norms:
        per.update({"post_attention_norm": (H,), "post_ffw_norm": (H,)})
    for i in range(cfg.n_layer):
        exp.update({f"blk.{i}.{n}": s for n, s in per.items()})
    return exp


def hf_to_engine_name(fam: Family, hf_name: str) -> str | None:
    """HF state-dict key -> engine name, or None when the family has no such tensor."""
    if fam.name == "qwen35":
        hf_name = qwen35.hf_key(hf_name)
    k = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
    if k == "embed_tokens.weight":
        return "token_embd"
    if k == "norm.weight":
        return "output_norm"
    if hf_name == "lm_head.weight":
        return "output"
    parts = k.split(".")
    if fam.name == "qwen35" and len(parts) >= 3 and parts[0] == "layers" and parts[1].isdigit():
        bare = qwen35.BARE_NAMES.get(".".join(parts[2:]))
        if bare:
            return f"blk.{int(parts[1])}.{bare}"
    if len(parts) >= 4 and parts[0] == "layers" and parts[1].isdigit() and parts[-1] in ("weight", "bias"):
        sub = ".".join(parts[2:-1])
        if sub in fam.hf_layer_names:
            base = f"blk.{int(parts[1])}.{fam.hf_layer_names[sub]}"
            return base if parts[-1] == "weight" else base + ".bias"
    return None


__all__ = ["FAMILIES", "config_from_gguf", "config_from_hf_dict", "engine_name", "expected_tensors", "family_for_hf",
           "family_of", "hf_to_engine_name"]
