"""What the commands share: consoles, progress, model loading with progress, option checks.

Torch-free at import (the engine loads inside :func:`load_with_progress`), so every command
module can import it and ``infertrace --help``/``show``/``diff``/``report`` never load torch.
``cli/run.py`` and ``cli/run_options.py`` both import from here; neither imports the other back.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from infertrace.engine.options import SamplingParams
from infertrace.errors import ConfigError, InfertraceError
from infertrace.runtimes.api import REGISTRY, names
from infertrace.safe_text import SafeConsole, visible
from infertrace.trace.records import VARIABLES

if TYPE_CHECKING:
    from infertrace.runner import Loaded, PromptSpec

#: the KV conventions of every registered runtime (each runtime refuses the ones it does not run)
BACKENDS = tuple(dict.fromkeys(c for r in REGISTRY.values() for c in r.conventions))
RUNTIMES = names()  # the runtimes of the registry (runtimes/api.py)
ATTENTION = ("torch", "triton", "auto")
DEVICES = ("cpu", "cuda")

#: JSONL keys of ``--prompts`` and their types (bool is not accepted as a number).
PROMPT_KEYS: dict[str, tuple[type, ...]] = {
    "prompt": (str,), "arrival": (int,), "max_new_tokens": (int,), "temperature": (int, float), "top_k": (int,),
    "top_p": (int, float), "min_p": (int, float), "repetition_penalty": (int, float), "seed": (int,),
    "chat": (bool,), "ignore_eos": (bool,), "penalty_last_n": (int,), "frequency_penalty": (int, float),
    "presence_penalty": (int, float),
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


def load_with_progress(model: Optional[Path], dtype: str, device: str, progress: Progress,
                       threads: Optional[int] = None, weights: str = "float", tensors: bool = True) -> Loaded:
    """:func:`load_model` with a progress bar while dequantising. Memoised per process on
    (path, size, mtime, dtype, device, weights, tensors), so repeated in-process invocations (tests) load once.
    First sets torch's thread count: ``threads`` (``--threads``) or the cores available now
    (:func:`infertrace.threads.choose_threads`).

    Raises:
        InfertraceError: as :func:`load_model`; ``threads`` or the thread variables outside 1..max_threads().
    """
    from infertrace.loading.registry import resolve_model
    from infertrace.runner import load_model
    from infertrace.threads import apply_threads, choose_threads

    apply_threads(choose_threads(threads))  # bounded: 1..max_threads() (threads.check_thread_settings)

    asm = progress.add_task("preparing model", total=None)
    path = resolve_model(model, lambda d, n, label: progress.update(asm, completed=d, total=n, description=label))
    progress.remove_task(asm)
    key = None
    if path.exists():
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns, dtype, device, weights, tensors)
        if key in _LOADED:
            return _LOADED[key]
    task = progress.add_task(f"loading {path.name}", total=None)

    def cb(done: int, total: int, name: str) -> None:
        progress.update(task, completed=done, total=total, description=f"dequantising {name}")

    loaded = load_model(path, dtype=dtype, device=device, progress=cb, weights=weights, tensors=tensors)
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


def parse_panels(values: Optional[list[str]], steps: Optional[str] = None, option: str = "--show") -> tuple[str, ...]:
    """Variables whose per-step panels are printed: display only (what is recorded is ``--keep``'s choice).

    ``run``/``show`` print the worked-example table and the summary by default (no panels); ``--show all``
    prints every panel of every step (the full output); ``--steps`` alone prints all five panels of those steps.

    Raises:
        InfertraceError: an unknown name (the message names ``option``).
    """
    if not values:
        return VARIABLES if steps is not None and steps.strip() else ()
    names = [n.strip().lower() for v in values for n in v.split(",") if n.strip()]
    if not names or "all" in names:
        return VARIABLES
    bad = [n for n in names if n not in VARIABLES]
    if bad:
        raise InfertraceError(f"unknown variable {bad[0]!r} in {option}; choose from {', '.join(VARIABLES)} (comma-separated) or all")
    return tuple(v for v in VARIABLES if v in names)


#: what ``--keep`` stores beyond trace.json (one of these) -- the rest of its items are variables
KEEP_STORAGE = ("summary", "tensors")


def parse_keep(text: Optional[str]) -> tuple[Optional[str], tuple[str, ...]]:
    """``--keep``: ``summary`` or ``tensors`` (what is written beside trace.json) and/or the variables
    recorded, comma-separated: ``--keep mask,kv``, ``--keep summary,decode``. Nothing given: ``(None, all five)``.

    Returns:
        ``(storage or None, variables in canonical order)``.

    Raises:
        InfertraceError: an unknown item, both summary and tensors, or no variable left.
    """
    if text is None:
        return None, VARIABLES
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in KEEP_STORAGE and n not in VARIABLES]
    if bad or not names:
        raise InfertraceError(f"--keep must be one of summary, tensors and/or variables {','.join(VARIABLES)} "
                              f"(comma-separated, e.g. --keep summary or --keep mask,kv; got {text!r})")
    storage = [n for n in names if n in KEEP_STORAGE]
    if len(set(storage)) > 1:
        raise InfertraceError("--keep takes summary or tensors, not both")
    kept = tuple(v for v in VARIABLES if v in names) or VARIABLES
    return (storage[0] if storage else None), kept


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


def _check_line_limits(where: str, obj: dict[str, Any], top_k: int, max_new_tokens: int, arrival: int) -> None:
    """A ``--prompts`` line's values within the trace schema's limits, named by the file's key and line (the
    run's :func:`~infertrace.cli.run_options.check_request_limits` names the flag, which the line did not use).

    Raises:
        InfertraceError: ``top_k`` over ``MAX_ID``, ``max_new_tokens`` over ``MAX_CTX``, ``arrival`` over ``MAX_STEPS``.
    """
    from infertrace.trace.schema import LIMITS

    for key, v, lim, hint in (("top_k", top_k, "MAX_ID", "; use 0 for off"), ("max_new_tokens", max_new_tokens, "MAX_CTX", ""),
                              ("arrival", arrival, "MAX_STEPS", "")):
        if key in obj and v > LIMITS[lim]:
            raise InfertraceError(f"{where}: {key!r} {v} is over the limit of {LIMITS[lim]} ({lim} of the trace format){hint}")


def read_prompts_file(path: Path, defaults: dict[str, Any], chat: bool, arrival: int = 0) -> list[PromptSpec]:
    """Parse ``--prompts`` JSONL: one object per non-empty line, keys of :data:`PROMPT_KEYS`
    (``prompt`` required; the others default to the command-line values).

    Raises:
        InfertraceError: unreadable file, or a malformed line (message names the line number).
    """
    from infertrace.loading.limits import MAX_PROMPTS_FILE_BYTES
    from infertrace.safe_io import read_input

    # a regular file or a pipe (--prompts <(cmd)); a FIFO nobody writes is refused within seconds,
    # /dev/zero and other devices are refused, a huge file or pipe stops at the limit
    data = read_input(path, MAX_PROMPTS_FILE_BYTES, "--prompts JSONL file")
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise InfertraceError(f"cannot read --prompts {visible(str(path))}: {e}") from None
    from infertrace.runner import PromptSpec

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
        except ConfigError as e:  # sampling.<key>: named by the file's key
            raise InfertraceError(f"{where}: {e.field.split('.')[-1]!r} {e.reason}") from None
        a = obj.get("arrival", arrival)
        if a < 0:
            raise InfertraceError(f"{where}: 'arrival' must be >= 0 (got {a})")
        _check_line_limits(where, obj, sp.top_k, sp.max_new_tokens, a)
        specs.append(PromptSpec(obj["prompt"], sp, a, bool(obj.get("chat", chat))))
    if not specs:
        raise InfertraceError(f"--prompts {path} holds no prompts")
    return specs
