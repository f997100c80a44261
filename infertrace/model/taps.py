"""The tap vocabulary: the named points where a tracer sees the forward pass, declared once.

In the spirit of TransformerLens' ``hook_points`` (``hook_embed``, ``blocks.N.hook_resid_pre``,
``attn.hook_q`` ...): one fixed list of per-block taps, the same for every family and every layer
kind. A layer kind that lacks a stage never fires that stage's tap (a Gated DeltaNet layer has no
``q_rot``; a dense attention layer has no ``ssm_state``). Torch-free: this module only names things.

Calls: ``tracer.tap(EMBED, value=hidden, ids=ids)`` once per step; per block, for the layers in
``tracer.layers`` and the names in ``tracer.taps``, ``tracer.tap(NAME, layer=il, value=tensor)``
(``SSM_STATE`` carries its own fields, see :data:`BLOCK_TAPS`). ``tracer.enabled`` False: the
decoder makes no tap call and no membership test per layer (the NullTracer path costs nothing).
"""

from __future__ import annotations

from typing import Any, Protocol

#: the embedding output (after the family's embedding scale): ``value [N, H]``, ``ids [N]`` int64
EMBED = "embed"

RESID_PRE = "resid_pre"
ATTN_IN = "attn_in"
QKV = "qkv"
GATE = "gate"
Q = "q"
K = "k"
V = "v"
Q_ROT = "q_rot"
K_ROT = "k_rot"
Z = "z"
SSM_STATE = "ssm_state"
ATTN_OUT = "attn_out"
RESID_MID = "resid_mid"
MLP_IN = "mlp_in"
MLP_OUT = "mlp_out"
RESID_POST = "resid_post"

#: every per-block tap in firing order: name -> what ``value`` holds (shapes for N packed tokens)
BLOCK_TAPS: dict[str, str] = {
    RESID_PRE: "[N, H] residual stream entering the block",
    ATTN_IN: "[N, H] the mixer's input: norm(resid_pre)",
    QKV: "[N, rows] fused input projection of the mixer (attention: [Q (| gate per head) | K | V]; "
         "Gated DeltaNet: in_proj_qkv, [N, conv_dim])",
    GATE: "output gate before its nonlinearity (gated attention: [N, n_head*hd], out * sigmoid(gate); "
          "Gated DeltaNet: z [N, Hv, dv], norm(o) * silu(z))",
    Q: "[N, n_head, hd] query heads entering RoPE (after the QK-norm where the family has one)",
    K: "[N, n_kv, hd] key heads entering RoPE",
    V: "[N, n_kv, hd] value heads, as written to the KV cache",
    Q_ROT: "[N, n_head, hd] query heads after RoPE",
    K_ROT: "[N, n_kv, hd] key heads after RoPE, as written to the KV cache",
    Z: "[N, n_head*hd] attention result per head before the output gate and projection (TransformerLens hook_z)",
    SSM_STATE: "Gated DeltaNet recurrent memory after the step: slots [(seq_id, slot)], conv [conv_dim, K-1] and "
               "rec [Hv, dk, dv] per request, g / beta [N, Hv] (log decay, write strength)",
    ATTN_OUT: "[N, H] the mixer's output after its projection (and the post-attention norm where the family has one)",
    RESID_MID: "[N, H] residual stream after the mixer's add",
    MLP_IN: "[N, H] the FFN's input: norm(resid_mid)",
    MLP_OUT: "[N, H] the FFN's output (after the post-FFN norm where the family has one)",
    RESID_POST: "[N, H] residual stream leaving the block",
}

#: every tap name: the embedding tap, then the block taps
TAP_NAMES: tuple[str, ...] = (EMBED, *BLOCK_TAPS)


class Tracer(Protocol):
    """Read-only observer of the named tap points (TransformerLens ``HookPoint`` style).

    Attributes:
        enabled: False means the decoder never calls ``tap`` (no cost).
        layers: layer indices whose block taps fire.
        taps: the block-tap names subscribed to (any of :data:`BLOCK_TAPS`; others never fire).
    """

    enabled: bool
    layers: frozenset[int]
    taps: frozenset[str]

    def tap(self, name: str, **tensors: Any) -> None: ...


class NullTracer:
    """The default tracer: records nothing (``enabled`` False, so ``tap`` is never called)."""

    enabled = False
    layers: frozenset[int] = frozenset()
    taps: frozenset[str] = frozenset()

    def tap(self, name: str, **tensors: Any) -> None:  # pragma: no cover - never called
        return None


NULL_TRACER = NullTracer()


class LayerTaps:
    """The taps of one block for one step: fires ``name`` iff the tracer subscribed to it.

    Built by the decoder only for layers in ``tracer.layers`` of an enabled tracer; elsewhere the
    block holds None and tests nothing else.
    """

    __slots__ = ("tracer", "layer", "want")

    def __init__(self, tracer: Tracer, layer: int, want: frozenset[str]):
        self.tracer, self.layer, self.want = tracer, layer, want

    def __call__(self, name: str, value: Any = None, **fields: Any) -> None:
        """Pass ``value`` (and extra ``fields``) to the tracer under ``name`` when subscribed."""
        if name in self.want:
            self.tracer.tap(name, layer=self.layer, value=value, **fields)


def layer_taps(tracer: Tracer, il: int) -> LayerTaps | None:
    """The :class:`LayerTaps` of layer ``il`` for this step, or None when nothing there is wanted."""
    if not tracer.enabled or il not in tracer.layers:
        return None
    want = tracer.taps
    return LayerTaps(tracer, il, want) if want else None
