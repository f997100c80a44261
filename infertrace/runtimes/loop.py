"""The one step loop: every :class:`~infertrace.trace.records.RunTrace` is built here, whatever runtime computed it.

``record_run`` checks the settings (the common checks, then the runtime's own), opens the runtime,
queues the requests, calls ``step()`` until it returns None, and assembles the trace from the
runtime's :class:`~infertrace.runtimes.api.RuntimeHeader` one way: the request records, the options
(``backend``, ``attention``, what the user asked, ``settings``, ``layer``, ``show``, then the runtime's
own fields), the notes (the model's, the tokenizer's, the runtime's) and the thread facts. The runtime
is closed in ``finally``. Mirrors vLLM ``LLM.generate`` (``add_request`` for each prompt, ``step()``
until no unfinished request) and nano-vllm ``LLMEngine.generate``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

from infertrace.errors import InfertraceError
from infertrace.runtimes.api import RunSettings, Runtime, RuntimeHeader, check_run, runtime_class


def checked_settings(cls: Any, loaded: Any, prompts: Sequence[Any], settings: RunSettings) -> RunSettings:
    """``settings`` checked for a run of ``prompts`` on ``cls`` (a Runtime class): the checks of every run
    (:func:`~infertrace.runtimes.api.check_run`), then the runtime's own ``check`` with the model's config.

    Raises:
        InfertraceError: as those checks (:class:`~infertrace.runtimes.api.SettingRefused` for a refused setting).
    """
    from infertrace.capture.recorder import VARIABLES

    settings = replace(settings, n_requests=max(1, len(prompts)))
    check_run(loaded.config, prompts, settings, VARIABLES)
    return cls.check(settings, loaded.config)


def open_runtime(name_or_cls: Any, loaded: Any, prompts: Sequence[Any], settings: RunSettings,
                 tensors: dict[str, Any] | None = None) -> tuple[Any, RunSettings]:
    """Check ``settings`` against the model and open the runtime (``name_or_cls``: a registered name, a
    :class:`~infertrace.runtimes.api.Runtime` class, or a runtime the caller opened on settings it
    checked with :func:`checked_settings`, used as it is).

    Returns:
        ``(runtime, settings)``: the opened runtime and the settings it was opened with (normalised by its ``check``).

    Raises:
        InfertraceError: as :func:`checked_settings` and the runtime's constructor.
    """
    if not isinstance(name_or_cls, (str, type)):  # opened by the caller (a test sharing one vLLM engine)
        return name_or_cls, name_or_cls.settings
    cls = runtime_class(name_or_cls) if isinstance(name_or_cls, str) else name_or_cls
    settings = checked_settings(cls, loaded, prompts, settings)
    return cls(loaded, settings, tensors), settings


def record_run(name_or_cls: Any, loaded: Any, prompts: Sequence[Any], settings: RunSettings,
               on_step: Callable[[Any], None] | None = None, tensors: dict[str, Any] | None = None) -> Any:
    """Run ``prompts`` on one runtime and return the trace.

    Args:
        name_or_cls: a registered runtime name (``api.REGISTRY``), a Runtime class, or an opened runtime.
        loaded: :class:`~infertrace.loading.model.Loaded` (config, tokenizer, checkpoint identity; the
            weights too for infertrace's own engine).
        prompts: :class:`~infertrace.engine.drive.PromptSpec` list; seq_ids follow list order.
        settings: what the runtime is opened with.
        on_step: called with each :class:`~infertrace.trace.records.StepTrace` as it is made.
        tensors: when a dict is given, each step's kept tensors are copied into it (names like
            ``step3/layer0/q_pre_rope``).

    Returns:
        the :class:`~infertrace.trace.records.RunTrace` (``runtime`` = the runtime's name).

    Raises:
        InfertraceError: bad settings, a prompt the runtime refuses, a runtime failure, or a run still
            unfinished after the trace format's ``MAX_STEPS`` steps.
    """
    from infertrace.engine.drive import encode_requests
    from infertrace.trace.schema import LIMITS

    rt, settings = open_runtime(name_or_cls, loaded, prompts, settings, tensors)
    try:
        for r in encode_requests(loaded.tokenizer, prompts):  # encoded right before it is queued: errors in request order
            rt.add_request(r)
        steps = run_steps(rt, LIMITS["MAX_STEPS"], on_step)
        return assemble(rt, loaded, settings, rt.header(), steps)
    finally:
        rt.close()


def run_steps(rt: Runtime, max_steps: int, on_step: Callable[[Any], None] | None = None) -> list[Any]:
    """``rt.step()`` until it returns None; returns the step traces (``on_step`` gets each as it is made).

    Raises:
        InfertraceError: requests left unfinished after ``max_steps`` steps (a trace no reader accepts).
    """
    steps: list[Any] = []
    for _ in range(max_steps):
        rec = rt.step()
        if rec is None:
            return steps
        if rec.trace is not None:
            steps.append(rec.trace)
            if on_step is not None:
                on_step(rec.trace)
    left = [r["seq_id"] for r in rt.requests() if r.get("stop_reason") is None]
    if left:
        raise InfertraceError(f"the run did not finish within {max_steps} steps (MAX_STEPS of the trace format; "
                              f"seq {left[0]} still running); lower --max-new-tokens")
    return steps


def assemble(rt: Runtime, loaded: Any, settings: RunSettings, h: RuntimeHeader, steps: list[Any]) -> Any:
    """The :class:`~infertrace.trace.records.RunTrace` of a finished run, from the runtime's header."""
    from infertrace.loading.model import model_identity
    from infertrace.threads import current
    from infertrace.trace.records import RunTrace

    options = {"backend": h.backend, "attention": h.attention, **settings.record, "settings": dict(h.settings),
               "layer": settings.layer if h.layer is None else h.layer, "show": list(settings.show), **h.options}
    tok = loaded.tokenizer
    notes = list(loaded.ckpt.notes) + list(getattr(tok, "warnings", []) or []) + list(h.notes)
    out = RunTrace(model=model_identity(loaded.ckpt), config=loaded.config.to_dict(), options=options, notes=notes,
                   steps=steps if settings.trace else [], requests=rt.requests(), runtime=type(rt).info.name,
                   spec=h.spec)  # type: ignore[arg-type]
    th = current()
    out.threads = {"n": th.n, "reason": th.reason}
    return out
