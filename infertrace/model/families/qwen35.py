"""Qwen3.5 (text): a hybrid of Gated DeltaNet (``linear_attention``) and gated full-attention layers.

HF ``Qwen3_5ForCausalLM`` / ``Qwen3_5TextConfig`` (``model_type`` ``qwen3_5_text``; the
multimodal ``qwen3_5`` config nests it under ``text_config``) and llama.cpp ``LLM_ARCH_QWEN35``
(``src/models/qwen35.cpp``; GGUF keys ``qwen35.ssm.*``, ``full_attention_interval``,
``rope.dimension_sections``; tensor names from gguf-py ``MODEL_ARCH.QWEN35``).

Full-attention layer: ``q_proj`` yields ``[Q | gate]`` per head (``2 * head_dim`` rows per head),
QK-norm, RoPE on the first ``partial_rotary_factor * head_dim`` dims (M-RoPE: three position
axes, equal for text), attention, ``out * sigmoid(gate)``, ``o_proj``.
GDN layer: ``in_proj_qkv`` -> causal depthwise conv (kernel ``linear_conv_kernel_dim``) + SiLU
-> L2-normed q/k -> gated delta rule (``g = -exp(A_log) * softplus(a + dt_bias)``,
``beta = sigmoid(b)``) -> gated RMSNorm (``norm(o) * silu(z)``) -> ``out_proj``.
Norms are zero-centred (``x_hat * (1 + w)``): llama.cpp's converter stores ``w + 1`` (except the
gated norm), so GGUF weights are used as stored and HF weights get ``+1`` at load. The converter
also stores ``ssm_a = -exp(A_log)`` and, when ``n_v_heads != n_k_heads``, V heads in tiled order
(``_LinearAttentionVReorderBase``); the loader puts them back in HF's grouped order.
"""

from __future__ import annotations

from typing import Any

from infertrace.errors import InfertraceError
from infertrace.model.families.base import (
    Family, Ledger, gguf_common, gguf_unknown_keys, hf_act, hf_common, hf_rope_params, layer_number,
)

#: HF decoder-layer sub-modules -> llama.cpp tensor names (``blk.N.*``). Bare parameters
#: (``A_log``, ``dt_bias``) map to names without a ``.weight`` suffix.
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
}
#: bare HF parameters (full key after ``layers.N.``) -> engine names.
BARE_NAMES = {"linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias"}

