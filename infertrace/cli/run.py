"""``infertrace run``: generate from one or more prompts and show the five variables of every step.

Thin: parse and validate options, load the model (progress on stderr), call
:func:`infertrace.runner.run_requests`, then print the trace with
:func:`infertrace.trace.render.render_run` or as JSON (``RunTrace.to_dict``).
Also holds the helpers other commands share (consoles, model loading with progress).
"""

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from infertrace.engine.engine import EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.errors import InfertraceError
from infertrace.safe_text import SafeConsole, visible, json_text
from infertrace.runner import Loaded, PromptSpec, load_model, parse_dtype, run_requests
from infertrace.trace.recorder import VARIABLES
from infertrace.trace.store import KEEP, parse_layers, save_trace

HELP = ("Generate from prompts and show, step by step, the five inference variables: hidden, positions (RoPE), "
        "mask, kv, decode. First a table like the study's worked example, then one panel per variable per step.")

BACKENDS = ("cells", "paged")
ENGINES = ("infertrace", "llama.cpp")
ATTENTION = ("torch", "triton", "auto")
DEVICES = ("cpu", "cuda")

#: JSONL keys of ``--prompts`` and their types (bool is not accepted as a number).
PROMPT_KEYS: dict[str, tuple[type, ...]] = {
    "prompt": (str,), "arrival": (int,), "max_new_tokens": (int,), "temperature": (int, float), "top_k": (int,),
    "top_p": (int, float), "min_p": (int, float), "repetition_penalty": (int, float), "seed": (int,),
    "chat": (bool,), "ignore_eos": (bool,),
}


# ----------------------------------------------------------------------------- shared helpers


#: narrowest layout the panels are designed for; narrower terminals soft-wrap whole lines
#: instead of rich truncating cells (values, mask rows) mid-number.
MIN_WIDTH = 120


def stdout_console() -> Console:
    """Console for the report: the terminal's width but at least :data:`MIN_WIDTH` columns, or
    exactly 120 when piped (unless COLUMNS is set)."""
    c = SafeConsole(highlight=False)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        return SafeConsole(highlight=False, width=120)
    if c.width < MIN_WIDTH:
        return SafeConsole(highlight=False, width=MIN_WIDTH)
    return c


def progress_display(enabled: bool) -> Progress:
    """Transient progress on stderr; disabled (prints nothing) when ``enabled`` is False or
    stderr is not a terminal."""
    err = SafeConsole(stderr=True)  # descriptions hold file and tensor names: no markup, no raw control bytes
    return Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=err, transient=True, disable=not (enabled and err.is_terminal))


_LOADED: dict[tuple, Loaded] = {}


def load_with_progress(model: Optional[Path], dtype: str, device: str, progress: Progress) -> Loaded:
    """:func:`load_model` with a progress bar while dequantising. Memoised per process on
    (path, size, mtime, dtype, device), so repeated in-process invocations (tests) load once.

    Raises:
        InfertraceError: as :func:`load_model`.
    """
    from infertrace.model.registry import resolve_model

    asm = progress.add_task("preparing model", total=None)
    path = resolve_model(model, lambda d, n, label: progress.update(asm, completed=d, total=n, description=label))
    progress.remove_task(asm)
    key = None
    if path.exists():
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns, dtype, device)
        if key in _LOADED:
            return _LOADED[key]
    task = progress.add_task(f"loading {path.name}", total=None)

    def cb(done: int, total: int, name: str) -> None:
        progress.update(task, completed=done, total=total, description=f"dequantising {name}")

    loaded = load_model(path, dtype=dtype, device=device, progress=cb)
    progress.remove_task(task)
    if key is not None:
        _LOADED.clear()  # keep at most one model in memory
        _LOADED[key] = loaded
    return loaded


def check_choice(option: str, value: str, choices: tuple[str, ...]) -> str:
    """Lower-cased ``value`` if it is one of ``choices``; else InfertraceError naming the option."""
    v = value.strip().lower()
    if v not in choices:
        raise InfertraceError(f"{option} must be one of {', '.join(choices)} (got {value!r})")
    return v


def check_min(option: str, value: Optional[int], lo: int) -> None:
    """InfertraceError when ``value`` is given and below ``lo``."""
    if value is not None and value < lo:
        raise InfertraceError(f"{option} must be >= {lo} (got {value})")


def parse_show(values: Optional[list[str]]) -> tuple[str, ...]:
    """``["hidden,mask", "kv"]`` -> variables in canonical order; ``all`` or nothing -> all five.

    Raises:
        InfertraceError: an unknown name.
    """
    if not values:
        return VARIABLES
    names = [n.strip().lower() for v in values for n in v.split(",") if n.strip()]
    if not names or "all" in names:
        return VARIABLES
    bad = [n for n in names if n not in VARIABLES]
    if bad:
        raise InfertraceError(f"unknown variable {bad[0]!r} in --show; choose from {', '.join(VARIABLES)} (comma-separated) or all")
    return tuple(v for v in VARIABLES if v in names)


