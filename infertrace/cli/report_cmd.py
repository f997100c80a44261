"""``infertrace report DIR -o report.html``: one self-contained HTML page for a saved trace.

Thin: :func:`infertrace.trace.store.load_trace`, then
:func:`infertrace.present.report.build_report`, written to ``-o`` (default ``<DIR name>-report.html`` in the
working directory).
"""

import os
import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from infertrace.errors import InfertraceError
from infertrace.safe_io import check_destination, write_output
from infertrace.safe_text import visible
from infertrace.trace.store import load_saved

HELP = ("Write one self-contained HTML page (inline CSS/JS/SVG, no network) for a saved trace: the worked-example "
        "table, each step's masks as heatmaps (llama.cpp kq_mask and the paged metadata's mask), the cell map and block "
        "tables over time, top-k bars.")


def report(
    trace_dir: Annotated[Path, typer.Argument(help="Directory written by 'infertrace run --save DIR'.", show_default=False)],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="HTML file to write (default: <DIR's name>-report.html in the working directory).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing regular output file (a device such as /dev/null or a FIFO is written into, never replaced).")] = False,
) -> None:
    """Errors (missing/broken/newer trace, unwritable output) are one ``error:`` line, exit 2."""
    from infertrace.present.report import build_report

    trace, _ = load_saved(trace_dir)  # a broken tensors file is reported too
    out = output if output is not None else default_output(Path(trace_dir))
    shown = visible(str(out))
    if _is_trace_file(out, Path(trace_dir)):
        raise InfertraceError(f"-o {shown} is a file of the trace itself; write the report somewhere else")
    if os.path.isdir(out):  # never raises (Path.is_dir lets ENAMETOOLONG through)
        raise InfertraceError(f"-o {shown} is a directory; give a file name such as {visible(str(out / 'report.html'))}")
    check_destination(out, force, "-o")  # refused before the page is built; write_output checks again
    try:
        html = build_report(trace, source=str(trace_dir))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError, ZeroDivisionError) as e:
        raise InfertraceError(f"{visible(str(trace_dir))}: malformed record, cannot build the report "
                              f"({type(e).__name__}: {visible(str(e))[:200]})") from None
    data = html.encode("utf-8")
    try:
        # a new name is created exclusively (temp file + link: two racing reports, one wins), a regular
        # file is replaced atomically with --force only, /dev/null or a FIFO is written through, never
        # unlinked; a planted symlink is never written through (safe_io.write_output)
        how = write_output(out, data, force, "-o")
    except OSError as e:
        raise InfertraceError(f"cannot write {shown}: {e.strerror or e}") from None
    # written into a device or pipe (-o /dev/stdout): the message goes to stderr, not into the page
    where = f" in the working directory {visible(os.getcwd())} (-o chooses)" if output is None else ""
    typer.echo(f"wrote {shown} ({len(data) / 1e3:.1f} kB, {len(trace.steps)} steps){where}", err=how == "written through")


def default_output(trace_dir: Path) -> Path:
    """``<name>-report.html`` in the working directory (never into the trace's own directory, which may be
    a read-only fixture): ``name`` is the trace directory's name, its unsafe characters replaced by ``_``."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", trace_dir.resolve().name or "trace").lstrip(".") or "trace"
    return Path(f"{name[:100]}-report.html")


def _is_trace_file(out: Path, trace_dir: Path) -> bool:
    """True when ``out`` is (by inode, through any link or path spelling) one of the trace's files."""
    for name in ("trace.json", "tensors.safetensors", "timing.json"):
        f = trace_dir / name
        try:
            if os.path.exists(out) and os.path.exists(f) and os.path.samefile(out, f):
                return True
        except OSError:
            pass
        if os.path.abspath(out) == os.path.abspath(f):  # not there yet: still the trace's own name
            return True
    return False
