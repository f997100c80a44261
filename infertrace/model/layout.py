"""Which tensors the decoder reads, per layer kind: engine names (llama.cpp's ``blk.N.*`` without
``.weight``) and torch shapes ``[out, in]`` / ``[n]``. Torch-free: the loader checks a file against
it before reading tensor data (and ``inspect`` never loads torch); the decoder builds its typed layer
weights from the same slots (:mod:`infertrace.model.layers`).

A block is ``attn_norm`` + its mixer's tensors + ``ffn_norm`` + the GLU FFN, plus what the config's
features add (biases, QK-norm, post-norms). The mixer comes from ``layer_types``: attention
(llama.cpp ``build_attn``; with ``attn_output_gate`` the Q projection also yields a per-head gate,
so ``attn_q`` has twice the rows) or Gated DeltaNet (llama.cpp ``qwen35.cpp``
``build_layer_attn_linear``). Slot names are llama.cpp's defaults; a family whose files use another
name for a slot maps it (``Family.block_names``, e.g. Qwen3.5 stores the pre-FFN norm as
``post_attention_norm``).
"""

from __future__ import annotations

from typing import Any, Mapping

Shape = tuple[int, ...]


def global_tensors(cfg: Any) -> dict[str, Shape]:
    """``token_embd [V, H]``, ``output_norm [H]`` and ``output [V, H]`` unless the head is tied."""
    H, V = cfg.n_embd, cfg.vocab_size
    exp: dict[str, Shape] = {"token_embd": (V, H), "output_norm": (H,)}
    if not cfg.tie_embeddings:
        exp["output"] = (V, H)
    return exp


def attention_slots(cfg: Any) -> dict[str, Shape]:
    """The attention mixer's projections: Q (``[Q | gate]`` per head when gated), K, V, output."""
    H, hd = cfg.n_embd, cfg.head_dim
    q_rows = (2 if cfg.attn_output_gate else 1) * cfg.n_head * hd
    kv = cfg.n_head_kv * hd
    return {"attn_q": (q_rows, H), "attn_k": (kv, H), "attn_v": (kv, H), "attn_output": (H, cfg.n_head * hd)}


def attention_feature_slots(cfg: Any) -> dict[str, Shape]:
    """What the config's attention features add: q/k/v biases, output bias, QK-norm weights."""
    H, kv = cfg.n_embd, cfg.n_head_kv * cfg.head_dim
    q = attention_slots(cfg)["attn_q"][0]
    per: dict[str, Shape] = {}
    if cfg.attn_bias:
        per.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
    if cfg.attn_out_bias:
        per["attn_output.bias"] = (H,)
    return per


def gdn_slots(cfg: Any) -> dict[str, Shape]:
    """The Gated DeltaNet mixer: in_proj_qkv, z, beta, alpha, conv kernel, A, dt bias, gated norm, out."""
    H, nv, dv = cfg.n_embd, cfg.ssm_n_v_heads, cfg.ssm_v_head_dim
    vd = nv * dv
    return {"attn_qkv": (cfg.conv_dim, H), "attn_gate": (vd, H), "ssm_beta": (nv, H), "ssm_alpha": (nv, H),
            "ssm_conv1d": (cfg.conv_dim, cfg.ssm_conv_kernel), "ssm_a": (nv,), "ssm_dt.bias": (nv,),
            "ssm_norm": (dv,), "ssm_out": (H, vd)}


def ffn_slots(cfg: Any) -> dict[str, Shape]:
    """The GLU FFN: gate, up, down (``down(act(gate) * up)``)."""
    H, ff = cfg.n_embd, cfg.n_ff
    return {"ffn_gate": (ff, H), "ffn_up": (ff, H), "ffn_down": (H, ff)}


def block_slots(cfg: Any, il: int) -> dict[str, Shape]:
    """Every slot block ``il`` reads, in check order: norm, mixer, FFN norm, FFN, then the features."""
    H, ff, hd = cfg.n_embd, cfg.n_ff, cfg.head_dim
    linear = cfg.is_linear(il)
    per: dict[str, Shape] = {"attn_norm": (H,)}
    per.update(gdn_slots(cfg) if linear else attention_slots(cfg))
    per["ffn_norm"] = (H,)
    per.update(ffn_slots(cfg))
    if not linear:
        per.update(attention_feature_slots(cfg))
    if cfg.mlp_bias:
        per.update({"ffn_gate.bias": (ff,), "ffn_up.bias": (ff,), "ffn_down.bias": (H,)})
    if cfg.qk_norm and not linear:
        per.update({"attn_q_norm": (hd,), "attn_k_norm": (hd,)})
    if cfg.post_norms:
        per.update({"post_attention_norm": (H,), "post_ffw_norm": (H,)})
    return per


def block_tensor_name(il: int, slot: str, names: Mapping[str, str]) -> str:
    """Engine name of ``slot`` in block ``il`` (``blk.{il}.{name}``, the family's name for the slot)."""
    return f"blk.{il}.{names.get(slot, slot)}"


#: the NextN / MTP tensors of an MTP block beside its decoder-block slots (gguf-py ``MODEL_TENSOR.NEXTN_*``):
#: ``eh_proj`` = HF ``mtp.fc`` ``[H, 2H]``, ``enorm`` = ``mtp.pre_fc_norm_embedding``, ``hnorm`` =
#: ``mtp.pre_fc_norm_hidden``, ``shared_head_norm`` = ``mtp.norm`` (llama.cpp ``conversion/qwen.py``
#: ``_Qwen35MtpMixin.modify_tensors``)
NEXTN_SLOTS = ("nextn.eh_proj", "nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm")


def mtp_block_slots(cfg: Any) -> dict[str, Shape]:
    """An MTP block's slots (llama.cpp ``llama_model_qwen35::load_arch_tensors`` ``load_block_mtp``): a
    full-attention decoder block (as :func:`block_slots` of a non-linear layer) plus the NextN tensors."""
    H = cfg.n_embd
    per = {"attn_norm": (H,)}
    per.update(attention_slots(cfg))
    per["ffn_norm"] = (H,)
    per.update(ffn_slots(cfg))
    per.update(attention_feature_slots(cfg))
    if cfg.mlp_bias:
        per.update({"ffn_gate.bias": (cfg.n_ff,), "ffn_up.bias": (cfg.n_ff,), "ffn_down.bias": (H,)})
    if cfg.qk_norm:
        per.update({"attn_q_norm": (cfg.head_dim,), "attn_k_norm": (cfg.head_dim,)})
    per.update({"nextn.eh_proj": (H, 2 * H), "nextn.enorm": (H,), "nextn.hnorm": (H,), "nextn.shared_head_norm": (H,)})
    return per


def expected_tensors(cfg: Any, names: Mapping[str, str]) -> dict[str, Shape]:
    """Every tensor the decoder reads for ``cfg``: global tensors, then each block's slots under the
    family's names (``names``: slot -> name where the family differs from llama.cpp's default), then
    the MTP blocks ``blk.{n_layer + j}`` when ``cfg.mtp_layers`` (:func:`mtp_block_slots`)."""
    exp = global_tensors(cfg)
    for il in range(cfg.n_layer):
        exp.update({block_tensor_name(il, s, names): shp for s, shp in block_slots(cfg, il).items()})
    for il in range(cfg.n_layer, cfg.n_layer + getattr(cfg, "mtp_layers", 0)):
        exp.update({block_tensor_name(il, s, names): shp for s, shp in mtp_block_slots(cfg).items()})
    return exp
