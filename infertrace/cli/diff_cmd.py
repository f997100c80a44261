"""``infertrace diff A B``: the first place two saved traces diverge.

Thin: load both manifests (and tensors when both kept them), call
:func:`infertrace.trace.diff.diff_traces`, print :func:`format_diff`. Exit 0 when equal within
tolerance, 1 on a difference, 2 on a broken trace or bad option.
"""

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer

from infertrace.safe_text import json_text, visible
from infertrace.errors import InfertraceError
from infertrace.trace.diff import (DEFAULT_ATOL, DEFAULT_RTOL, diff_traces, format_diff, unrecorded_lines, without_tap_sources,
                                   without_variables)
from infertrace.trace.store import load_tensors, read_manifest

HELP = ("Compare two saved traces and report the first divergence (step, seq, variable, field, A vs B). "
        "Floats within --atol/--rtol; exit 0 equal, 1 different, 2 broken trace.")


def diff(
    a: Annotated[Path, typer.Argument(help="First trace directory (A).", show_default=False)],
    b: Annotated[Optional[Path], typer.Argument(help="Second trace directory (B); omit it with --seq X --seq Y to compare two requests of A.", show_default=False)] = None,
    atol: Annotated[float, typer.Option("--atol", help="Absolute float tolerance.")] = DEFAULT_ATOL,
    rtol: Annotated[float, typer.Option("--rtol", help="Relative float tolerance.")] = DEFAULT_RTOL,
    ignore: Annotated[Optional[list[str]], typer.Option("--ignore", help="Field path (or prefix) to leave out, e.g. options.attention; repeatable.")] = None,
    tensors: Annotated[bool, typer.Option("--tensors/--no-tensors", help="Compare saved tensors when both traces kept them.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    seq: Annotated[Optional[list[int]], typer.Option("--seq", help="Twice: compare request X with request Y (of A, or X of A with Y of B) per position: tokens, positions, blocks or cells read, what the prefix cache served, logits and K/V.")] = None,
) -> None:
    if atol < 0 or rtol < 0:
        raise InfertraceError(f"--atol and --rtol must be >= 0 (got {atol:g}, {rtol:g})")
    if seq is not None or b is None:
        return diff_seqs(a, b, seq or [], tensors, as_json)
    ma, mb = read_manifest(a), read_manifest(b)
    ta = load_tensors(a, ma) if tensors else None
    tb = load_tensors(b, mb) if tensors else None
    ma, mb = without_tap_sources(ma, mb)
    unrecorded, dropped = unrecorded_lines(ma, mb, visible(str(a)), visible(str(b)))
    if dropped:  # saved with different --keep: compare what both hold, say so once per trace
        ma, mb = without_variables(ma, dropped), without_variables(mb, dropped)
        if not as_json:
            for line in unrecorded:
                typer.echo(line)
    cross = None
    from infertrace.trace.runtime_diff import logical_diff, needs_logical_diff

    from infertrace.trace.backend_diff import backend_diff, backend_lines, needs_backend_diff

    if needs_backend_diff(ma, mb):  # our engine, cells vs paged: the logical comparison diff-backends runs
        res, cross = backend_diff(ma, mb, ta, tb, atol, tuple(ignore or ()))
        if not as_json:
            for line in backend_lines(res, cross, visible(str(a)), visible(str(b))):
                typer.echo(visible(line))
    elif needs_logical_diff(ma, mb):  # e.g. --runtime llama.cpp (cells) vs --runtime vllm (paged): per request and position
        res, cross = logical_diff(ma, mb, tuple(ignore or ()), ta, tb)
    elif ma.get("runtime", "infertrace") != mb.get("runtime", "infertrace"):  # e.g. --runtime llama.cpp vs cells
        from infertrace.trace.engine_diff import cross_engine_diff

        res, cross = cross_engine_diff(ma, mb, tuple(ignore or ()))
    else:
        res = diff_traces(ma, mb, atol, rtol, ta, tb, ignore=ignore or ())
        if not tensors:
            res.tensors_note = "tensors not compared (--no-tensors)"
    from infertrace.trace.engine_diff import settings_differences

    settings = settings_differences(ma, mb)  # llama.cpp settings that change numbers, named when they differ
    if settings and not as_json:
        from infertrace.present.render_llamacpp import settings_lines

        for line in settings_lines(settings, cross is not None):
            typer.echo(line)
    if cross is not None and cross.get("mode") == "logical" and not as_json:
        from infertrace.present.render_runtimes import logical_lines

        for line in logical_lines(res, cross, visible(str(a)), visible(str(b))):
            typer.echo(line)
    elif cross is not None and cross.get("mode") != "backends" and not as_json:
        from infertrace.present.render_llamacpp import cross_engine_lines

        for line in cross_engine_lines(res, cross):
            typer.echo(line)
    if as_json:
        out = {"equal": res.equal, "count": res.count, "atol": atol, "rtol": rtol, "tensors": res.tensors_note,
               "first": None if res.first is None else
               {k: v for k, v in asdict(res.first).items() if k not in ("context_a", "context_b")}}
        if cross is not None:
            out["cross_engine"] = cross
        if settings:
            out["llama_cpp_settings_differ"] = settings
        if dropped:
            out["not_compared"] = {"variables": list(dropped), "why": unrecorded}
        typer.echo(json_text(out, default=str))
    elif not (cross is not None and cross.get("mode") in ("logical", "backends")):  # those lines end with their verdict
        for line in format_diff(res, ma, mb, str(a), str(b)):
            typer.echo(visible(line))  # paths and values come from the files
    if not res.equal:
        raise typer.Exit(1)


def diff_seqs(a: Path, b: Optional[Path], seq: list[int], tensors: bool, as_json: bool) -> None:
    """``diff A --seq X --seq Y`` (two requests of A) or ``diff A B --seq X --seq Y`` (X of A, Y of B):
    :func:`infertrace.trace.seq_diff.compare_seqs`; exit 0 when they agree, 1 when they differ.

    Raises:
        InfertraceError: not exactly two --seq, a seq id the trace does not hold, no B and no --seq.
    """
    from infertrace.trace.seq_diff import compare_seqs, seq_lines

    if len(seq) != 2:
        raise InfertraceError("diff needs two traces (diff A B) or two requests: diff A --seq 0 --seq 1 "
                              f"(got {len(seq)} --seq)" if b is None or seq else "--seq takes two request ids: --seq 0 --seq 1")
    ma = read_manifest(a)
    mb = ma if b is None else read_manifest(b)
    for m, sid, d in ((ma, seq[0], a), (mb, seq[1], b or a)):
        have = sorted(r.get("seq_id") for r in m.get("requests", []) if isinstance(r, dict))
        if sid not in have:
            raise InfertraceError(f"--seq {sid}: {visible(str(d))} has no request {sid} (seq ids {have})")
    ta = load_tensors(a, ma) if tensors else None
    tb = ta if b is None else (load_tensors(b, mb) if tensors else None)
    res = compare_seqs(ma, seq[0], mb, seq[1], ta, tb)
    if as_json:
        typer.echo(json_text(res, default=str))
    else:
        for line in seq_lines(res, visible(str(a)), visible(str(b or a))):
            typer.echo(visible(line))
    if not res["equal"]:
        raise typer.Exit(1)
