"""Older trace schemas read as the current one: :func:`upgrade` turns a schema 1 ``trace.json`` into
schema 2, in memory (the file is never rewritten), before :func:`infertrace.trace.schema.validate_trace`
checks it like any other.

Schema 2 (issue 27, "Words": one term per concept, as the field names it) renamed three things and
changed nothing else:

==============================  ==============================  =========================================
schema 1                        schema 2                        what it holds
==============================  ==============================  =========================================
``engine``                      ``runtime``                     who computed: ``infertrace``, ``llama.cpp``,
                                                                ``vllm``, ``hf`` (the runtime registry)
``options.engine``              ``options.settings``            the engine settings as the runtime honoured
                                                                them (``EngineOptions``: ctx_size, ...)
``runtime`` (``run --json``,    ``threads``                     thread facts of the run (machine facts:
timing.json)                                                    never in trace.json, timing.json holds them)
``{threads, threads_reason}``   ``{n, reason}``
==============================  ==============================  =========================================

Torch-free and pure: the input is not modified; a document already at the current version comes back
as is. A hostile schema 1 document is still refused with one line (the validator runs afterwards; a
document naming both spellings of a field is refused here, by the old field's name).
"""

from __future__ import annotations

from typing import Any

from infertrace.errors import InfertraceError
from infertrace.trace.records import SCHEMA_VERSION, checked_threads

#: schema 1 -> schema 2: (old path, new path) of each renamed field
RENAMED_V1 = (("engine", "runtime"), ("options.engine", "options.settings"), ("runtime", "threads"))


def threads_v1(rt: Any) -> dict[str, Any] | None:
    """Schema 1's thread facts ``{"threads": int, "threads_reason": str}`` as schema 2's ``{"n", "reason"}``;
    None for anything else (thread facts are informational: a malformed one is dropped, as schema 1 did)."""
    if isinstance(rt, dict) and "threads" in rt:
        return {"n": rt.get("threads"), "reason": rt.get("threads_reason", "")}
    return None


def upgrade(d: dict[str, Any], where: str = "trace.json") -> dict[str, Any]:
    """The schema 2 form of a parsed ``trace.json`` of schema 1 (``d`` itself when it is not schema 1).

    Args:
        d: what ``json.loads`` returned, its ``schema_version`` already checked to be an int
            (:func:`infertrace.trace.store.validate_manifest`); not modified.
        where: the file, for the message.

    Returns:
        a new dict: ``schema_version`` 2, ``engine`` -> ``runtime``, ``options.engine`` ->
        ``options.settings``, valid thread facts -> ``threads`` (:data:`RENAMED_V1`); every other
        value the same object.

    Raises:
        InfertraceError: a schema 1 document holding a field under both its names (``engine`` and a
            ``runtime`` that is not thread facts, or ``options.engine`` and ``options.settings``).
    """
    if not isinstance(d, dict) or d.get("schema_version") != 1:
        return d
    out = {k: v for k, v in d.items() if k not in ("engine", "runtime")}
    out["schema_version"] = SCHEMA_VERSION
    rt = d.get("runtime")
    if rt is not None and not isinstance(rt, dict):  # schema 1's "runtime" was only ever thread facts
        raise InfertraceError(f"{where}: a schema 1 trace's 'runtime' must be thread facts (an object), "
                              f"got {type(rt).__name__}; schema 1 names who computed 'engine'")
    if "engine" in d:
        out["runtime"] = d["engine"]
    th = checked_threads(threads_v1(rt))  # dropped when malformed, as schema 1's reader did
    if th:
        out["threads"] = th
    opts = d.get("options")
    if isinstance(opts, dict) and "engine" in opts:
        if "settings" in opts:
            raise InfertraceError(f"{where}: options.engine and options.settings both given; a schema 1 trace "
                                  "has options.engine only")
        out["options"] = {("settings" if k == "engine" else k): v for k, v in opts.items()}
    return out
