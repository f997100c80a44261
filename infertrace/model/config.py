"""One frozen :class:`ModelConfig`, built once from GGUF metadata or an HF ``config.json`` by the
family layer (:func:`infertrace.model.families.config_from_gguf` / ``config_from_hf``).

Nothing after the loader reads raw metadata (design rule 1). Key names follow llama.cpp's
GGUF constants (``llama.block_count`` ...; gguf-py ``gguf/constants.py``) and HF
``LlamaConfig`` (``num_hidden_layers`` ...).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from infertrace.errors import InfertraceError

DEFAULT_ROPE_THETA = 10000.0
#: why prefix / block reuse is disabled for hybrid models (stated in traces: the recorder's hybrid section, the
#: engine's refusal; :mod:`infertrace.kv.recurrent` re-exports it)
NO_REUSE_REASON = ("prefix/block reuse disabled: a GDN layer's state is one fixed-size summary of the whole prefix, "
                   "with no per-block pieces to share (TensorRT-LLM turns block reuse off for hybrid models)")
#: ModelConfig fields of hybrid (Qwen3.5) models, left out of ``to_dict`` for other models
HYBRID_FIELDS = ("layer_types", "attn_output_gate", "norm_mul_f32", "ssm_conv_kernel", "ssm_n_k_heads", "ssm_n_v_heads",
                 "ssm_k_head_dim", "ssm_v_head_dim", "mrope_sections")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF ``rope_scaling``; GGUF ``{arch}.rope.scaling.*``).

    ``type`` is ``"none"``, ``"linear"``, ``"llama3"``, ``"yarn"`` or ``"dynamic"``. For ``llama3``
    the GGUF converter bakes the per-pair divisors into the ``rope_freqs.weight`` tensor instead.
    ``beta_fast`` / ``beta_slow`` / ``attn_factor`` / ``mscale`` / ``mscale_all_dim`` /
    ``truncate`` are HF ``_compute_yarn_parameters`` inputs.
    """

    type: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attn_factor: float | None = None
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder of any supported family.

    Attributes:
        arch: GGUF ``general.architecture`` (``llama``, ``qwen2``, ``qwen3``, ``gemma3``) or, for HF
            directories, the family name.
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

    Family features (set by :mod:`infertrace.model.families`; defaults are plain Llama):
        family: ``llama`` / ``mistral`` / ``qwen2`` / ``qwen3`` / ``gemma3`` / ``qwen35`` (names the
            :class:`~infertrace.model.families.base.Family` that built it; read only to find its definitions).
        attn_bias, attn_out_bias, mlp_bias: q/k/v, output and gate/up/down projection biases.
        qk_norm: RMSNorm over ``head_dim`` on each Q and K head before RoPE (Qwen3, Gemma 3).
        post_norms: RMSNorm on the attention and FFN outputs before the residual add (Gemma 3).
        act: FFN gate activation, ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU).
        embed_scale: factor on the token embeddings (Gemma: sqrt(H), applied in the model dtype).
        attn_scale: softmax scale (Gemma ``query_pre_attn_scalar**-0.5``); None = ``head_dim**-0.5``.
        final_logit_softcap: ``cap * tanh(logits / cap)`` when set.
        sliding_window: W in tokens (0 = none); ``swa_layers`` per layer whether it is windowed
            (query at p sees keys p-W+1..p).
        rope_theta_swa / rope_scaling_swa: RoPE base of the windowed layers and whether the
            RoPE scaling applies to them (Gemma 3: base 10000, unscaled).
        layer_types: per layer ``full_attention`` or ``linear_attention`` (Gated DeltaNet); empty = all
            full attention. ``attn_output_gate``: the Q projection also yields a per-head gate,
            attention output ``* sigmoid(gate)`` (Qwen3.5). ``norm_mul_f32``: RMSNorm multiplies by
            its weight in float32 before the cast (HF ``Qwen3_5RMSNorm``).
        ssm_conv_kernel, ssm_n_k_heads, ssm_n_v_heads, ssm_k_head_dim, ssm_v_head_dim: Gated
            DeltaNet shape (HF ``linear_conv_kernel_dim``, ``linear_num_key_heads`` ...; GGUF
            ``ssm.conv_kernel``, ``ssm.group_count``, ``ssm.time_step_rank``, ``ssm.state_size``).
        mrope_sections: M-RoPE ``mrope_section`` (pairs per t/h/w axis; text: all axes equal).
        mtp_layers: multi-token-prediction (MTP / NextN) draft blocks stored after the main blocks
            (``blk.{n_layer}.*`` + ``blk.{n_layer}.nextn.*``; HF ``mtp.*``, ``mtp_num_hidden_layers``;
            GGUF ``{arch}.nextn_predict_layers``, counted in ``block_count``). 0 = none loaded. Not part
            of the main forward pass; ``--speculative mtp`` drafts with them (model/mtp.py).
        settings: the ledger ``(key, value, status, note)``; status ``honoured``,
            ``not applicable`` or ``refused`` (the loader refuses to run a model with any refused row).
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
    # --- forward-pass features switched on by the model family (model/families/) ---
    family: str = "llama"
    attn_bias: bool = False
    attn_out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    act: str = "silu"
    embed_scale: float | None = None
    attn_scale: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()
    rope_theta_swa: float | None = None
    rope_scaling_swa: bool = True
    # --- hybrid (Qwen3.5: Gated DeltaNet + gated full attention; model/families/qwen35.py) ---
    layer_types: tuple[str, ...] = ()
    attn_output_gate: bool = False
    norm_mul_f32: bool = False
    ssm_conv_kernel: int = 0
    ssm_n_k_heads: int = 0
    ssm_n_v_heads: int = 0
    ssm_k_head_dim: int = 0
    ssm_v_head_dim: int = 0
    mrope_sections: tuple[int, ...] = ()
    mtp_layers: int = 0
    settings: tuple[tuple[str, str, str, str], ...] = ()

    @property
    def softmax_scale(self) -> float:
        """Attention softmax scale: ``attn_scale`` when the family sets one, else ``head_dim**-0.5``."""
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def layer_window(self, il: int) -> int:
        """Sliding window W of layer ``il`` (query at p sees keys p-W+1..p), 0 = full attention."""
        return self.sliding_window if (self.sliding_window and il < len(self.swa_layers) and self.swa_layers[il]) else 0

    @property
    def windowed_layers(self) -> list[int]:
        """Indices of the layers with a sliding window."""
        return [i for i in range(self.n_layer) if self.layer_window(i)]

    @property
    def refusals(self) -> list[str]:
        """One-line reasons for every setting this engine does not implement (status ``refused``)."""
        return [f"{k} = {v}: {note}" for k, v, st, note in self.settings if st == "refused"]

    def is_linear(self, il: int) -> bool:
        """Whether layer ``il`` is a Gated DeltaNet (``linear_attention``) layer."""
        return il < len(self.layer_types) and self.layer_types[il] == "linear_attention"

    @property
    def is_hybrid(self) -> bool:
        """Whether any layer keeps a fixed-size recurrent state instead of KV."""
        return any(t == "linear_attention" for t in self.layer_types)

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: ``2 * n_k_heads * k_head_dim + n_v_heads * v_head_dim``."""
        return 2 * self.ssm_n_k_heads * self.ssm_k_head_dim + self.ssm_n_v_heads * self.ssm_v_head_dim

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.n_head // self.n_head_kv

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (for traces and ``inspect``)."""
        d = asdict(self)
        if d["rope_freq_factors"] is not None:
            d["rope_freq_factors"] = list(d["rope_freq_factors"])
        d["swa_layers"] = list(d["swa_layers"])
        d["layer_types"], d["mrope_sections"] = list(d["layer_types"]), list(d["mrope_sections"])
        if not self.layer_types:  # hybrid fields only for hybrid models (traces of other models stay as they were)
            for k in HYBRID_FIELDS:
                d.pop(k, None)
        if not self.mtp_layers:  # only models that carry an MTP head (traces of other models stay as they were)
            d.pop("mtp_layers", None)
        d["settings"] = [{"key": k, "value": v, "status": st, "note": n} for k, v, st, n in self.settings]
        return d

    def validate(self) -> "ModelConfig":
        """Check types, bounds and shape consistency; raise :class:`InfertraceError` on a broken config.

        Integers must be ints within :mod:`infertrace.loading.limits` (no bools), floats finite,
        RoPE scaling factors finite and > 0 (see also :mod:`infertrace.loading.hparams_check`,
        which checks the raw file values before conversion).
        """
        from infertrace.loading.hparams_check import check_config_bounds

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
