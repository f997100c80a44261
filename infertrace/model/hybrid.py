"""The Qwen3.5 hybrid layer stack: Gated DeltaNet layers beside gated full-attention layers.

One decoder skeleton (:mod:`infertrace.model.decoder`) calls :func:`qwen35_forward` for the layers;
the embedding, final norm and lm head stay there. Per layer (HF ``Qwen3_5DecoderLayer``, llama.cpp
``llama_model_qwen35::graph``): ``x + mixer(norm(x))`` then ``x + ffn(norm(x))``, where the mixer
is either GDN (:mod:`infertrace.model.gdn`; state in ``kv.state``, slots from
``attn.state_indices``) or gated attention (``q_proj -> [Q | gate]`` per head, QK-norm,
partial RoPE, KV cache attention, ``* sigmoid(gate)``, ``o_proj``). GDN layers ignore positions.

Tap points (for layers in ``tracer.layers``): ``rope`` as every family; ``attn_proj`` (full-attention
layer: qkv projection output and its Q / gate / K / V split); ``attn_out`` (attention output before
and after ``* sigmoid(gate)``, and after ``o_proj``); ``gdn`` (GDN layer: qkv, z, g,
beta, conv / recurrent state of each request after the step).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from infertrace.model.gdn import gated_rms_norm, gdn_sequence
from infertrace.model.rope import apply_rope_neox


def qwen35_layer(cfg: Any, w: dict[str, torch.Tensor], i: int, dev: torch.device) -> dict[str, Any]:
    """Engine-side tensors of layer ``i`` (fused where the math allows). Shapes in comments."""
    p = f"blk.{i}."
    g = lambda n: w[p + n].to(dev)  # noqa: E731
    L: dict[str, Any] = {
        "linear": cfg.is_linear(i),
        "attn_norm": g("attn_norm"),  # [H]
        "ffn_norm": g("post_attention_norm"),  # [H] (HF post_attention_layernorm = pre-FFN norm)
        "w_gate_up": torch.cat([w[p + "ffn_gate"], w[p + "ffn_up"]]).to(dev),  # [2*ff, H]
        "w_down": g("ffn_down"),  # [H, ff]
    }
    if L["linear"]:
        L.update({
            "w_qkv": g("attn_qkv"),  # [conv_dim, H]
            "w_z": g("attn_gate"),  # [Hv*dv, H]
            "w_ba": torch.cat([w[p + "ssm_beta"], w[p + "ssm_alpha"]]).to(dev),  # [2*Hv, H]
            "conv": g("ssm_conv1d"),  # [conv_dim, K]
            "A": g("ssm_a"),  # [Hv] = -exp(A_log)
            "dt_bias": g("ssm_dt.bias"),  # [Hv]
            "ssm_norm": g("ssm_norm"),  # [dv]
            "w_out": g("ssm_out"),  # [H, Hv*dv]
        })
    else:
        L.update({
            "wqkv": torch.cat([w[p + "attn_q"], w[p + "attn_k"], w[p + "attn_v"]]).to(dev),  # [2*nh*hd + 2*nkv*hd, H]
            "wo": g("attn_output"),  # [H, nh*hd]
            "q_norm": g("attn_q_norm"),  # [hd]
            "k_norm": g("attn_k_norm"),  # [hd]
        })
    return L


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    from infertrace.model.decoder import rms_norm_f32w

    return rms_norm_f32w(x, w, eps)


def gdn_mixer(model: Any, il: int, L: dict[str, Any], h: torch.Tensor, attn: Any, kv: Any, tracer: Any) -> torch.Tensor:
    """One GDN layer's mixer over the packed batch: ``h`` ``[N, H]`` -> ``[N, H]``; each request's
    tokens run through its own conv / recurrent state (``kv.state``, slot ``state_indices[i]``)."""
    cfg = model.cfg
    N = h.shape[0]
    nk, nv, dk, dv = cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.ssm_k_head_dim, cfg.ssm_v_head_dim
    qkv = F.linear(h, L["w_qkv"])  # [N, conv_dim]
    z = F.linear(h, L["w_z"]).view(N, nv, dv)  # [N, Hv, dv]
    ba = F.linear(h, L["w_ba"])  # [N, 2*Hv]
    beta = ba[:, :nv].sigmoid().float()  # [N, Hv] sigmoid in the model dtype, as HF
    g = L["A"].float() * F.softplus(ba[:, nv:].float() + L["dt_bias"])  # [N, Hv] log decay <= 0
    st = kv.state
    o = torch.empty(N, nv, dv, dtype=h.dtype, device=h.device)  # [N, Hv, dv]
    r = 0
    taps = []
    for c, slot in zip(attn.chunks, attn.state_indices):
        conv_s, rec_s = st.conv[il][slot], st.rec[il][slot]
        o_c, new_conv, new_rec, t = gdn_sequence(qkv[r:r + c.T], g[r:r + c.T], beta[r:r + c.T], L["conv"], conv_s, rec_s,
                                                nk, nv, dk, dv)  # [T, Hv, dv]
        st.conv[il][slot].copy_(new_conv)  # [conv_dim, K-1] advanced in place
        st.rec[il][slot].copy_(new_rec)  # [Hv, dk, dv] advanced in place
        o[r:r + c.T] = o_c
        taps.append((c.seq_id, slot))
        r += c.T
    if tracer.enabled and il in tracer.layers:
        tracer.tap("gdn", layer=il, qkv=qkv, z=z, g=g, beta=beta, slots=taps,
                   conv_state=[st.conv[il][s] for _, s in taps], rec_state=[st.rec[il][s] for _, s in taps])
    y = gated_rms_norm(o, z, L["ssm_norm"], cfg.rms_eps)  # [N, Hv, dv]
    return F.linear(y.reshape(N, nv * dv), L["w_out"])  # [N, H]


def attn_mixer(model: Any, il: int, L: dict[str, Any], x: torch.Tensor, h: torch.Tensor, attn: Any, kv: Any,
               cos: torch.Tensor, sin: torch.Tensor, tracer: Any) -> torch.Tensor:
    """One gated full-attention layer: ``h`` ``[N, H]`` -> ``[N, H]`` (K/V written to the cache)."""
    cfg = model.cfg
    N = h.shape[0]
    nh, nkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    qkv = F.linear(h, L["wqkv"])  # [N, 2*nh*hd + 2*nkv*hd]
    qg = qkv[:, : 2 * nh * hd].view(N, nh, 2 * hd)  # [N, nh, 2*hd] per head [Q | gate]
    q, gate = qg[..., :hd], qg[..., hd:].reshape(N, nh * hd)  # [N, nh, hd], [N, nh*hd]
    k = qkv[:, 2 * nh * hd: (2 * nh + nkv) * hd].view(N, nkv, hd)  # [N, nkv, hd]
    v = qkv[:, (2 * nh + nkv) * hd:].view(N, nkv, hd)  # [N, nkv, hd]
    if tracer.enabled and il in tracer.layers:
        tracer.tap("attn_proj", layer=il, h=h, qkv=qkv, q=q.reshape(N, nh * hd), gate=gate, k=k.reshape(N, nkv * hd),
                   v=v.reshape(N, nkv * hd))
    q = _norm(q, L["q_norm"], cfg.rms_eps)  # [N, nh, hd]
    k = _norm(k, L["k_norm"], cfg.rms_eps)  # [N, nkv, hd]
    q_r = apply_rope_neox(q, cos, sin)  # [N, nh, hd] first rope_dim dims rotated
    k_r = apply_rope_neox(k, cos, sin)  # [N, nkv, hd]
    if tracer.enabled and il in tracer.layers:
        tracer.tap("rope", layer=il, x=x, q=q, k=k, v=v, q_rot=q_r, k_rot=k_r, cos=cos, sin=sin)
    kv.write(il, k_r, v, attn)
    o = kv.attend(il, q_r, attn, model.scale)  # [N, nh, hd]
    og = o.reshape(N, nh * hd) * torch.sigmoid(gate)  # [N, nh*hd]
    out = F.linear(og, L["wo"])  # [N, H]
    if tracer.enabled and il in tracer.layers:
        tracer.tap("attn_out", layer=il, o=o.reshape(N, nh * hd), gated=og, out=out)
    return out


def qwen35_forward(model: Any, x: torch.Tensor, attn: Any, kv: Any, cos_sin: tuple[torch.Tensor, torch.Tensor],
                   tracer: Any) -> torch.Tensor:
    """All layers over the packed batch: ``x`` ``[N, H]`` (embeddings) -> ``[N, H]`` (before the final norm)."""
    cfg = model.cfg
    cos, sin = cos_sin
    for il, L in enumerate(model.layers):
        h = _norm(x, L["attn_norm"], cfg.rms_eps)  # [N, H]
        if L["linear"]:
            a = gdn_mixer(model, il, L, h, attn, kv, tracer)  # [N, H]
        else:
            a = attn_mixer(model, il, L, x, h, attn, kv, cos, sin, tracer)  # [N, H]
        x = x + a  # [N, H]
        h = _norm(x, L["ffn_norm"], cfg.rms_eps)  # [N, H]
        gu = F.linear(h, L["w_gate_up"])  # [N, 2*ff]
        gt, u = gu.chunk(2, dim=-1)  # [N, ff] each
        x = x + F.linear(F.silu(gt) * u, L["w_down"])  # [N, H]
    return x
