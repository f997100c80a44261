"""Sampling: logits of one request -> next token, reproducibly.

Two orders (``order=``):

* ``hf`` (HF ``generate`` / vLLM): repetition penalty -> temperature -> top-k -> top-p -> min-p
  -> draw; the filters see the temperature-scaled distribution.
* ``llama.cpp`` (``common_sampler``'s default chain, ``common/sampling.cpp``): penalties ->
  top-k -> top-p -> min-p -> temperature -> dist; the filters see the *unscaled* logits, so the
  same settings keep different sets (logits ``[3, 2, 1]``, top-p 0.8, temperature 0.5: ``hf``
  keeps ``{0}``, ``llama.cpp`` keeps ``{0, 1}``).

Penalties (:func:`apply_penalties`) come first in both orders, on the tokens of the request's
penalty window: the last ``penalty_last_n`` tokens seen, prompt included (llama.cpp
``llama_sampler_penalties``, default 64 in the llama.cpp order), or the whole context (HF
``RepetitionPenaltyLogitsProcessor``, default in the hf order). llama.cpp ``llama-sampling.cpp``
for min-p (``p >= min_p * p_max``). ``temperature == 0`` is greedy (first max index) in both.
Each request has its own ``torch.Generator`` seeded from its seed, so its tokens do not
depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from infertrace.engine.options import SamplingParams, check_penalties, penalty_window  # noqa: F401 - torch-free home; re-exported
from infertrace.errors import ConfigError


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


def apply_penalties(logits: torch.Tensor, seen: Sequence[int], params: SamplingParams, order: str = "hf") -> torch.Tensor:
    """The penalties sampler: each token in the window is penalised once, whatever its count, by
    ``repetition_penalty`` (logit <= 0 multiplied, else divided), then ``count * frequency_penalty
    + presence_penalty`` is subtracted (``count`` = its occurrences in the window).

    Args:
        logits: ``[V]`` float32.
        seen: the request's tokens so far, prompt first (llama.cpp accepts the prompt into the chain).
        params: ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``, ``penalty_last_n``
            (:func:`~infertrace.engine.options.penalty_window`: -1 all of ``seen``, 0 none, n the last n).
        order: ``hf`` or ``llama.cpp`` (the window's default).

    Returns:
        ``[V]`` float32 (``logits`` itself when nothing is penalised).

    Raises:
        ConfigError: frequency / presence penalty in the ``hf`` order (vLLM counts output tokens
            only there; not implemented).

    Mirrors llama.cpp ``llama_sampler_penalties_accept`` (a ring buffer of the last
    ``penalty_last_n`` tokens) and ``_apply`` (``src/llama-sampling.cpp``), float32 arithmetic.
    """
    check_penalties(params, order)
    n = penalty_window(params, order)
    if n == 0 or not params.penalized:
        return logits
    window = list(seen) if n < 0 else list(seen)[-n:]
    if not window:
        return logits
    ids, counts = torch.unique(torch.tensor(window, dtype=torch.int64), return_counts=True)  # [k] each
    out = logits.float().clone()  # [V]
    sel = out[ids]  # [k]
    rep = torch.tensor(params.repetition_penalty, dtype=torch.float32)
    sel = torch.where(sel <= 0, sel * rep, sel / rep)  # [k]
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        sub = (counts.float() * torch.tensor(params.frequency_penalty, dtype=torch.float32)
               + torch.tensor(params.presence_penalty, dtype=torch.float32))  # [k] float(count)*freq + float(count>0)*present
        sel = sel - sub
    out[ids] = sel
    return out


#: sampler orders: ``hf`` (temperature first) and ``llama.cpp`` (filters first, temperature last)
ORDERS = ("hf", "llama.cpp")


def default_order(backend: str) -> str:
    """The sampler order of the convention being mirrored: llama.cpp's for the ``cells`` backend, HF/vLLM's
    for ``paged`` (a runtime with its own order passes it to the engine: llama.cpp's is always ``llama.cpp``)."""
    return "llama.cpp" if backend == "cells" else "hf"


def kept_set(logits: torch.Tensor, params: SamplingParams, order: str = "hf") -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates a non-greedy draw chooses from, and their probabilities.

    Args:
        logits: ``[V]`` float32 after the repetition penalty.
        params: temperature > 0, top_k / top_p / min_p.
        order: ``hf`` or ``llama.cpp`` (see the module docstring).

    Returns:
        ``(ids [K] int64, probs [K] float32)``, best first (ties keep index order).

    Raises:
        ConfigError: ``sampler_order``: unknown order.
    """
    if order not in ORDERS:
        raise ConfigError("sampler_order", f"must be one of {', '.join(ORDERS)} (got {order!r})")
    x = logits.float() / params.temperature if order == "hf" else logits.float()  # [V] what the filters see
    vals, idx = torch.sort(x, descending=True, stable=True)  # [V] each, ties keep index order
    keep = torch.ones_like(vals, dtype=torch.bool)
    if params.top_k > 0:
        keep[params.top_k :] = False
    p = torch.softmax(vals.masked_fill(~keep, float("-inf")), -1)  # [V]
    if params.top_p < 1.0:
        cum = torch.cumsum(p, -1)
        before = torch.cat([cum.new_zeros(1), cum[:-1]])  # [V] mass before each token (case S3: not cum - p,
        drop = before >= params.top_p  # whose float rounding keeps a token after the mass reached top_p)
        keep &= ~drop
        p = torch.softmax(vals.masked_fill(~keep, float("-inf")), -1)
    if params.min_p > 0.0:
        keep &= p >= params.min_p * p[0]
    n = int(keep.sum())  # kept entries are a prefix of the sorted order
    final = vals[:n] / params.temperature if order == "llama.cpp" else vals[:n]  # [n] temperature last
    return idx[:n], torch.softmax(final, -1)


def sample(logits: torch.Tensor, params: SamplingParams, seen: Iterable[int], generator: torch.Generator,
           n_top: int = 5, order: str = "hf") -> SampleResult:
    """Choose the next token from one request's logits ``[V]`` (float32).

    Greedy (temperature 0) and ``top_k == 1`` both return the lowest index among tied
    maxima (case S2). ``order``: ``hf`` or ``llama.cpp`` (:func:`kept_set`); ``seen``: the
    request's tokens, prompt first (:func:`apply_penalties`). Returns :class:`SampleResult`
    with the top ``n_top`` candidates.
    """
    raw = logits.float()
    x = apply_penalties(raw, list(seen), params, order)  # [V]
    if params.greedy:
        probs = torch.softmax(x, -1)  # [V]
        tok = int(torch.argmax(x))  # first max index
        idx = torch.topk(x, min(n_top, x.numel())).indices.tolist()  # display only
        idx = [tok] + [i for i in idx if i != tok][: n_top - 1]
        top = [(int(i), float(raw[i]), float(probs[i])) for i in idx]
        return SampleResult(tok, top)
    ids, p = kept_set(x, params, order)  # [K] each
    full = torch.zeros(x.numel(), dtype=p.dtype)  # [V] sorted order, zeros past the kept prefix
    full[: p.numel()] = p  # the draw consumes the generator as over the whole vocabulary
    j = int(torch.multinomial(full, 1, generator=generator))
    tok = int(ids[j])
    top = [(int(ids[r]), float(raw[ids[r]]), float(p[r])) for r in range(min(n_top, ids.numel()))]
    return SampleResult(tok, top)


def mask_padded_rows(logits: torch.Tensor, n_tokens: int | None) -> torch.Tensor:
    """``logits`` (``[M, V]`` float) with columns ``n_tokens..V-1`` set to -inf, a new tensor (the
    same one when ``n_tokens`` is None): the padded rows of :func:`padded_vocab` can never be
    sampled, drafted or accepted."""
    if n_tokens is None or logits.shape[-1] <= n_tokens:
        return logits
    pad = torch.arange(logits.shape[-1], device=logits.device) >= n_tokens  # [V] bool
    return logits.masked_fill(pad, float("-inf"))  # [M, V]
