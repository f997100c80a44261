"""``run --runtime hf --keep tensors``: HF transformers' own per-layer tensors from forward hooks, saved under
the tap names every runtime uses (``step{s}/layer{l}/NAME``, :data:`~infertrace.capture.recorder.TENSOR_NAMES`).

Which module's output is which tap (transformers 5.19 ``models/llama/modeling_llama.py``,
``models/gemma3/modeling_gemma3.py``; TransformerLens' names in brackets):

* ``hidden_in`` [resid_pre]: the decoder layer's input ``hidden_states`` (a forward pre-hook);
* ``q_pre_rope`` / ``k_pre_rope``: ``self_attn.q_proj`` / ``k_proj`` output as heads, or ``q_norm`` / ``k_norm``
  output where the family normalises Q/K before RoPE (Gemma 3, Qwen3); ``v``: ``v_proj`` output as heads;
* ``attn_out``: ``self_attn`` output (after ``o_proj``); in a sandwich-norm layer (Gemma 3: it has
  ``pre_feedforward_layernorm``) ``post_attention_layernorm``'s output, the block's branch as our tap defines it;
* ``mlp_out``: ``mlp`` output; sandwich-norm: ``post_feedforward_layernorm``'s output;
* ``resid_post``: the decoder layer's output.

HF exposes no module whose output is Q or K after RoPE (``apply_rotary_pos_emb`` is a function inside the
attention forward): ``q_post_rope`` / ``k_post_rope`` are not saved, and ``options.tap_sources`` says so by
omission. Rows: a padded ``[B, q]`` forward's real query columns, packed in the step's row order (pad columns
dropped), so ``bisect`` compares a position with the same position of any runtime.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

#: saved tap name -> what HF module output it is (``options.tap_sources``)
SOURCES = {
    "hidden_in": "HF decoder layer input hidden_states (forward pre-hook)",
    "q_pre_rope": "HF self_attn.q_proj output as [heads, head_dim] (q_norm output where the family has one)",
    "k_pre_rope": "HF self_attn.k_proj output as [heads, head_dim] (k_norm output where the family has one)",
    "v": "HF self_attn.v_proj output as [heads, head_dim]",
    "attn_out": "HF self_attn output after o_proj (post_attention_layernorm output in a sandwich-norm layer, Gemma 3)",
    "mlp_out": "HF mlp output (post_feedforward_layernorm output in a sandwich-norm layer, Gemma 3)",
    "resid_post": "HF decoder layer output",
}


def _out(o: Any) -> torch.Tensor:
    return (o[0] if isinstance(o, tuple) else o).detach()


def layer_hooks(model: Any, layers: Iterable[int], got: dict[tuple[int, str], torch.Tensor]) -> list[Any]:
    """Register the hooks of the module docstring on ``layers`` of ``model`` (a ``*ForCausalLM``); each fills
    ``got[(layer, name)]`` with the module's output ``[B, q, ...]`` (detached, float32, CPU). Returns the handles."""
    dec = getattr(model, "model", model)
    cfg = getattr(model, "config", None)
    hd = getattr(cfg, "head_dim", None)
    hooks: list[Any] = []

    def keep(key: tuple[int, str], heads: bool = False) -> Any:
        def fn(m: Any, a: Any, o: Any) -> None:
            t = _out(o).float().cpu()  # [B, q, H] or [B, q, heads, hd]
            if heads and t.dim() == 3 and hd:
                t = t.reshape(t.shape[0], t.shape[1], -1, int(hd))  # [B, q, heads, hd]
            got[key] = t
        return fn

    for il in sorted(set(layers)):
        layer = dec.layers[il]
        hooks.append(layer.register_forward_pre_hook(
            lambda m, a, kw, _k=(il, "hidden_in"): got.__setitem__(_k, (a[0] if a else kw["hidden_states"]).detach().float().cpu()),
            with_kwargs=True))
        hooks.append(layer.register_forward_hook(keep((il, "resid_post"))))
        sandwich = hasattr(layer, "pre_feedforward_layernorm")
        att = getattr(layer, "self_attn", None)
        if att is not None:
            for name, proj, norm in (("q_pre_rope", "q_proj", "q_norm"), ("k_pre_rope", "k_proj", "k_norm"), ("v", "v_proj", None)):
                if getattr(att, proj, None) is not None:
                    hooks.append(getattr(att, proj).register_forward_hook(keep((il, name), heads=True)))
                if norm and getattr(att, norm, None) is not None:
                    hooks.append(getattr(att, norm).register_forward_hook(_normed((il, name), got)))
            src = layer.post_attention_layernorm if sandwich else att
            hooks.append(src.register_forward_hook(keep((il, "attn_out"))))
        mlp_src = getattr(layer, "post_feedforward_layernorm", None) if sandwich else getattr(layer, "mlp", None)
        if mlp_src is not None:
            hooks.append(mlp_src.register_forward_hook(keep((il, "mlp_out"))))
    return hooks


