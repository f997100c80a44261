"""``infertrace run``: generate from one or more prompts and show the five variables of every step.

Thin: parse and validate options, load the model (progress on stderr), call
:func:`infertrace.runner.run_requests`, then print the trace with
:func:`infertrace.present.render.render_run` or as JSON (``RunTrace.to_dict``).
The helpers other commands share (consoles, model loading with progress, option checks) live
in :mod:`infertrace.cli.common`; module level stays torch-free so ``--help`` is instant.
"""

import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from infertrace.cli import run_options as o
from infertrace.cli.common import (ATTENTION, BACKENDS, DEVICES, ENGINES, MIN_WIDTH, PROMPT_KEYS,  # noqa: F401 - re-exported
                                   check_choice, check_min, load_with_progress, parse_keep, parse_panels, parse_steps,
                                   progress_display, read_prompts_file, stdout_console)
from infertrace.engine.options import EngineOptions, SamplingParams
from infertrace.errors import InfertraceError
from infertrace.safe_text import json_text, visible
from infertrace.trace.records import VARIABLES
from infertrace.trace.store import KEEP, parse_layers, save_trace

HELP = ("Generate from prompts and show, step by step, the five inference variables: hidden, positions (RoPE), "
        "mask, kv, decode. Prints a table like the study's worked example and a summary; --show VAR adds that "
        "variable's panel for every step, --show all prints every panel.")

def check_output_dir(save: Path, force: bool) -> None:
    """Refuse a ``--save`` target that would lose something, before the run.

    Raises:
        InfertraceError: empty path, a symlink (dangling or not), an existing file, a non-empty directory (without
            ``--force``), or a place that cannot be written.
    """
    if str(save).strip() in ("", "."):
        raise InfertraceError("--save needs a directory name (e.g. --save runs/first)")
    if save.is_symlink():  # safe_io.publish_dir never renames onto a symlink: refuse now, not after the run
        raise InfertraceError(f"--save {visible(str(save))} is a symlink; pass a new directory name (a symlink is never replaced)")
    if save.exists() and not save.is_dir():
        raise InfertraceError(f"--save {save}: a file of that name exists; choose a directory name")
    if save.is_dir() and any(save.iterdir()) and not force:
        raise InfertraceError(f"--save {save}: the directory is not empty; choose a new one or pass --force to replace its trace")
    parent = save if save.exists() else next((p for p in save.parents if p.exists()), Path("."))
    if not os.access(parent, os.W_OK | os.X_OK) or not parent.is_dir():
        raise InfertraceError(f"--save {save}: cannot write in {parent}")


def save_options(save: Optional[Path], keep: Optional[str], layers: Optional[str]) -> tuple[bool, tuple[str, ...]]:
    """Validate ``--save/--keep/--layers`` before the model loads.

    Returns:
        ``(tensors kept, variables recorded)``: ``--save`` alone keeps tensors and all five variables;
        ``--keep summary`` keeps trace.json only, ``--keep mask,kv`` records only those variables
        (``options.show`` of the trace lists the variables recorded).

    Raises:
        InfertraceError: --keep or --layers without --save, an unknown --keep item, --layers with
            --keep summary, malformed --layers.
    """
    if save is None:
        if keep is not None or layers is not None:
            raise InfertraceError(f"{'--keep' if keep is not None else '--layers'} needs --save DIR")
        return False, VARIABLES
    storage, kept = parse_keep(keep)
    k = storage or "tensors"
    assert k in KEEP
    if layers is not None:
        if k == "summary":
            raise InfertraceError("--layers chooses the layers whose tensors are kept; it needs --keep tensors, not summary")
        parse_layers(layers)  # syntax now; the range once the model is loaded
    return k == "tensors", kept


def note_unkept(panels: tuple[str, ...], kept: tuple[str, ...], keep: Optional[str]) -> None:
    """One stderr line when ``--show`` asks for panels of variables ``--keep`` did not record."""
    missing = [v for v in panels if v not in kept]
    if missing and panels != VARIABLES:
        typer.echo(f"note: --show {','.join(missing)}: not recorded (--keep {keep}); no panel for it", err=True)


