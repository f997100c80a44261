"""A GGUF file as a dequantised HF model directory that vLLM's CPU build can load.

vLLM on CPU does not load GGUF (its GGUF path dequantises with CUDA kernels), so the file is
converted once: HF transformers reads the GGUF with its own reader and dequantisation
(``from_pretrained(..., gguf_file=...)``, float32) and ``save_pretrained`` writes safetensors, the
config and the tokenizer (not the chat template: vLLM is handed token ids, and renders a template
at start-up without limits). The directory is cached under the user cache
(``$XDG_CACHE_HOME/infertrace/vllm-hf-v2/<sha256 of the file>``), written in a private directory
beside it with a manifest of every file's SHA-256 and renamed into place; an entry is verified
against the GGUF and its manifest before every use (:mod:`.convert_cache`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from infertrace.errors import InfertraceError

from infertrace.runtimes.vllm.convert_cache import NEEDED  # noqa: F401 - re-exported (files an entry must hold)


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
    """The directory vLLM loads for ``model_path``: the path itself when it is an HF directory (its
    chat template checked first: :func:`check_template_for_vllm`), else the verified cached
    conversion of the GGUF file (made now when missing; :mod:`.convert_cache`).

    Raises:
        InfertraceError: neither a directory nor a ``.gguf`` file; a chat template over infertrace's
            template limits; transformers missing or unable to read the file; the cache cannot be
            written; a cache entry that fails verification (one line, exit 2).
    """
    p = Path(model_path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise InfertraceError(f"--runtime vllm: {p} has no config.json; pass an HF model directory or a GGUF file")
        check_template_for_vllm(p)
        return p
    if not p.is_file() or p.suffix.lower() != ".gguf":
        raise InfertraceError(f"--runtime vllm needs an HF model directory or a GGUF file; {p.name} is neither")
    from infertrace.runtimes.vllm.convert_cache import cache_root, verify_entry

    sha = file_sha256(p)
    target = cache_root() / sha
    if not os.path.lexists(target):
        _convert(p, target, sha)
    verify_entry(target, sha)  # also an entry a concurrent writer published, or one made just now
    return target


def check_template_for_vllm(d: Path) -> None:
    """vLLM renders an HF directory's chat template at start-up (``LLM.__init__`` ->
    ``renderer.warmup``, one ``{"role": "user", "content": "warmup"}`` message) with no loop or time
    limit; render the same message first under infertrace's own limits (those ``--chat`` applies:
    :mod:`infertrace.tokenizer.template_limits`) and refuse a template that passes one.

    Raises:
        InfertraceError: the template hits a render limit (errors vLLM only logs are let through).
    """
    from infertrace.tokenizer.template_limits import TemplateLimitError
    from infertrace.tokenizer.vocab import Tokenizer

    try:
        tok = Tokenizer.from_hf_dir(d)
    except InfertraceError:
        return  # the loader reports a broken tokenizer itself; this check is about the template only
    if not tok.chat_template:
        return
    try:
        tok.apply_chat_template([{"role": "user", "content": "warmup"}], add_generation_prompt=True)
    except InfertraceError as e:
        if isinstance(e.__cause__, TemplateLimitError):
            raise InfertraceError(f"--runtime vllm: the model's chat template {e.__cause__} (infertrace's template limit); "
                                  "vLLM renders it at start-up without limits and would hang: remove or fix chat_template "
                                  f"in {d.name}/tokenizer_config.json (or chat_template.jinja)") from None


def _convert(gguf: Path, target: Path, sha: str) -> None:
    """transformers' GGUF reader -> ``save_pretrained`` into a private directory, chat template
    stripped, manifest written, then renamed into place.

    Raises:
        InfertraceError: transformers missing or refusing the file; the cache not writable.
    """
    try:
        import torch
        import transformers
    except ImportError:
        raise InfertraceError("--runtime vllm with a GGUF file needs transformers to dequantise it: "
                              "run `make setup-dev` in the infertrace checkout (or `.venv/bin/pip install -e '.[vllm]'` there)") from None
    from infertrace.runtimes.vllm.convert_cache import strip_chat_template, write_manifest
    from infertrace.safe_io import DirTaken, fresh_dir_beside, publish_dir

    try:
        tmp = fresh_dir_beside(target)
    except OSError as e:
        raise InfertraceError(f"cannot write the vLLM conversion cache {target.parent}: {e.strerror}; "
                              "set XDG_CACHE_HOME to a writable directory") from None
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
        try:
            model.save_pretrained(str(tmp), safe_serialization=True, max_shard_size="20GB")
            tok.save_pretrained(str(tmp))
            strip_chat_template(tmp)  # vLLM gets token ids; it renders a template at start-up without limits
            (tmp / "SOURCE").write_text(f"dequantised from {gguf.name} by transformers {transformers.__version__}; "
                                        "chat template not copied (infertrace renders --chat itself)\n")
            write_manifest(tmp, sha, gguf.name, f"transformers {transformers.__version__}")
            publish_dir(tmp, target, replace=False)  # onto a new or empty name only: never a file, FIFO or symlink
        except DirTaken:
            pass  # a concurrent writer finished first (or something was planted): verify_entry decides
        except OSError as e:
            raise InfertraceError(f"cannot write the vLLM conversion of {gguf.name} into {target.parent}: "
                                  f"{e.strerror or e}; free disk space or set XDG_CACHE_HOME") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
