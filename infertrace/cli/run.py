"""``infertrace run``: generate from one or more prompts and show the five variables of every step.

Thin: parse and validate options, load the model (progress on stderr), call
:func:`infertrace.runner.run_requests`, then print the trace with
:func:`infertrace.present.render.render_run` or as JSON (``RunTrace.to_dict``).
The helpers other commands share (consoles, model loading with progress, option checks) live
in :mod:`infertrace.cli.common`; module level stays torch-free so ``--help`` is instant.
"""

import os
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any, Iterator, Optional

import typer

from infertrace.cli import run_options as o
from infertrace.cli.common import (ATTENTION, BACKENDS, DEVICES, RUNTIMES, MIN_WIDTH, PROMPT_KEYS,  # noqa: F401 - re-exported
                                   check_choice, check_min, load_with_progress, parse_keep, parse_panels, parse_steps,
                                   progress_display, read_prompts_file, stdout_console)
from infertrace.engine.options import EngineOptions, SamplingParams
from infertrace.errors import InfertraceError
from infertrace.runtimes.api import RunSettings
from infertrace.safe_text import json_text, visible
from infertrace.trace.records import VARIABLES
from infertrace.trace.store import KEEP, parse_layers, save_trace

def _runtime_help() -> str:
    """``--runtime``'s help, from the runtime registry."""
    from infertrace.runtimes.api import REGISTRY

    return "Who computes (the runtime): " + "; ".join(f"{n} ({e.summary})" for n, e in REGISTRY.items()) + "."


RUNTIME_HELP = _runtime_help()

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


def teacher_force_record(directory: Path) -> dict[str, Any]:
    """``options.teacher_force`` of a teacher-forced run: the followed trace's directory (as given, at most 400
    characters) and the SHA-256 of its ``trace.json`` (what ``bisect`` compares to name the pair)."""
    import hashlib

    from infertrace.safe_io import MAX_MANIFEST_BYTES, read_regular

    d = Path(directory)
    data = read_regular(d / "trace.json" if d.is_dir() else d, MAX_MANIFEST_BYTES, "trace.json")
    return {"trace": visible(str(directory))[:400], "trace_sha256": hashlib.sha256(data).hexdigest()}


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
    backend: Annotated[Optional[str], typer.Option("--backend", help="KV cache / attention convention: cells (llama.cpp) or paged (TensorRT-LLM/vLLM); dense (HF's padded batch) with --runtime hf only. Default: the runtime's own (cells for infertrace).", show_default=False)] = None,
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
    runtime: Annotated[Optional[str], typer.Option("--runtime", help=RUNTIME_HELP, show_default="infertrace")] = None,
    engine: Annotated[Optional[str], typer.Option("--engine", hidden=True, help="Old name of --runtime.")] = None,
    teacher_force: Annotated[Optional[Path], typer.Option("--teacher-force", help="Emit the tokens a saved trace (run --save DIR) generated instead of sampling (infertrace, llama.cpp, hf), so the two traces compare position by position (bisect).")] = None,
    llamacpp_flash_attn: o.LlamacppFlashAttn = None,
    padding: o.Padding = None,
    sampler_order: Annotated[Optional[str], typer.Option("--sampler-order", help="hf (temperature first, as HF/vLLM) or llama.cpp (top-k/top-p/min-p on unscaled logits, temperature last). Default: cells and --runtime llama.cpp: llama.cpp; paged: hf.")] = None,
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
    replay: Annotated[Optional[Path], typer.Option("--replay", help="With --backend paged: replay a saved run --runtime vllm trace's schedule, block ids, drafts and sampled tokens into this engine, which derives everything else, so `diff` compares the two step for step.")] = None,
) -> None:
    """Options are validated before the model loads; every user error is one ``error:`` line
    (raised as InfertraceError, printed by :func:`infertrace.cli.app.cli_errors`)."""
    run_command(SimpleNamespace(**locals()))


