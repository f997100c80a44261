"""A request (llama.cpp: sequence / server slot; TensorRT-LLM: LlmRequest)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from infertrace.engine.sampler import SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class Request:
    """One prompt being generated.

    Attributes:
        seq_id: llama.cpp ``seq_id`` / TensorRT-LLM ``request_id``.
        prompt_ids: tokenized prompt.
        params: :class:`SamplingParams`.
        arrival_step: first step at which the scheduler may admit it.
        output_ids: generated tokens so far.
        num_computed: C, tokens of ``all_ids`` whose K/V are in the cache.
        status: waiting / running / finished; ``stop_reason`` once finished.
        num_preemptions: times its cache was dropped for recompute.
        shifts: context shifts applied (``n_keep``, ``n_discard``); see :attr:`cache_ids`.
    """

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival_step: int = 0
    prompt_text: str = ""
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: str = WAITING
    stop_reason: str | None = None
    num_preemptions: int = 0
    shifts: list[tuple[int, int]] = field(default_factory=list)  # context shifts (n_keep, n_discard), in order
    generator: torch.Generator = field(default=None, repr=False)  # type: ignore[assignment]
    #: speculative decoding (engine/speculative.py): this step's draft tokens, their chunk-local
    #: parents (root = the pending token at index 0) and draft probabilities (None = a point mass)
    draft: list[int] = field(default_factory=list)
    draft_parents: list[int] = field(default_factory=list)
    draft_q: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def all_ids(self) -> list[int]:
        """Prompt followed by generated tokens (what the cache must eventually hold)."""
        return self.prompt_ids + self.output_ids

    @property
    def cache_ids(self) -> list[int]:
        """Token ids by cache position: ``all_ids`` with each context shift's discarded range
        ``[n_keep, n_keep + n_discard)`` removed (llama.cpp server erases them from the slot's tokens)."""
        ids = self.all_ids
        for keep, discard in self.shifts:
            ids = ids[:keep] + ids[keep + discard :]
        return ids

    @property
    def num_pending(self) -> int:
        """Tokens not yet computed: the prompt remainder, or the last sampled token."""
        return len(self.cache_ids) - self.num_computed

    @property
    def phase(self) -> str:
        """``decode`` when only the last sampled token is pending, else ``prefill``
        (including recompute after preemption)."""
        return "decode" if self.output_ids and self.num_pending == 1 else "prefill"
