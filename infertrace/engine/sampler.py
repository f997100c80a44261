"""Sampling: logits of one request -> next token, reproducibly.

Order: repetition penalty -> temperature -> top-k -> top-p -> min-p -> draw
(HF ``LogitsProcessor`` semantics for the penalty; llama.cpp ``common_sampler`` /
``llama-sampling.cpp`` for min-p). ``temperature == 0`` is greedy (first max index).
Each request has its own ``torch.Generator`` seeded from its seed, so its tokens do not
depend on what else is in the batch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable

import torch

from infertrace.errors import InfertraceError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    temperature 0 = greedy; top_k 0 = off; top_p 1 = off; min_p 0 = off;
    repetition_penalty 1 = off; ``seed`` seeds the request's generator.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    max_new_tokens: int = 16
    ignore_eos: bool = False

    def validate(self) -> "SamplingParams":
        """Raise :class:`InfertraceError` for out-of-range values."""
        for name, val in (("temperature", self.temperature), ("top-p", self.top_p), ("min-p", self.min_p),
                          ("repetition-penalty", self.repetition_penalty)):
            if not math.isfinite(val):
                raise InfertraceError(f"--{name} must be a finite number (got {val})")
        if self.temperature < 0 or 0 < self.temperature < 1e-3:
            raise InfertraceError(f"--temperature must be 0 (greedy) or >= 0.001 (got {self.temperature})")
        if not 0 <= self.seed < 2**63:
            raise InfertraceError(f"--seed must be in 0..2^63-1 (got {self.seed})")
        if self.top_k < 0:
            raise InfertraceError(f"--top-k must be >= 0 (got {self.top_k})")
        if not 1e-6 <= self.top_p <= 1:
            raise InfertraceError(f"--top-p must be in [1e-6, 1] (got {self.top_p})")
        if not 0 <= self.min_p < 1:
            raise InfertraceError(f"--min-p must be in [0, 1) (got {self.min_p})")
        if not 0.01 <= self.repetition_penalty <= 100:
            raise InfertraceError(f"--repetition-penalty must be in [0.01, 100] (got {self.repetition_penalty})")
        if self.max_new_tokens < 1:
            raise InfertraceError(f"--max-new-tokens must be >= 1 (got {self.max_new_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SampleResult:
    """Outcome of one draw: chosen ``token``; ``top`` = [(id, raw logit, prob)] of the
    final distribution, best first."""

    token: int
    top: list[tuple[int, float, float]]


def apply_repetition_penalty(logits: torch.Tensor, seen: Iterable[int], penalty: float) -> torch.Tensor:
    """Penalise already-seen tokens: positive logits divided, negative multiplied (case S1).

    Args: logits ``[V]`` float32; ``seen`` token ids; ``penalty`` > 0.
    Returns: new ``[V]`` tensor. Mirrors HF ``RepetitionPenaltyLogitsProcessor``.
    """
    if penalty == 1.0:
        return logits
    ids = torch.tensor(sorted(set(seen)), dtype=torch.int64)
    if ids.numel() == 0:
        return logits
    out = logits.clone()
    sel = out[ids]  # [k]
    out[ids] = torch.where(sel > 0, sel / penalty, sel * penalty)
    return out


def sample(logits: torch.Tensor, params: SamplingParams, seen: Iterable[int], generator: torch.Generator,
           n_top: int = 5) -> SampleResult:
    """Choose the next token from one request's logits ``[V]`` (float32).

    Greedy (temperature 0) and ``top_k == 1`` both return the lowest index among tied
    maxima (case S2). Returns :class:`SampleResult` with the top ``n_top`` candidates.
    """
    raw = logits.float()
    x = apply_repetition_penalty(raw, seen, params.repetition_penalty)  # [V]
    if params.greedy:
        probs = torch.softmax(x, -1)  # [V]
        tok = int(torch.argmax(x))  # first max index
        idx = torch.topk(x, min(n_top, x.numel())).indices.tolist()  # display only
        idx = [tok] + [i for i in idx if i != tok][: n_top - 1]
        top = [(int(i), float(raw[i]), float(probs[i])) for i in idx]
        return SampleResult(tok, top)
    x = x / params.temperature
    vals, idx = torch.sort(x, descending=True, stable=True)  # [V] each, ties keep index order
    keep = torch.ones_like(vals, dtype=torch.bool)
    if params.top_k > 0:
        keep[params.top_k :] = False
    p = torch.softmax(vals.masked_fill(~keep, float("-inf")), -1)  # [V]
    if params.top_p < 1.0:
        cum = torch.cumsum(p, -1)
        drop = (cum - p) >= params.top_p  # keep the smallest prefix reaching top_p
        keep &= ~drop
        p = torch.softmax(vals.masked_fill(~keep, float("-inf")), -1)
    if params.min_p > 0.0:
        keep &= p >= params.min_p * p[0]
        p = torch.softmax(vals.masked_fill(~keep, float("-inf")), -1)
    j = int(torch.multinomial(p, 1, generator=generator))
    tok = int(idx[j])
    top = [(int(idx[r]), float(raw[idx[r]]), float(p[r])) for r in range(min(n_top, int(keep.sum())))]
    return SampleResult(tok, top)
