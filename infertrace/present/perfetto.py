"""Request lanes as Chrome trace-event JSON (``infertrace export DIR --format perfetto``), torch-free.

The JSON Object Format of the Trace Event Format (the one ui.perfetto.dev and chrome://tracing open):
``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}`` with

- ``"M"`` metadata events: ``process_name`` (the run), ``thread_name`` / ``thread_sort_index`` per track;
- ``"X"`` complete events: ``name``, ``cat``, ``ts`` and ``dur`` in microseconds, ``pid``, ``tid``, ``args``.

Tracks (threads of process 1): tid 0 ``steps`` holds one slice per engine step (N, who shared it); tid
k + 1 is the k-th request's lane (:class:`infertrace.trace.lanes.Lanes` order), one slice per step it was
scheduled or preempted in, with the step's facts as ``args`` (kind, tokens, ``num_computed_tokens``,
positions, prefix hit and its blocks / cells, the block table or cells after the step, the sampled
token and piece, the stop reason, the co-scheduled requests).

Time axis (:func:`infertrace.trace.lanes.step_starts`, stated in ``otherData.time_axis`` and in the
process name): the recorded step wall times (``time_ms`` of ``timing.json``) laid end to end, so a slice's
``dur`` is its step's wall time; a trace without timings gets 1 ms per step (``ts`` = step × 1000 µs).
Slices on one track never overlap and events are sorted by ``ts``.

Strings from the trace (model name, pieces, stop reasons) go through :func:`infertrace.safe_text.visible`
and ``json.dumps(..., ensure_ascii=True)``: the file is ASCII, no string can break out of its JSON value.
At most :data:`MAX_SLICES` lane slices are written (the rest counted in ``otherData.truncated_slices``).
"""

from __future__ import annotations

import json
from typing import Any

from infertrace.safe_text import visible
from infertrace.trace.lanes import Lanes, Slot, build_lanes, step_starts
from infertrace.trace.records import RunTrace

#: lane slices written at most (each step slice counts too); the rest is counted, not written
MAX_SLICES = 500_000
PID = 1


def _s(x: Any, limit: int = 200) -> str:
    t = visible(x)
    return t if len(t) <= limit else t[: limit - 1] + "…"


def _us(ms: float) -> float:
    return round(ms * 1000.0, 3)


def slot_args(s: Slot, shared: list[int], n_tokens: int, time_ms: float) -> dict[str, Any]:
    """The ``args`` of one lane slice (JSON-ready; trace strings made visible and clipped)."""
    a: dict[str, Any] = {"step": s.step, "seq_id": s.seq_id, "kind": s.kind, "tokens": s.T,
                         "num_computed_tokens": s.C, "positions": s.positions or "-", "batch_tokens_N": n_tokens,
                         "shared_with": [x for x in shared if x != s.seq_id], "step_time_ms": time_ms}
    if s.kind == "chunk":
        a["chunk"] = f"{s.chunk}/{s.chunks}"
    if s.rows:
        a["packed_rows"] = s.rows
    if s.hit:
        a["prefix_hit_tokens"] = s.hit
        if s.hit_blocks:
            a["prefix_hit"] = _s(s.hit_blocks)
    if s.blocks:
        a["blocks_or_cells_after"] = _s(s.blocks)
    if s.sampled is not None:
        a["sampled"] = s.sampled
        a["sampled_piece"] = _s(s.piece if s.piece is not None else "")
    if s.finished:
        a["finished"] = _s(s.finished, 80)
    if s.kind == "verify":
        a["drafted"], a["accepted"] = s.drafted, s.accepted
    return a


def _meta(name: str, tid: int | None, args: dict[str, Any]) -> dict[str, Any]:
    e: dict[str, Any] = {"name": name, "ph": "M", "pid": PID, "args": args}
    if tid is not None:
        e["tid"] = tid
    return e


