"""Tiny random checkpoints written by tests: the same weights as a GGUF file (Q/K rows and
biases permuted for adjacent-pair RoPE for the ``llama`` arch, Gemma norms stored as ``w + 1``,
as llama.cpp's ``convert_hf_to_gguf.py`` does) and as an HF directory (safetensors +
config.json + tokenizer.json). Byte-level vocabulary of 256 tokens, one merge (``he``) and 2
specials. Families: llama (optionally with attention / MLP biases), mistral, qwen2, qwen3, gemma3.
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


def make_weights(n_layer=2, H=32, n_head=4, n_kv=2, head_dim=8, ff=48, vocab=VOCAB, tie=True, seed=0,
                 family="llama", attn_bias=False, mlp_bias=False):
    """HF-named fp32 tensors of a random decoder of ``family`` (biases / QK-norm / Gemma norms as the family has them)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.2)  # noqa: E731
    gemma = family == "gemma3"
    nw = (lambda n: r(n)) if gemma else (lambda n: 1 + r(n))  # noqa: E731  Gemma stores w of (1 + w)
    w = {"model.embed_tokens.weight": r(vocab, H), "model.norm.weight": nw(H)}
    attn_bias = attn_bias or family == "qwen2"
    for i in range(n_layer):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = nw(H)
        w[p + "post_attention_layernorm.weight"] = nw(H)
        if gemma:
            w[p + "pre_feedforward_layernorm.weight"] = nw(H)
            w[p + "post_feedforward_layernorm.weight"] = nw(H)
        if family in ("qwen3", "gemma3"):
            w[p + "self_attn.q_norm.weight"] = nw(head_dim)
            w[p + "self_attn.k_norm.weight"] = nw(head_dim)
        if attn_bias:
            w[p + "self_attn.q_proj.bias"] = r(n_head * head_dim)
            w[p + "self_attn.k_proj.bias"] = r(n_kv * head_dim)
            w[p + "self_attn.v_proj.bias"] = r(n_kv * head_dim)
            if family != "qwen2":
                w[p + "self_attn.o_proj.bias"] = r(H)
        if mlp_bias:
            w[p + "mlp.gate_proj.bias"] = r(ff)
            w[p + "mlp.up_proj.bias"] = r(ff)
            w[p + "mlp.down_proj.bias"] = r(H)
        w[p + "self_attn.q_proj.weight"] = r(n_head * head_dim, H)
        w[p + "self_attn.k_proj.weight"] = r(n_kv * head_dim, H)
        w[p + "self_attn.v_proj.weight"] = r(n_kv * head_dim, H)
        w[p + "self_attn.o_proj.weight"] = r(H, n_head * head_dim)
        w[p + "mlp.gate_proj.weight"] = r(ff, H)
        w[p + "mlp.up_proj.weight"] = r(ff, H)
        w[p + "mlp.down_proj.weight"] = r(H, ff)
    if not tie:
        w["lm_head.weight"] = r(vocab, H)
    shape = dict(n_layer=n_layer, H=H, n_head=n_head, n_kv=n_kv, head_dim=head_dim, ff=ff, vocab=vocab, tie=tie,
                 family=family, attn_bias=attn_bias, mlp_bias=mlp_bias)
    return w, shape


HF_ARCH = {"llama": ("LlamaForCausalLM", "llama"), "mistral": ("MistralForCausalLM", "mistral"),
           "qwen2": ("Qwen2ForCausalLM", "qwen2"), "qwen3": ("Qwen3ForCausalLM", "qwen3"),
           "gemma3": ("Gemma3ForCausalLM", "gemma3_text")}


def hf_config(s: dict, theta: float = 10000.0, **extra) -> dict:
    """The ``config.json`` of a tiny checkpoint; ``extra`` adds or overrides keys (``None`` deletes)."""
    fam = s.get("family", "llama")
    arch, mtype = HF_ARCH[fam]
    cfg = {"architectures": [arch], "model_type": mtype, "hidden_size": s["H"],
           "num_attention_heads": s["n_head"], "num_key_value_heads": s["n_kv"], "num_hidden_layers": s["n_layer"],
           "intermediate_size": s["ff"], "vocab_size": s["vocab"], "rms_norm_eps": 1e-5, "rope_theta": theta,
           "max_position_embeddings": 256, "tie_word_embeddings": s["tie"], "bos_token_id": VOCAB - 2,
           "eos_token_id": VOCAB - 1, "head_dim": s["head_dim"], "torch_dtype": "float32"}
    if fam == "llama":
        cfg.update(attention_bias=s.get("attn_bias", False), mlp_bias=s.get("mlp_bias", False))
    if fam == "qwen3":
        cfg.update(attention_bias=s.get("attn_bias", False))
    if fam == "gemma3":
        cfg.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=s["head_dim"], rope_local_base_freq=10000.0,
                   rope_theta=1_000_000.0, pad_token_id=0)
    for k, v in extra.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


