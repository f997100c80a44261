"""``infertrace diff-backends``: the same requests through cells and paged in lockstep, logical variables
compared, physical layouts side by side; ``infertrace diff-runtimes NAME``: our engine against another runtime
(hf, llama.cpp, vllm) on the same requests (``diff-backends --against NAME``, its old form, still works).

Thin: validate options (as ``run``), load the model, call
:func:`infertrace.compare.backends.diff_backends` or
:func:`infertrace.compare.hf.compare_with_reference`, print (rich or ``--json``).
Exit codes: 0 logically identical, 1 a logical mismatch (CI can rely on it), 2 bad input.
"""

from dataclasses import replace
from typing import Annotated, Any, Optional

import inspect

import typer

from infertrace.safe_text import json_text
from infertrace.cli import run_options as o
from infertrace.cli.common import check_choice, load_with_progress, progress_display, stdout_console
from infertrace.errors import InfertraceError
from infertrace.runtimes.api import RunSettings

#: the references recomputed outside the registry's runtimes (:data:`infertrace.compare.hf.AGAINST`; torch-free here)
AGAINST = ("hf",)

HELP = ("Run the same requests through both cache backends (cells and paged) step by step and compare the logical "
        "variables (positions, visible keys, K/V of all layers, tokens, logits) beside the physical layouts; exit 1 on "
        "a logical mismatch. `diff-runtimes NAME` compares our engine with another runtime instead.")
RUNTIMES_HELP = ("Run the same requests through our engine (--backend) and another runtime: hf (transformers), llama.cpp "
                 "(llama-cpp-python) or vllm (vLLM itself; our paged backend replays its schedule and block ids), and "
                 "compare the logical variables; exit 1 on a mismatch. Takes diff-backends' options.")


def _jsonable(x: object) -> object:
    """JSON for the few non-JSON values of a report (frozensets of seq_ids)."""
    if isinstance(x, (set, frozenset)):
        return sorted(x)
    raise TypeError(type(x).__name__)


