"""The decoder's layers as small typed objects: a block is ``x + mixer(norm(x))`` then ``x + ffn(norm(x))``.

Each class holds the engine-side weights of one piece (projections fused where the math allows:
Q/K/V, gate/up, the GDN beta/alpha) and computes it over the packed batch of one step:

* :class:`Attention` - llama.cpp ``build_attn`` / HF ``*Attention``: Q/K/V (+ biases), QK-norm,
  RoPE (the sliding-window layers' own base), the KV cache, the per-head output gate of Qwen3.5
  (``attn_output_gate``), the output projection (+ bias).
* :class:`GatedDeltaNet` - Qwen3.5's ``linear_attention`` mixer (HF ``Qwen3_5GatedDeltaNet``,
  llama.cpp ``build_layer_attn_linear``; the recurrence in :mod:`infertrace.model.gdn`).
* :class:`GLU` - the FFN ``down(act(gate) * up)`` (SwiGLU / GeGLU, + biases).
* :class:`Block` - the skeleton with the optional post-norms (Gemma 3) and the block's taps
  (:mod:`infertrace.model.taps`).

Every linear layer goes through ``step.linear`` (:class:`~infertrace.model.ops.Ops`); every norm
through ``step.norm`` (the config's RMSNorm flavour).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Union

import torch
import torch.nn.functional as F

from infertrace.errors import InfertraceError
from infertrace.model.gdn import gated_rms_norm, gdn_sequence, gdn_tree
from infertrace.model.layout import block_tensor_name
from infertrace.model.ops import Ops, Weight
from infertrace.model.rope import apply_rope_neox
from infertrace.model.taps import (
    ATTN_IN, ATTN_OUT, GATE, K, K_ROT, MLP_IN, MLP_OUT, Q, Q_ROT, QKV, RESID_MID, RESID_POST, RESID_PRE, SSM_STATE, V, Z,
    LayerTaps,
)

if TYPE_CHECKING:
    from infertrace.model.config import ModelConfig

Tensor = torch.Tensor
Norm = Callable[[Tensor, Tensor, float], Tensor]
Linear = Callable[..., Tensor]


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """RMSNorm in float32, cast back, then ``* w``: ``x`` ``[..., H]`` -> ``[..., H]`` (HF ``LlamaRMSNorm``)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., H]
    return (y.to(x.dtype)) * w


def rms_norm_f32w(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """RMSNorm multiplied by ``w`` in float32, then cast (HF ``Qwen3_5RMSNorm`` with ``w`` = 1 + weight);
    ``x`` ``[..., H]`` -> ``[..., H]`` in ``x``'s dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)  # [..., H]


def norm_of(cfg: ModelConfig) -> Norm:
    """The config's RMSNorm flavour: weight applied in float32 (``norm_mul_f32``) or after the cast."""
    return rms_norm_f32w if cfg.norm_mul_f32 else rms_norm


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,  # SwiGLU (llama.cpp LLM_FFN_SILU + LLM_FFN_PAR)
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),  # GeGLU (HF gelu_pytorch_tanh, llama.cpp LLM_FFN_GELU)
}


@dataclass
class Step:
    """What every layer of one forward step shares (built once per step by the decoder).

    Attributes:
        cfg: the model config. linear: ``ops.linear``. norm: the RMSNorm flavour.
        attn: the memory's attention inputs for this step (positions ``[N]`` inside).
        kv: the memory (K/V written and attended; GDN state in ``kv.state``).
        rope / rope_swa: ``(cos, sin)`` ``[N, rope_dim/2]`` for full-attention / sliding-window layers.
        scale: softmax scale.
    """

    cfg: ModelConfig
    linear: Linear
    norm: Norm
    attn: Any
    kv: Any
    rope: tuple[Tensor, Tensor]
    rope_swa: tuple[Tensor, Tensor]
    scale: float