def write_hf(d: Path, w: dict, s: dict, theta: float = 10000.0, **extra) -> Path:
    """Write ``config.json`` (see :func:`hf_config`), ``model.safetensors``, ``tokenizer.json`` into ``d``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    d.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(s, theta, **extra)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in w.items()}, str(d / "model.safetensors"))
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(TOKENS[:257])}, [("h", "e")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(TOKENS[257:])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": "<|im_end|>"}))
    return d


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
GEMMA_NAMES = {**GGUF_NAMES, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


def add_tiny_tokenizer(wr, vocab: int, add_bos: bool = False) -> None:
    """The tiny byte-level BPE (256 bytes, one merge, two specials) into a gguf-py GGUFWriter
    (``add_bos``: ``add_bos_token`` true with BOS = ``<|endoftext|>``, id ``VOCAB - 2``)."""
    wr.add_vocab_size(vocab)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("default")
    wr.add_token_list(TOKENS)
    wr.add_token_types([1] * 257 + [3, 3])
    wr.add_token_merges(["h e"])
    wr.add_eos_token_id(VOCAB - 1)
    if add_bos:
        wr.add_bos_token_id(VOCAB - 2)
    wr.add_add_bos_token(add_bos)


def write_gguf(path: Path, w: dict, s: dict, theta: float | None = 10000.0, arch: str | None = None,
               kv: dict | None = None, extra_tensors: dict | None = None, endianess=None, quant=None,
               add_bos: bool = False, chat_template: str | None = None) -> Path:
    """Write the same weights as a GGUF of the family's llama.cpp arch (F32 tensors, ggml names).

    ``llama`` (also Mistral): Q/K rows and biases permuted for adjacent-pair RoPE; ``gemma3``: every
    norm stored as ``w + 1`` (convert_hf_to_gguf ``Gemma3Model``). ``kv`` adds ``{arch}.KEY`` values
    (str/int/float/bool by type); ``extra_tensors`` adds raw ggml-named tensors; ``endianess``
    (``gguf.GGUFEndian.BIG``) writes a big-endian file (gguf-py swaps header and tensor data);
    ``quant(ggml_name, float32 array)`` may return ``(raw uint8 blocks, GGMLQuantizationType)`` to store
    a tensor quantised (``gguf.quants.quantize``), None to keep it F32.
    ``add_bos``: the tokenizer adds BOS (:func:`add_tiny_tokenizer`); ``chat_template``: ``tokenizer.chat_template``.
    """
    fam = s.get("family", "llama")
    arch = arch or {"mistral": "llama"}.get(fam, fam)
    wr = gguf.GGUFWriter(str(path), arch, **({"endianess": endianess} if endianess is not None else {}))
    wr.add_block_count(s["n_layer"])
    wr.add_context_length(256)
    wr.add_embedding_length(s["H"])
    wr.add_feed_forward_length(s["ff"])
    wr.add_head_count(s["n_head"])
    wr.add_head_count_kv(s["n_kv"])
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_rope_dimension_count(s["head_dim"])
    if fam in ("qwen3", "gemma3"):
        wr.add_key_length(s["head_dim"])
        wr.add_value_length(s["head_dim"])
    if fam == "gemma3" and theta == 10000.0:
        theta = 1_000_000.0
    if theta is not None:
        wr.add_rope_freq_base(theta)
    for k, v in (kv or {}).items():
        key = f"{arch}.{k}"
        if isinstance(v, bool):
            wr.add_bool(key, v)
        elif isinstance(v, int):
            wr.add_uint32(key, v)
        elif isinstance(v, float):
            wr.add_float32(key, v)
        else:
            wr.add_string(key, str(v))
    add_tiny_tokenizer(wr, s["vocab"], add_bos)
    if chat_template is not None:
        wr.add_chat_template(chat_template)
    names = GEMMA_NAMES if fam == "gemma3" else GGUF_NAMES
    permute = arch == "llama"
    for k, t in w.items():
        if k == "model.embed_tokens.weight":
            n = "token_embd.weight"
        elif k == "model.norm.weight":
            n = "output_norm.weight"
        elif k == "lm_head.weight":
            n = "output.weight"
        else:
            parts = k.split(".")
            n = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"
            if permute and parts[3:5] == ["self_attn", "q_proj"]:
                t = permute_for_norm(t, s["n_head"])
            elif permute and parts[3:5] == ["self_attn", "k_proj"]:
                t = permute_for_norm(t, s["n_kv"])
        if fam == "gemma3" and n.endswith("norm.weight"):
            t = t + 1  # llama.cpp's Gemma converter stores 1 + w
        arr = np.ascontiguousarray(t.numpy().astype(np.float32))
        q = quant(n, arr) if quant is not None else None
        if q is not None:
            wr.add_tensor(n, q[0], raw_dtype=q[1])
        else:
            wr.add_tensor(n, arr)
    for n, t in (extra_tensors or {}).items():
        wr.add_tensor(n, np.ascontiguousarray(np.asarray(t, dtype=np.float32)))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path
