"""``infertrace diff-backends``: the same requests through cells and paged in lockstep (or through our
engine and an external reference), logical variables compared, physical layouts side by side.

Thin: validate options (as ``run``), load the model, call
:func:`infertrace.engine.compare.diff_backends` or
:func:`infertrace.engine.against.compare_with_reference`, print (rich or ``--json``).
Exit codes: 0 logically identical, 1 a logical mismatch (CI can rely on it), 2 bad input.
"""

from typing import Annotated, Optional

import typer

from infertrace.safe_text import json_text
from infertrace.cli import run_options as o
from infertrace.cli.common import check_min, check_choice, load_with_progress, progress_display, stdout_console
from infertrace.errors import InfertraceError

HELP = ("Run the same requests through both cache backends (cells and paged) step by step and compare the logical "
        "variables (positions, visible keys, K/V of all layers, tokens, logits) beside the physical layouts; exit 1 on "
        "a logical mismatch. --against hf|llama.cpp compares our engine with an external implementation instead.")


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
    ctx_size: o.CtxSize = o.E.ctx_size,
    num_blocks: o.NumBlocks = None,
    tokens_per_block: o.TokensPerBlock = o.E.tokens_per_block,
    max_batch_tokens: o.MaxBatchTokens = o.E.max_batch_tokens,
    prefill_chunk: o.PrefillChunk = None,
    attention: o.Attention = "auto",
    dtype: o.Dtype = "float32",
    device: o.Device = "cpu",
    threads: o.Threads = None,
    layer: Annotated[int, typer.Option("--layer", help="With --against llama.cpp: the layer whose K/V are compared.")] = 0,
    sampler_order: o.SamplerOrder = None,
    prefix_cache: o.PrefixCache = "off",
    context_shift: o.ContextShift = False,
    n_keep: o.NKeep = 0,
    n_discard: o.NDiscard = 0,
    audit_kv: o.AuditKv = False,
) -> None:
    """Prints the report; ``typer.Exit(1)`` after it when anything logical differs."""
    if against is not None:
        against = check_choice("--against", against, ("hf", "llama.cpp", "vllm"))
    if atol is not None and against in ("llama.cpp", "vllm"):
        raise InfertraceError(f"--atol does not apply to --against {against}: its tolerance is a measured noise floor; drop --atol")
    if atol is not None and not atol >= 0:
        raise InfertraceError(f"--atol must be >= 0 (got {atol})")
    check_min("--threads", threads, 1)
    specs, opts = o.build_run_inputs(
        prompt=prompt, prompts=prompts, arrival=arrival, max_new_tokens=max_new_tokens, chat=chat,
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
        seed=seed, ignore_eos=ignore_eos, backend=backend, ctx_size=ctx_size, num_blocks=num_blocks,
        tokens_per_block=tokens_per_block, max_batch_tokens=max_batch_tokens, prefill_chunk=prefill_chunk,
        attention=attention, dtype=dtype, device=device, sampler_order=sampler_order,
        prefix_cache=prefix_cache, context_shift=context_shift, n_keep=n_keep, n_discard=n_discard, audit_kv=audit_kv)
    if against == "hf":  # fail before loading anything
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise InfertraceError("--against hf needs transformers: pip install 'infertrace[dev]'") from None
    elif against == "llama.cpp":
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise InfertraceError("--against llama.cpp needs llama-cpp-python: pip install 'infertrace[llamacpp]'") from None
    elif against == "vllm":
        from infertrace.runtimes.vllm import import_vllm

        import_vllm()
        if dtype.lower() not in ("float32", "fp32") or device != "cpu":
            raise InfertraceError("--against vllm compares float32 runs on the CPU; drop --dtype/--device")
    with progress_display(enabled=not as_json) as progress:
        loaded = load_with_progress(model, dtype, device, progress, threads)
        o.print_run_cost(progress, loaded, specs, opts, dtype)  # past n_ctx_train: warn with the cost
        progress.add_task("comparing" + (f" with {against}" if against else " cells and paged in lockstep"), total=None)
        if against is None:
            from infertrace.engine.compare import diff_backends as run_diff

            rep = run_diff(loaded, specs, opts, atol=atol)
        elif against == "llama.cpp":
            from infertrace.engine.llamacpp_compare import compare_with_llamacpp

            if backend != "cells" or dtype.lower() not in ("float32", "fp32"):
                raise InfertraceError("--against llama.cpp compares the cells backend in float32 (the base side); drop --backend/--dtype")
            rep = compare_with_llamacpp(loaded, specs, opts, layer=layer)
        elif against == "vllm":
            from infertrace.runtimes.vllm.compare import compare_with_vllm

            rep = compare_with_vllm(loaded, specs, opts, layer=layer)
            rep.pop("traces", None)
        else:
            from infertrace.engine.against import compare_with_reference

            rep = compare_with_reference(loaded, specs, opts, against, atol=atol)
    if as_json:
        typer.echo(json_text(rep, default=_jsonable))
    else:
        from infertrace.present.render_compare import render_backends_diff, render_reference_diff

        if against == "llama.cpp":
            from infertrace.present.render_llamacpp import render_llamacpp_diff

            render_llamacpp_diff(stdout_console(), rep)
        elif against == "vllm":
            from infertrace.present.render_vllm import render_vllm_diff

            render_vllm_diff(stdout_console(), rep)
        else:
            (render_backends_diff if against is None else render_reference_diff)(stdout_console(), rep)
    if not rep["identical"]:
        raise typer.Exit(1)