@dataclass
class Attention:
    """Self-attention mixer weights. Shapes: ``wqkv [q_rows + 2*nkv*hd, H]`` (``q_rows`` = nh*hd, or
    2*nh*hd with the per-head output gate: ``[Q | gate]`` per head), ``wo [H, nh*hd]``, biases ``[rows]``,
    QK-norm ``[hd]``; ``window`` W of this layer (0 = full attention)."""

    wqkv: Weight
    wo: Weight
    bqkv: Tensor | None
    bo: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None
    window: int
    gated: bool

    def forward(self, h: Tensor, s: Step, il: int, tp: LayerTaps | None) -> Tensor:
        """``h`` ``[N, H]`` (normed) -> ``[N, H]``; writes this layer's K/V into ``s.kv``."""
        cfg = s.cfg
        N = h.shape[0]
        nh, nkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        qkv = s.linear(h, self.wqkv, self.bqkv)  # [N, q_rows + 2*nkv*hd]
        nq = (2 if self.gated else 1) * nh * hd
        if self.gated:
            qg = qkv[:, :nq].view(N, nh, 2 * hd)  # [N, nh, 2*hd] per head [Q | gate]
            q, gate = qg[..., :hd], qg[..., hd:].reshape(N, nh * hd)  # [N, nh, hd], [N, nh*hd]
        else:
            q, gate = qkv[:, :nq].view(N, nh, hd), None  # [N, nh, hd]
        k = qkv[:, nq: nq + nkv * hd].view(N, nkv, hd)  # [N, nkv, hd]
        v = qkv[:, nq + nkv * hd:].view(N, nkv, hd)  # [N, nkv, hd]
        if self.q_norm is not None:
            q = s.norm(q, self.q_norm, cfg.rms_eps)  # [N, nh, hd] per-head RMSNorm
            k = s.norm(k, self.k_norm, cfg.rms_eps)  # [N, nkv, hd]
        cos, sin = s.rope_swa if self.window else s.rope
        q_r = apply_rope_neox(q, cos, sin)  # [N, nh, hd] (the first rope_dim dims rotated)
        k_r = apply_rope_neox(k, cos, sin)  # [N, nkv, hd]
        if tp:
            for name, t in ((QKV, qkv), (GATE, gate), (Q, q), (K, k), (V, v), (Q_ROT, q_r), (K_ROT, k_r)):
                if t is not None:  # no gate: the stage does not exist, the tap does not fire
                    tp(name, t)
        s.kv.write(il, k_r, v, s.attn)
        o = s.kv.attend(il, q_r, s.attn, s.scale).reshape(N, nh * hd)  # [N, nh*hd]
        if tp:
            tp(Z, o)
        if gate is not None:
            o = o * torch.sigmoid(gate)  # [N, nh*hd]
        return s.linear(o, self.wo, self.bo)  # [N, H]


@dataclass
class GatedDeltaNet:
    """Gated DeltaNet mixer weights. Shapes: ``w_qkv [conv_dim, H]``, ``w_z [Hv*dv, H]``,
    ``w_ba [2*Hv, H]`` (beta rows then alpha rows), ``conv [conv_dim, K]``, ``A [Hv]`` (= -exp(A_log)),
    ``dt_bias [Hv]``, ``ssm_norm [dv]``, ``w_out [H, Hv*dv]``."""

    w_qkv: Weight
    w_z: Weight
    w_ba: Weight
    conv: Tensor
    A: Tensor
    dt_bias: Tensor
    ssm_norm: Tensor
    w_out: Weight

    def forward(self, h: Tensor, s: Step, il: int, tp: LayerTaps | None) -> Tensor:
        """``h`` ``[N, H]`` -> ``[N, H]``; each request's tokens run through its own conv / recurrent
        state (``kv.state``, slot ``state_indices[i]``), advanced in place. A speculative verify chunk
        (``parents`` set) leaves the slot's state as it is and keeps the state after every candidate
        in the slot's snapshots instead (:func:`~infertrace.model.gdn.gdn_tree`; chosen after
        acceptance by :meth:`~infertrace.kv.recurrent.RecurrentState.select`), as TensorRT-LLM's
        ``gdn_mixer.py`` verify path writes ``intermediate_conv_states`` / ``intermediate_ssm_states``."""
        cfg = s.cfg
        N = h.shape[0]
        nk, nv, dk, dv = cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.ssm_k_head_dim, cfg.ssm_v_head_dim
        qkv = s.linear(h, self.w_qkv)  # [N, conv_dim]
        z = s.linear(h, self.w_z).view(N, nv, dv)  # [N, Hv, dv]
        ba = s.linear(h, self.w_ba)  # [N, 2*Hv]
        beta = ba[:, :nv].sigmoid().float()  # [N, Hv] sigmoid in the model dtype, as HF
        g = self.A.float() * F.softplus(ba[:, nv:].float() + self.dt_bias)  # [N, Hv] log decay <= 0
        st = s.kv.state
        o = torch.empty(N, nv, dv, dtype=h.dtype, device=h.device)  # [N, Hv, dv]
        r = 0
        slots = []
        for c, slot in zip(s.attn.chunks, s.attn.state_indices):
            conv_s, rec_s = st.conv[il][slot], st.rec[il][slot]
            if c.parents is not None:  # speculative verify: a state per candidate, the slot's state untouched
                o_c, convs, recs = gdn_tree(qkv[r:r + c.T], g[r:r + c.T], beta[r:r + c.T], self.conv, conv_s, rec_s,
                                            list(c.parents), nk, nv, dk, dv)  # [T, Hv, dv]
                st.keep_snapshots(il, slot, convs, recs)  # [T, conv_dim, K-1], [T, Hv, dk, dv]
                o[r:r + c.T] = o_c
                slots.append((c.seq_id, slot))
                r += c.T
                continue
            o_c, new_conv, new_rec, _ = gdn_sequence(qkv[r:r + c.T], g[r:r + c.T], beta[r:r + c.T], self.conv, conv_s,
                                                     rec_s, nk, nv, dk, dv)  # [T, Hv, dv]
            st.conv[il][slot].copy_(new_conv)  # [conv_dim, K-1] advanced in place
            st.rec[il][slot].copy_(new_rec)  # [Hv, dk, dv] advanced in place
            o[r:r + c.T] = o_c
            slots.append((c.seq_id, slot))
            r += c.T
        if tp:
            for name, t in ((QKV, qkv), (GATE, z), (Z, o)):
                tp(name, t)
            tp(SSM_STATE, slots=slots, conv=[st.conv[il][sl] for _, sl in slots], rec=[st.rec[il][sl] for _, sl in slots],
               g=g, beta=beta)
        y = gated_rms_norm(o, z, self.ssm_norm, cfg.rms_eps)  # [N, Hv, dv]
        return s.linear(y.reshape(N, nv * dv), self.w_out)  # [N, H]