def run_command(a: SimpleNamespace) -> None:
    """The ``run`` command on its parsed options ``a`` (attribute per option): validate everything that does not
    need the model, build the requests and the runtime's settings, run, save, print.

    Raises:
        InfertraceError: any bad option (one line; a runtime's refusal names its flag), any run error.
    """
    from infertrace.threads import check_thread_settings

    check_thread_settings(a.threads)  # --threads, OMP_NUM_THREADS, INFERTRACE_THREADS: bounded before any pool starts
    panels = parse_panels(a.show, a.steps)  # display only
    step_filter = parse_steps(a.steps)
    keep_tensors, show_vars = save_options(a.save, a.keep, a.layers)  # show_vars: the variables recorded
    note_unkept(panels, show_vars, a.keep)
    if a.save is not None:
        check_output_dir(a.save, a.force)
    check_min("--layer", a.layer, 0)
    runtime, specs, settings = run_settings(a, show_vars)
    trace, tensors, tensor_layers = execute_run(runtime, a.model, a.threads, specs, settings, a.layers, keep_tensors,
                                                quiet=a.as_json, ctx_given=a.ctx_size is not None)
    if a.teacher_force is not None:  # which trace's tokens this run emitted (bisect names it)
        trace.options["teacher_force"] = teacher_force_record(a.teacher_force)
        trace.notes.append(f"teacher-forced: every request emitted the tokens of the trace {visible(str(a.teacher_force))} "
                           "(its own top choice kept in each decode record's top list)")
    if a.replay is not None:
        trace.notes.append(f"replayed the schedule, block ids, drafts and sampled tokens of the vLLM trace {visible(str(a.replay))}; "
                           "positions, slot mapping, lengths, K/V and logits computed by this engine")
    if a.save is not None:
        save_run(trace, a.save, tensors, tensor_layers, a.force)
    print_run(trace, tuple(v for v in panels if v in show_vars), step_filter, a.steps, a.as_json)


def run_settings(a: SimpleNamespace, show_vars: tuple[str, ...]) -> tuple[str, list[Any], RunSettings]:
    """The runtime's name, the requests and the :class:`~infertrace.runtimes.api.RunSettings` of ``run``'s options,
    checked by the runtime before the model loads.

    Raises:
        InfertraceError: a bad option, a refused setting (naming its flag), an unreadable ``--teacher-force`` trace.
    """
    from infertrace.cli.run_options import build_run_inputs  # shares run's checks with dump-kv, diff-backends
    from infertrace.runtimes.api import info, names

    runtime = check_choice("--runtime", runtime_flag(a.runtime, a.engine), names())
    backend = info(runtime).convention if a.backend is None else a.backend
    forced = forced_tokens(a.teacher_force) if a.teacher_force is not None else None
    specs, opts = build_run_inputs(
        prompt=a.prompt, prompts=a.prompts, arrival=a.arrival, max_new_tokens=a.max_new_tokens, chat=a.chat,
        temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, repetition_penalty=a.repetition_penalty,
        seed=a.seed, ignore_eos=a.ignore_eos, backend=backend,
        ctx_size=EngineOptions.ctx_size if a.ctx_size is None else a.ctx_size, num_blocks=a.num_blocks,
        tokens_per_block=a.tokens_per_block, max_batch_tokens=a.max_batch_tokens, prefill_chunk=a.prefill_chunk,
        attention=a.attention, dtype=a.dtype, device=a.device, sampler_order=a.sampler_order,
        prefix_cache=a.prefix_cache, context_shift=a.context_shift, n_keep=a.n_keep, n_discard=a.n_discard,
        audit_kv=a.audit_kv, penalty_last_n=a.penalty_last_n, frequency_penalty=a.frequency_penalty,
        presence_penalty=a.presence_penalty, kv_dtype=a.kv_dtype, kv_unified=a.kv_unified)
    if a.teacher_force is not None:
        check_teacher_force(a.teacher_force, specs, a.model)
    opts = o.apply_spec_options(opts, a.speculative, a.num_spec_tokens, a.spec_tree, a.draft_model, a.draft_layers,
                                a.ngram_min, a.ngram_max)
    native = {k: v for k, v in (("flash_attn", a.llamacpp_flash_attn), ("replay", a.replay), ("padding", a.padding)) if v is not None}
    settings = checked_run_settings(runtime, RunSettings(
        opts=opts, layer=a.layer, show=show_vars, dtype=a.dtype, device=a.device,
        tensor_parallel_size=a.tensor_parallel_size, forced=forced, native=native, weights=a.weights),
        values={"weights": a.weights, "opts.backend": backend, "opts.kv_dtype": a.kv_dtype, "opts.speculative": a.speculative})
    return runtime, specs, settings


def runtime_flag(runtime: Optional[str], engine: Optional[str]) -> str:
    """The runtime named by ``--runtime``, or by its old name ``--engine`` (hidden, still honoured); neither
    given: the registry's first runtime (infertrace's own engine).

    Raises:
        InfertraceError: both given, naming different runtimes.
    """
    from infertrace.runtimes.api import names

    if runtime is not None and engine is not None and runtime.strip().lower() != engine.strip().lower():
        raise InfertraceError(f"--engine is the old name of --runtime; pass one of them (got --runtime {visible(runtime)} "
                              f"and --engine {visible(engine)})")
    return runtime if runtime is not None else engine if engine is not None else names()[0]


# ----------------------------------------------------------------------------- the command's parts


#: the flag of each setting a runtime may refuse (:class:`~infertrace.runtimes.api.SettingRefused` ``setting``)
FLAGS = {"opts.backend": "--backend", "device": "--device/--dtype", "dtype": "--dtype", "weights": "--weights",
         "serving": "--prefix-cache, --context-shift and --audit-kv", "opts.kv_dtype": "--kv-dtype",
         "opts.speculative": "--speculative", "forced": "--teacher-force", "native.flash_attn": "--llamacpp-flash-attn",
         "native.replay": "--replay", "native.padding": "--padding", "tensor_parallel_size": "--tensor-parallel-size", "tensor_layers": "--layers"}


