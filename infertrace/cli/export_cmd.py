"""``infertrace export DIR --format perfetto [-o FILE]``: a saved trace's request lanes as Chrome
trace-event JSON, the file ui.perfetto.dev and chrome://tracing open.

Thin: :func:`infertrace.trace.store.load_saved`, then :func:`infertrace.present.perfetto.perfetto_json`,
written with :func:`infertrace.safe_io.write_output` (a new file created exclusively; an existing one
replaced atomically only with ``--force``; never written through a symlink to a regular file).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from infertrace.errors import InfertraceError
from infertrace.fmt import clip
from infertrace.safe_io import check_destination, write_output
from infertrace.safe_text import visible
from infertrace.trace.store import load_saved

FORMATS = ("perfetto",)
HELP = ("Export a trace saved with 'run --save DIR' for another tool. --format perfetto: Chrome trace-event JSON "
        "(open it in ui.perfetto.dev or chrome://tracing): one track per request, one slice per step it ran in "
        "(prefill / chunk / decode / verify / preempted, tokens, positions, prefix hit, blocks or cells, sampled piece "
        "as args); time axis = the recorded step wall times (1 ms per step when the trace has none).")


def export(
    trace_dir: Annotated[Path, typer.Argument(help="Directory written by 'infertrace run --save DIR'.", show_default=False)],
    fmt: Annotated[str, typer.Option("--format", help="Output format: perfetto (Chrome trace-event JSON).")] = "perfetto",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="File to write (default: <DIR's name>-perfetto.json in the working directory).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing regular output file.")] = False,
) -> None:
    """Errors (missing/broken trace, unknown format, existing output without --force) are one ``error:`` line, exit 2."""
    from infertrace.present.perfetto import encode, trace_events

    if fmt not in FORMATS:
        raise InfertraceError(f"--format '{clip(visible(fmt), 40)}' is not supported; use --format perfetto")
    trace, _ = load_saved(trace_dir)
    out = output if output is not None else default_output(Path(trace_dir))
    shown = clip(visible(str(out)), 200)  # a path of thousands of characters is named, not echoed whole
    if _inside_trace(out, Path(trace_dir)):
        raise InfertraceError(f"-o {shown} is inside the trace directory; write the export somewhere else")
    if os.path.isdir(out):
        raise InfertraceError(f"-o {shown} is a directory; give a file name such as {visible(str(out / 'trace-perfetto.json'))}")
    check_destination(out, force, "-o")
    try:
        doc = trace_events(trace, source=str(trace_dir))
        data = encode(doc)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as e:
        raise InfertraceError(f"{visible(str(trace_dir))}: malformed record, cannot export it "
                              f"({type(e).__name__}: {visible(str(e))[:200]})") from None
    try:
        how = write_output(out, data, force, "-o")
    except OSError as e:
        raise InfertraceError(f"cannot write {shown}: {e.strerror or e}") from None
    where = f" in the working directory {clip(visible(os.getcwd()), 200)} (-o chooses)" if output is None else ""
    axis = ("" if doc["otherData"].get("time_axis") == "wall"
            else "; the trace has no step times: 1 ms per step on the time axis")
    typer.echo(f"wrote {shown} ({len(data) / 1e3:.1f} kB, {len(trace.steps)} steps{axis}; open it in ui.perfetto.dev)"
               f"{where}", err=how == "written through")


def default_output(trace_dir: Path) -> Path:
    """``<name>-perfetto.json`` in the working directory (``name``: the trace directory's name, unsafe characters ``_``)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", trace_dir.resolve().name or "trace").lstrip(".") or "trace"
    return Path(f"{name[:100]}-perfetto.json")


def _inside_trace(out: Path, trace_dir: Path) -> bool:
    """True when ``out`` would land in the trace's own directory (it may be a read-only fixture, and
    ``--force`` must never replace one of the trace's files)."""
    try:
        d = trace_dir if os.path.isdir(trace_dir) else os.path.dirname(os.path.abspath(trace_dir))  # DIR or DIR/trace.json
        return os.path.realpath(os.path.dirname(os.path.abspath(out))) == os.path.realpath(d)
    except OSError:
        return False
