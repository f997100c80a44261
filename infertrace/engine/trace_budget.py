"""What a saved trace may hold, as a bound on a run (``run --context-shift``).

``show``, ``diff`` and ``check`` read at most ``MAX_MANIFEST_BYTES`` (256 MiB) of a ``trace.json``
(:func:`infertrace.trace.store.load_saved`). A run without a context shift is bounded by its
context (a request stops at ``ctx_full``); with one, every request generates all its
``--max-new-tokens``, so the trace grows with ``-n`` alone — ~24 KB per step on SmolLM2 passes the
read cap after ~26,000 steps (530 with 32 requests), and ``run --save`` wrote what ``show`` refuses.

Two bounds, neither of which refuses a run whose trace would fit:

* up front (:func:`check_context_shift_budget`, before the model loads): a *lower* bound on the
  trace's bytes — every generated token is one batch row of at least :data:`MIN_ROW_BYTES`, every
  step at least :data:`MIN_STEP_BYTES` besides its rows (measured minima: 759 bytes for a one-row
  decode step with a single ``--show`` variable, its row ~300 of them; ``trace.json`` is written
  indented, larger still) — over the cap is refused in one line;
* while running (:class:`TraceBudget`): the bytes each step adds to ``trace.json`` (its canonical
  JSON as :func:`~infertrace.trace.store.save_trace` writes it, plus its tensor index entries) are
  counted, and the run stops with one line as soon as the total passes the cap — before hours of
  steps nobody can read back.
"""

from __future__ import annotations

from typing import Any, Sequence

from infertrace.errors import ConfigError, InfertraceError

#: bytes of one batch row of a step at least (seq_id, C, T, phase, token, piece, positions, cache ranges)
MIN_ROW_BYTES = 256
#: bytes of a step besides its rows at least (step, N, backend, attention and one variable's record)
MIN_STEP_BYTES = 384
#: bytes per generated or prompt token in the ``requests`` section (ids, text) — an allowance
REQUEST_TOKEN_BYTES = 16
#: indentation a step's lines get inside the manifest (``"steps": [`` then the step object)
_STEP_INDENT = 2


def manifest_cap() -> int:
    """The bytes of a ``trace.json`` that readers accept (``MAX_MANIFEST_BYTES``)."""
    from infertrace.safe_io import MAX_MANIFEST_BYTES

    return MAX_MANIFEST_BYTES


def check_context_shift_budget(max_new_tokens: Sequence[int], arrivals: Sequence[int]) -> None:
    """Refuse, before anything loads, a ``--context-shift`` run whose trace cannot fit the read cap
    even at the smallest size a step and a row can have.

    Args:
        max_new_tokens: each request's ``--max-new-tokens`` (all generated: a context shift never stops one).
        arrivals: each request's arrival step.

    Raises:
        InfertraceError: one line with the lower bound, the cap and the largest ``-n`` that could fit.
    """
    cap = manifest_cap()
    steps = max((a + n for a, n in zip(arrivals, max_new_tokens)), default=0)  # one token per step per request
    low = sum(max_new_tokens) * MIN_ROW_BYTES + steps * MIN_STEP_BYTES
    if low > cap:
        fit = cap // ((MIN_ROW_BYTES + MIN_STEP_BYTES) if len(max_new_tokens) == 1 else
                      (MIN_ROW_BYTES * len(max_new_tokens) + MIN_STEP_BYTES))
        raise ConfigError("sampling.max_new_tokens", f"{max(max_new_tokens)} for {len(max_new_tokens)} request(s) with a context "
                                                     f"shift: its trace would hold at least {low >> 20} MiB, more than the {cap >> 20} MiB "
                                                     f"a saved trace may hold (MAX_MANIFEST_BYTES); lower it (at most ~{fit} per request)")


class TraceBudget:
    """Counts the ``trace.json`` bytes of a run's steps as they are made; raises once over the cap.

    Args:
        steps: the recorder's list of :class:`~infertrace.trace.records.StepTrace` (read, never changed).
        tensors: the recorder's tensor dict (``--keep tensors``), whose names become index entries; or None.
        prompt_tokens: an allowance for the ``requests`` section (prompt + generated tokens).

    Raises (from :meth:`__call__`):
        InfertraceError: the steps so far pass the cap, naming the step and the cap.
    """

    def __init__(self, steps: list[Any], tensors: dict[str, Any] | None, prompt_tokens: int = 0):
        self.steps, self.tensors = steps, tensors
        self.cap = manifest_cap()
        self.total = 4096 + prompt_tokens * REQUEST_TOKEN_BYTES  # header sections (config, options, notes) allowance
        self.seen_steps = 0
        self.seen_tensors = 0

    def __call__(self, _batch: Any = None) -> None:
        from infertrace.trace.store import TIMING_FIELDS, canonical_json

        for st in self.steps[self.seen_steps:]:
            d = st.to_dict()
            for k in TIMING_FIELDS:
                d.pop(k, None)
            text = canonical_json(d)
            self.total += len(text.encode("utf-8")) + _STEP_INDENT * text.count("\n") + REQUEST_TOKEN_BYTES * st.N
        self.seen_steps = len(self.steps)
        if self.tensors is not None and len(self.tensors) > self.seen_tensors:
            names = list(self.tensors)[self.seen_tensors:]
            self.total += sum(len(n) + 80 for n in names)  # "name": {"dtype": ..., "shape": [...]} indented
            self.seen_tensors = len(self.tensors)
        if self.total > self.cap:
            last = self.steps[-1].step if self.steps else 0
            raise ConfigError("sampling.max_new_tokens", f"with a context shift the trace passed {self.cap >> 20} MiB at step "
                                                         f"{last} (what a saved trace may hold, MAX_MANIFEST_BYTES; "
                                                         f"~{self.total // max(1, len(self.steps))} bytes a step); lower it to at "
                                                         f"most ~{max(1, len(self.steps) - 1)} steps' worth")
