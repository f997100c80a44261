"""``infertrace diff-backends``: the same requests through cells and paged in lockstep (or through our
engine and an external reference), logical variables compared, physical layouts side by side.

Thin: validate options (as ``run``), load the model, call
:func:`infertrace.compare.backends.diff_backends` or
:func:`infertrace.compare.hf.compare_with_reference`, print (rich or ``--json``).
Exit codes: 0 logically identical, 1 a logical mismatch (CI can rely on it), 2 bad input.
"""

from typing import Annotated, Any, Optional

import typer

from infertrace.safe_text import json_text
from infertrace.cli import run_options as o
from infertrace.cli.common import check_choice, load_with_progress, progress_display, stdout_console
from infertrace.errors import InfertraceError

HELP = ("Run the same requests through both cache backends (cells and paged) step by step and compare the logical "
        "variables (positions, visible keys, K/V of all layers, tokens, logits) beside the physical layouts; exit 1 on "
        "a logical mismatch. --against hf|llama.cpp|vllm compares our engine with an external implementation instead.")


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
    against: Annotated[Optional[str], typer.Option("--against", help="Compare our engine (--backend) with hf (transformers), llama.cpp (llama-cpp-python) or vllm (vLLM itself; our paged backend replays its schedule and block ids) instead of the other backend.")] = None,
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
    backend: Annotated[str, typer.Option("--backend", help="With --against: our engine's backend (cells or paged). Without: both run.")] = "cells",
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
    layer: Annotated[int, typer.Option("--layer", help="With --against llama.cpp: the layer whose K/V are compared.")] = 0,
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
    if against == "vllm" and weights == "quant":
        raise InfertraceError("--weights quant does not apply to --against vllm (vLLM loads its own float weights and ours "
                              "replays its schedule in float32); drop --weights")
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
                              "--against llama.cpp (or --against hf)")
    check_reference_installed(against)  # fail before loading anything
    if against == "vllm" and (dtype.lower() not in ("float32", "fp32") or device != "cpu"):
        raise InfertraceError("--against vllm compares float32 runs on the CPU; drop --dtype/--device")
    with progress_display(enabled=not as_json) as progress:
        loaded = load_with_progress(model, dtype, device, progress, threads, "float" if against == "vllm" else weights)
        if not ctx_given:
            opts, note = o.default_ctx_note(loaded, opts, "vllm" if against == "vllm" else "infertrace")
            if note:
                progress.console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
        o.print_run_cost(progress, loaded, specs, opts, dtype)  # past n_ctx_train: warn with the cost
        progress.add_task("comparing" + (f" with {against}" if against else " cells and paged in lockstep"), total=None)
        rep = compare(loaded, specs, opts, against, atol, backend, dtype, layer, llamacpp_flash_attn)
        rep.update(o.weights_record(loaded))  # which weights path our side computed with (absent: the float path)
    print_report(rep, against, as_json)
    if not rep["identical"]:
        raise typer.Exit(1)


# ----------------------------------------------------------------------------- the command's parts


def check_against(against: Optional[str], atol: Optional[float], threads: Optional[int],
                  llamacpp_flash_attn: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """Validate ``--against`` and the options that depend on it, before anything loads.

    Returns:
        ``(against, llamacpp_flash_attn)`` normalised.

    Raises:
        InfertraceError: unknown reference, ``--atol`` negative or given with llama.cpp (whose tolerance is a
            measured floor), ``--threads`` outside 1..max_threads(), ``--llamacpp-flash-attn`` without ``--against llama.cpp``.
    """
    if against is not None:
        against = check_choice("--against", against, ("hf", "llama.cpp", "vllm"))
    if atol is not None and against in ("llama.cpp", "vllm"):
        raise InfertraceError(f"--atol does not apply to --against {against}: its tolerance is a measured noise floor; drop --atol")
    if atol is not None and not atol >= 0:
        raise InfertraceError(f"--atol must be >= 0 (got {atol})")
    from infertrace.threads import check_thread_settings

    check_thread_settings(threads)  # 1..max_threads(), and the thread environment variables
    if llamacpp_flash_attn is not None:
        if against != "llama.cpp":
            raise InfertraceError("--llamacpp-flash-attn sets llama.cpp's flash attention: it needs --against llama.cpp")
        from infertrace.runtimes.llamacpp.capture import check_flash_attn

        llamacpp_flash_attn = check_flash_attn(llamacpp_flash_attn)
    return against, llamacpp_flash_attn


def check_reference_installed(against: Optional[str]) -> None:
    """The package the reference needs is importable (transformers for ``hf``, llama-cpp-python for ``llama.cpp``).

    Raises:
        InfertraceError: the package is missing, naming the extra to install.
    """
    if against == "hf":
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise InfertraceError("--against hf needs transformers: run `make setup-dev` in the infertrace checkout (or `.venv/bin/pip install -e '.[dev]'` there)") from None
    elif against == "llama.cpp":
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise InfertraceError("--against llama.cpp needs llama-cpp-python: run `make setup-dev` in the infertrace checkout (or `.venv/bin/pip install -e '.[llamacpp]'` there)") from None
    elif against == "vllm":
        from infertrace.runtimes.vllm import import_vllm

        import_vllm()


def compare(loaded: Any, specs: list[Any], opts: Any, against: Optional[str], atol: Optional[float], backend: str,
            dtype: str, layer: int, llamacpp_flash_attn: Optional[str]) -> dict[str, Any]:
    """The comparison report: cells vs paged in lockstep (``against`` None), ours vs llama.cpp, or ours vs HF.

    Raises:
        InfertraceError: ``--against llama.cpp`` with another backend or dtype than cells / float32, any run error.
    """
    if against is None:
        from infertrace.compare.backends import diff_backends as run_diff

        return run_diff(loaded, specs, opts, atol=atol)
    if against == "llama.cpp":
        from infertrace.compare.llamacpp import compare_with_llamacpp

        if backend != "cells" or dtype.lower() not in ("float32", "fp32"):
            raise InfertraceError("--against llama.cpp compares the cells backend in float32 (the base side); drop --backend/--dtype")
        return compare_with_llamacpp(loaded, specs, opts, layer=layer, flash_attn=llamacpp_flash_attn or "auto")
    if against == "vllm":
        from infertrace.runtimes.vllm.compare import compare_with_vllm

        rep = compare_with_vllm(loaded, specs, opts, layer=layer)
        rep.pop("traces", None)
        return rep
    from infertrace.compare.hf import compare_with_reference

    return compare_with_reference(loaded, specs, opts, against, atol=atol)


def print_report(rep: dict[str, Any], against: Optional[str], as_json: bool) -> None:
    """Print ``rep`` as JSON or with the renderer of its kind (backends, llama.cpp, reference)."""
    if as_json:
        typer.echo(json_text(rep, default=_jsonable))
        return
    from infertrace.present.render_compare import render_backends_diff, render_reference_diff

    if against == "llama.cpp":
        from infertrace.present.render_llamacpp import render_llamacpp_diff

        render_llamacpp_diff(stdout_console(), rep)
    elif against == "vllm":
        from infertrace.present.render_vllm import render_vllm_diff

        render_vllm_diff(stdout_console(), rep)
    else:
        (render_backends_diff if against is None else render_reference_diff)(stdout_console(), rep)