def check_teacher_force(directory: Path, specs: list[Any], model: Optional[Path]) -> None:
    """``--teacher-force DIR`` feeds DIR's generated tokens to this run's requests by seq_id: refuse a
    trace of other prompts (count or text), warn on stderr when ``--model`` names another file than
    the trace's ``model.file`` (a renamed copy is legitimate; another model makes the comparison meaningless).

    Raises:
        InfertraceError: unreadable trace, or its prompts differ from this run's.
    """
    from infertrace.trace.store import read_manifest

    m = read_manifest(directory)
    theirs = [r.get("prompt") for r in sorted(m["requests"], key=lambda r: r.get("seq_id", 0))]
    ours = [s.text for s in specs]
    shown = visible(str(directory))
    if len(theirs) != len(ours):
        raise InfertraceError(f"--teacher-force {shown} holds {len(theirs)} request(s), this run has {len(ours)}: teacher "
                              "forcing feeds that trace's tokens request by request; give the same prompts")
    for i, (a, b) in enumerate(zip(theirs, ours)):
        if a != b:
            raise InfertraceError(f"--teacher-force {shown}: request {i} had the prompt {visible(str(a))[:60]!r}, this run "
                                  f"has {visible(str(b))[:60]!r}; give the same prompts (the forced tokens belong to them)")
    file = (m.get("model") or {}).get("file")
    if model is not None and isinstance(file, str) and Path(model).name != file:
        typer.echo(f"warning: --teacher-force {shown} was made with the model file {visible(file)!r}, this run uses "
                   f"{visible(Path(model).name)!r}: the forced tokens are that model's choices", err=True)


def forced_tokens(directory: Path) -> dict[int, list[int]]:
    """``{seq_id: output_ids}`` of a saved trace, for ``--teacher-force`` (validated: ints only).

    Raises:
        InfertraceError: unreadable trace or malformed requests.
    """
    from infertrace.trace.store import read_manifest

    m = read_manifest(directory)
    out: dict[int, list[int]] = {}
    for r in m["requests"]:
        ids, sid = r.get("output_ids"), r.get("seq_id")
        if not isinstance(sid, int) or not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise InfertraceError(f"--teacher-force {directory}: request {sid!r} has no list of token ids")
        out[sid] = ids
    return out


# ----------------------------------------------------------------------------- the command