def diff_backends(
    prompt: o.Prompt = None,
    prompts: o.Prompts = None,
    model: o.Model = None,
    arrival: o.Arrival = None,
    against: Annotated[Optional[str], typer.Option("--against", hidden=True, help="Old form of `diff-runtimes NAME`: compare our engine (--backend) with hf, llama.cpp or vllm instead of the other backend.")] = None,
    atol: Annotated[Optional[float], typer.Option("--atol", help="Tolerance on logits and K/V (default 1e-4 for float32 backends; 1e-3 against hf). Against llama.cpp the tolerance is a measured noise floor instead (ours float32 vs ours bfloat16); --atol is refused there.")] = None,
    as_json: o.Json = False,
    max_new_tokens: o.MaxNewTokens = o.D.max_new_tokens,
    chat: o.Chat = False,
    temperature: o.Temperature = o.D.temperature,
    top_k: o.TopK = o.D.top_k,
    top_p: o.TopP = o.D.top_p,
    min_p: o.MinP = o.D.min_p,
    repetition_penalty: o.RepetitionPenalty = o.D.repetition_penalty,
    seed: o.Seed = o.D.seed,
    ignore_eos: o.IgnoreEos = False,
    backend: Annotated[str, typer.Option("--backend", help="diff-runtimes: our engine's backend (cells or paged). diff-backends: both run.")] = "cells",
    ctx_size: o.CtxSize = None,
    num_blocks: o.NumBlocks = None,
    tokens_per_block: o.TokensPerBlock = o.E.tokens_per_block,
    max_batch_tokens: o.MaxBatchTokens = o.E.max_batch_tokens,
    prefill_chunk: o.PrefillChunk = None,
    attention: o.Attention = "auto",
    dtype: o.Dtype = "float32",
    device: o.Device = "cpu",
    weights: o.Weights = "auto",
    threads: o.Threads = None,
    layer: Annotated[int, typer.Option("--layer", help="diff-runtimes llama.cpp: the layer whose K/V are compared.")] = 0,
    sampler_order: o.SamplerOrder = None,
    prefix_cache: o.PrefixCache = "off",
    context_shift: o.ContextShift = False,
    n_keep: o.NKeep = 0,
    n_discard: o.NDiscard = 0,
    audit_kv: o.AuditKv = False,
    llamacpp_flash_attn: o.LlamacppFlashAttn = None,
    kv_unified: o.KvUnified = "on",
) -> None:
    """Prints the report; ``typer.Exit(1)`` after it when anything logical differs."""
    from infertrace.threads import check_thread_settings

    check_thread_settings(threads)  # --threads and OMP_NUM_THREADS/INFERTRACE_THREADS, before torch loads
    against, llamacpp_flash_attn = check_against(against, atol, threads, llamacpp_flash_attn)
    weights = o.check_weights(weights)
    ctx_given = ctx_size is not None  # not given: the default, lowered to the model's trained context once loaded
    ctx_size = o.E.ctx_size if ctx_size is None else ctx_size
    specs, opts = o.build_run_inputs(
        prompt=prompt, prompts=prompts, arrival=arrival, max_new_tokens=max_new_tokens, chat=chat,
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
        seed=seed, ignore_eos=ignore_eos, backend=backend, ctx_size=ctx_size, num_blocks=num_blocks,
        tokens_per_block=tokens_per_block, max_batch_tokens=max_batch_tokens, prefill_chunk=prefill_chunk,
        attention=attention, dtype=dtype, device=device, sampler_order=sampler_order,
        prefix_cache=prefix_cache, context_shift=context_shift, n_keep=n_keep, n_discard=n_discard, audit_kv=audit_kv,
        kv_unified=kv_unified)
    if not opts.kv_unified and against is None:
        raise InfertraceError("--kv-unified off has no paged counterpart: compare the non-unified cells cache with "
                              "diff-runtimes llama.cpp (or diff-runtimes hf)")
    settings = check_reference(against, atol, RunSettings(
        opts=opts, layer=layer, dtype=dtype, device=device, weights=weights,
        native={"flash_attn": llamacpp_flash_attn} if llamacpp_flash_attn is not None else {}))  # before anything loads
    with progress_display(enabled=not as_json) as progress:
        loaded = load_with_progress(model, dtype, device, progress, threads, settings.weights)
        if not ctx_given:
            opts, note = o.default_ctx_note(loaded, opts, against if _runtime(against) else "infertrace")
            settings = replace(settings, opts=opts)
            if note:
                progress.console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
        o.print_run_cost(progress, loaded, specs, opts, dtype)  # past n_ctx_train: warn with the cost
        progress.add_task("comparing" + (f" with {against}" if against else " cells and paged in lockstep"), total=None)
        rep = compare(loaded, specs, settings, against, atol)
        rep.update(o.weights_record(loaded))  # which weights path our side computed with (absent: the float path)
    print_report(rep, against, as_json)
    if not rep["identical"]:
        raise typer.Exit(1)


# ----------------------------------------------------------------------------- the command's parts


def _runtime(against: Optional[str]) -> Any:
    """The comparison module of the runtime ``--against`` names when the registry has one, else None
    (``hf``: a reference recomputed by :mod:`infertrace.compare.hf`; None: cells against paged)."""
    from infertrace.runtimes.api import REGISTRY, comparison

    entry = REGISTRY.get(against) if against is not None else None
    return comparison(against) if entry is not None and entry.comparison and against not in AGAINST else None


def choices() -> tuple[str, ...]:
    """``--against`` values: the references of :mod:`infertrace.compare.hf` and the comparable runtimes."""
    from infertrace.runtimes.api import REGISTRY

    return tuple(dict.fromkeys(AGAINST + tuple(n for n, e in REGISTRY.items() if e.comparison)))


