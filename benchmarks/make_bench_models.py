"""Build Llama-3.2-3B- and Llama-3.1-8B-shaped GGUFs with random weights, quantised to Q4_K_M by
llama.cpp's own quantiser, for the real-size benchmarks of issue 20 (never committed).

    python benchmarks/make_bench_models.py --shape 3b [--out DIR] [--threads N] [--keep-f16] [--dry-run]

What it writes, into ``$XDG_CACHE_HOME/infertrace/bench-models/`` (default ``~/.cache``):

1. ``llama-<shape>-random-f16.gguf``: every matrix float16 ~ N(0, 0.02²), norms 1.0 (float32),
   streamed tensor by tensor (memory: one tensor at a time, at most the 128256-row embedding);
2. ``llama-<shape>-random-Q4_K_M.gguf``: ``llama_model_quantize`` (llama-cpp-python) with
   ``LLAMA_FTYPE_MOSTLY_Q4_K_M``, llama.cpp's own choice of per-tensor types (Q4_K, Q6_K for
   ``ffn_down``/``attn_v`` of some layers and the output);
3. the F16 file is deleted afterwards unless ``--keep-f16``.

Disk and time are printed before anything is written (and the run refuses when the disk lacks
the room): 3B shape ≈ 6.4 GB F16 + 2.0 GB Q4_K_M, 8B shape ≈ 16.1 GB + 4.9 GB. Time on this
2-core machine: writing F16 ≈ 1-2 min per 3B parameters, quantising a few minutes per 3B.

Shapes are the public configs' (``meta-llama/Llama-3.2-3B``: hidden 3072, 28 layers, 24 query / 8
KV heads of 128, FFN 8192, vocab 128256, tied embeddings; ``Llama-3.1-8B``: hidden 4096, 32
layers, 32 / 8 heads, FFN 14336, vocab 128256, untied). RoPE base 500000; Llama 3.1's ``llama3``
frequency scaling (the ``rope_freqs`` tensor) is left out, it does not change speed or memory.
The tokenizer is byte-level: 256 byte tokens, fillers up to the vocabulary size, and two specials
(``tokenizer.ggml.model`` gpt2, pre ``llama-bpe``, no merges): prompts encode to byte tokens.
The weights are random: the tokens produced mean nothing; shapes, types, bytes per token and
memory are the real model's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {
    "3b": dict(name="Llama-3.2-3B-shaped (random weights)", n_embd=3072, n_layer=28, n_head=24, n_head_kv=8,
               n_ff=8192, vocab=128256, tied=True, ctx=131072),
    "8b": dict(name="Llama-3.1-8B-shaped (random weights)", n_embd=4096, n_layer=32, n_head=32, n_head_kv=8,
               n_ff=14336, vocab=128256, tied=False, ctx=131072),
}
HEAD_DIM = 128


def cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "infertrace" / "bench-models"


def tensors(s: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [rows, cols] = ggml ne reversed) in llama.cpp's converter order."""
    H, F, V, hd = s["n_embd"], s["n_ff"], s["vocab"], HEAD_DIM
    out = [("token_embd.weight", (V, H))]
    for i in range(s["n_layer"]):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (H,)), (p + "attn_q.weight", (s["n_head"] * hd, H)),
                (p + "attn_k.weight", (s["n_head_kv"] * hd, H)), (p + "attn_v.weight", (s["n_head_kv"] * hd, H)),
                (p + "attn_output.weight", (H, s["n_head"] * hd)), (p + "ffn_norm.weight", (H,)),
                (p + "ffn_gate.weight", (F, H)), (p + "ffn_up.weight", (F, H)), (p + "ffn_down.weight", (H, F))]
    out.append(("output_norm.weight", (H,)))
    if not s["tied"]:
        out.append(("output.weight", (V, H)))
    return out


def n_params(s: dict) -> int:
    return sum(int(np.prod(shape)) for _, shape in tensors(s))


def vocabulary(n: int) -> tuple[list[str], list[str]]:
    """Byte-level tokens (GPT-2 alphabet), one merge (two spaces -> token 256; gguf-py does not write
    an empty merges array and a gpt2 vocabulary needs one), fillers, and two specials at the end."""
    from infertrace.tokenizer.vocab import _BYTE_ENCODER

    sp = _BYTE_ENCODER[ord(" ")]
    toks = [_BYTE_ENCODER[b] for b in range(256)] + [sp + sp] + [f"<|r{i}|>" for i in range(257, n - 2)]
    return toks + ["<|begin_of_text|>", "<|end_of_text|>"], [f"{sp} {sp}"]


