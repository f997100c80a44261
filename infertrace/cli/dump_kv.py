"""``infertrace dump-kv --step N [DIR]``: the KV cache right after step N of a live run, or of a
trace saved with ``run --save DIR`` (:func:`infertrace.trace.saved_kv.dump_saved`, no model needed).

Thin: validate options (as ``run``), load the model, call
:func:`infertrace.runner.dump_kv_at_step`, print with
:func:`infertrace.present.render_kv.render_kv_dump` or as JSON.

``dump-kv --state FILE [--model GGUF]``: llama.cpp's saved slot instead of a run (torch-free):
:func:`infertrace.runtimes.llamacpp.state_file.read_state_file` checks it against the model's header,
:func:`~infertrace.runtimes.llamacpp.state_dump.state_dump` and
:func:`infertrace.present.render_kv.render_state_dump` show it.
"""

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from infertrace.safe_text import json_text
from infertrace.cli import run_options as o
from infertrace.cli.common import load_with_progress, progress_display, stdout_console
from infertrace.errors import InfertraceError
from infertrace.trace.kv_dump import parse_positions

HELP = ("Show the KV cache right after step N of a run (same options as run): cells map with head/used/n_kv "
        "(cells) or pool usage, free list, block tables and slot mapping (paged); --layer/--head add K/V values. "
        "With a saved trace DIR (run --save DIR) it reads the step's record instead of running; with --state FILE it reads "
        "a llama.cpp slot / sequence state file (llama-server's POST /slots/ID?action=save) for --model.")


def dump_kv(
    ctx: typer.Context,
    step: Annotated[Optional[int], typer.Option("--step", help="Step whose end state is shown (0-based; idle steps count).")] = None,
    trace_dir: Annotated[Optional[Path], typer.Argument(help="A trace saved with 'run --save DIR' (then no prompt/model options).", show_default=False)] = None,
    prompt: o.Prompt = None,
    prompts: o.Prompts = None,
    model: o.Model = None,
    arrival: o.Arrival = None,
    layer: Annotated[Optional[int], typer.Option("--layer", help="Add K/V values of this layer (default 0 when --head is given).")] = None,
    head: Annotated[Optional[int], typer.Option("--head", help="kv head of the values (default 0 when --layer is given).")] = None,
    positions: Annotated[Optional[str], typer.Option("--positions", help="Positions of the values: 0,3,5 or 0..4 (default: all cached).")] = None,
    full: Annotated[bool, typer.Option("--full", help="All head_dim values instead of the first 4.")] = False,
    state: Annotated[Optional[Path], typer.Option("--state", help="A llama.cpp slot / sequence state file (llama-server "
                     "slot save, llama_state_seq_save_file) to show for --model (no run, no --step).", show_default=False)] = None,
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
    backend: o.Backend = "cells",
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
    prefix_cache: o.PrefixCache = "off",
    context_shift: o.ContextShift = False,
    n_keep: o.NKeep = 0,
    n_discard: o.NDiscard = 0,
    audit_kv: o.AuditKv = False,
    kv_unified: o.KvUnified = "on",
) -> None:
    """Every user error is one ``error:`` line, exit 2 (including a step out of range)."""
    if state is not None:
        return _dump_state(state, step, trace_dir, prompt or prompts, model, layer, head, positions, full, as_json)
    if step is None:
        raise InfertraceError("--step N is required (the step whose end state is shown), unless --state FILE is given")
    if step < 0:
        raise InfertraceError(f"step {step} out of range: steps are numbered from 0")
    pos = _value_options(layer, head, positions, full)
    if trace_dir is not None:  # a saved trace: the step's record (+ saved tensors for values), no model, no run
        _refuse_live_options(ctx)
        return _dump_saved(trace_dir, step, prompt or prompts, layer, head, pos, full, as_json)
    from infertrace.threads import check_thread_settings

    check_thread_settings(threads)  # --threads and OMP_NUM_THREADS/INFERTRACE_THREADS, before torch loads
    weights = o.check_weights(weights)
    ctx_given = ctx_size is not None  # not given: the default, lowered to the model's trained context once loaded
    ctx_size = o.E.ctx_size if ctx_size is None else ctx_size
    specs, opts = o.build_run_inputs(
        prompt=prompt, prompts=prompts, arrival=arrival, max_new_tokens=max_new_tokens, chat=chat,
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
        seed=seed, ignore_eos=ignore_eos, backend=backend, ctx_size=ctx_size, num_blocks=num_blocks,
        tokens_per_block=tokens_per_block, max_batch_tokens=max_batch_tokens, prefill_chunk=prefill_chunk,
        attention=attention, dtype=dtype, device=device,
        prefix_cache=prefix_cache, context_shift=context_shift, n_keep=n_keep, n_discard=n_discard, audit_kv=audit_kv,
        kv_unified=kv_unified)
    d = _dump_live(model, dtype, device, threads, weights, ctx_given, specs, opts, step, layer, head, pos, full, as_json)
    if as_json:
        typer.echo(json_text(d))
        return
    from infertrace.present.render_kv import render_kv_dump

    render_kv_dump(stdout_console(), d)


#: dump-kv's parameters that only a live run reads (the model, the requests' sampling, the engine settings)
LIVE_ONLY = ("model", "arrival", "max_new_tokens", "chat", "temperature", "top_k", "top_p", "min_p",
             "repetition_penalty", "seed", "ignore_eos", "backend", "ctx_size", "num_blocks", "tokens_per_block",
             "max_batch_tokens", "prefill_chunk", "attention", "dtype", "device", "weights", "threads", "prefix_cache",
             "context_shift", "n_keep", "n_discard", "audit_kv", "kv_unified")