def run(
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="Prompt text; repeat for several requests (seq 0, 1, ...).")] = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="JSONL file, one {\"prompt\": ..., \"arrival\": ..., sampling keys} per line.")] = None,
    model: Annotated[Optional[Path], typer.Option("--model", "-m", help="GGUF file, HF model directory, or a model name: smollm2-135m (default), gemma3-270m.")] = None,
    arrival: Annotated[Optional[list[int]], typer.Option("--arrival", help="Step at which each --prompt arrives; one per --prompt.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate per request.")] = SamplingParams.max_new_tokens,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each prompt in the model's chat template.")] = False,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = SamplingParams.temperature,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = off.")] = SamplingParams.top_k,
    top_p: Annotated[float, typer.Option("--top-p", help="1 = off.")] = SamplingParams.top_p,
    min_p: Annotated[float, typer.Option("--min-p", help="0 = off.")] = SamplingParams.min_p,
    repetition_penalty: Annotated[float, typer.Option("--repetition-penalty", help="1 = off.")] = SamplingParams.repetition_penalty,
    penalty_last_n: o.PenaltyLastN = None,
    frequency_penalty: o.FrequencyPenalty = SamplingParams.frequency_penalty,
    presence_penalty: o.PresencePenalty = SamplingParams.presence_penalty,
    seed: Annotated[int, typer.Option("--seed", help="Seed of each request's sampler.")] = SamplingParams.seed,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Keep generating after an end-of-generation token.")] = False,
    show: Annotated[Optional[list[str]], typer.Option("--show", help="Panels printed per step after the table, comma-separated: hidden,positions,mask,kv,decode, or all (the full output). Default: none, only the worked-example table and the summary (with --steps: all five). Display only: --save records every variable unless --keep says otherwise.")] = None,
    layer: Annotated[int, typer.Option("--layer", help="Layer whose RoPE evidence and K/V values are shown.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole trace as JSON on stdout (nothing else).")] = False,
    backend: Annotated[str, typer.Option("--backend", help="KV cache / attention convention: cells (llama.cpp) or paged (TensorRT-LLM/vLLM).")] = "cells",
    ctx_size: o.CtxSize = None,
    num_blocks: Annotated[Optional[int], typer.Option("--num-blocks", help="paged: blocks in the pool (default ctx-size / tokens-per-block).")] = None,
    tokens_per_block: Annotated[int, typer.Option("--tokens-per-block", help="paged: slots per block.")] = EngineOptions.tokens_per_block,
    max_batch_tokens: Annotated[int, typer.Option("--max-batch-tokens", help="Scheduler token budget per step.")] = EngineOptions.max_batch_tokens,
    prefill_chunk: Annotated[Optional[int], typer.Option("--prefill-chunk", help="Max prompt tokens per request per step (chunked prefill).")] = None,
    attention: Annotated[str, typer.Option("--attention", help="Attention implementation: torch, triton (paged only) or auto.")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", help="Compute dtype: float32, bfloat16 or float16.")] = "float32",
    kv_dtype: o.KvDtype = None,
    kv_unified: o.KvUnified = "on",
    weights: o.Weights = "auto",
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    steps: Annotated[Optional[str], typer.Option("--steps", help="Steps whose panels are printed: 0,1,2 or 0..3 or 5.. (the table and --json keep all).")] = None,
    save: Annotated[Optional[Path], typer.Option("--save", help="Also write the trace to this directory (trace.json, tensors.safetensors, timing.json) for show, diff, report, dump-kv.")] = None,
    keep: Annotated[Optional[str], typer.Option("--keep", help="With --save, comma-separated: summary (trace.json only) or tensors (also Q/K/V, K/V cache, hidden, top-k logits of --layers; default), and/or the variables recorded (hidden,positions,mask,kv,decode; default all five), e.g. --keep summary,mask,kv.")] = None,
    layers: Annotated[Optional[str], typer.Option("--layers", help="With --save --keep tensors: layers whose tensors are kept, e.g. 0,5 or 0..3 or all (default: --layer).")] = None,
    force: Annotated[bool, typer.Option("--force", help="With --save: replace the trace in a non-empty directory.")] = False,
    threads: Annotated[Optional[int], typer.Option("--threads", help="CPU threads for torch (default: the cores available now: affinity, cgroup quota, minus cores busy elsewhere).", show_default=False)] = None,
    engine: Annotated[str, typer.Option("--engine", help="Who computes: infertrace (this engine), llama.cpp (llama.cpp itself via llama-cpp-python, GGUF only; its inp_pos, kq_mask, cells, K/V and logits are recorded) or vllm (vLLM itself, in-process, step by step; its scheduler output, block tables, slot mapping, K/V and logits are recorded).")] = "infertrace",
    teacher_force: Annotated[Optional[Path], typer.Option("--teacher-force", help="With --engine llama.cpp: feed the tokens a saved trace (run --save DIR) generated instead of sampling, so the two traces compare step for step.")] = None,
    llamacpp_flash_attn: o.LlamacppFlashAttn = None,
    sampler_order: Annotated[Optional[str], typer.Option("--sampler-order", help="hf (temperature first, as HF/vLLM) or llama.cpp (top-k/top-p/min-p on unscaled logits, temperature last). Default: cells and --engine llama.cpp: llama.cpp; paged: hf.")] = None,
    prefix_cache: Annotated[str, typer.Option("--prefix-cache", help="on: reuse cached K/V of a shared prompt prefix (paged: hashed full blocks; cells: seq_cp of a live or finished sequence).")] = "off",
    context_shift: Annotated[bool, typer.Option("--context-shift", help="When a request fills --ctx-size, drop cached tokens after --n-keep and continue (llama.cpp server), instead of stopping with ctx_full.")] = False,
    n_keep: Annotated[int, typer.Option("--n-keep", help="Context shift: cached tokens kept at the start.")] = 0,
    n_discard: Annotated[int, typer.Option("--n-discard", help="Context shift: tokens dropped after --n-keep (0 = half of the rest).")] = 0,
    audit_kv: Annotated[bool, typer.Option("--audit-kv", help="Record each cached K/V entry's provenance and recompute the cache from scratch every step (max |Δ| per provenance).")] = False,
    speculative: o.Speculative = None,
    num_spec_tokens: o.NumSpecTokens = EngineOptions.num_spec_tokens,
    spec_tree: o.SpecTree = None,
    draft_model: o.DraftModel = None,
    draft_layers: o.DraftLayers = None,
    ngram_min: o.NgramMin = EngineOptions.ngram_min,
    ngram_max: o.NgramMax = EngineOptions.ngram_max,
    tensor_parallel_size: o.TensorParallelSize = 1,
    replay: Annotated[Optional[Path], typer.Option("--replay", help="With --backend paged: replay a saved run --engine vllm trace's schedule, block ids, drafts and sampled tokens into this engine, which derives everything else, so `diff` compares the two step for step.")] = None,
) -> None:
    """Options are validated before the model loads; every user error is one ``error:`` line
    (raised as InfertraceError, printed by :func:`infertrace.cli.app.cli_errors`)."""
    # -- validate everything that does not need the model, before loading it
    from infertrace.threads import check_thread_settings

    check_thread_settings(threads)  # --threads, OMP_NUM_THREADS, INFERTRACE_THREADS: bounded before any pool starts
    panels = parse_panels(show, steps)  # display only
    step_filter = parse_steps(steps)
    keep_tensors, show_vars = save_options(save, keep, layers)  # show_vars: the variables recorded
    note_unkept(panels, show_vars, keep)
    if save is not None:
        check_output_dir(save, force)
    check_min("--layer", layer, 0)
    ctx_given = ctx_size is not None
    ctx_size = EngineOptions.ctx_size if ctx_size is None else ctx_size
    engine, backend, llamacpp_flash_attn = check_engine_options(engine, backend, device, dtype, prefix_cache, context_shift,
                                                                audit_kv, teacher_force, llamacpp_flash_attn,
                                                                tensor_parallel_size, replay)
    forced = forced_tokens(teacher_force) if teacher_force is not None else None
    from infertrace.cli.run_options import build_run_inputs  # shares run's checks with dump-kv, diff-backends

    specs, opts = build_run_inputs(
        prompt=prompt, prompts=prompts, arrival=arrival, max_new_tokens=max_new_tokens, chat=chat,
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
        seed=seed, ignore_eos=ignore_eos, backend=backend, ctx_size=ctx_size, num_blocks=num_blocks,
        tokens_per_block=tokens_per_block, max_batch_tokens=max_batch_tokens, prefill_chunk=prefill_chunk,
        attention=attention, dtype=dtype, device=device, sampler_order=sampler_order,
        prefix_cache=prefix_cache, context_shift=context_shift, n_keep=n_keep, n_discard=n_discard, audit_kv=audit_kv,
        penalty_last_n=penalty_last_n, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        kv_dtype=kv_dtype, kv_unified=kv_unified)
    if teacher_force is not None:
        check_teacher_force(teacher_force, specs, model)
    if replay is not None and opts.kv_dtype is not None:
        raise InfertraceError("--replay rebuilds vLLM's pool in the model dtype; drop --kv-dtype")
    check_runtime_cache_and_weights(engine, opts.kv_dtype, weights)
    opts = o.apply_spec_options(opts, speculative, num_spec_tokens, spec_tree, draft_model, draft_layers, ngram_min, ngram_max)
    if engine == "llama.cpp" and opts.speculative:
        raise InfertraceError("--engine llama.cpp runs llama_decode one token per step here; drop --speculative")
    if engine == "vllm" and opts.speculative not in (None, "ngram"):
        raise InfertraceError(f"--engine vllm runs --speculative ngram here; drop --speculative {opts.speculative}")
    factory = None
    if replay is not None:  # the vLLM trace is read and checked before the model loads
        from infertrace.runtimes.vllm.replay import replay_factory

        factory = replay_factory(replay)

    trace, tensors, tensor_layers = execute_run(engine, model, dtype, device, threads, specs, opts, layer, layers,
                                                keep_tensors, show_vars, forced, llamacpp_flash_attn, quiet=as_json,
                                                tensor_parallel_size=tensor_parallel_size, factory=factory,
                                                weights=weights, ctx_given=ctx_given)
    if replay is not None:
        trace.notes.append(f"replayed the schedule, block ids, drafts and sampled tokens of the vLLM trace {visible(str(replay))}; "
                           "positions, slot mapping, lengths, K/V and logits computed by this engine")
    if save is not None:
        save_run(trace, save, tensors, tensor_layers, force)
    print_run(trace, tuple(v for v in panels if v in show_vars), step_filter, steps, as_json)


