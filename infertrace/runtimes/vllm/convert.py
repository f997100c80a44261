"""A GGUF file as a dequantised HF model directory that vLLM's CPU build can load.

vLLM on CPU does not load GGUF (its GGUF path dequantises with CUDA kernels), so the file is
converted once: HF transformers reads the GGUF with its own reader and dequantisation
(``from_pretrained(..., gguf_file=...)``, float32) and ``save_pretrained`` writes safetensors, the
config and the tokenizer. The directory is cached under the user cache
(``$XDG_CACHE_HOME/infertrace/vllm-hf/<sha256 of the file>``), written in a private directory
beside it and renamed into place (a half-written directory is never read).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from infertrace.errors import InfertraceError

#: files a converted directory must hold to be used (a directory without them is redone)
NEEDED = ("config.json", "model.safetensors")


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 hex digest of the file's bytes (read in 4 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def hf_dir_for(model_path: Path) -> Path:
    """The directory vLLM loads for ``model_path``: the path itself when it is an HF directory,
    else the cached conversion of the GGUF file (made now when missing).

    Raises:
        InfertraceError: neither a directory nor a ``.gguf`` file; transformers missing or unable to
            read the file; the cache cannot be written.
    """
    p = Path(model_path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise InfertraceError(f"--engine vllm: {p} has no config.json; pass an HF model directory or a GGUF file")
        return p
    if not p.is_file() or p.suffix.lower() != ".gguf":
        raise InfertraceError(f"--engine vllm needs an HF model directory or a GGUF file; {p.name} is neither")
    from infertrace.loading.registry import cache_dir

    target = cache_dir() / "vllm-hf" / file_sha256(p)
    if all((target / n).is_file() for n in NEEDED):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InfertraceError(f"cannot create {target.parent}: {e.strerror}; set XDG_CACHE_HOME") from None
    _convert(p, target)
    return target


def _convert(gguf: Path, target: Path) -> None:
    """transformers' GGUF reader -> ``save_pretrained`` into a private directory, then rename."""
    try:
        import torch
        import transformers
    except ImportError:
        raise InfertraceError("--engine vllm with a GGUF file needs transformers to dequantise it: "
                              "run `make setup-dev` in the infertrace checkout (or `.venv/bin/pip install -e '.[vllm]'` there)") from None
    from infertrace.safe_io import DirTaken, fresh_dir_beside, publish_dir

    tmp = fresh_dir_beside(target)
    try:
        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                      dtype=torch.float32)
        except Exception as e:  # transformers raises many kinds for files it cannot read
            raise InfertraceError(f"transformers cannot dequantise {gguf.name} for vLLM ({type(e).__name__}: "
                                  f"{str(e)[:160]})") from None
        # the weights are dequantised float32 tensors now; only the GGUF marker blocks serialisation
        model.hf_quantizer = None
        for attr in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(model.config, attr):
                delattr(model.config, attr)
        model.is_quantized = False
        model.save_pretrained(str(tmp), safe_serialization=True, max_shard_size="20GB")
        tok.save_pretrained(str(tmp))
        (tmp / "SOURCE").write_text(f"dequantised from {gguf.name} by transformers {transformers.__version__}\n")
        try:
            publish_dir(tmp, target, replace=False)  # onto a new or empty name only: never a file, FIFO or symlink
        except DirTaken:
            if not (target.is_dir() and not target.is_symlink() and all((target / n).is_file() for n in NEEDED)):
                raise InfertraceError(f"the vLLM cache entry {target} exists but is not a whole converted model "
                                      "(not a directory, or files missing); remove it and run again") from None
            # else: a concurrent writer finished first; its copy is used
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
