"""Write a Qwen3.5-0.8B-shaped HF checkpoint with random weights (no real Qwen3.5 weights are
reachable here): the configuration of the study's appendix (hidden 1024, 8 query / 2 KV heads of
256, 24 layers = 18 GDN + 6 full attention, vocab 248320, partial_rotary_factor 0.25, conv kernel
4, GDN state [16, 128, 128]), stored in bfloat16 as the released model is. Shapes, dtypes and
memory are the real model's; the tokens it produces are not.

Values not in the study come from the public ``Qwen/Qwen3.5-0.8B`` ``config.json`` as HF's
``Qwen3_5TextConfig`` reads it: ``intermediate_size`` 3584, ``rope_theta`` 1e7,
``mrope_section`` [11, 11, 10], ``rms_norm_eps`` 1e-6, tied embeddings, one MTP block
(``mtp_num_hidden_layers`` 1: ``mtp.fc``, ``mtp.pre_fc_norm_embedding`` / ``_hidden``, ``mtp.norm``
and a full-attention ``mtp.layers.0``, the names vLLM ``qwen3_5_mtp.py`` loads). Initialisation
follows HF ``Qwen3_5PreTrainedModel._init_weights`` (normal std 0.02, zero-centred norms at 0,
``dt_bias`` 1, ``A_log = log U(0.01, 16)``); the gated GDN norm starts at 1.

``fmt="gguf"`` writes the same weights as one ``qwen35`` GGUF (bfloat16 tensors) the way llama.cpp's
converter does (``conversion/qwen.py`` ``Qwen3NextModel`` / ``_LinearAttentionVReorderBase`` /
``_Qwen35MtpMixin``): norms stored as ``1 + w`` except the gated ``ssm_norm``, ``ssm_a = -exp(A_log)``,
``dt_bias`` as ``ssm_dt.bias``, conv1d squeezed, V heads tiled when ``n_v_heads != n_k_heads``, the MTP
block as ``blk.{n_layer}.*`` + ``blk.{n_layer}.nextn.*`` with ``block_count`` counting it and
``qwen35.nextn_predict_layers`` 1.

The tokenizer is byte-level: 256 byte tokens, one merge (bytes 0xFE 0xFF, which UTF-8 text never holds,
so text encodes byte by byte; a GGUF ``gpt2`` tokenizer must carry merges), filler tokens up to the
vocabulary size (never produced by encoding; shown as ``<|rNNN|>`` when sampled) and two specials at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from safetensors import SafetensorError

from infertrace.errors import InfertraceError
from infertrace.safe_text import visible
from infertrace.safe_io import DirTaken, publish_dir

#: the marker config key: its value is the sentence every run on the checkpoint prints
RANDOM_KEY = "infertrace_random_weights"
RANDOM_NOTE = ("random weights (written by `infertrace make-qwen35`): shapes, dtypes and memory are the real "
               "Qwen3.5-0.8B's, the tokens are not the real model's")

CONFIG_08B = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 1024,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "num_hidden_layers": 24,
    "intermediate_size": 3584, "vocab_size": 248320, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144, "tie_word_embeddings": True, "attention_bias": False,
    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
    "torch_dtype": "bfloat16", RANDOM_KEY: RANDOM_NOTE,
    "_name_or_path": "Qwen3.5-0.8B-shaped (random weights)",  # the model name runs and inspect show
}


def _byte_tokens() -> list[str]:
    """GPT-2 byte-to-unicode table (the byte-level pre-tokenizer's alphabet), token i = byte i."""
    from infertrace.tokenizer.vocab import _BYTE_ENCODER  # the table the tokenizer decodes with

    return [_BYTE_ENCODER[b] for b in range(256)]


#: the one BPE merge (bytes 0xFE 0xFF, never in UTF-8 text: every encoding stays byte by byte); a GGUF
#: ``gpt2`` tokenizer must carry merges (llama.cpp ``llama_vocab::impl::load`` refuses a file without them)
MERGE = "\u00fe \u00ff"


def vocab_tokens(vocab: int) -> list[str]:
    """The ``vocab`` token strings: 256 bytes, the merged pair (id 256), fillers ``<|rNNN|>``, two specials."""
    specials = ["<|endoftext|>", "<|im_end|>"]
    return _byte_tokens() + [MERGE.replace(" ", "")] + [f"<|r{i}|>" for i in range(257, vocab - len(specials))] + specials


def write_tokenizer(d: Path, vocab: int) -> None:
    """``tokenizer.json`` (byte-level BPE, ``vocab`` entries) and ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_end|>"]
    toks = vocab_tokens(vocab)[: vocab - len(specials)]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(toks)}, [tuple(MERGE.split(" "))]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": "<|im_end|>"}))


def write_qwen35_08b(out: Path, seed: int = 0, progress: Callable[[str], None] | None = None, fmt: str = "hf",
                     **override) -> Path:
    """Write ``config.json``, ``model.safetensors`` (bfloat16) and the tokenizer into ``out`` (``fmt="hf"``),
    or the same weights as one GGUF file ``out`` (``fmt="gguf"``, see the module docstring).

    Args:
        out: a new or empty directory (hf) / a new file (gguf).
        seed: torch generator seed (same seed, same weights).
        progress: called with a short message per layer.
        override: config.json keys to change (tests use it to keep the run small elsewhere;
            the shapes asserted from a run are those of :data:`CONFIG_08B`).

    The files are written into a hidden staging directory beside ``out`` and renamed to ``out``
    at the end, so ``out`` never holds a partial checkpoint (a failed write removes the staging
    directory; a killed process leaves only ``.NAME.partial-*``, never a loadable ``out``).

    Raises:
        InfertraceError: ``seed`` outside 0..2^63-1; ``fmt`` not hf / gguf; ``out`` exists and is not an empty
            directory (a GGUF: exists at all); it cannot be created or written (permissions, no space), with the reason.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63:
        raise InfertraceError(f"--seed {seed} must be an integer in 0..2^63-1")
    if fmt not in ("hf", "gguf"):
        raise InfertraceError(f"--format must be hf or gguf (got {fmt!r})")
    out = Path(out)
    if out.is_symlink():  # publish_dir never renames onto a symlink: refuse now, not after writing 1.5 GB
        raise InfertraceError(f"--out {visible(str(out))} is a symlink; pass a new name (a symlink is never replaced)")
    if fmt == "gguf":
        return _write_gguf_file(out, seed, progress, {**CONFIG_08B, **override})
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InfertraceError(f"{out} exists and is not an empty directory; pass a new --out")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as e:
        raise InfertraceError(f"cannot create {out}: {e.strerror or e}; pass a writable --out") from None
    try:
        _write_into(stage, seed, progress, {**CONFIG_08B, **override})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(stage, 0o777 & ~umask)  # mkdtemp makes it 0700
        # atomic: ``out`` holds a whole checkpoint or nothing; a new name or an empty directory only,
        # never a file, FIFO, device node or symlink (safe_io.publish_dir)
        publish_dir(stage, out, replace=False)
    except BaseException as e:
        shutil.rmtree(stage, ignore_errors=True)
        if isinstance(e, DirTaken):
            raise InfertraceError(f"--out {out}: {e}; pass a new --out") from None
        if isinstance(e, InfertraceError) or not isinstance(e, (OSError, SafetensorError)):
            raise
        why = getattr(e, "strerror", None) or str(e)
        raise InfertraceError(f"cannot write the checkpoint to {out}: {why}; nothing was left there "
                              "(free some space or pass another --out)") from None
    return out


def _write_into(out: Path, seed: int, progress: Callable[[str], None] | None, cfg: dict) -> None:
    """The files of :func:`write_qwen35_08b`, written into the (staging) directory ``out``."""
    from safetensors.torch import save_file

    w = _random_weights(seed, progress, cfg)
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(out, cfg["vocab_size"])


def _random_weights(seed: int, progress: Callable[[str], None] | None, cfg: dict) -> dict:
    """HF-named bfloat16 tensors of the configuration (HF ``_init_weights``), the MTP head included."""
    import torch

    g = torch.Generator().manual_seed(seed)
    H, ff, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv, dk, dv, K = (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                         cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"])
    bf = torch.bfloat16

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(bf)

    w = {"model.embed_tokens.weight": rnd(V, H), "model.norm.weight": torch.zeros(H, dtype=bf)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.zeros(H, dtype=bf)
        w[p + "post_attention_layernorm.weight"] = torch.zeros(H, dtype=bf)
        w[p + "mlp.gate_proj.weight"] = rnd(ff, H)
        w[p + "mlp.up_proj.weight"] = rnd(ff, H)
        w[p + "mlp.down_proj.weight"] = rnd(H, ff)
        if (i + 1) % cfg["full_attention_interval"]:
            q = p + "linear_attn."
            w[q + "in_proj_qkv.weight"] = rnd(2 * nk * dk + nv * dv, H)
            w[q + "in_proj_z.weight"] = rnd(nv * dv, H)
            w[q + "in_proj_b.weight"] = rnd(nv, H)
            w[q + "in_proj_a.weight"] = rnd(nv, H)
            w[q + "conv1d.weight"] = (torch.randn(2 * nk * dk + nv * dv, 1, K, generator=g) * 0.3).to(bf)
            w[q + "A_log"] = torch.empty(nv).uniform_(0.01, 16, generator=g).log().to(bf)
            w[q + "dt_bias"] = torch.ones(nv, dtype=bf)
            w[q + "norm.weight"] = torch.ones(dv, dtype=bf)
            w[q + "out_proj.weight"] = rnd(H, nv * dv)
        else:
            q = p + "self_attn."
            w[q + "q_proj.weight"] = rnd(2 * nh * hd, H)
            w[q + "k_proj.weight"] = rnd(nkv * hd, H)
            w[q + "v_proj.weight"] = rnd(nkv * hd, H)
            w[q + "o_proj.weight"] = rnd(H, nh * hd)
            w[q + "q_norm.weight"] = torch.zeros(hd, dtype=bf)
            w[q + "k_norm.weight"] = torch.zeros(hd, dtype=bf)
        if progress:
            progress(f"layer {i}")
    if cfg.get("mtp_num_hidden_layers"):  # the MTP head: fc [H, 2H], two pre-fc norms, its norm, one attention block
        w["mtp.fc.weight"] = rnd(H, 2 * H)
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            w[f"mtp.{n}.weight"] = torch.zeros(H, dtype=bf)
        p = "mtp.layers.0."
        w[p + "input_layernorm.weight"] = torch.zeros(H, dtype=bf)
        w[p + "post_attention_layernorm.weight"] = torch.zeros(H, dtype=bf)
        w[p + "self_attn.q_proj.weight"] = rnd(2 * nh * hd, H)
        w[p + "self_attn.k_proj.weight"] = rnd(nkv * hd, H)
        w[p + "self_attn.v_proj.weight"] = rnd(nkv * hd, H)
        w[p + "self_attn.o_proj.weight"] = rnd(H, nh * hd)
        w[p + "self_attn.q_norm.weight"] = torch.zeros(hd, dtype=bf)
        w[p + "self_attn.k_norm.weight"] = torch.zeros(hd, dtype=bf)
        w[p + "mlp.gate_proj.weight"] = rnd(ff, H)
        w[p + "mlp.up_proj.weight"] = rnd(ff, H)
        w[p + "mlp.down_proj.weight"] = rnd(H, ff)
        if progress:
            progress("mtp")
    return w


#: HF layer sub-modules -> llama.cpp names (the converter's tensor map for qwen35)
_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
               "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.conv1d": "ssm_conv1d",
               "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out"}
_GGUF_MTP = {"mtp.fc": "nextn.eh_proj", "mtp.pre_fc_norm_embedding": "nextn.enorm",
             "mtp.pre_fc_norm_hidden": "nextn.hnorm", "mtp.norm": "nextn.shared_head_norm"}


def _tiled(t, dim: int, nk: int, nv: int, head: int):
    """HF grouped V-head order -> llama.cpp's tiled order along ``dim`` (converter ``_reorder_v_heads``)."""
    if nk == nv:
        return t
    shape = list(t.shape)
    x = t.reshape(*shape[:dim], nk, nv // nk, head, *shape[dim + 1:])
    return x.transpose(dim, dim + 1).contiguous().reshape(shape)


def gguf_tensors(w: dict, cfg: dict) -> dict:
    """HF-named Qwen3.5 tensors -> llama.cpp-named ones as its converter writes them (float32 values;
    see the module docstring). Raises KeyError on a tensor it does not know."""
    import torch

    n_layer = cfg["num_hidden_layers"]
    nk, nv, dk, dv = (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                      cfg["linear_value_head_dim"])
    qk = 2 * nk * dk
    out = {}
    for k, t in w.items():
        t = t.float()
        if k == "model.embed_tokens.weight":
            out["token_embd.weight"] = t
        elif k == "model.norm.weight":
            out["output_norm.weight"] = t + 1
        elif k == "lm_head.weight":
            out["output.weight"] = t
        elif k[: -len(".weight")] in _GGUF_MTP:  # every MTP block shares them (n_layer .. block_count - 1)
            out[f"blk.{n_layer}.{_GGUF_MTP[k[:-len('.weight')]]}.weight"] = t if k == "mtp.fc.weight" else t + 1
        else:
            parts = k.split(".")
            if parts[0] == "mtp":  # mtp.layers.J.X -> model.layers.{n_layer + J}.X
                bid, sub = n_layer + int(parts[2]), ".".join(parts[3:])
            else:
                bid, sub = int(parts[2]), ".".join(parts[3:])
            if sub == "linear_attn.A_log":
                out[f"blk.{bid}.ssm_a"] = _tiled(-t.exp(), 0, nk, nv, 1)
                continue
            if sub == "linear_attn.dt_bias":
                out[f"blk.{bid}.ssm_dt.bias"] = _tiled(t, 0, nk, nv, 1)
                continue
            mod = sub[: -len(".weight")]
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
            out[f"blk.{bid}.{_GGUF_NAMES[mod]}.weight"] = t
    return out


def _write_gguf_file(out: Path, seed: int, progress: Callable[[str], None] | None, cfg: dict) -> Path:
    """One ``qwen35`` GGUF (bfloat16 tensors, the byte-level tokenizer) at ``out``, staged beside it
    and renamed at the end (``out`` never holds a partial file)."""
    import gguf
    import numpy as np

    if out.exists():
        raise InfertraceError(f"{out} exists; pass a new --out")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.partial-", dir=out.parent)
        os.close(fd)
    except OSError as e:
        raise InfertraceError(f"cannot create {out}: {e.strerror or e}; pass a writable --out") from None
    try:
        V, H = cfg["vocab_size"], cfg["hidden_size"]
        n_mtp = int(cfg.get("mtp_num_hidden_layers") or 0)
        rp = cfg["rope_parameters"]
        wr = gguf.GGUFWriter(tmp, "qwen35")
        wr.add_name(cfg.get("_name_or_path", "qwen35"))
        wr.add_description(RANDOM_NOTE)  # the marker the loader turns into the random-weights note
        wr.add_block_count(cfg["num_hidden_layers"] + n_mtp)  # the converter counts the MTP blocks (_Qwen35MtpMixin)
        if n_mtp:
            wr.add_uint32("qwen35.nextn_predict_layers", n_mtp)
        wr.add_context_length(cfg["max_position_embeddings"])
        wr.add_embedding_length(H)
        wr.add_feed_forward_length(cfg["intermediate_size"])
        wr.add_head_count(cfg["num_attention_heads"])
        wr.add_head_count_kv(cfg["num_key_value_heads"])
        wr.add_key_length(cfg["head_dim"])
        wr.add_value_length(cfg["head_dim"])
        wr.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        wr.add_rope_freq_base(rp["rope_theta"])
        wr.add_rope_dimension_count(int(cfg["head_dim"] * rp["partial_rotary_factor"]))
        wr.add_rope_dimension_sections(list(rp["mrope_section"]) + [0])
        wr.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        wr.add_ssm_state_size(cfg["linear_key_head_dim"])
        wr.add_ssm_group_count(cfg["linear_num_key_heads"])
        wr.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        wr.add_ssm_inner_size(cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"])
        wr.add_full_attention_interval(cfg["full_attention_interval"])
        wr.add_vocab_size(V)
        wr.add_tokenizer_model("gpt2")
        wr.add_tokenizer_pre("default")
        wr.add_token_list(vocab_tokens(V))
        wr.add_token_types([1] * (V - 2) + [3, 3])
        wr.add_token_merges([MERGE])
        wr.add_eos_token_id(V - 1)
        wr.add_add_bos_token(False)
        for name, t in gguf_tensors(_random_weights(seed, progress, cfg), cfg).items():
            a = np.ascontiguousarray(t.numpy().astype(np.float32))
            if a.ndim == 1 or name.endswith("ssm_conv1d.weight"):  # the converter keeps 1-D tensors and SSM_CONV1D
                wr.add_tensor(name, a)  # F32 (llama.cpp's ssm_conv op reads an F32 kernel)
            else:
                wr.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
        wr.write_header_to_file()
        wr.write_kv_data_to_file()
        wr.write_tensors_to_file()
        wr.close()
        os.replace(tmp, out)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, InfertraceError) or not isinstance(e, OSError):
            raise
        raise InfertraceError(f"cannot write the GGUF to {out}: {e.strerror or e}; nothing was left there "
                              "(free some space or pass another --out)") from None
    return out