# ----------------------------------------------------------------------------- the command's parts


def check_runtime_cache_and_weights(engine: str, kv_dtype: Optional[str], weights: str) -> None:
    """Refuse ``--kv-dtype`` and an explicit ``--weights`` with a recorded runtime, which keeps its own
    cache type and computes on its own copy of the weights (one line each, naming the runtime's setting).

    Raises:
        InfertraceError: ``--kv-dtype`` or ``--weights quant|float`` with ``--engine llama.cpp`` (llama.cpp's
            ``type_k/type_v``; its kernels on the GGUF's own tensor types), ``--kv-dtype`` or ``--weights quant``
            with ``--engine vllm`` (vLLM's ``kv_cache_dtype``; its dequantised float copy).
    """
    if engine == "llama.cpp":
        if kv_dtype is not None:
            raise InfertraceError("--kv-dtype sets this engine's cache; --engine llama.cpp keeps its own (llama.cpp's "
                                  "type_k/type_v are in the trace header, options.llama_cpp): drop --kv-dtype")
        if weights.strip().lower() != "auto":
            raise InfertraceError(f"--weights {weights} chooses this engine's linear kernels; --engine llama.cpp computes on "
                                  "the GGUF's own tensor types with its own kernels: drop --weights")
    elif engine == "vllm":
        if kv_dtype is not None:
            raise InfertraceError("--kv-dtype sets this engine's cache; --engine vllm keeps vLLM's kv_cache_dtype 'auto' (the "
                                  "model dtype; recorded as options.vllm.cache_dtype in the trace header): drop --kv-dtype")
        if weights.strip().lower() == "quant":
            raise InfertraceError("--weights quant chooses this engine's quantised kernels; --engine vllm computes on its own "
                                  "dequantised float copy of the GGUF (options.vllm.dtype in the trace header): drop --weights")


