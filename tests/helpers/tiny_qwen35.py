"""Tiny random Qwen3.5 (hybrid GDN + gated attention) checkpoints: an HF directory
(``Qwen3_5ForCausalLM`` / ``qwen3_5_text``) and the same weights as a ``qwen35`` GGUF written the
way llama.cpp's ``convert_hf_to_gguf.py`` does (norms stored as ``1 + w`` except the gated
``ssm_norm``, ``ssm_a = -exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, conv1d squeezed, V heads
reordered from grouped to tiled when ``n_v_heads != n_k_heads``; ``qwen35.ssm.*`` keys).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from tests.helpers.tiny import VOCAB, add_tiny_tokenizer, write_hf

SHAPE = dict(n_layer=4, H=32, n_head=4, n_kv=2, head_dim=16, ff=48, vocab=VOCAB, nk=2, nv=4, dk=8, dv=8, conv=4,
             interval=2, partial=0.25, tie=False, mtp=False)

#: the MTP head's HF tensors (Qwen3.5 checkpoints: ``mtp.*``; vLLM ``qwen3_5_mtp.py`` names)
MTP_LAYER = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
             "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def make_weights(seed: int = 0, **over) -> tuple[dict[str, torch.Tensor], dict]:
    """HF-named fp32 tensors of a random tiny Qwen3.5 text model (norm weights zero-centred)."""
    s = dict(SHAPE, **over)
    g = torch.Generator().manual_seed(seed)
    r = lambda *sh: torch.randn(*sh, generator=g) * 0.2  # noqa: E731
    H, hd, nh, nkv, ff = s["H"], s["head_dim"], s["n_head"], s["n_kv"], s["ff"]
    nk, nv, dk, dv, K = s["nk"], s["nv"], s["dk"], s["dv"], s["conv"]
    conv_dim = 2 * nk * dk + nv * dv
    w = {"model.embed_tokens.weight": r(s["vocab"], H), "model.norm.weight": r(H)}
    if not s["tie"]:
        w["lm_head.weight"] = r(s["vocab"], H)
    for i in range(s["n_layer"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = r(H)
        w[p + "post_attention_layernorm.weight"] = r(H)
        w[p + "mlp.gate_proj.weight"] = r(ff, H)
        w[p + "mlp.up_proj.weight"] = r(ff, H)
        w[p + "mlp.down_proj.weight"] = r(H, ff)
        if (i + 1) % s["interval"]:
            q = p + "linear_attn."
            w[q + "in_proj_qkv.weight"] = r(conv_dim, H)
            w[q + "in_proj_z.weight"] = r(nv * dv, H)
            w[q + "in_proj_b.weight"] = r(nv, H)
            w[q + "in_proj_a.weight"] = r(nv, H)
            w[q + "conv1d.weight"] = r(conv_dim, 1, K) * 2
            w[q + "A_log"] = torch.empty(nv).uniform_(0.01, 4, generator=g).log()
            w[q + "dt_bias"] = 1 + r(nv)
            w[q + "norm.weight"] = 1 + r(dv)
            w[q + "out_proj.weight"] = r(H, nv * dv)
        else:
            q = p + "self_attn."
            w[q + "q_proj.weight"] = r(2 * nh * hd, H)
            w[q + "k_proj.weight"] = r(nkv * hd, H)
            w[q + "v_proj.weight"] = r(nkv * hd, H)
            w[q + "o_proj.weight"] = r(H, nh * hd)
            w[q + "q_norm.weight"] = r(hd)
            w[q + "k_norm.weight"] = r(hd)
    if s["mtp"]:  # one MTP block (full attention) + fc / pre-fc norms / its own final norm
        w["mtp.fc.weight"] = r(H, 2 * H)
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            w[f"mtp.{n}.weight"] = r(H)
        q = "mtp.layers.0."
        shapes = {"input_layernorm": (H,), "post_attention_layernorm": (H,), "self_attn.q_proj": (2 * nh * hd, H),
                  "self_attn.k_proj": (nkv * hd, H), "self_attn.v_proj": (nkv * hd, H), "self_attn.o_proj": (H, nh * hd),
                  "self_attn.q_norm": (hd,), "self_attn.k_norm": (hd,), "mlp.gate_proj": (ff, H), "mlp.up_proj": (ff, H),
                  "mlp.down_proj": (H, ff)}
        for n in MTP_LAYER:
            w[q + n + ".weight"] = r(*shapes[n])
    return w, s


def hf_config(s: dict) -> dict:
    """``config.json`` of the tiny model (``Qwen3_5ForCausalLM``, ``qwen3_5_text``)."""
    types = ["linear_attention" if (i + 1) % s["interval"] else "full_attention" for i in range(s["n_layer"])]
    return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": s["H"],
            "num_attention_heads": s["n_head"], "num_key_value_heads": s["n_kv"], "num_hidden_layers": s["n_layer"],
            "intermediate_size": s["ff"], "vocab_size": s["vocab"], "rms_norm_eps": 1e-6, "head_dim": s["head_dim"],
            "max_position_embeddings": 256, "tie_word_embeddings": s["tie"], "hidden_act": "silu",
            "bos_token_id": VOCAB - 2, "eos_token_id": VOCAB - 1, "layer_types": types,
            "linear_conv_kernel_dim": s["conv"], "linear_key_head_dim": s["dk"], "linear_value_head_dim": s["dv"],
            "linear_num_key_heads": s["nk"], "linear_num_value_heads": s["nv"], "torch_dtype": "float32",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": s["partial"],
                                "mrope_section": [1, 1, 0], "mrope_interleaved": True},
            **({"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False} if s.get("mtp") else {})}


def write_hf_dir(d: Path, w: dict, s: dict) -> Path:
    """HF directory: config.json, model.safetensors, tokenizer files (the byte-level tiny tokenizer)."""
    write_hf(d, {"model.embed_tokens.weight": w["model.embed_tokens.weight"]},
             dict(n_layer=1, H=s["H"], n_head=s["n_head"], n_kv=s["n_kv"], head_dim=s["head_dim"], ff=s["ff"],
                  vocab=s["vocab"], tie=True, family="llama"))
    (d / "config.json").write_text(json.dumps(hf_config(s)))
    save_file({k: v.contiguous() for k, v in w.items()}, str(d / "model.safetensors"))
    return d


def _tiled(t: torch.Tensor, dim: int, nk: int, nv: int, head: int) -> torch.Tensor:
    """HF grouped V-head order -> llama.cpp tiled order along ``dim`` (convert_hf_to_gguf ``_reorder_v_heads``)."""
    if nk == nv:
        return t
    shape = list(t.shape)
    d = dim % len(shape)
    x = t.reshape(*shape[:d], nk, nv // nk, head, *shape[d + 1:])
    return x.transpose(d, d + 1).contiguous().reshape(shape)


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate", "linear_attn.in_proj_b": "ssm_beta",
              "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm",
              "linear_attn.out_proj": "ssm_out"}


MTP_GGUF = {"mtp.fc.weight": "nextn.eh_proj", "mtp.pre_fc_norm_embedding.weight": "nextn.enorm",
            "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm", "mtp.norm.weight": "nextn.shared_head_norm"}


def write_gguf(path: Path, w: dict, s: dict, extra_kv: dict | None = None) -> Path:
    """The same weights as a ``qwen35`` GGUF (F32), converted as llama.cpp's converter does."""
    nk, nv, dk, dv = s["nk"], s["nv"], s["dk"], s["dv"]
    wr = gguf.GGUFWriter(str(path), "qwen35")
    n_mtp = 1 if s.get("mtp") else 0
    wr.add_block_count(s["n_layer"] + n_mtp)  # llama.cpp's converter counts the MTP block (_Qwen35MtpMixin)
    if n_mtp:
        wr.add_uint32("qwen35.nextn_predict_layers", n_mtp)
    wr.add_context_length(256)
    wr.add_embedding_length(s["H"])
    wr.add_feed_forward_length(s["ff"])
    wr.add_head_count(s["n_head"])
    wr.add_head_count_kv(s["n_kv"])
    wr.add_key_length(s["head_dim"])
    wr.add_value_length(s["head_dim"])
    wr.add_layer_norm_rms_eps(1e-6)
    wr.add_rope_freq_base(10000.0)
    wr.add_rope_dimension_count(int(s["head_dim"] * s["partial"]))
    wr.add_rope_dimension_sections([1, 1, 0, 0])
    wr.add_ssm_conv_kernel(s["conv"])
    wr.add_ssm_state_size(dk)
    wr.add_ssm_group_count(nk)
    wr.add_ssm_time_step_rank(nv)
    wr.add_ssm_inner_size(nv * dv)
    wr.add_full_attention_interval(s["interval"])
    for k, v in (extra_kv or {}).items():
        wr.add_uint32(f"qwen35.{k}", v)
    add_tiny_tokenizer(wr, s["vocab"])
    qk = 2 * nk * dk
    for k, t in w.items():
        if k == "model.embed_tokens.weight":
            n = "token_embd.weight"
        elif k == "model.norm.weight":
            n, t = "output_norm.weight", t + 1
        elif k == "lm_head.weight":
            n = "output.weight"
        elif k in MTP_GGUF:  # converter: mtp.fc -> eh_proj, pre_fc_norm_* -> enorm / hnorm, norm -> shared_head.norm (+1)
            n, t = f"blk.{s['n_layer']}.{MTP_GGUF[k]}.weight", (t if k == "mtp.fc.weight" else t + 1)
        elif k.startswith("mtp.layers.0."):  # -> model.layers.{n_layer}.*, then the usual names (+1 on norms)
            mod = k[len("mtp.layers.0."):-len(".weight")]
            n = f"blk.{s['n_layer']}.{GGUF_NAMES[mod]}.weight"
            t = t + 1 if mod.endswith("norm") else t
        else:
            parts = k.split(".")
            bid, sub = parts[2], ".".join(parts[3:])
            if sub == "linear_attn.A_log":
                n, t = f"blk.{bid}.ssm_a", _tiled(-t.exp(), 0, nk, nv, 1)
            elif sub == "linear_attn.dt_bias":
                n, t = f"blk.{bid}.ssm_dt.bias", _tiled(t, 0, nk, nv, 1)
            else:
                mod = ".".join(parts[3:-1])
                n = f"blk.{bid}.{GGUF_NAMES[mod]}.{parts[-1]}"
                if mod.endswith("norm") and mod != "linear_attn.norm":
                    t = t + 1
                if mod in ("linear_attn.in_proj_qkv", "linear_attn.conv1d"):
                    t = t.reshape(t.shape[0], -1)
                    t = torch.cat([t[:qk], _tiled(t[qk:], 0, nk, nv, dv)])
                    t = t.squeeze(-1) if t.shape[-1] == 1 else t
                elif mod == "linear_attn.in_proj_z":
                    t = _tiled(t, 0, nk, nv, dv)
                elif mod in ("linear_attn.in_proj_b", "linear_attn.in_proj_a"):
                    t = _tiled(t, 0, nk, nv, 1)
                elif mod == "linear_attn.out_proj":
                    t = _tiled(t, 1, nk, nv, dv)
        wr.add_tensor(n, np.ascontiguousarray(t.numpy().astype(np.float32)))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def hf_model(w: dict, s: dict):
    """The HF transformers reference ``Qwen3_5ForCausalLM`` (fp32, eval) with these weights."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = hf_config(s)
    cfg.pop("architectures")
    cfg.pop("model_type")
    cfg.pop("torch_dtype")
    m = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg)).eval()
    missing, unexpected = m.load_state_dict({k: v for k, v in w.items() if not k.startswith("mtp.")}, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    return m
