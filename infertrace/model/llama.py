"""The Llama decoder forward pass over a packed batch, reading and writing a KV backend.

Mirrors llama.cpp ``src/models/llama.cpp`` (``build_inp_embd`` -> per layer: RMSNorm,
Q/K/V, RoPE on Q and K, ``build_attn`` with the KV cache, output projection, RMSNorm,
SwiGLU FFN -> final norm -> lm head for the rows that need logits) and HF
``LlamaForCausalLM``. Only the current tokens are computed; history lives in the cache.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from infertrace.kv.base import AttnInputs, KVBackend
from infertrace.model.config import ModelConfig
from infertrace.model.rope import apply_rope_neox, cos_sin, inv_freq_table


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


class LlamaModel:
    """Engine-side Llama weights (Q/K/V and gate/up fused) and the forward pass.

    Args:
        config: the frozen :class:`ModelConfig`.
        weights: engine-named tensors from :func:`infertrace.model.weights.load_checkpoint`
            (Q/K in half-split order).
        device: torch device for compute.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: str | torch.device = "cpu"):
        self.cfg = config
        self.device = torch.device(device)
        w = weights
        self.dtype = w["token_embd"].dtype
        self.tok_embd = w["token_embd"].to(self.device)  # [V, H]
        self.output = w.get("output", w["token_embd"]).to(self.device)  # [V, H] (tied when absent)
        self.output_norm = w["output_norm"].to(self.device)  # [H]
        self.layers = []
        for i in range(config.n_layer):
            p = f"blk.{i}."
            self.layers.append({
                "attn_norm": w[p + "attn_norm"].to(self.device),  # [H]
                "wqkv": torch.cat([w[p + "attn_q"], w[p + "attn_k"], w[p + "attn_v"]]).to(self.device),  # [(nh+2nkv)*hd, H]
                "wo": w[p + "attn_output"].to(self.device),  # [H, nh*hd]
                "ffn_norm": w[p + "ffn_norm"].to(self.device),  # [H]
                "w_gate_up": torch.cat([w[p + "ffn_gate"], w[p + "ffn_up"]]).to(self.device),  # [2*ff, H]
                "w_down": w[p + "ffn_down"].to(self.device),  # [H, ff]
            })
        self.inv_freq = inv_freq_table(config)  # [rope_dim/2] float64
        self.scale = config.head_dim ** -0.5

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attn: AttnInputs, kv: KVBackend, logits_rows: torch.Tensor,
                tracer: Tracer = NULL_TRACER) -> torch.Tensor:
        """One step over the packed batch.

        Args:
            input_ids: ``[N]`` int64 current token ids (packed, request after request).
            attn: the backend's :class:`AttnInputs` for this step (positions ``[N]`` inside).
            kv: the KV backend (written with current K/V, read for attention).
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
        if tracer.enabled:
            tracer.tap("embed", hidden=x)
        cos, sin = cos_sin(attn.positions.to(self.device), self.inv_freq.to(self.device), self.dtype)  # [N, rope_dim/2] each
        for il, L in enumerate(self.layers):
            h = rms_norm(x, L["attn_norm"], cfg.rms_eps)  # [N, H]
            qkv = F.linear(h, L["wqkv"])  # [N, (nh+2nkv)*hd]
            q = qkv[:, : nh * hd].view(N, nh, hd)  # [N, nh, hd]
            k = qkv[:, nh * hd : (nh + nkv) * hd].view(N, nkv, hd)  # [N, nkv, hd]
            v = qkv[:, (nh + nkv) * hd :].view(N, nkv, hd)  # [N, nkv, hd]
            q_r = apply_rope_neox(q, cos, sin)  # [N, nh, hd]
            k_r = apply_rope_neox(k, cos, sin)  # [N, nkv, hd]
            if tracer.enabled and il in tracer.layers:
                tracer.tap("rope", layer=il, x=x, q=q, k=k, v=v, q_rot=q_r, k_rot=k_r, cos=cos, sin=sin)
            kv.write(il, k_r, v, attn)
            o = kv.attend(il, q_r, attn, self.scale)  # [N, nh, hd]
            x = x + F.linear(o.reshape(N, nh * hd), L["wo"])  # [N, H]
            h = rms_norm(x, L["ffn_norm"], cfg.rms_eps)  # [N, H]
            gu = F.linear(h, L["w_gate_up"])  # [N, 2*ff]
            g, u = gu.chunk(2, dim=-1)  # [N, ff] each
            x = x + F.linear(F.silu(g) * u, L["w_down"])  # [N, H]
        xs = x[logits_rows.to(self.device)]  # [M, H]
        xs = rms_norm(xs, self.output_norm, cfg.rms_eps)  # [M, H]
        return F.linear(xs, self.output).float()  # [M, V]
