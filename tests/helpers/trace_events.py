"""A structural check of Chrome trace-event JSON (the JSON Object Format of the Trace Event Format that
ui.perfetto.dev and chrome://tracing read), written from the format's document, not from infertrace:
a top-level object with a ``traceEvents`` list; every event an object with a string ``name``, a
one-character ``ph``, integer ``pid``; ``"X"`` complete events with numeric ``ts`` / ``dur`` >= 0
(microseconds) and an integer ``tid``; ``"M"`` metadata events named ``process_name``, ``process_labels``,
``process_sort_index``, ``thread_name`` or ``thread_sort_index`` with an ``args`` object (``name`` a
string for the *_name ones); optional ``args`` an object, ``cat`` a string."""

from __future__ import annotations

import math
from typing import Any

META_NAMES = {"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"}


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_trace_events(doc: Any) -> dict[int, list[tuple[float, float, dict]]]:
    """Assert ``doc`` is valid trace-event JSON whose complete events are sorted by ``ts`` and never overlap on one
    track; return the ``X`` events per ``tid`` as ``[(ts, dur, event)]``."""
    assert isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list), "top level: {traceEvents: [...]}"
    if "displayTimeUnit" in doc:
        assert doc["displayTimeUnit"] in ("ms", "ns")
    tracks: dict[int, list[tuple[float, float, dict]]] = {}
    named: set[int] = set()
    last_ts = -math.inf
    for e in doc["traceEvents"]:
        assert isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("ph"), str) and len(e["ph"]) == 1, e
        assert _int(e.get("pid")), e
        if "args" in e:
            assert isinstance(e["args"], dict), e
        if "cat" in e:
            assert isinstance(e["cat"], str), e
        if e["ph"] == "M":
            assert e["name"] in META_NAMES and isinstance(e.get("args"), dict), e
            if e["name"].endswith("_name"):
                assert isinstance(e["args"].get("name"), str), e
            if e["name"].startswith("thread"):
                assert _int(e.get("tid")), e
                if e["name"] == "thread_name":
                    named.add(e["tid"])
            continue
        assert e["ph"] == "X", f"unexpected phase {e['ph']!r}"
        assert _num(e.get("ts")) and _num(e.get("dur")) and e["dur"] >= 0 and _int(e.get("tid")), e
        assert e["ts"] >= last_ts, f"ts not monotonic at {e}"
        last_ts = e["ts"]
        tracks.setdefault(e["tid"], []).append((float(e["ts"]), float(e["dur"]), e))
    for tid, xs in tracks.items():
        assert tid in named, f"track {tid} has no thread_name"
        for (t0, d0, _), (t1, _, e1) in zip(xs, xs[1:]):
            assert t0 + d0 <= t1 + 1e-6, f"track {tid}: slices overlap at {e1}"
    return tracks