Mixer = Union[Attention, GatedDeltaNet]


@dataclass
class GLU:
    """Gated FFN weights: ``w_gate_up [2*ff, H]`` (gate rows then up rows), ``w_down [H, ff]``, optional
    biases ``[2*ff]`` / ``[H]``; ``act`` the gate's activation (SiLU: SwiGLU, tanh-GELU: GeGLU)."""

    w_gate_up: Weight
    w_down: Weight
    b_gate_up: Tensor | None
    b_down: Tensor | None
    act: Callable[[Tensor], Tensor]

    def forward(self, h: Tensor, linear: Linear) -> Tensor:
        """``h`` ``[N, H]`` -> ``down(act(gate) * up)`` ``[N, H]``."""
        gu = linear(h, self.w_gate_up, self.b_gate_up)  # [N, 2*ff]
        g, u = gu.chunk(2, dim=-1)  # [N, ff] each
        return linear(self.act(g) * u, self.w_down, self.b_down)  # [N, H]


@dataclass
class Block:
    """One decoder block: ``x + mixer(norm(x))`` then ``x + ffn(norm(x))``, with the optional
    post-norms on each branch (Gemma 3). Norm weights ``[H]``."""

    attn_norm: Tensor
    mixer: Mixer
    ffn_norm: Tensor
    ffn: GLU
    post_attn_norm: Tensor | None = None
    post_ffw_norm: Tensor | None = None

    def forward(self, x: Tensor, s: Step, il: int, tp: LayerTaps | None) -> Tensor:
        """Residual stream ``x`` ``[N, H]`` in -> out; fires the block taps when ``tp`` is given."""
        norm, eps = s.norm, s.cfg.rms_eps
        if tp:
            tp(RESID_PRE, x)
        h = norm(x, self.attn_norm, eps)  # [N, H]
        if tp:
            tp(ATTN_IN, h)
        a = self.mixer.forward(h, s, il, tp)  # [N, H]
        if self.post_attn_norm is not None:
            a = norm(a, self.post_attn_norm, eps)  # [N, H]
        if tp:
            tp(ATTN_OUT, a)
        x = x + a  # [N, H]
        if tp:
            tp(RESID_MID, x)
        h = norm(x, self.ffn_norm, eps)  # [N, H]
        if tp:
            tp(MLP_IN, h)
        f = self.ffn.forward(h, s.linear)  # [N, H]
        if self.post_ffw_norm is not None:
            f = norm(f, self.post_ffw_norm, eps)  # [N, H]
        if tp:
            tp(MLP_OUT, f)
        x = x + f  # [N, H]
        if tp:
            tp(RESID_POST, x)
        return x


# ----------------------------------------------------------------------------- building from a checkpoint


