"""The ``dump-kv`` dict, torch-free: the KV cache right after step N as one JSON-ready dict.

Two sources build the same dict with :func:`build_dump` (so one renderer,
:func:`infertrace.present.render_kv.render_kv_dump`, prints both):

* a live run: :func:`infertrace.runner.dump_kv_at_step` steps an engine up to and including
  step N and describes the backend at the end of that step (before requests finishing at N are
  freed, the same moment :class:`~infertrace.trace.records.KVRec` ``physical`` is taken);
* a saved trace: :func:`dump_from_step` rebuilds it from one :class:`StepTrace` (no K/V
  values beyond what the trace kept; :mod:`infertrace.trace.saved_kv` adds saved tensors).

What it mirrors: for ``cells``, llama.cpp ``src/llama-kv-cache.cpp`` ``find_slot`` debug print
(``LLAMA_KV_CACHE_DEBUG``: ``n = used_max_p1, used, head, size``, a character per cell, ``.``
empty, the owner's seq_id, ``M`` for several owners, then per-seq pos min/max); for ``paged``,
TensorRT-LLM ``_torch/pyexecutor/resource_manager.py`` ``KVCacheManager`` (pool, free blocks,
per-request block offsets) and vLLM's block manager ``slot_mapping``.
"""

from __future__ import annotations

import bisect
from typing import Any

from infertrace.errors import InfertraceError
from infertrace.ranges import parse_ranges

#: leading values of head_dim shown per K/V row unless ``full``
N_FIRST = 4
#: characters of the compact cell map per line
MAP_WIDTH = 64
_SEQ_CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


# ----------------------------------------------------------------------------- derived layout (pure)


def seq_char(seq_id: int) -> str:
    """One character per seq_id in the cell map: ``0-9``, then ``a-z``, ``A-Z``, then ``#``."""
    return _SEQ_CHARS[seq_id] if 0 <= seq_id < len(_SEQ_CHARS) else "#"


#: cells drawn in the character map at most (a longer map ends with "… N more cells")
MAX_MAP_CELLS = 1 << 16


def cells_layout(physical: dict[str, Any]) -> dict[str, Any]:
    """Stretches and character map of a cells snapshot (:meth:`CellsKV.snapshot`).

    A stretch is a maximal run of consecutive cells with the same owner set and consecutive
    positions (or a run of empty cells); the map covers cells ``0..max(n_kv, used_max_p1)-1``
    with one character per cell (``.`` empty, seq char, ``M`` several owners), at most
    :data:`MAX_MAP_CELLS` of them (``map_cells_total`` says how many there were). Pure function
    of the dict, so it works on saved traces; the work is O(cells used), never O(size).

    Returns:
        ``{"stretches": [{"first", "last", "cells", "seq_ids", "pos"}], "map": str, "map_cells": int,
        "used_max_p1": int}``; ``pos`` is ``None`` for empty stretches.
    """
    size = int(physical["size"])
    by_cell = {int(c["cell"]): (int(c["pos"]), tuple(c["seq_ids"])) for c in physical.get("cells", [])}
    used = sorted(by_cell)
    used_max_p1 = used[-1] + 1 if used else 0
    stretches: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    i = 0
    while i < size:  # O(cells used): a run of empty cells is crossed in one jump, never cell by cell
        if i not in by_cell and cur is not None and not cur["seq_ids"] and cur["_last_pos"] < 0:
            j = bisect.bisect_right(used, i)
            nxt = used[j] if j < len(used) else size
            cur["last"], i = nxt - 1, nxt
            continue
        pos, owners = by_cell.get(i, (-1, ()))
        if cur is not None and tuple(cur["seq_ids"]) == owners and (
                (pos < 0 and cur["_last_pos"] < 0) or (pos >= 0 and cur["_last_pos"] >= 0 and pos == cur["_last_pos"] + 1)):
            cur["last"], cur["_last_pos"] = i, pos
            i += 1
            continue
        cur = {"first": i, "last": i, "seq_ids": list(owners), "_first_pos": pos, "_last_pos": pos}
        stretches.append(cur)
        if i >= used_max_p1:  # everything after the last used cell is one empty stretch
            cur["last"] = size - 1
            break
        i += 1
    for st in stretches:
        first_pos, last_pos = st.pop("_first_pos"), st.pop("_last_pos")
        st["cells"] = _span(st["first"], st["last"])
        st["pos"] = None if first_pos < 0 else _span(first_pos, last_pos)
    n_all = min(size, max(int(physical.get("n_kv", 0)), used_max_p1))
    n_map = min(n_all, MAX_MAP_CELLS)
    chars = []
    for i in range(n_map):
        _, owners = by_cell.get(i, (-1, ()))
        chars.append("." if not owners else seq_char(owners[0]) if len(owners) == 1 else "M")
    return {"stretches": stretches, "map": "".join(chars), "map_cells": n_map, "map_cells_total": n_all,
            "used_max_p1": used_max_p1}


def _span(a: int, b: int) -> str:
    """:func:`infertrace.ranges.ranges_text` of ``range(a, b + 1)`` without building it: ``"a..b"`` or ``"a"``."""
    return f"{a}..{b}" if b > a else f"{a}"


