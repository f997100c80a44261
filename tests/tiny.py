"""Tiny random Llama checkpoints written by tests: the same weights as a GGUF file (Q/K rows
permuted for adjacent-pair RoPE, as llama.cpp's converter does) and as an HF directory
(safetensors + config.json + tokenizer.json). Byte-level vocabulary of 256 tokens, one merge (``he``) and 2 specials.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from infertrace.model.rope import permute_for_norm


def _byte_chars() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


TOKENS = _byte_chars() + ["he", "<|endoftext|>", "<|im_end|>"]
VOCAB = len(TOKENS)


def make_weights(n_layer=2, H=32, n_head=4, n_kv=2, head_dim=8, ff=48, vocab=VOCAB, tie=True, seed=0):
    """HF-named fp32 tensors of a random Llama."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.2)  # noqa: E731
    w = {"model.embed_tokens.weight": r(vocab, H), "model.norm.weight": 1 + r(H)}
    for i in range(n_layer):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + r(H)
        w[p + "post_attention_layernorm.weight"] = 1 + r(H)
        w[p + "self_attn.q_proj.weight"] = r(n_head * head_dim, H)
        w[p + "self_attn.k_proj.weight"] = r(n_kv * head_dim, H)
        w[p + "self_attn.v_proj.weight"] = r(n_kv * head_dim, H)
        w[p + "self_attn.o_proj.weight"] = r(H, n_head * head_dim)
        w[p + "mlp.gate_proj.weight"] = r(ff, H)
        w[p + "mlp.up_proj.weight"] = r(ff, H)
        w[p + "mlp.down_proj.weight"] = r(H, ff)
    if not tie:
        w["lm_head.weight"] = r(vocab, H)
    shape = dict(n_layer=n_layer, H=H, n_head=n_head, n_kv=n_kv, head_dim=head_dim, ff=ff, vocab=vocab, tie=tie)
    return w, shape


def write_hf(d: Path, w: dict, s: dict, theta: float = 10000.0) -> Path:
    """Write ``config.json``, ``model.safetensors``, ``tokenizer.json`` into ``d``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s["H"],
           "num_attention_heads": s["n_head"], "num_key_value_heads": s["n_kv"], "num_hidden_layers": s["n_layer"],
           "intermediate_size": s["ff"], "vocab_size": s["vocab"], "rms_norm_eps": 1e-5, "rope_theta": theta,
           "max_position_embeddings": 256, "tie_word_embeddings": s["tie"], "bos_token_id": VOCAB - 2,
           "eos_token_id": VOCAB - 1, "head_dim": s["head_dim"], "torch_dtype": "float32"}
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in w.items()}, str(d / "model.safetensors"))
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(TOKENS[:257])}, [("h", "e")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(TOKENS[257:])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": "<|im_end|>"}))
    return d


def write_gguf(path: Path, w: dict, s: dict, theta: float | None = 10000.0, arch: str = "llama") -> Path:
    """Write the same weights as a llama GGUF (F32 tensors, Q/K permuted, ggml names)."""
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_block_count(s["n_layer"])
    wr.add_context_length(256)
    wr.add_embedding_length(s["H"])
    wr.add_feed_forward_length(s["ff"])
    wr.add_head_count(s["n_head"])
    wr.add_head_count_kv(s["n_kv"])
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_rope_dimension_count(s["head_dim"])
    if theta is not None:
        wr.add_rope_freq_base(theta)
    wr.add_vocab_size(s["vocab"])
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(TOKENS)
    wr.add_token_types([1] * 257 + [3, 3])
    wr.add_token_merges(["h e"])
    wr.add_eos_token_id(VOCAB - 1)
    wr.add_add_bos_token(False)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for k, t in w.items():
        if k == "model.embed_tokens.weight":
            n = "token_embd.weight"
        elif k == "model.norm.weight":
            n = "output_norm.weight"
        elif k == "lm_head.weight":
            n = "output.weight"
        else:
            parts = k.split(".")
            n = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.weight"
            if parts[3:5] == ["self_attn", "q_proj"]:
                t = permute_for_norm(t, s["n_head"])
            elif parts[3:5] == ["self_attn", "k_proj"]:
                t = permute_for_norm(t, s["n_kv"])
        wr.add_tensor(n, np.ascontiguousarray(t.numpy().astype(np.float32)))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path