@contextmanager
def refusals_as_flags(values: Optional[dict[str, Any]] = None) -> Iterator[None]:
    """Re-raise a runtime's :class:`~infertrace.runtimes.api.SettingRefused` naming the flag: a setting only some
    runtimes take says which (``--teacher-force needs --runtime llama.cpp (...)``), any other what to drop
    (``--runtime vllm: vLLM keeps its kv_cache_dtype ...; drop --kv-dtype f16``; ``values``: what the user gave,
    by setting).

    Raises:
        InfertraceError: the refusal in one line.
    """
    from infertrace.runtimes.api import SettingRefused, takers

    try:
        yield
    except SettingRefused as e:
        flag = FLAGS.get(e.setting, e.setting)
        who = takers(e.setting)
        if who:
            raise InfertraceError(f"{flag} needs --runtime {' or '.join(who)} ({e})") from None
        given = (values or {}).get(e.setting)
        raise InfertraceError(f"--runtime {e.runtime}: {e}; drop {flag}{f' {given}' if given is not None else ''}") from None


def checked_run_settings(runtime: str, settings: Any, values: Optional[dict[str, Any]] = None) -> Any:
    """``settings`` checked by the runtime ``runtime`` before the model loads (its own refusals, as flags).

    Raises:
        InfertraceError: the runtime's package missing, or a setting it refuses.
    """
    from infertrace.runtimes.api import runtime_class

    with refusals_as_flags(values):
        return runtime_class(runtime).check(settings)


def execute_run(runtime: str, model: Optional[Path], threads: Optional[int], specs: list[Any], settings: Any,
                layers: Optional[str], keep_tensors: bool, quiet: bool,
                ctx_given: bool = True) -> tuple[Any, Optional[dict], Optional[list[int]]]:
    """Load the model and run the requests on the runtime ``runtime`` (:func:`~infertrace.runtimes.loop.record_run`),
    progress on stderr (none when ``quiet``).

    Returns:
        ``(trace, tensors, tensor_layers)``: the :class:`~infertrace.trace.records.RunTrace`, the kept
        tensors by name (None unless ``keep_tensors``) and the layers they belong to.

    Raises:
        InfertraceError: load failures, ``--layers`` out of range, a refused setting, any run error.
    """
    from dataclasses import replace

    from infertrace.cli.run_options import print_run_cost
    from infertrace.runtimes.api import info, runtime_class
    from infertrace.runtimes.loop import record_run  # the engine (torch) loads only when a run starts

    cls, ours = runtime_class(runtime), not info(runtime).own_weights  # own weights: header, config, tokenizer only
    with progress_display(enabled=not quiet) as progress:
        loaded = load_with_progress(model, settings.dtype, settings.device, progress, threads,
                                    settings.weights if ours else "float", tensors=ours)
        opts, ctx_note = settings.opts, None
        if not ctx_given:  # the default --ctx-size, no larger than the model's trained context
            opts, ctx_note = o.default_ctx_note(loaded, opts, runtime)
        print_run_cost(progress, loaded, specs, opts, settings.dtype)  # past n_ctx_train: warn with the cost
        task = progress.add_task("running steps", total=None)

        def on_step(st: Any) -> None:
            progress.update(task, description=f"step {st.step}: N={st.N} tokens")

        tensor_layers = (parse_layers(layers, loaded.config.n_layer) or [settings.layer]) if keep_tensors else None
        tensors: Optional[dict] = {} if keep_tensors else None
        settings = replace(settings, opts=opts, record=run_record(settings, loaded, ours),
                           tensor_layers=tuple(tensor_layers) if tensor_layers is not None else None)
        with refusals_as_flags({"tensor_layers": layers}), cls.run_output(progress.console):
            trace = record_run(cls, loaded, specs, settings, on_step, tensors)
    if ctx_note:
        trace.notes.append(ctx_note)
    return trace, tensors, tensor_layers


def run_record(settings: Any, loaded: Any, ours: bool) -> dict[str, Any]:
    """``trace.options``' record of what was asked: dtype, device, and (infertrace's engine) the weights —
    the quant kernels, or ``{"weights": "float"}`` when ``--weights float`` was given explicitly (a default/auto
    float run records nothing, so traces of the reference path are unchanged)."""
    explicit_float = ours and settings.weights == "float" and loaded.weights.get("weights") == "float"
    return {"dtype": settings.dtype, "device": settings.device,
            **({"weights": loaded.weights} if ours and (loaded.weights.get("weights") != "float" or explicit_float) else {})}


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
