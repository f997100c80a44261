"""``infertrace bisect A B``: the first position, layer and tap where two saved traces diverge.

Thin: load both traces (records and tensors), choose the floor (``--floor``, ``--floor-from C D``
or the stated default), call :func:`infertrace.trace.bisect.bisect`, print it (or ``--json``).
Exit 0 when nothing is above the floor, 1 on a divergence above it, 2 on bad input (traces of
different models or token sequences, broken traces).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from infertrace.errors import InfertraceError
from infertrace.safe_text import json_text, visible
from infertrace.trace.store import load_tensors, load_trace, read_manifest

if TYPE_CHECKING:  # numpy-based: imported when the command runs, so `infertrace --help` stays light
    from infertrace.trace import bisect as bs

HELP = ("Find where two saved traces of one model and one token sequence first diverge: the first position whose "
        "top-1 or logits differ beyond the noise floor, the first layer/tap there (attention vs MLP), and the batch "
        "each trace ran at that step. Exit 0 none above the floor, 1 diverged, 2 bad input.")


def _side(path: Path, seq: Optional[int], prompt_ids: Optional[list[int]] = None) -> tuple[bs.Side, dict[str, Any]]:
    from infertrace.trace import bisect as bs

    m = read_manifest(path)
    tensors = load_tensors(path, m)
    tr = load_trace(path, timings=False, manifest=m)
    name = visible(str(path))
    req = bs.pick_request(tr, name, seq, prompt_ids)
    return bs.load_side(name, tr, tensors, req), m


def _dtype(m: dict[str, Any]) -> str:
    """The compute dtype of a trace: ``options.dtype`` (run records it), else the first step's hidden dtype."""
    d = m.get("options", {}).get("dtype")
    if isinstance(d, str):
        return d
    for st in m.get("steps", []):
        h = st.get("hidden") if isinstance(st, dict) else None
        if isinstance(h, dict) and isinstance(h.get("dtype"), str):
            return h["dtype"]
    return "unknown"


def _default_floor(ma: dict[str, Any], mb: dict[str, Any]) -> bs.Floor:
    from infertrace.trace import bisect as bs

    da, db = (_dtype(m) for m in (ma, mb))
    if da == db == "float32":
        f, why = bs.DEFAULT_FLOOR_FP32, "default for two float32 traces"
    else:
        f, why = bs.DEFAULT_FLOOR_LOW, f"default for {visible(str(da))} vs {visible(str(db))} traces"
    ea, eb = (visible(str(m.get("runtime", "infertrace"))) for m in (ma, mb))
    if ea != eb:  # e.g. llama.cpp's quantised dot products against our dequantised float path
        why += f"; A and B were computed by different engines ({ea}, {eb}), whose kernels differ: measure the floor"
    return bs.Floor(logits=f, default=f, source=f"{why} (no --floor or --floor-from given; measure one with --floor-from C D)")


def _forced_notes(a: Path, b: Path, ma: dict[str, Any], mb: dict[str, Any]) -> list[str]:
    """A note when one trace was teacher-forced on the other (``options.teacher_force.trace_sha256`` is the
    SHA-256 of the other's ``trace.json``): the two emitted the same tokens by construction."""
    import hashlib

    from infertrace.safe_io import MAX_MANIFEST_BYTES, read_regular

    out = []
    for (x, mx), (y, my), nx, ny in (((a, ma), (b, mb), "A", "B"), ((b, mb), (a, ma), "B", "A")):
        tf = (my.get("options") or {}).get("teacher_force")
        if not isinstance(tf, dict):
            continue
        p = x / "trace.json" if x.is_dir() else x
        same = hashlib.sha256(read_regular(p, MAX_MANIFEST_BYTES, "trace.json")).hexdigest() == tf.get("trace_sha256")
        out.append(f"{ny} was teacher-forced on {nx} (run --teacher-force): it emitted {nx}'s tokens, so every position "
                   "compares" if same else f"{ny} was teacher-forced on another trace than {nx} "
                   f"({visible(str(tf.get('trace')))[:80]}): its tokens are that trace's")
    return out


def _finite(x: Any) -> Any:
    """``x`` with non-finite floats written as the strings "inf" / "-inf" / "nan" (JSON has none)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def bisect(
    a: Annotated[Path, typer.Argument(help="First trace directory (A, the reference).", show_default=False)],
    b: Annotated[Path, typer.Argument(help="Second trace directory (B).", show_default=False)],
    floor: Annotated[Optional[float], typer.Option("--floor", help="Relative-L2 noise floor for logits rows and taps (explicit).")] = None,
    floor_from: Annotated[Optional[tuple[Path, Path]], typer.Option("--floor-from", help="Measure the floor from two traces C D whose difference is noise (e.g. one runtime in float32 and bfloat16).")] = None,
    seq: Annotated[Optional[int], typer.Option("--seq", help="seq_id of the request compared in A (default: the first); B's request is the one with the same prompt tokens.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    from infertrace.trace import bisect as bs

    if floor is not None and floor_from is not None:
        raise InfertraceError("give --floor F or --floor-from C D, not both")
    if floor is not None and not (math.isfinite(floor) and floor >= 0):
        raise InfertraceError(f"--floor must be a finite number >= 0 (got {floor})")
    sa, ma = _side(a, seq)
    sb, mb = _side(b, sa.seq_id, sa.tokens[:sa.n_prompt])
    bs.same_model(ma, mb, sa.name, sb.name)
    cfg = ma.get("config", {})
    if floor is not None:
        fl = bs.Floor(logits=floor, default=floor, source="--floor (given)")
    elif floor_from is not None:
        c, d = floor_from
        try:  # an error in C or D names the option it came from
            sc, mc = _side(c, None)
            sd, md = _side(d, sc.seq_id, sc.tokens[:sc.n_prompt])
            bs.same_model(ma, mc, sa.name, sc.name)
            bs.same_model(mc, md, sc.name, sd.name)
        except InfertraceError as e:
            raise InfertraceError(f"--floor-from C D: {e}") from None
        fp32 = _dtype(ma) == _dtype(mb) == "float32"
        fl = bs.measure_floor(sc, sd, cfg, f"measured from --floor-from {sc.name} {sd.name}",
                              bs.MIN_FLOOR_FP32 if fp32 else bs.MIN_FLOOR_LOW)
    else:
        fl = _default_floor(ma, mb)
    res = bs.bisect(sa, sb, cfg, fl)
    res["notes"] = res.get("notes", []) + _forced_notes(a, b, ma, mb)
    if as_json:
        typer.echo(json_text(_finite(res), default=str))
    else:
        from infertrace.present.render_bisect import bisect_lines

        for line in bisect_lines(res):
            typer.echo(line)
    if res["diverged"]:
        raise typer.Exit(1)