def check_engine_options(engine: str, backend: str, device: str, dtype: str, prefix_cache: str, context_shift: bool,
                         audit_kv: bool, teacher_force: Optional[Path], llamacpp_flash_attn: Optional[str],
                         tensor_parallel_size: int = 1, replay: Optional[Path] = None) -> tuple[str, str, Optional[str]]:
    """Validate ``--engine`` and the options that only go with one engine, before the model loads.

    Returns:
        ``(engine, backend, llamacpp_flash_attn)`` normalised (``--engine vllm`` runs the paged convention).

    Raises:
        InfertraceError: unknown engine, llama-cpp-python missing, an option the chosen engine
            cannot honour (``--backend paged``, ``--device``/``--dtype``, serving mechanisms with
            llama.cpp; ``--teacher-force``/``--llamacpp-flash-attn`` without it).
    """
    engine = check_choice("--engine", engine, ENGINES)
    if engine == "llama.cpp":
        from infertrace.runtimes.llamacpp.capture import import_llama_cpp

        import_llama_cpp()  # fail before loading anything
        if backend.strip().lower() != "cells":
            raise InfertraceError("--engine llama.cpp records llama.cpp's own cells cache; drop --backend paged")
        if device != "cpu" or dtype.lower() not in ("float32", "fp32"):
            raise InfertraceError("--engine llama.cpp computes on llama.cpp's CPU backend; drop --device/--dtype")
        if prefix_cache.strip().lower() != "off" or context_shift or audit_kv:
            raise InfertraceError("--engine llama.cpp records llama.cpp's own cache as it is; drop --prefix-cache, "
                                  "--context-shift and --audit-kv (they are this engine's serving mechanisms)")
    elif engine == "vllm":
        from infertrace.runtimes.vllm.cli import check_vllm_options

        backend = check_vllm_options(backend, device, dtype, context_shift, audit_kv, teacher_force, tensor_parallel_size)
    elif teacher_force is not None:
        raise InfertraceError("--teacher-force needs --engine llama.cpp")
    elif llamacpp_flash_attn is not None:
        raise InfertraceError("--llamacpp-flash-attn sets llama.cpp's flash attention: it needs --engine llama.cpp")
    if engine == "vllm" and llamacpp_flash_attn is not None:
        raise InfertraceError("--llamacpp-flash-attn sets llama.cpp's flash attention: it needs --engine llama.cpp")
    if replay is not None and engine != "infertrace":
        raise InfertraceError("--replay runs this engine's paged backend on a vLLM trace's schedule; drop --engine")
    if engine != "vllm" and tensor_parallel_size != 1:
        raise InfertraceError("--tensor-parallel-size needs --engine vllm (vLLM's own distributed executor)")
    if llamacpp_flash_attn is not None:
        from infertrace.runtimes.llamacpp.capture import check_flash_attn

        llamacpp_flash_attn = check_flash_attn(llamacpp_flash_attn)
    return engine, backend, llamacpp_flash_attn


