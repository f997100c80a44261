"""What HF builds inside one forward, captured read-only: the attention mask of each layer type (what its mask
functions return), the embedding output and the rotary cos/sin.

The mask functions are the ones the modeling module imported (transformers 5.19 ``masking_utils``:
``create_causal_mask`` for ``full_attention`` layers, ``create_sliding_window_causal_mask`` for
``sliding_attention`` layers, as ``models/gemma3/modeling_gemma3.py`` builds ``causal_mask_mapping``); they are
wrapped for the duration of one forward and restored after it. With ``sdpa`` a mask HF can drop (no pad column,
causal) comes back as None: the kernel runs ``is_causal`` and the trace says ``none: is_causal``.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch

#: mask function name -> the layer type whose attention reads what it returns
MASK_FUNCTIONS = {"create_causal_mask": "full_attention", "create_sliding_window_causal_mask": "sliding_attention"}


class ForwardCapture:
    """One forward's captured objects: ``masks`` (layer type -> ``(function name, returned mask or None)``),
    ``embed`` (embedding output ``[B, q, H]``), ``cos`` / ``sin`` (``[B, q, head_dim]``, the first rotary module)."""

    def __init__(self) -> None:
        self.masks: dict[str, tuple[str, torch.Tensor | None]] = {}
        self.embed: torch.Tensor | None = None
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None


def _decoder(model: Any) -> Any:
    """The decoder stack of a ``*ForCausalLM`` (``model.model``), or the model itself."""
    return getattr(model, "model", model)


@contextlib.contextmanager
def capture_forward(model: Any) -> Iterator[ForwardCapture]:
    """Wrap the modeling module's mask functions and hook the embedding and rotary modules for one forward.

    Yields:
        a :class:`ForwardCapture` filled while the forward runs (tensors detached, on CPU).
    """
    cap = ForwardCapture()
    dec = _decoder(model)
    mod = sys.modules[type(dec).__module__]
    saved: dict[str, Any] = {}
    for name, layer_type in MASK_FUNCTIONS.items():
        fn = getattr(mod, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def wrapped(*a: Any, _fn: Any = fn, _name: str = name, _type: str = layer_type, **k: Any) -> Any:
            out = _fn(*a, **k)
            cap.masks[_type] = (_name, None if out is None else out.detach().to("cpu"))
            return out

        setattr(mod, name, wrapped)
    hooks = []
    emb = dec.get_input_embeddings() if hasattr(dec, "get_input_embeddings") else None
    if emb is not None:
        hooks.append(emb.register_forward_hook(lambda m, a, out: setattr(cap, "embed", out.detach().to("cpu"))))
    rot = getattr(dec, "rotary_emb", None)
    if rot is not None:
        def on_rot(m: Any, a: Any, kw: Any, out: Any) -> None:
            # Gemma 3 calls it once per layer type (rotary_emb(x, position_ids, layer_type)): keep full_attention's,
            # the one whose inv_freq :func:`inv_freq` returns and whose theta the trace names
            lt = a[2] if len(a) > 2 else kw.get("layer_type")
            if lt in (None, "full_attention") and isinstance(out, tuple) and len(out) == 2:
                cap.cos, cap.sin = out[0].detach().to("cpu"), out[1].detach().to("cpu")
        hooks.append(rot.register_forward_hook(on_rot, with_kwargs=True))
    try:
        yield cap
    finally:
        for h in hooks:
            h.remove()
        for name, fn in saved.items():
            setattr(mod, name, fn)


def inv_freq(model: Any) -> torch.Tensor | None:
    """The rotary module's ``inv_freq`` buffer ``[head_dim / 2]`` (float32; Gemma 3: the full-attention layers'
    ``full_attention_inv_freq``), or None."""
    rot = getattr(_decoder(model), "rotary_emb", None)
    bufs = dict(rot.named_buffers()) if rot is not None else {}
    for name in ("inv_freq", "full_attention_inv_freq"):  # Llama-like; Gemma 3 keeps one per layer type
        if name in bufs:
            return bufs[name].detach().float().cpu()
    return None


def keep_matrix(mask: torch.Tensor | None, b: int, q: int, kv: int) -> torch.Tensor:
    """Row ``b`` of a captured mask as keep (True) / drop ``[q, kv]``: a bool mask is HF's keep, a float mask is
    additive (0 keep, the dtype's min drop), None (``is_causal``) is the causal rule over the columns."""
    if mask is None:
        return torch.ones(q, kv, dtype=torch.bool).tril(kv - q)  # [q, kv] causal, queries the last q columns
    m = mask[b, 0] if mask.dim() == 4 else mask[b]  # [q, kv]
    return m if m.dtype == torch.bool else m == 0


def cache_layers(cache: Any) -> list[dict[str, Any]]:
    """Per layer of a ``DynamicCache``: its class, ``is_sliding``, ``get_seq_length()`` (tokens seen) and the
    columns it stores (``keys.shape[-2]``; a ``DynamicSlidingWindowLayer`` keeps the last ``sliding_window - 1``)."""
    out = []
    for i, layer in enumerate(cache.layers):
        keys = getattr(layer, "keys", None)
        stored = int(keys.shape[-2]) if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0
        d = {"layer": i, "class": type(layer).__name__, "is_sliding": bool(getattr(layer, "is_sliding", False)),
             "seq_length": int(layer.get_seq_length()), "stored": stored}
        if getattr(layer, "sliding_window", None) is not None:
            d["sliding_window"] = int(layer.sliding_window)
        out.append(d)
    return out
