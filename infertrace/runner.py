"""Library entry points the CLI commands share: load a model, run requests with tracing.

``run_requests`` is the whole main job without any printing: it returns a
:class:`~infertrace.trace.records.RunTrace` that ``render`` prints, ``--json`` dumps and
``--save`` stores.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Callable, Sequence

import torch

from infertrace.engine.drive import PromptSpec, drive, drive_bounded, encode_prompt, encode_requests  # noqa: F401 - re-exported
from infertrace.engine.engine import Engine, EngineOptions
from infertrace.errors import InfertraceError
from infertrace.loading.model import DTYPES, Loaded, load_model, model_identity, parse_dtype  # noqa: F401 - re-exported
from infertrace.model.taps import NULL_TRACER
from infertrace.trace.records import RunTrace
from infertrace.capture.recorder import VARIABLES, Recorder

#: EngineOptions fields of the serving mechanisms and their off values (engine/serving.py)
SERVING_DEFAULTS = {"prefix_cache": False, "context_shift": False, "n_keep": 0, "n_discard": 0, "audit_kv": False}
#: EngineOptions fields of speculative decoding and their defaults (recorded only when speculative is on)
SPEC_DEFAULTS = {"speculative": None, "num_spec_tokens": 3, "spec_tree": None, "draft_model": None, "draft_layers": None,
                 "ngram_min": 1, "ngram_max": 3}

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
    if opts.backend == "cells" and getattr(cfg, "windowed_layers", None) and opts.n_seq_max == EngineOptions.n_seq_max:
        # llama.cpp's n_seq_max is the number of parallel sequences (llama-cli 1, --parallel N), and it sizes the
        # iSWA cache's SWA pool (kv/iswa.py): one per request here, as --engine llama.cpp runs them
        opts = replace(opts, n_seq_max=max(1, len(prompts)))
    tok = loaded.tokenizer
    rec = Recorder(tok, cfg, layer=layer, show=tuple(show), layers=tensor_layers, tensors=tensors) if trace else NULL_TRACER
    eng = (engine_factory or Engine)(loaded.model, tok, opts, rec)
    emitted = 0
    budget = None
    if trace and opts.context_shift:  # bounded by -n alone: stop once the trace passes what a saved trace may hold
        from infertrace.engine.trace_budget import TraceBudget

        budget = TraceBudget(rec.steps, tensors, sum(len(p.ids if p.ids is not None else p.text or "") + p.params.max_new_tokens
                                                     for p in prompts))

    def emit(_batch: Any) -> None:  # hand each new StepTrace to on_step as it is made
        nonlocal emitted
        if budget is not None:
            budget()
        for st in rec.steps[emitted:] if on_step is not None else ():
            on_step(st)
        emitted = len(rec.steps)

    done = drive_bounded(eng, encode_requests(tok, prompts), emit if (on_step is not None or budget is not None) and trace else None)
    reqs = []
    for r in done:
        reqs.append({"seq_id": r.seq_id, "prompt": r.prompt_text, "prompt_ids": r.prompt_ids, "output_ids": r.output_ids,
                     "text": tok.decode(r.output_ids), "stop_reason": r.stop_reason, "arrival_step": r.arrival_step,
                     "num_preemptions": r.num_preemptions, "params": r.params.to_dict()})
    engine_opts = asdict(opts)
    for k, default in SERVING_DEFAULTS.items():  # serving options recorded only when set (older traces compare equal)
        if engine_opts.get(k) == default:
            engine_opts.pop(k, None)
    if opts.kv_dtype is None:  # --kv-dtype recorded only when set (the cache is then in the model dtype, "dtype")
        engine_opts.pop("kv_dtype", None)
    if opts.kv_unified:  # --kv-unified recorded only when off (a unified trace reads as before the option)
        engine_opts.pop("kv_unified", None)
    if not opts.speculative:
        for k in SPEC_DEFAULTS:
            engine_opts.pop(k, None)
    elif opts.spec_tree is not None:
        engine_opts["spec_tree"] = list(opts.spec_tree)
    options = {"backend": opts.backend, "attention": eng.attn_impl, **(options_for_record or {}),
               "engine": engine_opts, "layer": getattr(rec, "layer", layer), "show": list(show)}
    extra_notes = []
    pv = eng.padded_vocab
    if pv:  # case T3: lm head rows past the tokenizer (engine.padded_vocab says why they are masked)
        options["padded_vocab"] = pv
        extra_notes.append(f"padded vocabulary: the lm head has {pv['rows']} rows, the tokenizer {pv['tokens']} tokens; "
                           f"rows {pv['masked']} masked out of sampling (-inf logits; as vLLM, ids past the tokenizer "
                           "are never sampled, drafted or accepted)")
    if trace and getattr(rec, "layer", layer) != layer:
        extra_notes.append(f"layer {layer} is a Gated DeltaNet layer (no K/V, no RoPE): evidence from layer {rec.layer}, "
                           "the first full-attention layer")
    if not opts.kv_unified:
        extra_notes.append(kv_streams_note(opts))
    if opts.prefix_cache and "prefix_cache" in eng.disabled:
        extra_notes.append(f"--prefix-cache on ignored: {eng.disabled['prefix_cache']}")
        engine_opts.pop("prefix_cache", None)  # record what ran: no prefix cache (off is recorded by omission)
    out = RunTrace(model=model_identity(loaded.ckpt), config=cfg.to_dict(), options=options,
                   notes=list(loaded.ckpt.notes) + list(getattr(tok, "warnings", []) or []) + extra_notes,
                   steps=list(rec.steps) if trace else [], requests=reqs,
                   spec=eng.spec.summary() if eng.spec is not None else None)
    from infertrace.threads import current

    th = current()
    out.runtime = {"threads": th.n, "threads_reason": th.reason}
    return out


# ----------------------------------------------------------------------------- dump-kv: run to step N


class StepProbe:
    """A tracer that records nothing but calls ``fn(ctx)`` at the end of step ``target``
    (after sampling, before finished requests are freed) and keeps the result."""

    enabled = True
    layers: frozenset[int] = frozenset()

    def __init__(self, target: int, fn: Any):
        self.target, self.fn, self.result = target, fn, None

    def tap(self, name: str, **tensors: Any) -> None:
        """Tap points are ignored (the tracer protocol of :class:`~infertrace.capture.recorder.Recorder`)."""
        return None

    def begin_step(self) -> None:
        """Nothing to prepare."""
        return None

    def end_step(self, ctx: Any) -> None:
        """Keep ``fn(ctx)`` when ``ctx.step`` is the target step."""
        if ctx.step == self.target:
            self.result = self.fn(ctx)


def dump_kv_at_step(loaded: Any, prompts: list[Any], opts: Any, step: int, layer: int | None = None,
                    head: int | None = None, positions: Sequence[int] | None = None, full: bool = False) -> dict[str, Any]:
    """Run ``prompts`` up to and including ``step`` and return the cache right after it.

    Args:
        loaded: from :func:`infertrace.runner.load_model`.
        prompts: :class:`~infertrace.engine.drive.PromptSpec` list (seq_ids in list order).
        opts: :class:`~infertrace.engine.engine.EngineOptions` (backend, sizes, batching) as ``run`` uses them.
        step: step number (0-based, idle steps count).
        layer, head: with either given, K/V values of that layer and kv head (defaults 0) are added.
        positions: logical positions for the values (None = all cached).
        full: all head_dim values instead of the first 4.

    Returns:
        the dict of :func:`infertrace.trace.kv_dump.build_dump` (:func:`infertrace.capture.kv_views.describe_live`).

    Raises:
        InfertraceError: step out of range (``step 12 out of range: the run has steps 0..7``),
            layer/head out of range, positions not cached, or any run error.
    """
    from infertrace.capture.kv_views import describe_live

    cfg = loaded.config
    if layer is not None and not 0 <= layer < cfg.n_layer:
        raise InfertraceError(f"--layer {layer} out of range: the model has layers 0..{cfg.n_layer - 1}")
    if head is not None and not 0 <= head < cfg.n_head_kv:
        raise InfertraceError(f"--head {head} out of range: the cache holds kv heads 0..{cfg.n_head_kv - 1} "
                              f"(n_head_kv = {cfg.n_head_kv}; query heads share them, GQA)")
    if step < 0:
        raise InfertraceError(f"step {step} out of range: steps are numbered from 0")
    if not prompts:
        raise InfertraceError("no prompt given; pass --prompt TEXT (or --prompts FILE)")
    probe = StepProbe(step, lambda ctx: describe_live(ctx, layer, head, positions, full))
    eng = Engine(loaded.model, loaded.tokenizer, opts, probe)
    drive(eng, encode_requests(loaded.tokenizer, prompts), last_step=step, max_steps=None)
    if probe.result is None:
        raise InfertraceError(f"step {step} out of range: the run has steps 0..{eng.step_no - 1}")
    probe.result["attention"] = eng.attn_impl
    return probe.result


def kv_streams_note(opts: EngineOptions) -> str:
    """The trace note of ``--kv-unified off``: streams, cells per stream, and the ubatch rule."""
    from infertrace.kv.streams import n_ctx_seq

    return (f"non-unified KV (--kv-unified off, llama.cpp kv_unified = false): {opts.n_seq_max} streams of "
            f"{n_ctx_seq(opts.ctx_size, opts.n_seq_max)} cells, one per sequence; each step is one llama.cpp split_equal "
            "ubatch (consecutive seq_ids, equal token counts; the rest stays pending for the next step), kq_mask "
            "ne = [n_kv, n_tokens_per_stream, 1, n_stream of the ubatch], n_kv = the largest padded used_max_p1 of its streams")
