"""Rotary position embedding: frequency tables and the two pairings.

* ``neox`` (half-split): dims ``i`` and ``i + d/2`` form a pair (HF ``rotate_half``,
  llama.cpp ``GGML_ROPE_TYPE_NEOX``).
* ``norm`` (adjacent): dims ``2i`` and ``2i+1`` form a pair (llama.cpp ``ggml_rope_ext``
  mode 0, which GGUF llama checkpoints use after the converter permutes Q/K rows).

Frequency scaling follows HF ``modeling_rope_utils._compute_llama3_parameters`` and
llama.cpp ``rope_freqs.weight`` (``theta_i = pos * base^(-2i/d) / freq_factor_i``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from infertrace.model.config import ModelConfig, RopeScaling


def base_inv_freq(theta: float, rot_dim: int) -> torch.Tensor:
    """``[rot_dim/2]`` float64 inverse frequencies ``theta^(-2i/rot_dim)``."""
    return 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)  # [rot_dim/2]


def llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Apply Llama-3 frequency scaling to ``inv_freq`` ``[d/2]`` (float64).

    Pairs with wavelength shorter than ``orig/high_freq_factor`` keep their frequency,
    longer than ``orig/low_freq_factor`` are divided by ``factor``, the band in between is
    blended. Mirrors HF ``_compute_llama3_parameters`` and llama.cpp's converter, which
    writes the resulting divisors to ``rope_freqs.weight``.
    """
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [d/2]
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)  # [d/2]
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )  # [d/2]
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled  # [d/2]
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)  # [d/2]
    return torch.where(medium, blended, scaled)  # [d/2]


def llama3_freq_factors(theta: float, rot_dim: int, s: RopeScaling) -> torch.Tensor:
    """Per-pair divisors ``base / scaled`` as llama.cpp stores in ``rope_freqs.weight`` ``[d/2]``."""
    base = base_inv_freq(theta, rot_dim)
    return base / llama3_inv_freq(base, s)  # [d/2]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention factor ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(theta: float, rot_dim: int, s: RopeScaling, n_ctx_train: int) -> torch.Tensor:
    """YaRN frequencies ``[rot_dim/2]`` float64: interpolated (``/ factor``) below the correction
    range, extrapolated (plain) above it, a linear ramp between.

    Mirrors HF ``_compute_yarn_parameters`` (``find_correction_range`` with ``beta_fast`` /
    ``beta_slow``, floor/ceil when ``truncate``) and ggml ``rope_yarn`` / ``ggml_rope_yarn_corr_dims``.
    ``original_max_position_embeddings`` falls back to ``n_ctx_train`` as HF's
    ``standardize_rope_params`` does.
    """
    orig = s.original_max_position_embeddings or n_ctx_train
    d = rot_dim

    def corr_dim(rot: float) -> float:
        return (d * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr_dim(s.beta_fast), corr_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # [d/2]
    extrap = 1 - ramp  # [d/2] weight of the plain frequency
    inv = base_inv_freq(theta, d)  # [d/2]
    return inv / s.factor * (1 - extrap) + inv * extrap  # [d/2]


def rope_attention_factor(cfg: ModelConfig) -> float:
    """Factor on cos/sin (HF ``attention_scaling``): YaRN's ``attention_factor`` or
    ``0.1 ln(factor) + 1`` (with ``mscale`` / ``mscale_all_dim`` when both set); 1.0 otherwise."""
    s = cfg.rope_scaling
    if s.type != "yarn":
        return 1.0
    if s.attn_factor is not None:
        return float(s.attn_factor)
    if s.mscale and s.mscale_all_dim:
        return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    return yarn_mscale(s.factor)


def inv_freq_table(cfg: ModelConfig, swa: bool = False) -> torch.Tensor:
    """``[rope_dim/2]`` float64 inverse frequencies used by the engine for this model.

    Args:
        cfg: the model config.
        swa: the table of the sliding-window layers (their own base ``rope_theta_swa`` and,
            unless ``rope_scaling_swa``, no scaling: llama.cpp ``rope_freq_base_train_swa``,
            HF ``rope_parameters["sliding_attention"]``).

    Order of precedence: GGUF ``rope_freqs.weight`` divisors, HF ``llama3`` scaling, ``yarn``,
    ``linear`` scaling (frequencies divided by ``factor``), ``dynamic`` (plain frequencies up to
    ``max_position_embeddings``, HF ``_compute_dynamic_ntk_parameters`` with ``seq_len`` at
    most that; the decoder refuses positions beyond it), plain base.
    """
    theta = cfg.rope_theta
    scaled = True
    if swa and cfg.rope_theta_swa is not None:
        theta, scaled = cfg.rope_theta_swa, cfg.rope_scaling_swa
    inv = base_inv_freq(theta, cfg.rope_dim)  # [d/2]
    if not scaled:
        return inv
    if cfg.rope_freq_factors is not None:
        return inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float64)  # [d/2]
    if cfg.rope_scaling.type == "llama3":
        return llama3_inv_freq(inv, cfg.rope_scaling)
    if cfg.rope_scaling.type == "yarn":
        return yarn_inv_freq(theta, cfg.rope_dim, cfg.rope_scaling, cfg.n_ctx_train)
    if cfg.rope_scaling.type == "linear":
        return inv / cfg.rope_scaling.factor
    return inv


