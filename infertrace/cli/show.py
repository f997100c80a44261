"""``infertrace show DIR``: print a saved trace exactly as ``run`` printed it.

Thin: load with :func:`infertrace.trace.store.load_trace`, then the same
:func:`infertrace.present.render.render_run` on the same console width, so
``show DIR --var V --step S`` prints the same bytes as ``run ... --show V --steps S`` did.
"""

from pathlib import Path
from typing import Annotated, Optional

import typer

from infertrace.cli.common import parse_panels, parse_steps, stdout_console
from infertrace.errors import InfertraceError
from infertrace.trace.records import RunTrace
from infertrace.trace.store import load_saved, read_manifest

#: the variables ``show`` draws from facts ``check`` recomputes (positions, the mask and its window, the cache's
#: cells / blocks / streams, vLLM's own metadata, HF's dense batch: input_ids / attention_mask / position_ids /
#: cache lengths): a trace whose copy of them contradicts the facts would be displayed as if it held
MISLEADING = ("positions", "mask", "kv", "vllm", "hf")

HELP = ("Print a trace saved with 'run --save DIR' as run prints it: header, worked-example table, outputs and a "
        "summary; --var VAR (or --show VAR) adds that variable's panel per step, --var all every panel.")


def render_saved(trace: RunTrace, where: str, show: tuple[str, ...], steps: Optional[list[int]]) -> None:
    """:func:`render_run` on stdout; a malformed record that rendering trips over becomes a
    one-line :class:`InfertraceError` naming ``where`` (the file is at fault, not the program)."""
    from infertrace.present.render import render_run

    try:
        render_run(stdout_console(), trace, show=show, steps=steps)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError, ZeroDivisionError) as e:
        raise InfertraceError(f"{where}: malformed record, cannot render it ({type(e).__name__}: {e})") from None


def select_steps(trace: RunTrace, text: Optional[str]) -> Optional[list[int]]:
    """Step numbers matching ``--step`` (None = all).

    Raises:
        InfertraceError: malformed text, or no step of the trace matches.
    """
    pred = parse_steps(text)
    if pred is None:
        return None
    wanted = [s.step for s in trace.steps if pred(s.step)]
    if not wanted:
        have = f"0..{trace.steps[-1].step}" if trace.steps else "none"
        raise InfertraceError(f"--step {text}: no such step in this trace (steps {have})")
    return wanted


def show(
    trace_dir: Annotated[Path, typer.Argument(help="Directory written by 'infertrace run --save DIR'.", show_default=False)],
    step: Annotated[Optional[str], typer.Option("--step", "--steps", help="Steps whose panels are printed: 3 or 0,1,2 or 0..3 or 5.. (the table keeps all).")] = None,
    var: Annotated[Optional[list[str]], typer.Option("--var", "--show", help="Panels printed per step, comma-separated: hidden,positions,mask,kv,decode, or all (default: none, the table and the summary; with --step: all recorded).")] = None,
) -> None:
    """Errors (missing/broken/newer trace, bad options) are one ``error:`` line, exit 2."""
    variables = parse_panels(var, step, option="--var")
    trace, _ = load_saved(trace_dir)  # a broken tensors file is reported too
    refuse_misleading(trace_dir)
    if variables:
        variables = recorded_variables(trace, str(trace_dir), variables, quiet=not var)
    render_saved(trace, str(trace_dir), variables, select_steps(trace, step))


def refuse_misleading(trace_dir: Path) -> None:
    """Refuse a trace that ``check`` finds inconsistent in a variable ``show`` would draw as fact
    (:data:`MISLEADING`): e.g. windowed keys past the window, a kq_mask keeping another sequence's cell.

    Raises:
        InfertraceError: one line with the violation and the command that explains it.
    """
    from infertrace.cli.check_cmd import _safe
    from infertrace.trace.check import check_trace

    v, _ = check_trace(read_manifest(trace_dir, consistency=False))
    if v is not None and v.variable in MISLEADING and v.rule != "schema":
        raise InfertraceError(f"{trace_dir}: inconsistent trace, not shown (showing it would mislead): {_safe(v.line())}; "
                              f"run `infertrace check {trace_dir}` for the rule")


def recorded_variables(trace: RunTrace, where: str, asked: tuple[str, ...], quiet: bool = False) -> tuple[str, ...]:
    """The asked variables the trace recorded (``options.show``: all five unless ``run --save --keep`` chose,
    or an older trace saved with ``run --show``); the ones it did not are named on one line (stderr, unless
    ``quiet``: panels implied by ``--step``), and the rest are rendered.

    Raises:
        InfertraceError: none of the asked variables was recorded.
    """
    rec = trace.options.get("show") if isinstance(trace.options, dict) else None
    if not isinstance(rec, list):
        return asked  # an older trace without options.show: render what is there
    have = tuple(v for v in asked if v in rec)
    missing = [v for v in asked if v not in rec]
    if not missing:
        return have
    msg = (f"{','.join(missing)} not recorded in {where}: it was saved keeping only {','.join(map(str, rec)) or '(none)'} "
           f"(run --save --keep chose them); re-run with --save (all five variables by default) to see it")
    if not have:
        raise InfertraceError(msg)
    if quiet:
        return have
    typer.echo(f"note: {msg}", err=True)
    return have
