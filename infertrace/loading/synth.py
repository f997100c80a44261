"""Write a Qwen3.5-0.8B-shaped HF checkpoint with random weights (no real Qwen3.5 weights are
reachable here): the configuration of the study's appendix (hidden 1024, 8 query / 2 KV heads of
256, 24 layers = 18 GDN + 6 full attention, vocab 248320, partial_rotary_factor 0.25, conv kernel
4, GDN state [16, 128, 128]), stored in bfloat16 as the released model is. Shapes, dtypes and
memory are the real model's; the tokens it produces are not.

Values not in the study come from the public ``Qwen/Qwen3.5-0.8B`` ``config.json`` as HF's
``Qwen3_5TextConfig`` reads it: ``intermediate_size`` 3584, ``rope_theta`` 1e7,
``mrope_section`` [11, 11, 10], ``rms_norm_eps`` 1e-6, tied embeddings. Initialisation follows
HF ``Qwen3_5PreTrainedModel._init_weights`` (normal std 0.02, zero-centred norms at 0,
``dt_bias`` 1, ``A_log = log U(0.01, 16)``); the gated GDN norm starts at 1.

The tokenizer is byte-level: 256 byte tokens, filler tokens up to the vocabulary size (never
produced by encoding; shown as ``<|rNNN|>`` when sampled) and two specials at the end.
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
    "torch_dtype": "bfloat16", RANDOM_KEY: RANDOM_NOTE,
    "_name_or_path": "Qwen3.5-0.8B-shaped (random weights)",  # the model name runs and inspect show
}


def _byte_tokens() -> list[str]:
    """GPT-2 byte-to-unicode table (the byte-level pre-tokenizer's alphabet), token i = byte i."""
    from infertrace.tokenizer.vocab import _BYTE_ENCODER  # the table the tokenizer decodes with

    return [_BYTE_ENCODER[b] for b in range(256)]


def write_tokenizer(d: Path, vocab: int) -> None:
    """``tokenizer.json`` (byte-level BPE, ``vocab`` entries) and ``tokenizer_config.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_end|>"]
    toks = _byte_tokens() + [f"<|r{i}|>" for i in range(256, vocab - len(specials))]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(toks)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "eos_token": "<|im_end|>"}))


def write_qwen35_08b(out: Path, seed: int = 0, progress: Callable[[str], None] | None = None, **override) -> Path:
    """Write ``config.json``, ``model.safetensors`` (bfloat16) and the tokenizer into ``out``.

    Args:
        out: a new or empty directory.
        seed: torch generator seed (same seed, same weights).
        progress: called with a short message per layer.
        override: config.json keys to change (tests use it to keep the run small elsewhere;
            the shapes asserted from a run are those of :data:`CONFIG_08B`).

    The files are written into a hidden staging directory beside ``out`` and renamed to ``out``
    at the end, so ``out`` never holds a partial checkpoint (a failed write removes the staging
    directory; a killed process leaves only ``.NAME.partial-*``, never a loadable ``out``).

    Raises:
        InfertraceError: ``seed`` outside 0..2^63-1; ``out`` exists and is not an empty directory; it cannot be created or
            written (permissions, no space), with the reason.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63:
        raise InfertraceError(f"--seed {seed} must be an integer in 0..2^63-1")
    out = Path(out)
    if out.is_symlink():  # publish_dir never renames onto a symlink: refuse now, not after writing 1.5 GB
        raise InfertraceError(f"--out {visible(str(out))} is a symlink; pass a new directory name (a symlink is never replaced)")
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
    import torch
    from safetensors.torch import save_file

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
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(out, V)
