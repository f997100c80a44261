"""Sampling: logits of one request -> next token, reproducibly.

Order: repetition penalty -> temperature -> top-k -> top-p -> min-p -> draw
(HF ``LogitsProcessor`` semantics for the penalty; llama.cpp ``common_sampler`` /
``llama-sampling.cpp`` for min-p). ``temperature == 0`` is greedy (first max index).
Each request has its own ``torch.Generator`` seeded from its seed, so its tokens do not
depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from infertrace.engine.options import SamplingParams  # noqa: F401 - torch-free home; re-exported


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