def _refuse_live_options(ctx: Any) -> None:
    """``dump-kv DIR`` with a run option on the command line (``--dtype``, ``--backend``, ``--temperature`` ...):
    the saved trace was computed with its own settings, so such an option would be ignored silently.

    Raises:
        InfertraceError: naming the first such option.
    """
    given = [p.opts[0] for p in ctx.command.params if p.name in LIVE_ONLY
             and getattr(ctx.get_parameter_source(p.name), "name", None) == "COMMANDLINE"]
    if given:
        raise InfertraceError(f"{given[0]} is for a live run; the saved trace DIR was computed with its own settings "
                              "(drop it, or drop DIR to run again with it)")


def _dump_saved(trace_dir: Path, step: int, prompt: Optional[object], layer: Optional[int], head: Optional[int],
                pos: Optional[list[int]], full: bool, as_json: bool) -> None:
    """``dump-kv --step N DIR``: the step's record of a saved trace (+ its saved tensors for values), no model,
    no run (:func:`infertrace.trace.saved_kv.dump_saved`); printed as JSON or as the rendered dump.

    Raises:
        InfertraceError: ``--prompt/--prompts`` given (the saved trace holds its prompts), or what
            ``dump_saved`` refuses (a broken trace, a step not in it, no kv record).
    """
    from infertrace.present.render_kv import render_kv_dump
    from infertrace.trace.saved_kv import dump_saved

    if prompt:
        raise InfertraceError("--prompt/--prompts are for a live run; the saved trace DIR already holds its prompts")
    d = dump_saved(trace_dir, step, layer=layer, head=head, positions=pos, full=full)
    return typer.echo(json_text(d)) if as_json else render_kv_dump(stdout_console(), d)


def _dump_live(model: Optional[Path], dtype: str, device: str, threads: Optional[int], weights: str, ctx_given: bool,
               specs: list[Any], opts: Any, step: int, layer: Optional[int], head: Optional[int], pos: Optional[list[int]],
               full: bool, as_json: bool) -> dict[str, Any]:
    """The live run of ``dump-kv --step N``: load the model (progress on stderr unless ``as_json``), lower the
    default context to the model's trained one when ``--ctx-size`` was not given (a ``note:``), warn with the
    cost past it, run to step N (:func:`infertrace.runner.dump_kv_at_step`). ``specs`` / ``opts``: the
    ``PromptSpec`` list and ``EngineOptions`` of :func:`~infertrace.cli.run_options.build_run_inputs`.

    Returns:
        The dump dict (as ``dump_kv_at_step``), with the weights path that computed the K/V shown.
    """
    with progress_display(enabled=not as_json) as progress:
        loaded = load_with_progress(model, dtype, device, progress, threads, weights)
        if not ctx_given:
            opts, note = o.default_ctx_note(loaded, opts, "infertrace")
            if note:
                progress.console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
        o.print_run_cost(progress, loaded, specs, opts, dtype)  # past n_ctx_train: warn with the cost
        progress.add_task(f"running to step {step}", total=None)
        from infertrace.runner import dump_kv_at_step  # the engine side (torch): only for a live run

        d = dump_kv_at_step(loaded, specs, opts, step, layer=layer, head=head, positions=pos, full=full)
        d.update(o.weights_record(loaded))  # which weights path computed the K/V shown (absent: the float path)
    return d


def _dump_state(state: Path, step: Optional[int], trace_dir: Optional[Path], prompt: Optional[object], model: Optional[Path],
                layer: Optional[int], head: Optional[int], positions: Optional[str], full: bool, as_json: bool) -> None:
    """``dump-kv --state FILE``: the file checked against ``--model``'s header (no weights, no torch)."""
    if step is not None or trace_dir is not None or prompt:
        raise InfertraceError("--state FILE shows a saved llama.cpp slot: drop --step, the trace DIR and --prompt/--prompts")
    pos = _value_options(layer, head, positions, full)
    from infertrace.loading.registry import resolve_model
    from infertrace.loading.weights import load_checkpoint
    from infertrace.runtimes.llamacpp.state_dump import state_dump
    from infertrace.runtimes.llamacpp.state_file import read_state_file

    path = resolve_model(model)
    if path.is_dir():
        raise InfertraceError("--state needs the GGUF file llama.cpp ran (--model FILE.gguf), not an HF directory")
    cfg = load_checkpoint(path, header_only=True).config
    il = layer if layer is not None else (0 if head is not None else None)
    d = state_dump(read_state_file(state, cfg, il), cfg, head, pos, full)
    if as_json:
        typer.echo(json_text(d))
        return
    from infertrace.present.render_kv import render_state_dump

    render_state_dump(stdout_console(), d)


def _value_options(layer: Optional[int], head: Optional[int], positions: Optional[str], full: bool):
    """The K/V value options checked: ``--layer`` / ``--head`` >= 0, ``--positions`` parsed (None = all).

    Raises:
        InfertraceError: a negative layer or head, or ``--positions`` / ``--full`` without a layer or head.
    """
    for opt, val in (("--layer", layer), ("--head", head)):
        if val is not None and val < 0:
            raise InfertraceError(f"{opt} must be >= 0 (got {val})")
    pos = parse_positions(positions)
    if (pos is not None or full) and layer is None and head is None:
        raise InfertraceError("--positions / --full choose K/V values: add --layer L and/or --head H")
    return pos