LINEAR, FULL = "linear_attention", "full_attention"


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text part of a Qwen3.5 ``config.json``: ``text_config`` merged over the top level
    (the multimodal ``qwen3_5`` layout), or the dict itself (``qwen3_5_text``)."""
    tc = cfg.get("text_config")
    if tc is None:
        return cfg
    if not isinstance(tc, dict):
        raise InfertraceError(f"config.json text_config must be an object, got {type(tc).__name__}; fix the model's config")
    out = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    out.update(tc)
    out["architectures"] = cfg.get("architectures") or ["Qwen3_5ForCausalLM"]
    return out


def _layer_types_from_interval(n_layer: int, interval: int) -> tuple[str, ...]:
    """HF ``Qwen3_5TextConfig`` / llama.cpp: layer ``i`` is full attention iff ``(i + 1) % interval == 0``."""
    return tuple(LINEAR if (i + 1) % interval else FULL for i in range(n_layer))


def _check_gdn(kw: dict[str, Any]) -> None:
    nk, nv = kw["ssm_n_k_heads"], kw["ssm_n_v_heads"]
    for k in ("ssm_conv_kernel", "ssm_n_k_heads", "ssm_n_v_heads", "ssm_k_head_dim", "ssm_v_head_dim"):
        if isinstance(kw[k], bool) or not isinstance(kw[k], int) or not 1 <= kw[k] <= (1 << 20):
            raise InfertraceError(f"Qwen3.5 linear-attention setting {k} = {kw[k]!r} must be an integer in 1..{1 << 20}")
    if nv % nk:
        raise InfertraceError(f"linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}; the config is inconsistent")


def _ranges(types: tuple[str, ...], want: str) -> str:
    from infertrace.ranges import ranges_text

    return ranges_text([i for i, t in enumerate(types) if t == want])


def _ledger_hybrid(led: Ledger, kw: dict[str, Any], src: str) -> None:
    types = kw["layer_types"]
    if FULL not in types:
        raise InfertraceError(f"every one of the {len(types)} layers is linear_attention (GDN); a Qwen3.5 model without a "
                              "full-attention layer is not supported (the trace follows the KV of one); check layer_types / "
                              "full_attention_interval")
    n_lin = sum(t == LINEAR for t in types)
    led.honour("(family) layer map", f"{n_lin} GDN + {len(types) - n_lin} full-attention",
               f"GDN layers {_ranges(types, LINEAR)}; full attention {_ranges(types, FULL)}")
    led.honour("(family) full attention", "gated", "q_proj -> [Q | gate] per head, QK-norm, out * sigmoid(gate) -> o_proj")
    led.honour("(family) Gated DeltaNet", f"conv {kw['ssm_conv_kernel']}, heads k{kw['ssm_n_k_heads']}/v{kw['ssm_n_v_heads']}",
               f"state [{kw['ssm_n_v_heads']}, {kw['ssm_k_head_dim']}, {kw['ssm_v_head_dim']}] per request, "
               "conv state [conv_dim, kernel-1]")
    led.honour("(family) RMSNorm", "x_hat * (1 + w)", "+1 stored by llama.cpp's converter" if src == "gguf"
               else "+1 folded in at load (gated GDN norm excluded)")


def from_hf(cfg: dict[str, Any], led: Ledger, names: set[str]) -> dict[str, Any]:
    """HF ``Qwen3_5TextConfig`` (or the ``text_config`` of ``Qwen3_5Config``) -> ModelConfig kwargs."""
    cfg = dict(text_config(cfg))
    partial = cfg.pop("partial_rotary_factor", None)  # HF_FOREIGN would refuse it; honoured here
    kw = hf_common(cfg, led)
    rp, rkey = hf_rope_params(cfg, "full_attention")
    # HF ``convert_rope_params_to_dict``: the top-level value (default 0.25) is only a default for rope_parameters'
    partial = rp.get("partial_rotary_factor", 0.25 if partial is None else partial)
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < float(partial) <= 1:
        raise InfertraceError(f"config.json partial_rotary_factor must be a number in (0, 1], got {partial!r}")
    rope_dim = int(kw["head_dim"] * float(partial))
    if rope_dim % 2 or rope_dim < 2:
        raise InfertraceError(f"partial_rotary_factor {partial} gives {rope_dim} rotary dims of head_dim {kw['head_dim']}; must be even")
    led.honour("partial_rotary_factor", partial, f"RoPE rotates dims 0..{rope_dim - 1} of each head of {kw['head_dim']} "
               "(half-split pairs); the rest pass through")
    sec = rp.get("mrope_section", [11, 11, 10])
    if not (isinstance(sec, list) and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 4096 for x in sec)):
        raise InfertraceError("config.json rope_parameters.mrope_section must be a list of small integers")
    led.honour(f"{rkey}.mrope_section", sec, "M-RoPE t/h/w pair sections; text positions are equal on all axes, so "
               "the rotation equals 1-D RoPE")
    if "mrope_interleaved" in rp:
        led.honour(f"{rkey}.mrope_interleaved", rp["mrope_interleaved"], "axis layout of the sections; no effect for text")
    act = hf_act(cfg, led, "silu", ("silu",))
    if cfg.get("attention_bias"):
        led.refuse("attention_bias", True, "Qwen3.5 attention biases are not implemented")
    elif "attention_bias" in cfg:
        led.honour("attention_bias", False)
    if cfg.get("attn_output_gate", True) is not True:
        led.refuse("attn_output_gate", cfg.get("attn_output_gate"), "only the gated attention output of Qwen3.5 is implemented")
    n = kw["n_layer"]
    lt = cfg.get("layer_types")
    if lt is None:
        interval = cfg.get("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise InfertraceError(f"config.json full_attention_interval must be an integer >= 1, got {interval!r}")
        types = _layer_types_from_interval(n, interval)
        led.honour("full_attention_interval", interval, "every interval-th layer is full attention")
    elif not isinstance(lt, list) or len(lt) != n or any(t not in (LINEAR, FULL) for t in lt):
        raise InfertraceError(f"config.json layer_types must list {n} entries of linear_attention / full_attention")
    else:
        types = tuple(lt)
        led.honour("layer_types", f"{sum(t == LINEAR for t in types)} linear of {n}")
        if "full_attention_interval" in cfg:
            led.na("full_attention_interval", cfg["full_attention_interval"], "layer_types given; it wins (as HF)")
    gdn = dict(ssm_conv_kernel=cfg.get("linear_conv_kernel_dim", 4), ssm_n_k_heads=cfg.get("linear_num_key_heads", 16),
               ssm_n_v_heads=cfg.get("linear_num_value_heads", 32), ssm_k_head_dim=cfg.get("linear_key_head_dim", 128),
               ssm_v_head_dim=cfg.get("linear_value_head_dim", 128))
    _check_gdn(gdn)
    for k in ("linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim"):
        if k in cfg:
            led.honour(k, cfg[k])
    mtp = _hf_mtp_layers(cfg, led)
    for k, note in (("attention_dropout", "training only"), ("use_cache", "HF generation option"),
                    ("image_token_id", "vision input"), ("video_token_id", "vision input"),
                    ("vision_start_token_id", "vision input"), ("vision_end_token_id", "vision input")):
        if k in cfg:
            led.na(k, cfg[k], note)
    from infertrace.loading.synth import RANDOM_KEY, RANDOM_NOTE

    if cfg.get(RANDOM_KEY):
        led.na(RANDOM_KEY, "yes", RANDOM_NOTE)
    kw.update(rope_dim=rope_dim)
    if cfg.get("rms_norm_eps") is None:
        kw["rms_eps"] = 1e-6  # Qwen3_5TextConfig default
        led.add("rms_norm_eps", "absent (Qwen3.5 default 1e-6)", "honoured")
    hybrid = dict(layer_types=types, attn_output_gate=True, norm_mul_f32=True, mrope_sections=tuple(sec), **gdn)
    _ledger_hybrid(led, hybrid, "hf")
    return dict(kw, family="qwen35", act=act, qk_norm=True, mtp_layers=mtp, **hybrid)


#: what the ledger says of a loaded MTP head
MTP_NOTE = ("MTP draft head loaded as blk.{n}.* + blk.{n}.nextn.* (one full-attention block after the main blocks): "
            "drafts for --speculative mtp, not part of the main forward pass")


def _hf_mtp_layers(cfg: dict[str, Any], led: Ledger) -> int:
    """``mtp_num_hidden_layers`` / ``mtp_use_dedicated_embeddings`` -> MTP blocks to load (0 or 1).

    One block, drafting with the main model's ``embed_tokens`` (vLLM ``qwen3_5_mtp.py`` loads
    ``embed_tokens`` from the main model; llama.cpp ``graph_mtp`` falls back to ``tok_embd`` when
    ``nextn.embed_tokens`` is absent). Dedicated MTP embeddings or more than one block: the head is
    not loaded (the main forward pass does not read it either way) and ``--speculative mtp`` is refused."""
    n = cfg.get("mtp_num_hidden_layers", 0)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 64:
        raise InfertraceError(f"config.json mtp_num_hidden_layers must be an integer in 0..64, got {n!r}")
    ded = cfg.get("mtp_use_dedicated_embeddings", False)
    if "mtp_use_dedicated_embeddings" in cfg:
        led.na("mtp_use_dedicated_embeddings", ded, "MTP drafts embed with the main embed_tokens" if not ded else
               "dedicated MTP embeddings are not implemented: the MTP head is not loaded (--speculative mtp refused)")
    if "mtp_num_hidden_layers" not in cfg:
        return 0
    if n == 1 and not ded:
        led.honour("mtp_num_hidden_layers", n, MTP_NOTE.format(n=cfg.get("num_hidden_layers", "N")))
        return 1
    led.na("mtp_num_hidden_layers", n, "no MTP head" if n == 0 else "only one MTP block is implemented (llama.cpp "
           "graph_mtp asserts one): the mtp.* tensors are not loaded (--speculative mtp refused)")
    return 0


def from_gguf(meta: dict[str, Any], led: Ledger, names: set[str]) -> dict[str, Any]:
    """``qwen35.*`` keys -> ModelConfig kwargs (llama.cpp ``llama_model_qwen35::load_arch_hparams``)."""
    arch = "qwen35"
    rope_dim_raw = meta.get(f"{arch}.rope.dimension_count")
    kw, f = gguf_common({k: v for k, v in meta.items() if k != f"{arch}.rope.dimension_count"}, arch, led)
    led.seen.discard(f.key("rope.dimension_count"))
    led.rows = [r for r in led.rows if r[0] != f.key("rope.dimension_count")]
    if rope_dim_raw is None:  # llama.cpp would then rotate every dim (n_rot = head dim); Qwen3.5 rotates a quarter
        raise InfertraceError(f"GGUF lacks {arch}.rope.dimension_count (llama.cpp's converter always writes it; without it "
                              "llama.cpp rotates the whole head, Qwen3.5 a quarter of it); the file is incomplete")
    if isinstance(rope_dim_raw, bool) or not isinstance(rope_dim_raw, int):
        raise InfertraceError(f"GGUF {arch}.rope.dimension_count must be an integer, got {type(rope_dim_raw).__name__}")
    rope_dim = rope_dim_raw
    if rope_dim % 2 or not 2 <= rope_dim <= kw["head_dim"]:
        raise InfertraceError(f"GGUF {arch}.rope.dimension_count {rope_dim} must be even and <= head dim {kw['head_dim']}")
    led.honour(f.key("rope.dimension_count"), rope_dim, f"RoPE rotates dims 0..{rope_dim - 1} of {kw['head_dim']} per head")
    kw["rope_dim"] = rope_dim
    sec = meta.get(f"{arch}.rope.dimension_sections")
    if sec is None:
        sec = [11, 11, 10, 0]
    elif not (isinstance(sec, (list, tuple)) and len(sec) <= 4
              and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 4096 for x in sec)):
        raise InfertraceError(f"GGUF {arch}.rope.dimension_sections must be up to 4 small integers; the file is broken")
    sec = list(sec)
    led.honour(f.key("rope.dimension_sections"), sec, "M-RoPE sections (ggml_rope_multi); text positions equal on all axes")
    mtp = _gguf_nextn(f, kw, led)
    n = kw["n_layer"]
    rec = meta.get(f"{arch}.attention.recurrent_layers")
    n_all = n + (f.num("nextn_predict_layers", 0, int) or 0)
    if rec is not None and not (isinstance(rec, (list, tuple)) and len(rec) in (n, n_all)):
        raise InfertraceError(f"GGUF {arch}.attention.recurrent_layers must list {n_all} flags (one per block); the file is broken")
    if rec is not None and any(rec[n:]):
        raise InfertraceError(f"GGUF {arch}.attention.recurrent_layers flags an MTP block recurrent (llama.cpp: MTP "
                              "layers are dense attention); the file is broken")
    if rec is not None:
        types = tuple(LINEAR if rec[i] else FULL for i in range(n))
        led.honour(f.key("attention.recurrent_layers"), f"{sum(bool(x) for x in rec[:n])} recurrent of {n}")
    else:
        interval = f.num("full_attention_interval", 4, int)
        if interval is None or interval < 1:
            raise InfertraceError(f"GGUF {arch}.full_attention_interval must be >= 1")
        types = _layer_types_from_interval(n, interval)
        led.honour(f.key("full_attention_interval"), interval, "every interval-th layer is full attention")
    state = f.num("ssm.state_size", None, int)
    n_v = f.num("ssm.time_step_rank", None, int)
    inner = f.num("ssm.inner_size", None, int)
    gdn = dict(ssm_conv_kernel=f.num("ssm.conv_kernel", None, int), ssm_n_k_heads=f.num("ssm.group_count", None, int),
               ssm_n_v_heads=n_v, ssm_k_head_dim=state,
               ssm_v_head_dim=(inner // n_v) if (inner and n_v) else None)
    if any(v is None for v in gdn.values()):
        raise InfertraceError(f"GGUF lacks a {arch}.ssm.* key (conv_kernel, group_count, time_step_rank, state_size, "
                              "inner_size); the file is incomplete")
    _check_gdn(gdn)
    if inner != n_v * gdn["ssm_v_head_dim"]:
        raise InfertraceError(f"GGUF {arch}.ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {n_v}")
    for k in ("ssm.conv_kernel", "ssm.group_count", "ssm.time_step_rank", "ssm.state_size", "ssm.inner_size"):
        led.honour(f.key(k), f.get(k))
    gguf_unknown_keys(meta, arch, led)
    hybrid = dict(layer_types=types, attn_output_gate=True, norm_mul_f32=True, mrope_sections=tuple(sec), **gdn)
    _ledger_hybrid(led, hybrid, "gguf")
    return dict(kw, family="qwen35", act="silu", qk_norm=True, mtp_layers=mtp, **hybrid)


def _gguf_nextn(f: Any, kw: dict[str, Any], led: Ledger) -> int:
    """``{arch}.nextn_predict_layers``: llama.cpp counts the MTP blocks in ``block_count``
    (``n_layer_all``; ``hparams.n_layer() = n_layer_all - n_layer_nextn``, src/llama-hparams.cpp) and
    stores them as ``blk.{n_layer}.*`` (``load_block_mtp`` in src/models/qwen35.cpp). Sets
    ``kw["n_layer"]`` to the main blocks; returns the MTP blocks to load (0 or 1).

    Raises:
        InfertraceError: ``nextn_predict_layers`` not smaller than ``block_count``.
    """
    nextn = f.num("nextn_predict_layers", 0, int)
    if not f.has("nextn_predict_layers"):
        return 0
    if nextn is None or not 0 <= nextn < kw["n_layer"]:
        raise InfertraceError(f"GGUF {f.key('nextn_predict_layers')} = {nextn} must be in 0..block_count-1 "
                              f"(block_count {kw['n_layer']} counts the MTP blocks too); the file is broken")
    kw["n_layer"] -= nextn
    if nextn == 0:
        led.na(f.key("nextn_predict_layers"), 0, "no MTP layers")
        return 0
    if nextn > 1:
        led.refuse(f.key("nextn_predict_layers"), nextn, "more than one MTP block is not implemented (llama.cpp "
                   "graph_mtp asserts one)")
        return 0
    led.honour(f.key("nextn_predict_layers"), nextn, MTP_NOTE.format(n=kw["n_layer"]) + f"; block_count {kw['n_layer'] + 1} "
           f"= {kw['n_layer']} main + 1 MTP")
    return 1


def v_heads_tiled_to_grouped(t: Any, dim: int, n_k: int, n_v: int, head: int) -> Any:
    """Undo llama.cpp's ``_reorder_v_heads`` along ``dim``: tiled ``[r, n_k]`` head order -> HF's
    grouped ``[n_k, r]`` (``r = n_v // n_k``); ``head`` = elements per head along ``dim``."""
    if n_k == n_v:
        return t
    r = n_v // n_k
    shape = list(t.shape)
    d = dim % len(shape)
    x = t.reshape(*shape[:d], r, n_k, head, *shape[d + 1:])
    return x.transpose(d, d + 1).contiguous().reshape(shape)


def fix_gguf_weights(cfg: Any, w: dict[str, Any]) -> None:
    """In place: GGUF V-head order (tiled) -> HF grouped order, for ``n_v_heads != n_k_heads``."""
    nk, nv, dk, dv = cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.ssm_k_head_dim, cfg.ssm_v_head_dim
    if nk == nv:
        return
    qk = 2 * nk * dk
    for i in range(cfg.n_layer):
        if not cfg.is_linear(i):
            continue
        p = f"blk.{i}."
        for n in ("attn_qkv", "ssm_conv1d"):
            t = w[p + n]
            w[p + n] = _cat_rows(t[:qk], v_heads_tiled_to_grouped(t[qk:], 0, nk, nv, dv))
        w[p + "attn_gate"] = v_heads_tiled_to_grouped(w[p + "attn_gate"], 0, nk, nv, dv)
        for n in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt.bias"):
            w[p + n] = v_heads_tiled_to_grouped(w[p + n], 0, nk, nv, 1)
        w[p + "ssm_out"] = v_heads_tiled_to_grouped(w[p + "ssm_out"], 1, nk, nv, dv)


def _cat_rows(a: Any, b: Any) -> Any:
    import torch

    return torch.cat([a, b], dim=0)


def fix_hf_weights(cfg: Any, w: dict[str, Any]) -> dict[str, Any]:
    """As llama.cpp's converter does once (in place, ``w`` returned): ``ssm_a = -exp(A_log)`` (float32),
    conv1d ``[C, 1, K] -> [C, K]``, zero-centred norms ``w -> 1 + w`` (the gated GDN norm excluded)."""
    for k in list(w):
        last = k.split(".")[-1]
        if last == "ssm_a":
            w[k] = -w[k].float().exp()  # [n_v] A = -exp(A_log)
        elif last == "ssm_conv1d" and w[k].dim() == 3:
            w[k] = w[k].squeeze(1)  # [conv_dim, K]
        elif last.endswith("norm") and last != "ssm_norm":
            w[k] = w[k].float() + 1.0  # (1 + w)
    return w


def load_notes(cfg: Any, source: str, raw: dict[str, Any]) -> list[str]:
    """What the loader did to this file's tensors (and whether the weights are random)."""
    n = cfg.n_layer
    mtp = ([f"MTP draft head loaded: blk.{n}.* (full-attention block) + blk.{n}.nextn.{{eh_proj,enorm,hnorm,"
            "shared_head_norm}" + ("" if source == "gguf" else " from mtp.layers.0.* / mtp.fc / mtp.pre_fc_norm_embedding "
                                   "/ mtp.pre_fc_norm_hidden / mtp.norm (norms + 1)")
            + "; read only by --speculative mtp (model/mtp.py), never by the main forward pass"] if cfg.mtp_layers else [])
    if source == "gguf":
        from infertrace.loading.synth import RANDOM_NOTE

        if raw.get("general.description") == RANDOM_NOTE:  # make-qwen35 --format gguf
            mtp = [RANDOM_NOTE] + mtp
        if cfg.ssm_n_k_heads != cfg.ssm_n_v_heads:
            return ["Qwen3.5: llama.cpp's converter stored norms as 1 + w (not ssm_norm), ssm_a = -exp(A_log) and GDN "
                    "V heads in tiled order; norms and ssm_a used as stored, V heads put back in HF's grouped order"] + mtp
        return ["Qwen3.5: llama.cpp's converter stored norms as 1 + w (not ssm_norm) and ssm_a = -exp(A_log); used as stored"] + mtp
    from infertrace.loading.synth import RANDOM_KEY, RANDOM_NOTE

    notes = [RANDOM_NOTE] if raw.get(RANDOM_KEY) else []
    return notes + ["Qwen3.5 zero-centred RMSNorm (1 + w): +1 folded into every norm but the gated ssm_norm at load; "
                    "A_log -> ssm_a = -exp(A_log) (as llama.cpp's converter)"] + mtp


def hf_skip(cfg: Any, key: str) -> str | None:
    """Why an HF tensor outside the text decoder (and its loaded MTP head) is not loaded (None: load it)."""
    if key.startswith("mtp.") and not cfg.mtp_layers:
        return "MTP draft head not loaded (see mtp_num_hidden_layers in inspect; not part of the main forward pass)"
    if key.startswith(("model.visual.", "visual.")):
        return "vision tower (text-only run; HF Qwen3_5ForCausalLM ignores it too)"
    return None


#: HF ``mtp.*`` tensors outside ``mtp.layers.J`` -> NextN slots (llama.cpp ``conversion/qwen.py``
#: ``_Qwen35MtpMixin.modify_tensors`` remapper, then gguf-py ``MODEL_TENSOR.NEXTN_*`` names)
MTP_NAMES = {"mtp.fc.weight": "nextn.eh_proj", "mtp.pre_fc_norm_embedding.weight": "nextn.enorm",
             "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm", "mtp.norm.weight": "nextn.shared_head_norm"}


def hf_mtp_name(cfg: Any, key: str) -> str | None:
    """An HF ``mtp.*`` key -> engine name (None for any other key): ``mtp.layers.J.X`` ->
    ``blk.{n_layer + J}.X`` under the decoder-layer names (llama.cpp's converter renames it
    ``model.layers.{n_layer + J}``), ``mtp.fc`` / ``pre_fc_norm_*`` / ``norm`` -> ``blk.{n_layer}.nextn.*``."""
    if not key.startswith("mtp.") or not cfg.mtp_layers:
        return None
    if key in MTP_NAMES:
        return f"blk.{cfg.n_layer}.{MTP_NAMES[key]}"
    parts = key.split(".")
    j = layer_number(parts[2]) if len(parts) >= 5 and parts[1] == "layers" else None
    if j is not None and j < cfg.mtp_layers:
        sub, last = ".".join(parts[3:-1]), parts[-1]
        if sub in LAYER_NAMES and last in ("weight", "bias"):
            base = f"blk.{cfg.n_layer + j}.{LAYER_NAMES[sub]}"
            return base if last == "weight" else base + ".bias"
    return None


def hf_key(key: str) -> str:
    """``model.language_model.X`` (multimodal layout) -> ``model.X``."""
    return "model." + key[len("model.language_model."):] if key.startswith("model.language_model.") else key


FAMILY = Family(
    name="qwen35", gguf_archs=("qwen35",), hf_archs=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    hf_model_types=("qwen3_5", "qwen3_5_text"), gguf_rope_pairing="neox", hf_layer_names=LAYER_NAMES,
    from_gguf=from_gguf, from_hf=from_hf,
    features=("hybrid: Gated DeltaNet (linear_attention) + gated full attention layers",
              "GDN: causal conv + L2-normed q/k + gated delta rule + gated RMSNorm; fixed-size state per request",
              "full attention: Q+gate projection, QK-norm, partial RoPE (M-RoPE sections), out * sigmoid(gate)",
              "zero-centred RMSNorm (1 + w)",
              "MTP draft head (mtp.* / blk.N.nextn.*): loaded when present; drafts for --speculative mtp (model/mtp.py)"),
    block_names={"ffn_norm": "post_attention_norm"},  # llama.cpp LLM_TENSOR_ATTN_POST_NORM is the pre-FFN norm here
    hf_text_config=text_config, hf_key=hf_key, hf_bare_names=BARE_NAMES, hf_skip=hf_skip, hf_name=hf_mtp_name,
    gguf_weights=fix_gguf_weights, hf_weights=fix_hf_weights, load_notes=load_notes,
)