def inv_freq_f32(cfg: ModelConfig, swa: bool = False) -> torch.Tensor:
    """``[rope_dim/2]`` float32 frequencies the decoder rotates with, computed as HF does
    (``1 / base ** (arange(0, d, 2).float() / d)`` in fp32 for plain RoPE; the float64 table of
    :func:`inv_freq_table` rounded to fp32 otherwise). With fp32 angles (``pos * inv_freq``, as HF
    ``RotaryEmbedding.forward`` and ggml's rope cache) long prompts stay within 1e-3 of HF's logits."""
    theta, scaled = cfg.rope_theta, True
    if swa and cfg.rope_theta_swa is not None:
        theta, scaled = cfg.rope_theta_swa, cfg.rope_scaling_swa
    plain = not scaled or (cfg.rope_freq_factors is None and cfg.rope_scaling.type in ("none", "dynamic"))
    if plain:
        d = cfg.rope_dim
        return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # [d/2] float32
    return inv_freq_table(cfg, swa).float()  # [d/2] float32


@dataclass(frozen=True)
class LayerRope:
    """The RoPE one attention layer applies (what a K-shift of that layer must rotate with).

    Attributes:
        inv_freq: ``[rope_dim/2]`` float32 frequencies (:func:`inv_freq_f32`: the layer's base, scaling
            and ``rope_dim`` -- partial rotary leaves dims ``rope_dim..head_dim`` unrotated).
        mscale: factor on cos/sin (YaRN ``attention_scaling``; 1.0 otherwise and on windowed layers
            with their own base).
        theta: the layer's RoPE base.
        scaled: whether the model's ``rope_scaling`` / ``rope_freqs.weight`` applies to this layer.

    Mirrors llama.cpp ``build_rope_shift`` called per layer with the layer's ``freq_base`` /
    ``freq_scale`` (``hparams.is_swa(il)`` picks ``rope_freq_base_train_swa``, PR 12373) and HF
    Gemma 3's two rotary embeddings (``rotary_emb`` / ``rotary_emb_local``).
    """

    inv_freq: torch.Tensor
    mscale: float
    theta: float
    scaled: bool

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` each ``[N, rope_dim/2]`` in ``dtype`` for ``positions`` ``[N]`` int64 (mscale applied)."""
        return cos_sin(positions, self.inv_freq.to(positions.device), dtype, self.mscale)


def layer_ropes(cfg: ModelConfig) -> list[LayerRope | None]:
    """The RoPE of every layer, by model layer index (None for a layer without RoPE: a Gated DeltaNet layer).

    Windowed layers of a model with ``rope_theta_swa`` rotate with that base, unscaled unless
    ``rope_scaling_swa``, and without YaRN's cos/sin factor; every other attention layer rotates with
    the model's table (:func:`inv_freq_f32`) times :func:`rope_attention_factor`. This is the table the
    decoder applies (``DecoderModel.forward``: ``cos_l, sin_l`` on windowed layers, ``cos_g, sin_g``
    elsewhere) and the one the sequence operations re-rotate cached K with.
    """
    glob = LayerRope(inv_freq_f32(cfg), rope_attention_factor(cfg), cfg.rope_theta, True)
    local = glob
    if cfg.windowed_layers and cfg.rope_theta_swa is not None:
        local = LayerRope(inv_freq_f32(cfg, swa=True), 1.0, cfg.rope_theta_swa, cfg.rope_scaling_swa)
    return [None if cfg.is_linear(il) else (local if cfg.layer_window(il) else glob) for il in range(cfg.n_layer)]


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
            mscale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Angles for each token: returns ``cos, sin`` each ``[N, d/2]`` in ``dtype``.

    Args:
        positions: ``[N]`` int64 position ids.
        inv_freq: ``[d/2]`` float64 (angles in float64) or float32 (angles in float32, as HF).
        mscale: factor on cos and sin (YaRN ``attention_scaling``; 1.0 otherwise).
    """
    ang = positions.to(inv_freq.dtype).unsqueeze(1) * inv_freq.unsqueeze(0)  # [N, d/2]
    if mscale != 1.0:
        return (ang.cos() * mscale).to(dtype), (ang.sin() * mscale).to(dtype)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate half-split pairs ``(i, i + d/2)`` of the first ``d = 2*cos.shape[1]`` dims.

    Args:
        x: ``[N, n_heads, head_dim]``.
        cos, sin: ``[N, d/2]``.
    Returns: ``[N, n_heads, head_dim]`` (dims beyond ``d`` unchanged).
    """
    half = cos.shape[1]
    d = 2 * half
    x1, x2 = x[..., :half], x[..., half:d]  # [N, h, d/2]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [N, 1, d/2]
    rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)  # [N, h, d]
    if d == x.shape[-1]:
        return rot
    return torch.cat((rot, x[..., d:]), dim=-1)  # [N, h, head_dim]


def apply_rope_norm(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs ``(2i, 2i+1)`` (llama.cpp ``ggml_rope_ext`` mode 0).

    Args: as :func:`apply_rope_neox`. Returns ``[N, n_heads, head_dim]``.
    """
    half = cos.shape[1]
    d = 2 * half
    xe, xo = x[..., 0:d:2], x[..., 1:d:2]  # [N, h, d/2]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [N, 1, d/2]
    rot = torch.stack((xe * c - xo * s, xo * c + xe * s), dim=-1).flatten(-2)  # [N, h, d]
    if d == x.shape[-1]:
        return rot
    return torch.cat((rot, x[..., d:]), dim=-1)


def permute_for_norm(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF (half-split) Q/K rows -> GGUF (adjacent-pair) order, as llama.cpp's
    ``convert_hf_to_gguf.py`` ``LlamaModel.permute`` does. ``w``: ``[n_heads*head_dim, in]``."""
    out = w.shape[0]
    return w.reshape(n_heads, 2, out // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_from_norm(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`permute_for_norm`: GGUF Q/K rows -> half-split order.

    ``n_heads`` must be ``head_count`` for Q and ``head_count_kv`` for K (using the query
    head count on K under GQA scrambles heads: case R2). ``w``: ``[n_heads*head_dim, in]``.
    """
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