def execute_run(engine: str, model: Optional[Path], dtype: str, device: str, threads: Optional[int], specs: list[Any],
                opts: EngineOptions, layer: int, layers: Optional[str], keep_tensors: bool, show_vars: tuple[str, ...],
                forced: Optional[dict[int, list[int]]], llamacpp_flash_attn: Optional[str],
                quiet: bool, tensor_parallel_size: int = 1, factory: Any = None,
                weights: str = "float", ctx_given: bool = True) -> tuple[Any, Optional[dict], Optional[list[int]]]:
    """Load the model and run the requests on ``engine``, progress on stderr (none when ``quiet``).

    Returns:
        ``(trace, tensors, tensor_layers)``: the :class:`~infertrace.trace.records.RunTrace`, the kept
        tensors by name (None unless ``keep_tensors``) and the layers they belong to.

    Raises:
        InfertraceError: load failures, ``--layers`` out of range, any run error.
    """
    from infertrace.cli.run_options import print_run_cost
    from infertrace.runner import run_requests  # the engine (torch) loads only when a run starts

    with progress_display(enabled=not quiet) as progress:
        ours = engine == "infertrace"  # llama.cpp and vLLM compute from their own copy: header, config, tokenizer only
        loaded = load_with_progress(model, dtype, device, progress, threads, weights if ours else "float", tensors=ours)
        ctx_note = None
        if not ctx_given:  # the default --ctx-size, no larger than the model's trained context
            opts, ctx_note = o.default_ctx_note(loaded, opts, engine)
        # options.weights: the quant kernels, or {"weights": "float"} when --weights float was given explicitly (a
        # default/auto float run records nothing, so traces of the reference path are unchanged)
        explicit_float = ours and weights == "float" and loaded.weights.get("weights") == "float"
        record = {"dtype": dtype, "device": device,
                  **({"weights": loaded.weights} if ours and (loaded.weights.get("weights") != "float" or explicit_float) else {})}
        print_run_cost(progress, loaded, specs, opts, dtype)  # past n_ctx_train: warn with the cost
        task = progress.add_task("running steps", total=None)

        def on_step(st: Any) -> None:
            progress.update(task, description=f"step {st.step}: N={st.N} tokens")

        tensor_layers = (parse_layers(layers, loaded.config.n_layer) or [layer]) if keep_tensors else None
        tensors: Optional[dict] = {} if keep_tensors else None
        if engine == "llama.cpp":
            from infertrace.runtimes.llamacpp.engine import run_requests_llamacpp

            if tensor_layers is not None and tensor_layers != [layer]:
                raise InfertraceError(f"--engine llama.cpp captures one layer's tensors: use --layer {tensor_layers[0]} instead of --layers")
            trace = run_requests_llamacpp(loaded, specs, opts, layer=layer, show=show_vars, on_step=on_step,
                                          options_for_record=record, tensors=tensors,
                                          forced=forced, flash_attn=llamacpp_flash_attn or "auto")
        elif engine == "vllm":
            from infertrace.runtimes.vllm.engine import run_requests_vllm

            if tensor_layers is not None and tensor_layers != [layer]:
                raise InfertraceError(f"--engine vllm captures one layer's tensors: use --layer {tensor_layers[0]} instead of --layers")
            from infertrace.runtimes.vllm.logfile import vllm_log

            with vllm_log(progress.console):  # vLLM's logger, warnings and bars: to a file named in one line
                trace = run_requests_vllm(loaded, specs, opts, layer=layer, show=show_vars, on_step=on_step,
                                          options_for_record={"dtype": dtype, "device": device}, tensors=tensors,
                                          dtype=dtype, tp=tensor_parallel_size)
        else:
            trace = run_requests(loaded, specs, opts, layer=layer, show=show_vars, on_step=on_step,
                                 options_for_record=record, tensors=tensors,
                                 tensor_layers=tensor_layers, engine_factory=factory)
    if ctx_note:
        trace.notes.append(ctx_note)
    return trace, tensors, tensor_layers


