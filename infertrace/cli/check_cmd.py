"""``infertrace check TRACE``: assert the trace invariants (:mod:`infertrace.trace.check`) on a saved
trace, ours or llama.cpp's: ``trace.json`` and, when the trace kept tensors, ``tensors.safetensors``
(opened and its header checked as every command does, then :func:`~infertrace.trace.check.check_tensors`:
names, shapes and the values the records quote). Exit 0 when all hold, 1 at the first violation (step,
seq, variable), 2 when the trace cannot be read.
"""

import json
import re
from pathlib import Path
from typing import Annotated

import typer

from infertrace.errors import InfertraceError
from infertrace.trace.check import Violation, check_tensors, check_trace
from infertrace.trace.schema import validate_trace
from infertrace.trace.store import TENSORS, load_tensors, read_manifest

HELP = ("Check a saved trace's invariants: positions contiguous per sequence across chunks, RoPE angles consistent "
        "with positions, causality and the sliding window recomputed from positions, no cross-sequence visibility, "
        "cells/blocks owned and freed consistently, verify cells, the hybrid layer map, and the tensor file when the "
        "trace kept one. Exit 1 with the first violation (step, seq, variable).")


def _safe(text: str) -> str:
    """Terminal-safe: control characters and non-ASCII as backslash escapes (the trace is untrusted)."""
    return "".join(c if 32 <= ord(c) < 127 else c.encode("unicode_escape").decode("ascii") for c in text)


def check(
    trace: Annotated[Path, typer.Argument(help="Trace directory (run --save DIR).", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    m = read_manifest(trace, consistency=False)  # types, sizes, limits: exit 2 when they fail
    tensors = load_tensors(trace, m)  # keep tensors: the file opened and its header checked (exit 2), as show/diff do
    v, n = check_trace(m)
    if v is None:  # the schema's cross-field consistency is an invariant too: a failure is a violation
        try:
            validate_trace(m, "trace.json")
            n += 1
        except InfertraceError as e:
            msg = str(e).split(": ", 1)[-1]  # "steps[2].batch[1].positions: ..." without the file name
            at = re.match(r"steps\[(\d+)\]", msg)
            v = Violation(step=int(at.group(1)) if at else None, seq_id=None, variable="trace.json",
                          rule="cross-field consistency", detail=msg)
    if v is None and tensors is not None:
        v, k = check_tensors(m, tensors)
        n += k
    read = f"trace.json + {TENSORS} ({len(tensors.index)} tensors)" if tensors is not None else "trace.json (saved with --keep summary: no tensors)"
    runtime = m.get("runtime", "infertrace") if isinstance(m.get("runtime", ""), str) else "?"
    if as_json:
        typer.echo(json.dumps({"ok": v is None, "checks": n, "runtime": runtime, "read": read,
                               "violation": None if v is None else v.__dict__}, ensure_ascii=False))
    elif v is None:
        typer.echo(f"ok: {len(m['steps'])} steps, {n} checks, no violation; read {read}")
    else:
        typer.echo(_safe(v.line()))
    if v is not None:
        raise typer.Exit(1)
