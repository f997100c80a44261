"""HF transformers' own per-layer tensors, from forward hooks: the independent side of the bisect tests."""

from __future__ import annotations

from typing import Any


def hf_taps(model: Any, ids: Any) -> dict[tuple[int, str], Any]:
    """Run ``model`` (a Llama-style ``*ForCausalLM``) on ``ids`` ``[1, T]`` and return per ``(layer, tap)`` its
    output ``[1, T, ...]``: ``q_pre_rope`` / ``k_pre_rope`` / ``v`` (the projections), ``attn_out`` (the attention
    block), ``mlp_out`` and ``resid_post`` (the decoder layer's output)."""
    import torch

    got: dict[tuple[int, str], Any] = {}
    hooks = []

    def keep(key: tuple[int, str]) -> Any:
        return lambda m, a, o: got.__setitem__(key, (o[0] if isinstance(o, tuple) else o).detach())

    for i, layer in enumerate(model.model.layers):
        for tap, mod in (("q_pre_rope", layer.self_attn.q_proj), ("k_pre_rope", layer.self_attn.k_proj),
                         ("v", layer.self_attn.v_proj), ("attn_out", layer.self_attn), ("mlp_out", layer.mlp),
                         ("resid_post", layer)):
            hooks.append(mod.register_forward_hook(keep((i, tap))))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return got