def check_against(against: Optional[str], atol: Optional[float], threads: Optional[int],
                  llamacpp_flash_attn: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """Validate ``--against`` and the options that depend on it, before anything loads.

    Returns:
        ``(against, llamacpp_flash_attn)`` normalised (lower case).

    Raises:
        InfertraceError: unknown reference, ``--atol`` negative, ``--threads`` outside 1..max_threads(),
            ``--llamacpp-flash-attn`` without ``--against`` the runtime that takes it.
    """
    from infertrace.runtimes.api import owner_of

    if against is not None:
        against = check_choice("--against", against, choices())
    if atol is not None and not atol >= 0:
        raise InfertraceError(f"--atol must be >= 0 (got {atol})")
    from infertrace.threads import check_thread_settings

    check_thread_settings(threads)  # 1..max_threads(), and the thread environment variables
    owner = owner_of("flash_attn")
    if llamacpp_flash_attn is not None and against != owner:
        raise InfertraceError(f"--llamacpp-flash-attn sets {owner}'s flash attention: it needs diff-runtimes {owner}")
    return against, llamacpp_flash_attn


def check_reference(against: Optional[str], atol: Optional[float], settings: RunSettings) -> RunSettings:
    """The reference can run: its package is importable and it takes these settings (a runtime's own
    ``check_comparison``; transformers for ``hf``). Returns the settings it runs with.

    Raises:
        InfertraceError: the package is missing (naming the extra to install), or a refused setting as a flag.
    """
    cls = _runtime(against)
    if cls is not None:
        from infertrace.runtimes.api import SettingRefused

        try:
            return cls.check_comparison(settings, atol)
        except SettingRefused as e:
            from infertrace.cli.run import FLAGS

            flag = {"atol": "--atol"}.get(e.setting) or FLAGS.get(e.setting, e.setting)
            raise InfertraceError(f"{flag} does not apply to diff-runtimes {e.runtime} ({e}); drop {flag}") from None
    if against in AGAINST:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise InfertraceError(f"diff-runtimes {against} needs transformers: run `make setup-dev` in the infertrace checkout (or `.venv/bin/pip install -e '.[dev]'` there)") from None
    return settings


def compare(loaded: Any, specs: list[Any], settings: RunSettings, against: Optional[str], atol: Optional[float]) -> dict[str, Any]:
    """The comparison report: cells vs paged in lockstep (``against`` None), ours vs a runtime (its ``compare``),
    or ours vs a reference (HF).

    Raises:
        InfertraceError: settings the comparison refuses, any run error.
    """
    if against is None:
        from infertrace.compare.backends import diff_backends as run_diff

        return run_diff(loaded, specs, settings.opts, atol=atol)
    cls = _runtime(against)
    if cls is not None:
        return cls.compare(loaded, specs, settings, atol)
    from infertrace.compare.hf import compare_with_reference

    return compare_with_reference(loaded, specs, settings.opts, against, atol=atol)


def print_report(rep: dict[str, Any], against: Optional[str], as_json: bool) -> None:
    """Print ``rep`` as JSON or with the renderer of its kind (backends, a runtime's own, reference)."""
    if as_json:
        typer.echo(json_text(rep, default=_jsonable))
        return
    from infertrace.present.render_compare import render_backends_diff, render_reference_diff

    cls = _runtime(against)
    if cls is not None:
        cls.render_comparison(stdout_console(), rep)
    else:
        (render_backends_diff if against is None else render_reference_diff)(stdout_console(), rep)


def diff_runtimes(runtime: str, **options: Any) -> None:
    """``diff-runtimes NAME``: :func:`diff_backends` with ``--against NAME`` (its other options the same;
    the signature Typer reads is built below from :func:`diff_backends`')."""
    return diff_backends(against=check_choice("diff-runtimes NAME", runtime, choices()), **options)


def _runtimes_signature() -> inspect.Signature:
    """:func:`diff_backends`' options with ``--against`` replaced by the positional NAME."""
    sig = inspect.signature(diff_backends)
    name = inspect.Parameter("runtime", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[str, typer.Argument(
        metavar="NAME", help="The runtime compared with our engine: hf, llama.cpp or vllm.", show_default=False)])
    return sig.replace(parameters=[name] + [p for p in sig.parameters.values() if p.name != "against"])


diff_runtimes.__signature__ = _runtimes_signature()  # type: ignore[attr-defined]