def parse_steps(text: Optional[str]) -> Optional[Callable[[int], bool]]:
    """``"0,1,2"``, ``"0..3"``, ``"0-3"``, ``"5.."`` -> predicate on step numbers (None = all).

    Raises:
        InfertraceError: malformed text.
    """
    if text is None or not text.strip():
        return None
    ranges: list[tuple[int, Optional[int]]] = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:(?:\.\.|-)(\d*))?", part)
        if not m:
            raise InfertraceError(f"--steps {text!r}: {part!r} is not a step number or range (use 0,1,2 or 0..3 or 5..)")
        lo = int(m.group(1))
        hi = lo if m.group(2) is None else (int(m.group(2)) if m.group(2) else None)
        if hi is not None and hi < lo:
            raise InfertraceError(f"--steps {text!r}: range {part!r} is empty")
        ranges.append((lo, hi))
    return lambda s: any(lo <= s and (hi is None or s <= hi) for lo, hi in ranges)


def read_prompts_file(path: Path, defaults: dict[str, Any], chat: bool, arrival: int = 0) -> list[PromptSpec]:
    """Parse ``--prompts`` JSONL: one object per non-empty line, keys of :data:`PROMPT_KEYS`
    (``prompt`` required; the others default to the command-line values).

    Raises:
        InfertraceError: unreadable file, or a malformed line (message names the line number).
    """
    from infertrace.model.limits import MAX_PROMPTS_FILE_BYTES

    try:
        with open(path, "rb") as fh:  # a pipe (--prompts <(cmd)) is fine; /dev/zero or a huge file stops at the limit
            data = fh.read(MAX_PROMPTS_FILE_BYTES + 1)
        if len(data) > MAX_PROMPTS_FILE_BYTES:
            raise InfertraceError(f"--prompts {path} is over the limit of {MAX_PROMPTS_FILE_BYTES} bytes")
        lines = data.decode("utf-8").splitlines()
    except IsADirectoryError:
        raise InfertraceError(f"--prompts {path} is a directory; pass a JSONL file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InfertraceError(f"cannot read --prompts {path}: {e.strerror if isinstance(e, OSError) else e}") from None
    specs = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path.name} line {no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InfertraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        except (RecursionError, ValueError):  # nesting past the recursion limit; integers over 4300 digits
            raise InfertraceError(f"{where}: not valid JSON (nested too deeply or a number too long)") from None
        if not isinstance(obj, dict):
            raise InfertraceError(f"{where}: expected a JSON object like {{\"prompt\": \"...\"}}")
        unknown = sorted(set(obj) - set(PROMPT_KEYS))
        if unknown:
            raise InfertraceError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(PROMPT_KEYS)}")
        if "prompt" not in obj:
            raise InfertraceError(f"{where}: missing \"prompt\"")
        for k, v in obj.items():
            types = PROMPT_KEYS[k]
            if not isinstance(v, types) or (bool not in types and isinstance(v, bool)):
                raise InfertraceError(f"{where}: {k!r} must be {' or '.join(t.__name__ for t in types)}, got {json.dumps(v)}")
        params = {k: obj.get(k, dv) for k, dv in defaults.items()}
        try:
            sp = SamplingParams(**params).validate()
        except InfertraceError as e:
            msg = re.sub(r"--([a-z-]+)", lambda m: repr(m.group(1).replace("-", "_")), e.message)
            raise InfertraceError(f"{where}: {msg}") from None
        a = obj.get("arrival", arrival)
        if a < 0:
            raise InfertraceError(f"{where}: 'arrival' must be >= 0 (got {a})")
        specs.append(PromptSpec(obj["prompt"], sp, a, bool(obj.get("chat", chat))))
    if not specs:
        raise InfertraceError(f"--prompts {path} holds no prompts")
    return specs


def check_output_dir(save: Path, force: bool) -> None:
    """Refuse a ``--save`` target that would lose something, before the run.

    Raises:
        InfertraceError: empty path, an existing file, a non-empty directory (without
            ``--force``), or a place that cannot be written.
    """
    if str(save).strip() in ("", "."):
        raise InfertraceError("--save needs a directory name (e.g. --save runs/first)")
    if save.exists() and not save.is_dir():
        raise InfertraceError(f"--save {save}: a file of that name exists; choose a directory name")
    if save.is_dir() and any(save.iterdir()) and not force:
        raise InfertraceError(f"--save {save}: the directory is not empty; choose a new one or pass --force to replace its trace")
    parent = save if save.exists() else next((p for p in save.parents if p.exists()), Path("."))
    if not os.access(parent, os.W_OK | os.X_OK) or not parent.is_dir():
        raise InfertraceError(f"--save {save}: cannot write in {parent}")