def save_run(trace: Any, save: Path, tensors: Optional[dict], tensor_layers: Optional[list[int]], force: bool) -> None:
    """Write ``trace`` (and the kept tensors) to ``save`` atomically and say so on stderr.

    Raises:
        InfertraceError: the directory cannot be written (a racing ``--save`` loses with exit 2).
    """
    from infertrace.capture.tensors import encode_tensors
    from infertrace.fmt import human_bytes

    sizes = save_trace(trace, save, encode_tensors(tensors or {}, tensor_layers or ()), replace=force)  # atomic; a racing --save loses with exit 2
    typer.echo(f"saved trace to {visible(str(save))}: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in sizes.items()), err=True)


def print_run(trace: Any, show_vars: tuple[str, ...], step_filter: Any, steps: Optional[str], as_json: bool) -> None:
    """Print ``trace``: JSON on stdout, or the table and the panels of the steps ``step_filter`` keeps
    (plus the hybrid appendix tables for a Gated DeltaNet model).

    Raises:
        InfertraceError: ``--steps`` selects no step of the run.
    """
    wanted = None if step_filter is None else [s.step for s in trace.steps if step_filter(s.step)]
    if wanted == [] and not as_json:
        last = trace.steps[-1].step if trace.steps else -1
        raise InfertraceError(f"--steps {steps} selects no step: the run has steps 0..{last}")
    if as_json:
        typer.echo(json_text(trace.to_dict()))
        return
    from infertrace.present.render import render_run

    render_run(stdout_console(), trace, show=show_vars, steps=wanted)
    if any(st.hybrid for st in trace.steps):  # Qwen3.5-style hybrid: the study's appendix B tables, measured
        from infertrace.present.render_hybrid import render_appendix

        render_appendix(stdout_console(), trace)