def build_dump(*, step: int, backend: str, physical: dict[str, Any], physical_shape: list[int], dtype: str,
               n_layer: int, batch: list[dict[str, Any]], writes: list[dict[str, Any]],
               finished: dict[str, str] | None = None, values: dict[str, Any] | None = None,
               source: str = "live") -> dict[str, Any]:
    """Assemble the dump dict both sources share (see the module docstring).

    Args:
        physical: the backend snapshot after the step (``CellsKV.snapshot()`` plus
            ``head_before``/``head_after``, or ``PagedKV.snapshot()``).
        physical_shape: per-layer K (and V) storage: cells ``[size, n_kv_heads, head_dim]``;
            paged ``[num_blocks, 2, n_kv_heads, tokens_per_block, head_dim]``.
        batch: what the step computed, per request ``{seq_id, phase, C, T, rows}``.
        writes: where the step's K/V went, per request ``{seq_id, pos: [..], cells: [..]}``
            (cells) or ``{seq_id, pos, slots}`` (paged).
        finished: requests that finished at this step (freed right after it).
        values: K/V values (see :func:`infertrace.capture.kv_views.read_values`) or None.
    """
    d: dict[str, Any] = {"step": step, "backend": backend, "source": source, "idle": not batch, "dtype": dtype,
                         "n_layer": n_layer, "physical_shape": list(physical_shape), "batch": batch, "writes": writes,
                         "finished": dict(finished or {}), "physical": physical, "values": values}
    if backend == "cells":
        d["layout"] = cells_layout(physical)
    return d


# ----------------------------------------------------------------------------- saved trace: StepTrace -> dict


def dump_from_step(st: Any) -> dict[str, Any]:
    """Dump dict from a recorded :class:`~infertrace.trace.records.StepTrace` (live or loaded).

    The K/V values are those the recorder kept (``KVRec.layer_view``: its layer, kv head 0,
    first values of the positions written at this step), not a fresh read.

    Raises:
        InfertraceError: the step was recorded without the ``kv`` variable.
    """
    if st.kv is None:
        raise InfertraceError(f"step {st.step} of the trace has no kv record (it was run with --show without kv)")
    kv = st.kv
    batch = [{"seq_id": r.seq_id, "phase": r.phase, "C": r.C, "T": r.T, "rows": list(r.rows)} for r in st.batch]
    writes = []
    by_sid = {d["seq_id"]: d for d in kv.per_request}
    for r in st.batch:
        d = by_sid.get(r.seq_id, {})
        w: dict[str, Any] = {"seq_id": r.seq_id, "pos": list(r.positions)}
        if kv.backend == "cells":
            w["cells"] = parse_ranges(d["cells"]) if d.get("cells") else []  # validated range text (schema Range)
        else:
            w["slots"] = list(d.get("slot_mapping", []))
        writes.append(w)
    lv = kv.layer_view or {}
    values = None
    if lv.get("requests"):
        key = "cell" if kv.backend == "cells" else "slot"
        where = {(w["seq_id"], p): loc for w in writes for p, loc in zip(w["pos"], w.get("cells", w.get("slots", [])))}
        values = {"layer": lv.get("layer", 0), "head": 0, "full": False, "n_values": N_FIRST, "source": "trace",
                  "requests": [{"seq_id": q["seq_id"], "len": None,
                                "rows": [{**dict(x), **({key: where[(q["seq_id"], x["pos"])]} if (q["seq_id"], x["pos"]) in where else {})}
                                         for x in q["rows"]]}
                               for q in lv["requests"]]}
    finished = {str(r.seq_id): r.finished for r in st.batch if r.finished}
    d = build_dump(step=st.step, backend=kv.backend, physical=dict(kv.physical), physical_shape=kv.physical_shape,
                   dtype=kv.dtype, n_layer=kv.layers, batch=batch, writes=writes, finished=finished,
                   values=values, source="trace")
    if getattr(st, "hybrid", None) and isinstance(st.hybrid.get("state"), dict):  # hybrid: GDN state beside the KV
        d["state"] = st.hybrid["state"]
    return d


#: upper bound for position arguments (no context here is longer; keeps ranges small).
MAX_POSITION = 1 << 20


def parse_positions(text: str | None) -> list[int] | None:
    """``"0,3,5"`` or ``"0..4"`` (mixed: ``"0..2,7"``) -> sorted positions; None/empty -> None.

    Raises:
        InfertraceError: malformed text or a negative/empty range.
    """
    if text is None or not text.strip():
        return None
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        a, sep, b = part.partition("..")
        try:
            lo, hi = int(a), int(b) if sep else int(a)
        except ValueError:
            raise InfertraceError(f"--positions {text!r}: {part!r} is not a position or range (use 0,3,5 or 0..4)") from None
        if lo < 0 or hi < lo:
            raise InfertraceError(f"--positions {text!r}: {part!r} is empty or negative")
        if hi >= MAX_POSITION:
            raise InfertraceError(f"--positions {text!r}: {hi} is beyond any context this tool runs (< {MAX_POSITION})")
        out.update(range(lo, hi + 1))
    return sorted(out)


