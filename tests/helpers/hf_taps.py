"""HF transformers' own per-layer tensors, from forward hooks: the independent side of the bisect tests."""

from __future__ import annotations

from typing import Any


def hf_taps(model: Any, ids: Any, sandwich: bool = False) -> dict[tuple[int, str], Any]:
    """Run ``model`` (a Llama-style ``*ForCausalLM``) on ``ids`` ``[1, T]`` and return per ``(layer, tap)`` its
    output ``[1, T, ...]``: ``q_pre_rope`` / ``k_pre_rope`` / ``v`` (the projections), ``attn_out`` (the attention
    block), ``mlp_out`` and ``resid_post`` (the decoder layer's output). ``sandwich`` (Gemma 3): ``attn_out`` /
    ``mlp_out`` are the post-norms' outputs (``post_attention_layernorm`` / ``post_feedforward_layernorm``)."""
    import torch

    got: dict[tuple[int, str], Any] = {}
    hooks = []

    def keep(key: tuple[int, str]) -> Any:
        return lambda m, a, o: got.__setitem__(key, (o[0] if isinstance(o, tuple) else o).detach())

    for i, layer in enumerate(model.model.layers):
        for tap, mod in (("q_pre_rope", layer.self_attn.q_proj), ("k_pre_rope", layer.self_attn.k_proj),
                         ("v", layer.self_attn.v_proj),
                         ("attn_out", layer.post_attention_layernorm if sandwich else layer.self_attn),
                         ("mlp_out", layer.post_feedforward_layernorm if sandwich else layer.mlp),
                         ("resid_post", layer)):
            hooks.append(mod.register_forward_hook(keep((i, tap))))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return got


def planted_truth(hf_smol: Any, bad_gguf: Any, prompt: str) -> dict[tuple[int, str], float]:
    """Per (layer, tap): HF's own relative L2 between the clean model (``hf_smol`` = (tokenizer, model)) and HF loading
    the planted GGUF ``bad_gguf`` with its own reader, on the last prompt row of ``prompt``."""
    import torch
    import transformers

    tok, clean = hf_smol
    bad = transformers.AutoModelForCausalLM.from_pretrained(str(bad_gguf.parent), gguf_file=bad_gguf.name,
                                                            dtype=torch.float32).eval()
    ids = torch.tensor([tok(prompt)["input_ids"]])  # [1, T]
    a, b = hf_taps(clean, ids), hf_taps(bad, ids)
    a, b = ({k: t[0, -1] for k, t in x.items()} for x in (a, b))  # the last prompt row
    return {k: float((a[k] - b[k]).norm() / a[k].norm()) for k in a}
