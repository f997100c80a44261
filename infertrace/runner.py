"""Library entry points the CLI commands share: load a model, run requests with tracing.

``run_requests`` is the whole main job without any printing: it returns a
:class:`~infertrace.trace.records.RunTrace` that ``render`` prints, ``--json`` dumps and
``--save`` stores.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from infertrace.engine.drive import PromptSpec, drive, drive_bounded, encode_prompt, encode_requests  # noqa: F401 - re-exported
from infertrace.engine.engine import Engine, EngineOptions
from infertrace.errors import ConfigError, InfertraceError
from infertrace.loading.model import DTYPES, Loaded, load_model, model_identity, parse_dtype  # noqa: F401 - re-exported
from infertrace.trace.records import RunTrace
from infertrace.capture.recorder import VARIABLES

from infertrace.runtimes.ours import SERVING_DEFAULTS, SPEC_DEFAULTS, kv_streams_note  # noqa: F401,E402 - re-exported


def run_requests(loaded: Loaded, prompts: list[PromptSpec], opts: EngineOptions | None = None, trace: bool = True,
                 layer: int = 0, show: tuple[str, ...] = VARIABLES, on_step: Callable[[Any], None] | None = None,
                 options_for_record: dict[str, Any] | None = None, tensors: dict[str, torch.Tensor] | None = None,
                 tensor_layers: Sequence[int] | None = None, replay: Any = None) -> RunTrace:
    """Run ``prompts`` through infertrace's engine and return the trace
    (:func:`infertrace.runtimes.loop.record_run` on :class:`~infertrace.runtimes.ours.OurRuntime`).

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
        replay: a saved ``--runtime vllm`` trace directory (or its plan) to replay (``run --replay``).

    Raises:
        InfertraceError: bad layer, prompt too long, cache too small, ...
    """
    from infertrace.runtimes.api import RunSettings
    from infertrace.runtimes.loop import record_run

    settings = RunSettings(opts=opts or EngineOptions(), layer=layer, show=tuple(show),
                           tensor_layers=tuple(tensor_layers) if tensor_layers is not None else None,
                           native={"replay": replay} if replay is not None else {}, record=dict(options_for_record or {}),
                           trace=trace)
    return record_run("infertrace", loaded, prompts, settings, on_step, tensors if trace else None)


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
        raise ConfigError("run.layer", f"{layer} out of range: the model has layers 0..{cfg.n_layer - 1}")
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