def on_device(w: Weight, dev: torch.device) -> Weight:
    """A float tensor moved to ``dev``; a weight object (:class:`~infertrace.model.ops.LinearWeight`) as it is."""
    return w.to(dev) if isinstance(w, torch.Tensor) else w


class _Slots:
    """Reads block ``il``'s tensors by slot name (:mod:`infertrace.model.layout`) onto ``dev``."""

    def __init__(self, w: Mapping[str, Any], il: int, names: Mapping[str, str], dev: torch.device):
        self.w, self.il, self.names, self.dev = w, il, names, dev

    def raw(self, slot: str) -> Any:
        """The checkpoint tensor of this layer's ``slot`` as loaded (InfertraceError when the checkpoint lacks it)."""
        n = block_tensor_name(self.il, slot, self.names)
        if n not in self.w:
            raise InfertraceError(f"the weights lack tensor {n}, which the config implies; the checkpoint is incomplete")
        return self.w[n]

    def __call__(self, slot: str) -> Any:
        return on_device(self.raw(slot), self.dev)

    def opt(self, slot: str, on: bool) -> Any:
        return self(slot) if on else None


def build_attention(cfg: ModelConfig, t: _Slots, ops: Ops) -> Attention:
    """:class:`Attention` of one layer (Q/K/V fused through ``ops.cat_rows``)."""
    return Attention(
        wqkv=on_device(ops.cat_rows([t.raw("attn_q"), t.raw("attn_k"), t.raw("attn_v")]), t.dev),  # [q_rows+2*nkv*hd, H]
        wo=t("attn_output"),  # [H, nh*hd]
        bqkv=(torch.cat([t.raw("attn_q.bias"), t.raw("attn_k.bias"), t.raw("attn_v.bias")]).to(t.dev)
              if cfg.attn_bias else None),  # [q_rows+2*nkv*hd]
        bo=t.opt("attn_output.bias", cfg.attn_out_bias),  # [H]
        q_norm=t.opt("attn_q_norm", cfg.qk_norm),  # [hd]
        k_norm=t.opt("attn_k_norm", cfg.qk_norm),  # [hd]
        window=cfg.layer_window(t.il), gated=cfg.attn_output_gate,
    )


def build_gdn(cfg: ModelConfig, t: _Slots, ops: Ops) -> GatedDeltaNet:
    """:class:`GatedDeltaNet` of one layer (beta/alpha fused through ``ops.cat_rows``)."""
    return GatedDeltaNet(
        w_qkv=t("attn_qkv"),  # [conv_dim, H]
        w_z=t("attn_gate"),  # [Hv*dv, H]
        w_ba=on_device(ops.cat_rows([t.raw("ssm_beta"), t.raw("ssm_alpha")]), t.dev),  # [2*Hv, H]
        conv=t("ssm_conv1d"),  # [conv_dim, K]
        A=t("ssm_a"),  # [Hv] = -exp(A_log)
        dt_bias=t("ssm_dt.bias"),  # [Hv]
        ssm_norm=t("ssm_norm"),  # [dv]
        w_out=t("ssm_out"),  # [H, Hv*dv]
    )


def build_block(cfg: ModelConfig, w: Mapping[str, Any], il: int, names: Mapping[str, str], ops: Ops,
                dev: torch.device) -> Block:
    """Block ``il`` from engine-named weights (``blk.{il}.*``; ``names``: the family's slot names).

    The mixer comes from ``cfg.layer_types`` (Gated DeltaNet for ``linear_attention``, else attention).

    Raises:
        InfertraceError: a tensor the config implies is missing.
    """
    t = _Slots(w, il, names, dev)
    mixer: Mixer = build_gdn(cfg, t, ops) if cfg.is_linear(il) else build_attention(cfg, t, ops)
    ffn = GLU(
        w_gate_up=on_device(ops.cat_rows([t.raw("ffn_gate"), t.raw("ffn_up")]), dev),  # [2*ff, H]
        w_down=t("ffn_down"),  # [H, ff]
        b_gate_up=torch.cat([t.raw("ffn_gate.bias"), t.raw("ffn_up.bias")]).to(dev) if cfg.mlp_bias else None,  # [2*ff]
        b_down=t.opt("ffn_down.bias", cfg.mlp_bias),  # [H]
        act=ACTIVATIONS[cfg.act],
    )
    return Block(attn_norm=t("attn_norm"), mixer=mixer, ffn_norm=t("ffn_norm"), ffn=ffn,
                 post_attn_norm=t.opt("post_attention_norm", cfg.post_norms),
                 post_ffw_norm=t.opt("post_ffw_norm", cfg.post_norms))
