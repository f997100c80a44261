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
from infertrace.model.families.base import Family, Ledger, layer_number
from infertrace.model.layout import expected_tensors as layout_tensors

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

    Args:
        meta: ``{key: python value}`` of the GGUF header.
        tensor_names: names of the tensors in the file (output head, optional biases ...).
        freq_factors: contents of ``rope_freqs.weight`` if present.

    Raises:
        InfertraceError: unknown architecture, a required key missing, an inconsistent shape, a
        value of the wrong type. Settings the engine does not implement are recorded as ``refused``
        in ``settings`` (the loader raises).

    Mirrors llama.cpp ``src/llama-model.cpp`` ``load_hparams``.
    """
    try:
        return _config_from_gguf(meta, tensor_names, freq_factors)
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        raise InfertraceError(f"GGUF metadata has an invalid value ({type(e).__name__}: {e}); the file is broken") from None


def _config_from_gguf(meta: dict[str, Any], tensor_names: set[str], freq_factors: tuple[float, ...] | None) -> ModelConfig:
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


def config_from_hf(cfg: dict[str, Any], tie_default: bool) -> ModelConfig:
    """HF ``config.json`` dict -> validated :class:`ModelConfig` (refusals recorded, not raised).

    Args:
        cfg: parsed ``config.json``.
        tie_default: whether the checkpoint lacks ``lm_head.weight`` (tied head).

    Raises:
        InfertraceError: unsupported ``architectures``, missing keys, a value of the wrong type.

    Mirrors HF ``PretrainedConfig`` subclasses.
    """
    try:
        return _config_from_hf(cfg, tie_default)
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        raise InfertraceError(f"config.json has an invalid value ({type(e).__name__}: {e}); fix the checkpoint's config") from None


def _config_from_hf(cfg: dict[str, Any], tie_default: bool) -> ModelConfig:
    fam = family_for_hf(cfg)
    if fam.hf_text_config is not None:
        cfg = fam.hf_text_config(cfg)
    led = Ledger()
    kw = fam.from_hf(cfg, led, set())
    tie = bool(cfg.get("tie_word_embeddings", fam.hf_tie_default)) or tie_default
    return ModelConfig(
        arch=fam.name, source="hf", tie_embeddings=tie, rope_pairing_in_file="neox", rope_freq_factors=None,
        name=str(cfg.get("_name_or_path", "")), settings=tuple(led.rows), **kw,
    ).validate()


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder reads, engine-named, with its torch shape ``[out, in]`` / ``[n]``
    (:func:`infertrace.model.layout.expected_tensors` under the family's tensor names).

    Global: ``token_embd [V, H]``, ``output_norm [H]``, ``output [V, H]`` unless tied. Per layer
    ``blk.{i}.``: norms, the mixer's projections, ``ffn_gate/up/down``, plus the config's biases,
    QK-norms (``[head_dim]``) and post norms.
    """
    return layout_tensors(cfg, family_of(cfg).block_names)


def hf_to_engine_name(fam: Family, hf_name: str) -> str | None:
    """HF state-dict key -> engine name, or None when the family has no such tensor."""
    if fam.hf_key is not None:
        hf_name = fam.hf_key(hf_name)
    k = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
    if k == "embed_tokens.weight":
        return "token_embd"
    if k == "norm.weight":
        return "output_norm"
    if hf_name == "lm_head.weight":
        return "output"
    parts = k.split(".")
    il = layer_number(parts[1]) if len(parts) >= 3 and parts[0] == "layers" else None
    if fam.hf_bare_names and il is not None:
        bare = fam.hf_bare_names.get(".".join(parts[2:]))
        if bare:
            return f"blk.{il}.{bare}"
    if len(parts) >= 4 and il is not None and parts[-1] in ("weight", "bias"):
        sub = ".".join(parts[2:-1])
        if sub in fam.hf_layer_names:
            base = f"blk.{il}.{fam.hf_layer_names[sub]}"
            return base if parts[-1] == "weight" else base + ".bias"
    return None




__all__ = ["FAMILIES", "layer_number", "config_from_gguf", "config_from_hf", "engine_name", "expected_tensors", "family_for_hf",
           "family_of", "hf_to_engine_name"]