def save_options(save: Optional[Path], keep: Optional[str], layers: Optional[str]) -> bool:
    """Validate ``--save/--keep/--layers`` before the model loads; True when tensors are kept.

    Raises:
        InfertraceError: --keep or --layers without --save, an unknown --keep, --layers with
            --keep summary, malformed --layers.
    """
    if save is None:
        if keep is not None or layers is not None:
            raise InfertraceError(f"{'--keep' if keep is not None else '--layers'} needs --save DIR")
        return False
    k = check_choice("--keep", keep or "tensors", KEEP)
    if layers is not None:
        if k == "summary":
            raise InfertraceError("--layers chooses the layers whose tensors are kept; it needs --keep tensors, not summary")
        parse_layers(layers)  # syntax now; the range once the model is loaded
    return k == "tensors"


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
    seed: Annotated[int, typer.Option("--seed", help="Seed of each request's sampler.")] = SamplingParams.seed,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Keep generating after an end-of-generation token.")] = False,
    show: Annotated[Optional[list[str]], typer.Option("--show", help="Variables to record and show, comma-separated: hidden,positions,mask,kv,decode (default all).")] = None,
    layer: Annotated[int, typer.Option("--layer", help="Layer whose RoPE evidence and K/V values are shown.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole trace as JSON on stdout (nothing else).")] = False,
    backend: Annotated[str, typer.Option("--backend", help="KV cache / attention convention: cells (llama.cpp) or paged (TensorRT-LLM/vLLM).")] = "cells",
    ctx_size: Annotated[int, typer.Option("--ctx-size", help="KV capacity and per-request context limit, in tokens.")] = EngineOptions.ctx_size,
    num_blocks: Annotated[Optional[int], typer.Option("--num-blocks", help="paged: blocks in the pool (default ctx-size / tokens-per-block).")] = None,
    tokens_per_block: Annotated[int, typer.Option("--tokens-per-block", help="paged: slots per block.")] = EngineOptions.tokens_per_block,
    max_batch_tokens: Annotated[int, typer.Option("--max-batch-tokens", help="Scheduler token budget per step.")] = EngineOptions.max_batch_tokens,
    prefill_chunk: Annotated[Optional[int], typer.Option("--prefill-chunk", help="Max prompt tokens per request per step (chunked prefill).")] = None,
    attention: Annotated[str, typer.Option("--attention", help="Attention implementation: torch, triton (paged only) or auto.")] = "auto",
    dtype: Annotated[str, typer.Option("--dtype", help="Compute dtype: float32, bfloat16 or float16.")] = "float32",
    device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
    steps: Annotated[Optional[str], typer.Option("--steps", help="Steps whose panels are printed: 0,1,2 or 0..3 or 5.. (the table and --json keep all).")] = None,
    save: Annotated[Optional[Path], typer.Option("--save", help="Also write the trace to this directory (trace.json, tensors.safetensors, timing.json) for show, diff, report, dump-kv.")] = None,
    keep: Annotated[Optional[str], typer.Option("--keep", help="With --save: summary (trace.json only) or tensors (also Q/K/V, K/V cache, hidden, top-k logits of --layers; default).")] = None,
    layers: Annotated[Optional[str], typer.Option("--layers", help="With --save --keep tensors: layers whose tensors are kept, e.g. 0,5 or 0..3 or all (default: --layer).")] = None,
    force: Annotated[bool, typer.Option("--force", help="With --save: replace the trace in a non-empty directory.")] = False,
    engine: Annotated[str, typer.Option("--engine", help="Who computes: infertrace (this engine) or llama.cpp (llama.cpp itself via llama-cpp-python, GGUF only; its inp_pos, kq_mask, cells, K/V and logits are recorded).")] = "infertrace",
    teacher_force: Annotated[Optional[Path], typer.Option("--teacher-force", help="With --engine llama.cpp: feed the tokens a saved trace (run --save DIR) generated instead of sampling, so the two traces compare step for step.")] = None,
    sampler_order: Annotated[Optional[str], typer.Option("--sampler-order", help="hf (temperature first, as HF/vLLM) or llama.cpp (top-k/top-p/min-p on unscaled logits, temperature last). Default: cells and --engine llama.cpp: llama.cpp; paged: hf.")] = None,
    prefix_cache: Annotated[str, typer.Option("--prefix-cache", help="on: reuse cached K/V of a shared prompt prefix (paged: hashed full blocks; cells: seq_cp of a live or finished sequence).")] = "off",
    context_shift: Annotated[bool, typer.Option("--context-shift", help="When a request fills --ctx-size, drop cached tokens after --n-keep and continue (llama.cpp server), instead of stopping with ctx_full.")] = False,
    n_keep: Annotated[int, typer.Option("--n-keep", help="Context shift: cached tokens kept at the start.")] = 0,
    n_discard: Annotated[int, typer.Option("--n-discard", help="Context shift: tokens dropped after --n-keep (0 = half of the rest).")] = 0,
    audit_kv: Annotated[bool, typer.Option("--audit-kv", help="Record each cached K/V entry's provenance and recompute the cache from scratch every step (max |Δ| per provenance).")] = False,
) -> None:
    """Options are validated before the model loads; every user error is one ``error:`` line
    (raised as InfertraceError, printed by :func:`infertrace.cli.app.cli_errors`)."""
    # -- validate everything that does not need the model, before loading it
    show_vars = parse_show(show)
    step_filter = parse_steps(steps)
    keep_tensors = save_options(save, keep, layers)
    if save is not None:
        check_output_dir(save, force)
    check_min("--layer", layer, 0)
    engine = check_choice("--engine", engine, ENGINES)
    if engine == "llama.cpp":
        from infertrace.engine.llamacpp_capture import import_llama_cpp

        import_llama_cpp()  # fail before loading anything
        if backend.strip().lower() != "cells":
            raise InfertraceError("--engine llama.cpp records llama.cpp's own cells cache; drop --backend paged")
        if device != "cpu" or dtype.lower() not in ("float32", "fp32"):
            raise InfertraceError("--engine llama.cpp computes on llama.cpp's CPU backend; drop --device/--dtype")
        if prefix_cache.strip().lower() != "off" or context_shift or audit_kv:
            raise InfertraceError("--engine llama.cpp records llama.cpp's own cache as it is; drop --prefix-cache, "
                                  "--context-shift and --audit-kv (they are this engine's serving mechanisms)")
    elif teacher_force is not None:
        raise InfertraceError("--teacher-force needs --engine llama.cpp")
    forced = forced_tokens(teacher_force) if teacher_force is not None else None
    from infertrace.cli.run_options import build_run_inputs, print_run_cost  # shares run's checks with dump-kv, diff-backends

    specs, opts = build_run_inputs(
        prompt=prompt, prompts=prompts, arrival=arrival, max_new_tokens=max_new_tokens, chat=chat,
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
        seed=seed, ignore_eos=ignore_eos, backend=backend, ctx_size=ctx_size, num_blocks=num_blocks,
        tokens_per_block=tokens_per_block, max_batch_tokens=max_batch_tokens, prefill_chunk=prefill_chunk,
        attention=attention, dtype=dtype, device=device, sampler_order=sampler_order,
        prefix_cache=prefix_cache, context_shift=context_shift, n_keep=n_keep, n_discard=n_discard, audit_kv=audit_kv)

    # -- load and run (progress on stderr only)
    with progress_display(enabled=not as_json) as progress:
        loaded = load_with_progress(model, dtype, device, progress)
        print_run_cost(progress, loaded, specs, opts, dtype)  # past n_ctx_train: warn with the cost
        task = progress.add_task("running steps", total=None)

        def on_step(st: Any) -> None:
            progress.update(task, description=f"step {st.step}: N={st.N} tokens")

        tensor_layers = (parse_layers(layers, loaded.config.n_layer) or [layer]) if keep_tensors else None
        tensors: Optional[dict] = {} if keep_tensors else None
        if engine == "llama.cpp":
            from infertrace.engine.llamacpp_engine import run_requests_llamacpp

            if tensor_layers is not None and tensor_layers != [layer]:
                raise InfertraceError(f"--engine llama.cpp captures one layer's tensors: use --layer {tensor_layers[0]} instead of --layers")
            trace = run_requests_llamacpp(loaded, specs, opts, layer=layer, show=show_vars, on_step=on_step,
                                          options_for_record={"dtype": dtype, "device": device}, tensors=tensors,
                                          forced=forced)
        else:
            trace = run_requests(loaded, specs, opts, layer=layer, show=show_vars, on_step=on_step,
                                 options_for_record={"dtype": dtype, "device": device}, tensors=tensors,
                                 tensor_layers=tensor_layers)
    if save is not None:
        from infertrace.trace.render import human_bytes

        sizes = save_trace(trace, save, tensors, tensor_layers or (), replace=force)  # atomic; a racing --save loses with exit 2
        typer.echo(f"saved trace to {visible(str(save))}: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in sizes.items()), err=True)

    wanted = None if step_filter is None else [s.step for s in trace.steps if step_filter(s.step)]
    if wanted == [] and not as_json:
        last = trace.steps[-1].step if trace.steps else -1
        raise InfertraceError(f"--steps {steps} selects no step: the run has steps 0..{last}")
    if as_json:
        typer.echo(json_text(trace.to_dict()))
        return
    from infertrace.trace.render import render_run

    render_run(stdout_console(), trace, show=show_vars, steps=wanted)