def trace_events(trace: RunTrace, source: str = "") -> dict[str, Any]:
    """The whole trace-event document (see the module docstring) for ``trace``.

    Args:
        trace: a loaded trace (its ``time_ms`` merged from ``timing.json``, :func:`infertrace.trace.store.load_trace`).
        source: what to name as the trace's origin in ``otherData`` (the directory).

    Returns:
        ``{"traceEvents": list, "displayTimeUnit": "ms", "otherData": dict}``, JSON-ready.
    """
    lanes: Lanes = build_lanes(trace)
    start, dur, axis = step_starts(lanes)
    axis_text = ("wall: each step's recorded wall time (time_ms of timing.json), steps laid end to end"
                 if axis == "wall" else "step: no step times recorded; 1 ms per step, ts = step x 1000 us")
    tid = {sid: k + 1 for k, sid in enumerate(lanes.seqs)}
    m = trace.model if isinstance(trace.model, dict) else {}
    proc = f"runtime {_s(trace.runtime, 40)} · {_s(m.get('file', '?'), 120)} · time axis {axis}"
    events: list[dict[str, Any]] = [_meta("process_name", None, {"name": proc}),
                                    _meta("thread_name", 0, {"name": "steps (whole batch)"}),
                                    _meta("thread_sort_index", 0, {"sort_index": 0})]
    for sid, t in tid.items():
        events += [_meta("thread_name", t, {"name": f"seq {sid}"}), _meta("thread_sort_index", t, {"sort_index": t})]
    slices: list[dict[str, Any]] = []
    dropped = 0
    for st in lanes.steps:
        slots = lanes.at(st)
        ts, d = _us(start[st]), _us(dur[st])
        seqs = [s.seq_id for s in slots if s.kind != "preempted"]
        for s in [None, *slots]:
            if len(slices) >= MAX_SLICES:
                dropped += 1
                continue
            if s is None:
                slices.append({"name": f"step {st} · N={lanes.n_tokens.get(st, 0)}" if slots else f"step {st} · idle",
                               "cat": "step" if slots else "idle", "ph": "X", "ts": ts, "dur": d, "pid": PID, "tid": 0,
                               "args": {"step": st, "batch_tokens_N": lanes.n_tokens.get(st, 0), "requests": seqs,
                                        "preempted": [x.seq_id for x in slots if x.kind == "preempted"],
                                        "step_time_ms": lanes.time_ms.get(st, 0.0)}})
                continue
            name = s.label() + (f" ■ {_s(s.finished, 40)}" if s.finished else "") + (f" hit {s.hit}" if s.hit else "")
            slices.append({"name": name, "cat": s.kind, "ph": "X", "ts": ts, "dur": d, "pid": PID, "tid": tid[s.seq_id],
                           "args": slot_args(s, seqs, lanes.n_tokens.get(st, 0), lanes.time_ms.get(st, 0.0))})
    slices.sort(key=lambda e: (e["ts"], e["tid"]))
    other = {"producer": "infertrace export --format perfetto", "runtime": _s(trace.runtime, 40),
             "model": _s(m.get("file", "?"), 200), "source": _s(source, 400), "time_axis": axis,
             "time_axis_meaning": axis_text, "steps": len(lanes.steps), "requests": [int(x) for x in lanes.seqs],
             "slices": len(slices), "truncated_slices": dropped,
             "tracks": "tid 0 = whole steps; tid k+1 = the k-th request (thread_name 'seq <seq_id>')"}
    return {"traceEvents": events + slices, "displayTimeUnit": "ms", "otherData": other}


def encode(doc: dict[str, Any]) -> bytes:
    """A trace-event document as compact ASCII JSON bytes (one trailing newline)."""
    return (json.dumps(doc, ensure_ascii=True, allow_nan=False, separators=(",", ":")) + "\n").encode("ascii")


def perfetto_json(trace: RunTrace, source: str = "") -> bytes:
    """:func:`trace_events` as compact ASCII JSON bytes (one trailing newline)."""
    return encode(trace_events(trace, source))
