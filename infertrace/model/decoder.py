"""One decoder skeleton for every family, with named features, over a packed batch.

Mirrors llama.cpp ``src/models/{llama,qwen2,qwen3,gemma3}.cpp`` and HF ``modeling_*.py``:
``build_inp_embd`` (x sqrt(H) when ``embed_scale``) -> per layer: RMSNorm, Q/K/V (+ biases),
QK-norm, RoPE on Q and K (per-layer base: sliding-window layers may use their own),
``build_attn`` with the KV cache (per-layer sliding window), output projection (+ bias,
+ post-attention norm), RMSNorm, SwiGLU / GeGLU FFN (+ biases, + post-FFN norm) -> final norm
-> lm head for the rows that need logits (-> soft-cap). Only the current tokens are computed;
history lives in the cache. Which feature a family switches on: :mod:`infertrace.model.families`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from infertrace.kv.base import AttnInputs, KVBackend
from infertrace.errors import InfertraceError
from infertrace.model.config import ModelConfig
from infertrace.model.rope import apply_rope_neox, cos_sin, inv_freq_f32, rope_attention_factor


class Tracer(Protocol):
    """Read-only observer of named tap points (TransformerLens ``HookPoint`` style).

    ``enabled`` False means the engine never calls ``tap`` (no cost). ``layers`` is the set
    of layer indices whose per-layer taps (``"rope"``) are wanted.
    """

    enabled: bool
    layers: frozenset[int]

    def tap(self, name: str, **tensors: Any) -> None: ...


class NullTracer:
    """The default tracer: records nothing."""

    enabled = False
    layers: frozenset[int] = frozenset()

    def tap(self, name: str, **tensors: Any) -> None:  # pragma: no cover - never called
        return None


NULL_TRACER = NullTracer()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32: ``x / sqrt(mean(x^2) + eps) * w``; ``x`` ``[N, H]`` -> ``[N, H]``."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [N, H]
    return (y.to(x.dtype)) * w


def rms_norm_f32w(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm multiplied by ``w`` in float32, then cast (HF ``Qwen3_5RMSNorm`` with ``w`` = 1 + weight);
    ``x`` ``[..., H]`` -> ``[..., H]`` in ``x``'s dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)  # [..., H]


ACTIVATIONS = {
    "silu": F.silu,  # SwiGLU (llama.cpp LLM_FFN_SILU + LLM_FFN_PAR)
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),  # GeGLU (HF gelu_pytorch_tanh, llama.cpp LLM_FFN_GELU)
}


class DecoderModel:
    """Engine-side weights (Q/K/V and gate/up fused) and the forward pass of any supported family.

    Args:
        config: the frozen :class:`ModelConfig` (its family features decide the optional steps).
        weights: engine-named tensors from :func:`infertrace.loading.weights.load_checkpoint`
            (Q/K in half-split order; Gemma norms already ``1 + w``).
        device: torch device for compute.

    Raises:
        InfertraceError: the config has a ``refused`` setting or an unknown activation (no silent math).
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: str | torch.device = "cpu"):
        if config.refusals:
            raise InfertraceError(f"{config.refusals[0]}; infertrace refuses to run math it would get wrong")
        if config.act not in ACTIVATIONS:
            raise InfertraceError(f"activation {config.act!r} is not implemented (supported: {', '.join(ACTIVATIONS)})")
        self.cfg = config
        self.device = torch.device(device)
        w = weights
        dev = self.device
        self.dtype = w["token_embd"].dtype
        self.tok_embd = w["token_embd"].to(dev)  # [V, H]
        self.output = w.get("output", w["token_embd"]).to(dev)  # [V, H] (tied when absent)
        self.output_norm = w["output_norm"].to(dev)  # [H]
        self.act = ACTIVATIONS[config.act]
        self.layers = []
        for i in range(config.n_layer):
            p = f"blk.{i}."
            opt = lambda n: w[p + n].to(dev) if (p + n) in w else None  # noqa: E731
            if config.family == "qwen35":
                from infertrace.model.hybrid import qwen35_layer

                self.layers.append(qwen35_layer(config, w, i, dev))
                continue
            L = {
                "attn_norm": w[p + "attn_norm"].to(dev),  # [H]
                "wqkv": torch.cat([w[p + "attn_q"], w[p + "attn_k"], w[p + "attn_v"]]).to(dev),  # [(nh+2nkv)*hd, H]
                "wo": w[p + "attn_output"].to(dev),  # [H, nh*hd]
                "ffn_norm": w[p + "ffn_norm"].to(dev),  # [H]
                "w_gate_up": torch.cat([w[p + "ffn_gate"], w[p + "ffn_up"]]).to(dev),  # [2*ff, H]
                "w_down": w[p + "ffn_down"].to(dev),  # [H, ff]
                "bqkv": (torch.cat([w[p + "attn_q.bias"], w[p + "attn_k.bias"], w[p + "attn_v.bias"]]).to(dev)
                         if config.attn_bias else None),  # [(nh+2nkv)*hd]
                "bo": opt("attn_output.bias") if config.attn_out_bias else None,  # [H]
                "b_gate_up": (torch.cat([w[p + "ffn_gate.bias"], w[p + "ffn_up.bias"]]).to(dev)
                              if config.mlp_bias else None),  # [2*ff]
                "b_down": opt("ffn_down.bias") if config.mlp_bias else None,  # [H]
                "q_norm": opt("attn_q_norm") if config.qk_norm else None,  # [hd]
                "k_norm": opt("attn_k_norm") if config.qk_norm else None,  # [hd]
                "post_attn_norm": opt("post_attention_norm") if config.post_norms else None,  # [H]
                "post_ffw_norm": opt("post_ffw_norm") if config.post_norms else None,  # [H]
                "window": config.layer_window(i),
            }
            self.layers.append(L)
        self.inv_freq = inv_freq_f32(config)  # [rope_dim/2] float32 (full-attention layers)
        self.inv_freq_swa = (inv_freq_f32(config, swa=True) if config.windowed_layers and config.rope_theta_swa is not None
                             else self.inv_freq)  # [rope_dim/2] float32 (sliding-window layers)
        self.rope_mscale = rope_attention_factor(config)  # yarn's cos/sin factor (1.0 otherwise)
        self.scale = config.softmax_scale
        self.embed_scale = (torch.tensor(config.embed_scale, dtype=self.dtype, device=dev)
                            if config.embed_scale is not None else None)  # scalar, model dtype (as HF)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attn: AttnInputs, kv: KVBackend, logits_rows: torch.Tensor,
                tracer: Tracer = NULL_TRACER) -> torch.Tensor:
        """One step over the packed batch.

        Args:
            input_ids: ``[N]`` int64 current token ids (packed, request after request).
            attn: the backend's :class:`AttnInputs` for this step (positions ``[N]`` inside).
            kv: the KV backend (written with current K/V, read for attention; it applies each
                layer's sliding window).
            logits_rows: ``[M]`` int64 rows of the packed batch that need logits
                (last prompt token of a finished prefill, each decode token).
            tracer: tap observer; taps ``embed`` (hidden ``[N, H]``) and, for layers in
                ``tracer.layers``, ``rope`` (layer input x, q/k before and after RoPE, v).

        Returns:
            ``[M, vocab]`` float32 logits.
        """
        cfg = self.cfg
        N = int(input_ids.shape[0])
        nh, nkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        ids = input_ids.to(self.device)
        x = self.tok_embd[ids]  # [N, H]
        if self.embed_scale is not None:
            x = x * self.embed_scale  # [N, H] Gemma: x sqrt(H)
        if tracer.enabled:
            tracer.tap("embed", hidden=x, ids=ids)
        pos = attn.positions.to(self.device)
        if cfg.rope_scaling.type == "dynamic" and N and int(pos.max()) >= cfg.n_ctx_train:
            raise InfertraceError(f"position {int(pos.max())} reaches max_position_embeddings {cfg.n_ctx_train} of a 'dynamic' "
                                  "RoPE model: HF rescales the base per forward there (stateful), which infertrace does not "
                                  "implement; keep prompts + new tokens below it")
        cos_g, sin_g = cos_sin(pos, self.inv_freq.to(self.device), self.dtype, self.rope_mscale)  # [N, rope_dim/2] each
        cos_l, sin_l = ((cos_g, sin_g) if self.inv_freq_swa is self.inv_freq else
                        cos_sin(pos, self.inv_freq_swa.to(self.device), self.dtype))  # [N, rope_dim/2] each
        if cfg.family == "qwen35":
            from infertrace.model.hybrid import qwen35_forward

            x = qwen35_forward(self, x, attn, kv, (cos_g, sin_g), tracer)  # [N, H]
            xs = x[logits_rows.to(self.device)]  # [M, H]
            xs = rms_norm_f32w(xs, self.output_norm, cfg.rms_eps)  # [M, H]
            return F.linear(xs, self.output).float()  # [M, V]
        for il, L in enumerate(self.layers):
            h = rms_norm(x, L["attn_norm"], cfg.rms_eps)  # [N, H]
            qkv = F.linear(h, L["wqkv"], L["bqkv"])  # [N, (nh+2nkv)*hd]
            q = qkv[:, : nh * hd].view(N, nh, hd)  # [N, nh, hd]
            k = qkv[:, nh * hd : (nh + nkv) * hd].view(N, nkv, hd)  # [N, nkv, hd]
            v = qkv[:, (nh + nkv) * hd :].view(N, nkv, hd)  # [N, nkv, hd]
            if L["q_norm"] is not None:
                q = rms_norm(q, L["q_norm"], cfg.rms_eps)  # [N, nh, hd] per-head RMSNorm
                k = rms_norm(k, L["k_norm"], cfg.rms_eps)  # [N, nkv, hd]
            cos, sin = (cos_l, sin_l) if L["window"] else (cos_g, sin_g)
            q_r = apply_rope_neox(q, cos, sin)  # [N, nh, hd]
            k_r = apply_rope_neox(k, cos, sin)  # [N, nkv, hd]
            if tracer.enabled and il in tracer.layers:
                tracer.tap("rope", layer=il, x=x, q=q, k=k, v=v, q_rot=q_r, k_rot=k_r, cos=cos, sin=sin)
            kv.write(il, k_r, v, attn)
            o = kv.attend(il, q_r, attn, self.scale)  # [N, nh, hd]
            a = F.linear(o.reshape(N, nh * hd), L["wo"], L["bo"])  # [N, H]
            if L["post_attn_norm"] is not None:
                a = rms_norm(a, L["post_attn_norm"], cfg.rms_eps)  # [N, H]
            x = x + a  # [N, H]
            h = rms_norm(x, L["ffn_norm"], cfg.rms_eps)  # [N, H]
            gu = F.linear(h, L["w_gate_up"], L["b_gate_up"])  # [N, 2*ff]
            g, u = gu.chunk(2, dim=-1)  # [N, ff] each
            f = F.linear(self.act(g) * u, L["w_down"], L["b_down"])  # [N, H]
            if L["post_ffw_norm"] is not None:
                f = rms_norm(f, L["post_ffw_norm"], cfg.rms_eps)  # [N, H]
            x = x + f  # [N, H]
        xs = x[logits_rows.to(self.device)]  # [M, H]
        xs = rms_norm(xs, self.output_norm, cfg.rms_eps)  # [M, H]
        logits = F.linear(xs, self.output).float()  # [M, V]
        if cfg.final_logit_softcap:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap  # [M, V]
        return logits


#: the name the engine used before the family layer; same class.
LlamaModel = DecoderModel
