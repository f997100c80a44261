"""One frozen :class:`ModelConfig`, built once from GGUF metadata or an HF ``config.json``.

Nothing after the loader reads raw metadata (design rule 1). Key names follow llama.cpp's
GGUF constants (``llama.block_count`` ...; gguf-py ``gguf/constants.py``) and HF
``LlamaConfig`` (``num_hidden_layers`` ...).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from infertrace.errors import InfertraceError

#: architectures whose tensors and forward pass are the Llama decoder (GGUF names).
SUPPORTED_GGUF_ARCHS = ("llama",)
#: HF ``architectures`` entries with the same shapes as LlamaForCausalLM.
SUPPORTED_HF_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM")

DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF ``rope_scaling``; GGUF ``{arch}.rope.scaling.*``).

    ``type`` is ``"none"``, ``"linear"`` or ``"llama3"``. For ``llama3`` the GGUF converter
    bakes the per-pair divisors into the ``rope_freqs.weight`` tensor instead.
    """

    type: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder.

    Attributes:
        arch: ``"llama"``.
        source: ``"gguf"`` or ``"hf"``.
        n_layer, n_embd (H), n_ff, n_head, n_head_kv, head_dim: model shape.
        vocab_size: rows of ``token_embd`` / lm head.
        n_ctx_train: trained context length (``llama.context_length``).
        rope_theta: RoPE base; ``rope_theta_is_default`` is True when the file omits it.
        rope_dim: rotary dimensions per head (``llama.rope.dimension_count``), <= head_dim.
        rope_scaling: :class:`RopeScaling`.
        rope_freq_factors: per-pair divisors from GGUF ``rope_freqs.weight`` (llama3), or None.
        rms_eps: RMSNorm epsilon.
        tie_embeddings: lm head reuses ``token_embd`` (no ``output.weight``).
        rope_pairing_in_file: ``"norm"`` (adjacent pairs, GGUF Q/K rows permuted by
            llama.cpp's converter) or ``"neox"`` (half-split, HF). The engine always runs
            ``neox`` after the loader un-permutes GGUF Q/K rows.
    """

    arch: str
    source: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    vocab_size: int
    n_ctx_train: int
    rope_theta: float
    rope_theta_is_default: bool
    rope_dim: int
    rms_eps: float
    tie_embeddings: bool
    rope_pairing_in_file: str
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rope_freq_factors: tuple[float, ...] | None = None
    name: str = ""

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.n_head // self.n_head_kv

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (for traces and ``inspect``)."""
        d = asdict(self)
        if d["rope_freq_factors"] is not None:
            d["rope_freq_factors"] = list(d["rope_freq_factors"])
        return d

    def validate(self) -> "ModelConfig":
        """Check types, bounds and shape consistency; raise :class:`InfertraceError` on a broken config.

        Integers must be ints within :mod:`infertrace.model.limits` (no bools), floats finite,
        RoPE scaling factors finite and > 0 (see also :mod:`infertrace.model.hparams_check`,
        which checks the raw file values before conversion).
        """
        from infertrace.model.hparams_check import check_config_bounds

        check_config_bounds(self)
        for name, val in (("block_count", self.n_layer), ("embedding_length", self.n_embd), ("feed_forward_length", self.n_ff),
                          ("vocab_size", self.vocab_size), ("head_dim", self.head_dim)):
            if val <= 0:
                raise InfertraceError(f"{name} is {val}; the model file is broken (it must be >= 1)")
        if not (self.rope_theta > 0 and self.rms_eps > 0):
            raise InfertraceError(f"rope theta ({self.rope_theta}) and rms epsilon ({self.rms_eps}) must be > 0; the model file is broken")
        if self.n_head <= 0 or self.n_head_kv <= 0 or self.n_head % self.n_head_kv:
            raise InfertraceError(
                f"head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}; the model file is inconsistent"
            )
        if self.head_dim * self.n_head != self.n_embd and self.head_dim <= 0:
            raise InfertraceError("head_dim * head_count does not match embedding_length; the model file is inconsistent")
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise InfertraceError(
                f"rope.dimension_count {self.rope_dim} must be even and <= head_dim {self.head_dim}"
            )
        return self


def config_from_gguf_fields(meta: dict[str, Any], tensor_names: set[str], freq_factors: tuple[float, ...] | None) -> ModelConfig:
    """See :func:`_config_from_gguf_fields`; wrong value types become :class:`InfertraceError`."""
    try:
        return _config_from_gguf_fields(meta, tensor_names, freq_factors)
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        raise InfertraceError(f"GGUF metadata has an invalid value ({type(e).__name__}: {e}); the file is broken") from None


def _config_from_gguf_fields(meta: dict[str, Any], tensor_names: set[str], freq_factors: tuple[float, ...] | None) -> ModelConfig:
    """Build a :class:`ModelConfig` from decoded GGUF key/values.

    Args:
        meta: ``{key: python value}`` of the GGUF header.
        tensor_names: names of the tensors in the file (to detect ``output.weight``).
        freq_factors: contents of ``rope_freqs.weight`` if present.

    Raises:
        InfertraceError: unknown architecture or a required key missing.

    Mirrors llama.cpp ``src/llama-model.cpp`` ``load_hparams`` for ``LLM_ARCH_LLAMA``.
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise InfertraceError(
            f"unsupported architecture {arch!r} in GGUF (supported: {', '.join(SUPPORTED_GGUF_ARCHS)}); use a Llama-family model"
        )

    def req(key: str) -> Any:
        k = f"{arch}.{key}"
        if k not in meta:
            raise InfertraceError(f"GGUF is missing required key {k!r}; the file is incomplete or not a Llama model")
        return meta[k]

    n_embd = int(req("embedding_length"))
    n_head = int(req("attention.head_count"))
    if n_head <= 0:
        raise InfertraceError(f"{arch}.attention.head_count is {n_head}; the model file is broken")
    n_head_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(meta.get(f"{arch}.attention.key_length", n_embd // n_head))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    theta = meta.get(f"{arch}.rope.freq_base")
    if "token_embd.weight" in tensor_names:
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(meta.get("tokenizer.ggml.tokens", []) or []) or None
        if vocab is None:
            raise InfertraceError("cannot tell the vocabulary size: no llama.vocab_size and no tokenizer.ggml.tokens")
    else:
        raise InfertraceError("GGUF has no token_embd.weight tensor; the file is incomplete")
    stype = str(meta.get(f"{arch}.rope.scaling.type", "none") or "none")
    if stype not in ("none", "linear"):
        raise InfertraceError(f"unsupported RoPE scaling type {stype!r} in GGUF (supported: none, linear, llama3 via rope_freqs)")
    scaling = RopeScaling(
        type=stype,
        factor=float(meta.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0),
        original_max_position_embeddings=int(meta.get(f"{arch}.rope.scaling.original_context_length", 8192) or 8192),
    )
    return ModelConfig(
        arch=arch,
        source="gguf",
        n_layer=int(req("block_count")),
        n_embd=n_embd,
        n_ff=int(req("feed_forward_length")),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        vocab_size=int(vocab),
        n_ctx_train=int(meta.get(f"{arch}.context_length", 2048)),
        rope_theta=float(theta) if theta is not None else DEFAULT_ROPE_THETA,
        rope_theta_is_default=theta is None,
        rope_dim=rope_dim,
        rms_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensor_names,
        rope_pairing_in_file="norm",
        rope_scaling=scaling,
        rope_freq_factors=freq_factors,
        name=str(meta.get("general.name", "") or ""),
    ).validate()


def config_from_hf(cfg: dict[str, Any], tie_default: bool) -> ModelConfig:
    """See :func:`_config_from_hf`; wrong value types become :class:`InfertraceError`."""
    try:
        return _config_from_hf(cfg, tie_default)
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        raise InfertraceError(f"config.json has an invalid value ({type(e).__name__}: {e}); fix the checkpoint's config") from None


def _config_from_hf(cfg: dict[str, Any], tie_default: bool) -> ModelConfig:
    """Build a :class:`ModelConfig` from an HF ``config.json`` dict.

    Args:
        cfg: parsed ``config.json``.
        tie_default: whether the checkpoint lacks ``lm_head.weight`` (tied head).

    Raises:
        InfertraceError: unsupported ``architectures`` or missing keys.

    Mirrors HF ``LlamaConfig`` and ``_compute_llama3_parameters`` inputs.
    """
    archs = cfg.get("architectures") or []
    by_type = not archs and cfg.get("model_type") in ("llama", "mistral")  # configs without architectures
    if not by_type and not any(a in SUPPORTED_HF_ARCHS for a in archs):
        raise InfertraceError(
            f"unsupported architecture {archs!r} in config.json (supported: {', '.join(SUPPORTED_HF_ARCHS)})"
        )
    try:
        n_embd = int(cfg["hidden_size"])
        n_head = int(cfg["num_attention_heads"])
        n_layer = int(cfg["num_hidden_layers"])
        n_ff = int(cfg["intermediate_size"])
        vocab = int(cfg["vocab_size"])
    except KeyError as e:
        raise InfertraceError(f"config.json is missing {e.args[0]!r}; the checkpoint is incomplete") from None
    head_dim = int(cfg.get("head_dim") or n_embd // n_head)
    rs = cfg.get("rope_scaling") or (cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else None) or {}
    rtype = rs.get("rope_type", rs.get("type", "default")) or "default"
    theta = cfg.get("rope_theta", rs.get("rope_theta"))
    if rtype in ("default", "none"):
        scaling = RopeScaling()
    elif rtype in ("linear", "llama3"):
        scaling = RopeScaling(
            type=rtype,
            factor=float(rs.get("factor", 1.0)),
            low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
        )
    else:
        raise InfertraceError(f"unsupported rope_scaling type {rtype!r} (supported: linear, llama3)")
    return ModelConfig(
        arch="llama",
        source="hf",
        n_layer=n_layer,
        n_embd=n_embd,
        n_ff=n_ff,
        n_head=n_head,
        n_head_kv=int(cfg.get("num_key_value_heads") or n_head),
        head_dim=head_dim,
        vocab_size=vocab,
        n_ctx_train=int(cfg.get("max_position_embeddings", 2048)),
        rope_theta=float(theta) if theta is not None else DEFAULT_ROPE_THETA,
        rope_theta_is_default=theta is None,
        rope_dim=head_dim,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)) or tie_default,
        rope_pairing_in_file="neox",
        rope_scaling=scaling,
        rope_freq_factors=None,
        name=str(cfg.get("_name_or_path", "")),
    ).validate()