def _normed(key: tuple[int, str], got: dict[tuple[int, str], torch.Tensor]) -> Any:
    """The hook of a per-head Q/K norm: replaces the projection's heads ``got[key]`` ``[B, q, heads, hd]`` by the
    norm's output in that layout. The norm's input tells the layout the family uses (Qwen3 normalises
    ``[B, q, heads, hd]``, Gemma 3 ``[B, heads, q, hd]`` after its transpose): it must equal the projection's heads
    as they are or transposed; anything else leaves the projection's output as the tap (never a guess)."""
    def fn(m: Any, a: Any, o: Any) -> None:
        proj, x, y = got.get(key), a[0].detach().float().cpu(), _out(o).float().cpu()
        if proj is None or x.dim() != 4:
            return
        if x.shape == proj.shape and torch.equal(x, proj):
            got[key] = y  # [B, q, heads, hd]
        elif x.transpose(1, 2).shape == proj.shape and torch.equal(x.transpose(1, 2), proj):
            got[key] = y.transpose(1, 2).contiguous()  # [B, heads, q, hd] -> [B, q, heads, hd]
    return fn


def packed(t: torch.Tensor, rows: list[Any]) -> torch.Tensor:
    """``t`` ``[B, q, ...]`` -> ``[N, ...]``: the real query columns of each row, in the step's row order."""
    return torch.stack([t[r.b, c] for r in rows for c in r.q_cols]) if rows else t[:0, 0]


def keep_step(out: dict[str, torch.Tensor], step: int, got: dict[tuple[int, str], torch.Tensor], embed: torch.Tensor | None,
              rows: list[Any], logits: torch.Tensor, cache: Any, attention_mask: torch.Tensor, layer: int,
              top_k: int = 20) -> None:
    """Copy one step's tensors into ``out`` (names as :meth:`~infertrace.capture.recorder.Recorder._capture`):
    ``step{s}/hidden`` ``[N, H]``, ``step{s}/layer{l}/NAME`` per hooked tap, ``step{s}/layer{layer}/seq{id}/k_cache`` /
    ``v_cache`` ``[len, n_kv, hd]`` (the DynamicCache's real columns of each computed row, by position; a sliding
    layer that keeps fewer columns is skipped), ``step{s}/logits_topk_values`` float32 / ``_ids`` int64 ``[M, k]``
    (rows = the sampled rows in row order, ``DecodeRec.logits_rows``)."""
    p = f"step{step}/"
    if embed is not None:
        out[p + "hidden"] = packed(embed.float(), rows).contiguous()  # [N, H]
    for (il, name), t in sorted(got.items()):
        out[f"{p}layer{il}/{name}"] = packed(t, rows).contiguous()  # [N, H] or [N, heads, hd]
    lay = cache.layers[layer] if cache is not None and layer < len(cache.layers) else None
    keys, vals = getattr(lay, "keys", None), getattr(lay, "values", None)
    if isinstance(keys, torch.Tensor) and keys.dim() == 4 and keys.shape[-2] == attention_mask.shape[1]:
        for r in rows:
            cols = [j for j, m in enumerate(attention_mask[r.b].tolist()) if m][: r.C + r.T]
            idx = torch.tensor(cols, dtype=torch.int64)
            out[f"{p}layer{layer}/seq{r.seq_id}/k_cache"] = keys[r.b][:, idx].transpose(0, 1).float().cpu().contiguous()  # [len, n_kv, hd]
            out[f"{p}layer{layer}/seq{r.seq_id}/v_cache"] = vals[r.b][:, idx].transpose(0, 1).float().cpu().contiguous()  # [len, n_kv, hd]
    lrows = [logits[r.b, r.logit_col] for r in rows if r.sample is not None]
    if lrows:
        lg = torch.stack(lrows).float()  # [M, V]
        v, i = torch.topk(lg, min(top_k, lg.shape[-1]), dim=-1)  # [M, k]
        out[p + "logits_topk_values"], out[p + "logits_topk_ids"] = v.contiguous(), i.to(torch.int64).contiguous()