def retokenize(path: Path) -> None:
    """Rewrite the tokenizer of a file written before :func:`vocabulary` had its merge (copies the file
    with gguf-py's ``copy_with_new_metadata``, then replaces it)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    r = gguf.GGUFReader(str(path))
    toks, merges = vocabulary(len(r.fields["tokenizer.ggml.tokens"].data))
    A, S = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), r.fields["general.architecture"].contents())
    copy_with_new_metadata(r, w, {"tokenizer.ggml.tokens": MetadataDetails(A, toks, S),
                                  "tokenizer.ggml.merges": MetadataDetails(A, merges, S)}, [])
    os.replace(tmp, path)


def write_f16(path: Path, s: dict, seed: int) -> None:
    """Stream the random-weight F16 GGUF to ``path`` (tensor by tensor)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(s["name"])
    w.add_description("random weights (benchmarks/make_bench_models.py): shapes and bytes of the real model, not its tokens")
    w.add_context_length(s["ctx"])
    w.add_embedding_length(s["n_embd"])
    w.add_block_count(s["n_layer"])
    w.add_feed_forward_length(s["n_ff"])
    w.add_head_count(s["n_head"])
    w.add_head_count_kv(s["n_head_kv"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(s["vocab"])
    w.add_file_type(1)  # LLAMA_FTYPE_MOSTLY_F16
    toks, merges = vocabulary(s["vocab"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(toks)
    w.add_token_types([1] * (len(toks) - 2) + [3, 3])
    w.add_token_merges(merges)
    w.add_bos_token_id(len(toks) - 2)
    w.add_eos_token_id(len(toks) - 1)
    w.add_add_bos_token(False)
    ts = tensors(s)
    for name, shape in ts:
        dt = np.float32 if len(shape) == 1 else np.float16
        w.add_tensor_info(name, shape, np.dtype(dt), int(np.prod(shape)) * np.dtype(dt).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    t0 = time.time()
    for k, (name, shape) in enumerate(ts):
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
            continue
        arr = np.empty(shape, dtype=np.float16)
        step = max(1, (1 << 24) // shape[1])
        for r0 in range(0, shape[0], step):  # float32 temporaries of 64 MB at most
            arr[r0: r0 + step] = (rng.standard_normal((min(step, shape[0] - r0), shape[1]), dtype=np.float32) * 0.02)
        w.write_tensor_data(arr)
        if k % 20 == 0:
            print(f"  f16 {k + 1}/{len(ts)} tensors, {time.time() - t0:.0f} s", flush=True)
    w.close()


def quantise(src: Path, dst: Path, threads: int) -> None:
    """llama.cpp's ``llama_model_quantize`` to Q4_K_M (its own per-tensor type choice).

    Raises:
        SystemExit: llama.cpp reports a failure.
    """
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        sys.exit(f"llama_model_quantize failed with {rc}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, default=None, help="directory (default: the user cache)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-f16", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (disk, time) and stop")
    ap.add_argument("--retokenize", action="store_true", help="only rewrite the tokenizer of an already built Q4_K_M file")
    args = ap.parse_args()
    if args.retokenize:
        retokenize((args.out or cache_dir()) / f"llama-{args.shape}-random-Q4_K_M.gguf")
        return
    s = SHAPES[args.shape]
    out = args.out or cache_dir()
    n = n_params(s)
    f16_bytes, q_bytes = 2 * n, int(n * 4.85 / 8)  # Q4_K_M ≈ 4.85 bits a weight
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    print(f"{s['name']}: {n / 1e9:.2f} B parameters; needs {f16_bytes / 1e9:.1f} GB (F16, temporary) + "
          f"~{q_bytes / 1e9:.1f} GB (Q4_K_M) in {out}; free {free / 1e9:.1f} GB. "
          f"Expected time here: ~{n / 3e9 * 1.5:.0f} min writing F16 + ~{n / 3e9 * 4:.0f} min quantising (2 cores)")
    if free < f16_bytes + q_bytes + (1 << 30):
        sys.exit("not enough free disk for the F16 file and the Q4_K_M file (+1 GB margin)")
    if args.dry_run:
        return
    f16 = out / f"llama-{args.shape}-random-f16.gguf"
    q = out / f"llama-{args.shape}-random-Q4_K_M.gguf"
    t0 = time.time()
    write_f16(f16, s, args.seed)
    t1 = time.time()
    print(f"F16 written: {f16} ({f16.stat().st_size / 1e9:.2f} GB, {t1 - t0:.0f} s)", flush=True)
    quantise(f16, q, args.threads)
    t2 = time.time()
    print(f"Q4_K_M written: {q} ({q.stat().st_size / 1e9:.2f} GB, {t2 - t1:.0f} s)", flush=True)
    if not args.keep_f16:
        f16.unlink()
        print(f"removed {f16.name}")


if __name__ == "__main__":
    main()
