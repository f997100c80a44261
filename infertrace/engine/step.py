"""The typed record the engine hands its tracer after every step (:class:`StepContext`). Below the
engine and the recorder: the recorder reads it without importing the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from infertrace.engine.request import Request
from infertrace.engine.sampler import SampleResult
from infertrace.engine.scheduler import ScheduledBatch
from infertrace.kv.base import AttnInputs, Memory


@dataclass
class StepContext:
    """What the engine hands ``tracer.end_step`` after each step (typed; read by attribute).

    Attributes:
        step: step number. batch: the :class:`ScheduledBatch` (chunks in packed order).
        inp: the step's :class:`AttnInputs`; None for an idle step (nothing scheduled).
        kv: the KV backend (state after the step's writes). attention: attention impl name.
        logits: ``[M, V]`` float, rows ``logits_rows`` of the packed batch (None when idle).
        samples: ``{seq_id: SampleResult}``. finished: ``{seq_id: stop reason}``.
        requests: every request the engine holds, by seq_id. time_ms: wall time of the step.
        sampler_order: ``hf`` or ``llama.cpp`` (the run's order; shown only for sampled rows).
        serving: the step's serving record (prefix lookups, context shifts, evictions, audit;
        engine/serving.py) or None.
        spec: speculative decoding: ``{"requests": {seq_id: verify record}, "drafted", "accepted",
        "acceptance_rate"}`` or None.
        vllm: ``run --runtime vllm``: vLLM's own step section in its names (scheduler output, attention
        metadata as built, logits indices, sampled ids; runtimes/vllm/steprec.py), JSON values only; the
        recorder sets :attr:`StepTrace.vllm <infertrace.trace.records.StepTrace>` from it. None otherwise.

    ``ctx["step"]`` and ``ctx.get("time_ms")`` still work, for tracers written against the
    dict this replaced.
    """

    step: int
    batch: ScheduledBatch
    inp: AttnInputs | None
    kv: Memory
    attention: str
    logits: torch.Tensor | None
    logits_rows: list[int]
    samples: dict[int, SampleResult]
    finished: dict[int, str]
    requests: dict[int, Request]
    time_ms: float = 0.0
    sampler_order: str | None = None
    serving: dict[str, Any] | None = None
    spec: dict[str, Any] | None = None  # speculative verify record of the step (engine/speculative.py)
    vllm: dict[str, Any] | None = None  # vLLM's native step section (runtimes/vllm/steprec.py), JSON values

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)
