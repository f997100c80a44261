"""``infertrace report DIR -o report.html``: one self-contained HTML page for a saved trace.

Thin: :func:`infertrace.trace.store.load_trace`, then
:func:`infertrace.trace.report.build_report`, written to ``-o`` (default ``DIR/report.html``).
"""

from pathlib import Path
from typing import Annotated, Optional

import typer

from infertrace.errors import InfertraceError
from infertrace.trace.store import load_saved

HELP = ("Write one self-contained HTML page (inline CSS/JS/SVG, no network) for a saved trace: the worked-example "
        "table, each step's masks as heatmaps (llama.cpp kq_mask and the paged metadata's mask), the cell map and block "
        "tables over time, top-k bars.")


def report(
    trace_dir: Annotated[Path, typer.Argument(help="Directory written by 'infertrace run --save DIR'.", show_default=False)],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="HTML file to write (default: DIR/report.html).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output file.")] = False,
) -> None:
    """Errors (missing/broken/newer trace, unwritable output) are one ``error:`` line, exit 2."""
    from infertrace.trace.report import build_report

    trace, _ = load_saved(trace_dir)  # a broken tensors file is reported too
    out = output if output is not None else Path(trace_dir) / "report.html"
    trace_files = {(Path(trace_dir) / n).resolve() for n in ("trace.json", "tensors.safetensors", "timing.json")}
    if out.resolve() in trace_files:
        raise InfertraceError(f"-o {out} is a file of the trace itself; write the report somewhere else")
    if out.is_dir():
        raise InfertraceError(f"-o {out} is a directory; give a file name such as {out / 'report.html'}")
    if out.exists() and not force:
        raise InfertraceError(f"{out} exists; pass --force to replace it or choose another -o")
    try:
        html = build_report(trace, source=str(trace_dir))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise InfertraceError(f"{trace_dir}: malformed record, cannot build the report ({type(e).__name__}: {e})") from None
    try:
        out.write_text(html, encoding="utf-8")
    except OSError as e:
        raise InfertraceError(f"cannot write {out}: {e.strerror or e}") from None
    typer.echo(f"wrote {out} ({len(html.encode()) / 1e3:.1f} kB, {len(trace.steps)} steps)")
