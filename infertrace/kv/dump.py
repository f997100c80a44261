"""``dump-kv``: the KV cache right after step N, as one JSON-ready dict.

Two sources build the same dict (so one renderer, :func:`infertrace.trace.render_kv.render_kv_dump`,
prints both):

* a live run: :func:`dump_kv_at_step` steps an engine up to and including step N and
  describes the backend at the end of that step (before requests finishing at N are freed,
  the same moment :class:`~infertrace.trace.records.KVRec` ``physical`` is taken);
* a saved trace: :func:`dump_from_step` rebuilds it from one :class:`StepTrace` (no K/V
  values beyond what the trace kept).

What it mirrors: for ``cells``, llama.cpp ``src/llama-kv-cache.cpp`` ``find_slot`` debug print
(``LLAMA_KV_CACHE_DEBUG``: ``n = used_max_p1, used, head, size``, a character per cell, ``.``
empty, the owner's seq_id, ``M`` for several owners, then per-seq pos min/max); for ``paged``,
TensorRT-LLM ``_torch/pyexecutor/resource_manager.py`` ``KVCacheManager`` (pool, free blocks,
per-request block offsets) and vLLM's block manager ``slot_mapping``.
"""

from __future__ import annotations

import bisect

from typing import Any, Sequence

from infertrace.errors import InfertraceError
from infertrace.ranges import ranges_text

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
    """:func:`ranges_text` of ``range(a, b + 1)`` without building it: ``"a..b"`` or ``"a"``."""
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
        values: K/V values (see :func:`read_values`) or None.
    """
    d: dict[str, Any] = {"step": step, "backend": backend, "source": source, "idle": not batch, "dtype": dtype,
                         "n_layer": n_layer, "physical_shape": list(physical_shape), "batch": batch, "writes": writes,
                         "finished": dict(finished or {}), "physical": physical, "values": values}
    if backend == "cells":
        d["layout"] = cells_layout(physical)
    return d


# ----------------------------------------------------------------------------- live: engine state -> dict


def read_values(kv: Any, layer: int, head: int, positions: Sequence[int] | None, full: bool) -> dict[str, Any]:
    """K/V of kv head ``head`` in ``layer`` for the chosen positions of every request in the cache,
    read at their physical location (cell index, or slot ``= block * B + offset``).

    Args:
        kv: a ``CellsKV`` or ``PagedKV``.
        positions: logical positions (None = every cached position of each request).
        full: all ``head_dim`` values instead of the first :data:`N_FIRST`.

    Returns:
        ``{"layer", "head", "full", "n_values", "requests": [{"seq_id", "len", "rows": [{"pos", "cell"|"slot",
        "block", "offset", "k": [float], "v": [float]}]}]}``; values are float32 read as Python floats.

    Raises:
        InfertraceError: none of ``positions`` is cached by any request.
    """
    n = None if full else N_FIRST
    wanted = None if positions is None else set(positions)
    reqs = []
    if kv.kind == "cells":
        seqs = sorted({s for c in kv.snapshot()["cells"] for s in c["seq_ids"]})
        for sid in seqs:
            cells = kv.cells_of(sid)  # [(cell, pos)] ordered by pos
            rows = []
            for cell, p in cells:
                if wanted is not None and p not in wanted:
                    continue
                k = kv.k[layer][cell, head, :n]  # [hd] or [N_FIRST]
                v = kv.v[layer][cell, head, :n]
                rows.append({"pos": p, "cell": cell, "k": k.float().tolist(), "v": v.float().tolist()})
            reqs.append({"seq_id": sid, "len": len(cells), "rows": rows})
    else:
        for sid in sorted(kv.tables):
            L = kv.seq_len(sid)
            rows = []
            for p in range(L):
                if wanted is not None and p not in wanted:
                    continue
                slot = kv.slot(sid, p)
                blk, off = divmod(slot, kv.B)
                k = kv.pool[layer][blk, 0, head, off, :n]  # [hd] or [N_FIRST]
                v = kv.pool[layer][blk, 1, head, off, :n]
                rows.append({"pos": p, "slot": slot, "block": blk, "offset": off, "k": k.float().tolist(),
                             "v": v.float().tolist()})
            reqs.append({"seq_id": sid, "len": L, "rows": rows})
    if positions is not None and reqs and not any(r["rows"] for r in reqs):
        lens = ", ".join(f"seq {r['seq_id']}: 0..{r['len'] - 1}" for r in reqs)
        raise InfertraceError(f"--positions {ranges_text(positions)}: no request has those positions cached at this step ({lens})")
    head_dim = kv.k[0].shape[-1] if kv.kind == "cells" else kv.pool[0].shape[-1]
    return {"layer": layer, "head": head, "full": full, "n_values": head_dim if full else min(N_FIRST, head_dim),
            "requests": reqs}


def describe_live(ctx: dict[str, Any], layer: int | None = None, head: int | None = None,
                  positions: Sequence[int] | None = None, full: bool = False) -> dict[str, Any]:
    """Dump dict from an engine step context (the ``ctx`` a tracer's ``end_step`` receives:
    step, batch, inp (None when idle), kv, finished)."""
    kv, inp, batch = ctx["kv"], ctx["inp"], ctx["batch"]
    rows, r, out_batch, writes = {}, 0, [], []
    for c in batch.chunks:
        rows[c.req.seq_id] = list(range(r, r + c.T))
        r += c.T
        out_batch.append({"seq_id": c.req.seq_id, "phase": c.phase, "C": c.C, "T": c.T, "rows": rows[c.req.seq_id]})
    phys = kv.snapshot()
    if kv.kind == "cells":
        idx = inp.extra["cell_idx"].tolist() if inp is not None else []
        for c in batch.chunks:
            writes.append({"seq_id": c.req.seq_id, "pos": list(range(c.C, c.C + c.T)),
                           "cells": [idx[i] for i in rows[c.req.seq_id]]})
        phys["head_before"] = inp.extra["head_before"] if inp is not None else kv.head
        phys["head_after"] = kv.head
        shape = [kv.size, *kv.k[0].shape[1:]]
        dtype = kv.k[0].dtype
    else:
        sm = inp.extra["slot_mapping"].tolist() if inp is not None else []
        for c in batch.chunks:
            writes.append({"seq_id": c.req.seq_id, "pos": list(range(c.C, c.C + c.T)),
                           "slots": [sm[i] for i in rows[c.req.seq_id]]})
        shape = list(kv.pool[0].shape)
        dtype = kv.pool[0].dtype
    values = None
    if layer is not None or head is not None:
        il = layer if layer is not None else getattr(kv, "kv_layers", [0])[0]  # hybrid: first attention layer
        values = read_values(kv, kv.phys_layer(il) if hasattr(kv, "phys_layer") else il, head or 0, positions, full)
        values["layer"] = il
    d = build_dump(step=ctx["step"], backend=kv.kind, physical=phys, physical_shape=shape,
                   dtype=str(dtype).replace("torch.", ""), n_layer=len(kv.k) if kv.kind == "cells" else len(kv.pool),
                   batch=out_batch, writes=writes, finished={str(k): v for k, v in ctx["finished"].items()},
                   values=values)
    if getattr(kv, "state", None) is not None:  # hybrid: the GDN state beside the KV (constant shape)
        from infertrace.trace.hybrid_rec import state_summary

        d["state"] = state_summary(kv.state, inp is not None)
    return d


class StepProbe:
    """A tracer that records nothing but calls ``fn(ctx)`` at the end of step ``target``
    (after sampling, before finished requests are freed) and keeps the result."""

    enabled = True
    layers: frozenset[int] = frozenset()

    def __init__(self, target: int, fn: Any):
        self.target, self.fn, self.result = target, fn, None

    def tap(self, name: str, **tensors: Any) -> None:
        return None

    def begin_step(self) -> None:
        return None

    def end_step(self, ctx: dict[str, Any]) -> None:
        if ctx["step"] == self.target:
            self.result = self.fn(ctx)


def dump_kv_at_step(loaded: Any, prompts: list[Any], opts: Any, step: int, layer: int | None = None,
                    head: int | None = None, positions: Sequence[int] | None = None, full: bool = False) -> dict[str, Any]:
    """Run ``prompts`` up to and including ``step`` and return the cache right after it.

    Args:
        loaded: from :func:`infertrace.runner.load_model`.
        prompts: :class:`~infertrace.runner.PromptSpec` list (seq_ids in list order).
        opts: :class:`~infertrace.engine.engine.EngineOptions` (backend, sizes, batching) as ``run`` uses them.
        step: step number (0-based, idle steps count).
        layer, head: with either given, K/V values of that layer and kv head (defaults 0) are added.
        positions: logical positions for the values (None = all cached).
        full: all head_dim values instead of the first 4.

    Returns:
        the dict of :func:`build_dump`.

    Raises:
        InfertraceError: step out of range (``step 12 out of range: the run has steps 0..7``),
            layer/head out of range, positions not cached, or any run error.
    """
    from infertrace.engine.engine import Engine  # the engine imports the backends: import it here, not at module level
    from infertrace.runner import encode_prompt

    cfg = loaded.config
    if layer is not None and not 0 <= layer < cfg.n_layer:
        raise InfertraceError(f"--layer {layer} out of range: the model has layers 0..{cfg.n_layer - 1}")
    if head is not None and not 0 <= head < cfg.n_head_kv:
        raise InfertraceError(f"--head {head} out of range: the cache holds kv heads 0..{cfg.n_head_kv - 1} "
                              f"(n_head_kv = {cfg.n_head_kv}; query heads share them, GQA)")
    if step < 0:
        raise InfertraceError(f"step {step} out of range: steps are numbered from 0")
    if not prompts:
        raise InfertraceError("no prompt given; pass --prompt TEXT (or --prompts FILE)")
    probe = StepProbe(step, lambda ctx: describe_live(ctx, layer, head, positions, full))
    eng = Engine(loaded.model, loaded.tokenizer, opts, probe)
    for s in prompts:
        eng.add_request(encode_prompt(loaded.tokenizer, s), s.params, s.arrival_step, s.text)
    while eng.step_no <= step and eng.step() is not None:
        pass
    if probe.result is None:
        raise InfertraceError(f"step {step} out of range: the run has steps 0..{eng.step_no - 1}")
    probe.result["attention"] = eng.attn_impl
    return probe.result


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
            w["cells"] = _expand(d.get("cells", ""))
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
    if getattr(st, "hybrid", None) and isinstance(st.hybrid.get("state"), dict):
        d["state"] = st.hybrid["state"]
    return d


def _expand(text: str) -> list[int]:
    """Inverse of :func:`ranges_text`: ``"0..2,5"`` -> ``[0, 1, 2, 5]`` (``"-"``/empty -> [])."""
    out: list[int] = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part or part == "-":
            continue
        a, _, b = part.partition("..")
        out += list(range(int(a), int(b or a) + 1))
    return out


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


