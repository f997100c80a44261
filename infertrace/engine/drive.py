"""Drive a bare engine over a list of requests ("add each request, step until done, collect"): the loop
``dump-kv``, ``diff-backends`` and the comparisons use. A traced run of any runtime goes through
:func:`infertrace.runtimes.loop.record_run` instead, which builds the trace.

The request side lives here too: :class:`PromptSpec` (text or ids, sampling settings, arrival
step) and :func:`encode_prompt`, so the drivers below the runner (``compare/``,
``capture/kv_views.py``, ``runtimes/``) need not import it (runner -> engine, never back).

Mirrors the offline loop of vLLM ``LLM.generate`` (``add_request`` for each prompt, then
``step()`` until no unfinished request) and nano-vllm ``LLMEngine.generate``.

Torch-free: the engine is duck-typed (anything with ``add_request``, ``step``, ``step_no`` and
``requests``, e.g. :class:`~infertrace.engine.engine.Engine` and its subclasses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Protocol

from infertrace.engine.options import SamplingParams
from infertrace.errors import InfertraceError

#: the bound on steps of one drive (as :meth:`Engine.run`)
MAX_STEPS = 100_000


@dataclass
class PromptSpec:
    """One request to run: text (or ids), its arrival step and sampling settings."""

    text: str
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_step: int = 0
    chat: bool = False
    ids: list[int] | None = None


@dataclass(frozen=True)
class EncodedRequest:
    """A request ready for ``Engine.add_request``: token ids, sampling settings, arrival step
    (0-based engine step) and the prompt text kept for the trace."""

    ids: list[int]
    params: SamplingParams
    arrival_step: int
    text: str


class Steppable(Protocol):
    """What :func:`drive` needs of an engine (:class:`~infertrace.engine.engine.Engine`)."""

    step_no: int
    requests: dict[int, Any]

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None, arrival_step: int = 0,
                    prompt_text: str = "") -> Any: ...

    def step(self) -> Any: ...


def encode_prompt(tok: Any, spec: PromptSpec) -> list[int]:
    """Token ids of a prompt (rendering the chat template first when ``spec.chat``).

    Raises:
        InfertraceError: text that is not valid UTF-8, or ``chat`` on a model without a chat template.
    """
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


def encode_requests(tok: Any, prompts: Iterable[PromptSpec]) -> Iterator[EncodedRequest]:
    """:func:`encode_prompt` of each prompt, in order (seq_ids follow this order), lazily: given to
    :func:`submit`, each prompt is encoded right before it is queued, so a bad prompt and a prompt
    the engine refuses are reported in request order."""
    for s in prompts:
        yield EncodedRequest(encode_prompt(tok, s), s.params, s.arrival_step, s.text)


def submit(engine: Steppable, requests: Iterable[EncodedRequest]) -> None:
    """Queue every request on ``engine`` in order (seq_ids 0, 1, 2 ...).

    Raises:
        InfertraceError: as ``Engine.add_request`` (empty or too long prompt, too many requests).
    """
    for r in requests:
        engine.add_request(r.ids, r.params, r.arrival_step, r.text)


def drive(engine: Steppable, requests: Iterable[EncodedRequest], on_step: Callable[[Any], None] | None = None,
          last_step: int | None = None, max_steps: int | None = MAX_STEPS) -> list[Any]:
    """Queue ``requests`` on ``engine`` and step it until every request finished.

    Args:
        engine: a fresh engine (no request queued yet).
        requests: from :func:`encode_requests`.
        on_step: called after every step with what ``engine.step()`` returned (the scheduled batch).
        last_step: stop once step ``last_step`` (0-based, idle steps count) has run, even with work left.
        max_steps: at most this many steps (None: no bound, the run ends when the engine has no work).

    Returns:
        the engine's requests by seq_id (finished unless ``last_step``/``max_steps`` stopped the run).

    Raises:
        InfertraceError: as ``add_request`` and ``step`` (prompt too long, cache too small, NaN logits ...).
    """
    submit(engine, requests)
    n = 0
    while max_steps is None or n < max_steps:
        n += 1
        if last_step is not None and engine.step_no > last_step:
            break
        batch = engine.step()
        if batch is None:
            break
        if on_step is not None:
            on_step(batch)
    return [engine.requests[k] for k in sorted(engine.requests)]


def drive_bounded(engine: Steppable, requests: Iterable[EncodedRequest],
                  on_step: Callable[[Any], None] | None = None) -> list[Any]:
    """:func:`drive` for a traced run: at most the trace format's ``MAX_STEPS`` steps (the CLI refuses a run
    whose bound is larger before it starts: ``cli/run_options.check_request_limits``); a run still
    unfinished there is an error rather than a trace no reader accepts.

    Raises:
        InfertraceError: as :func:`drive`, or requests left unfinished after ``MAX_STEPS`` steps.
    """
    from infertrace.errors import InfertraceError
    from infertrace.trace.schema import LIMITS

    done = drive(engine, requests, on_step, max_steps=LIMITS["MAX_STEPS"])
    left = [r.seq_id for r in done if getattr(r, "status", "finished") != "finished"]
    if left:
        raise InfertraceError(f"the run did not finish within {LIMITS['MAX_STEPS']} steps (MAX_STEPS of the trace format; "
                              f"seq {left[0]} still running); lower --max-new-tokens")
    return done

