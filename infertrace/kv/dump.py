"""``dump-kv``: the KV cache right after step N, as one JSON-ready dict.

The live source of the dump dict (:mod:`infertrace.trace.kv_dump` holds the dict itself, its
layout and the saved-trace source): :func:`infertrace.runner.dump_kv_at_step` steps an engine up to
and including step N and :func:`describe_live` describes the memory at the end of that step (before requests finishing at N are
freed, the same moment :class:`~infertrace.trace.records.KVRec` ``physical`` is taken), with
K/V values read from the live cache (:func:`read_values`).

What it mirrors: for ``cells``, llama.cpp ``src/llama-kv-cache.cpp`` ``find_slot`` debug print
(``LLAMA_KV_CACHE_DEBUG``: ``n = used_max_p1, used, head, size``, a character per cell, ``.``
empty, the owner's seq_id, ``M`` for several owners, then per-seq pos min/max); for ``paged``,
TensorRT-LLM ``_torch/pyexecutor/resource_manager.py`` ``KVCacheManager`` (pool, free blocks,
per-request block offsets) and vLLM's block manager ``slot_mapping``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from infertrace.errors import InfertraceError
from infertrace.ranges import ranges_text
from infertrace.trace.kv_dump import N_FIRST, build_dump

if TYPE_CHECKING:
    from infertrace.kv.base import Memory


# ----------------------------------------------------------------------------- live: engine state -> dict


def read_values(kv: Memory, layer: int, head: int, positions: Sequence[int] | None, full: bool) -> dict[str, Any]:
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
    reqs = kv.dump_values(layer, head, n, wanted)
    if positions is not None and reqs and not any(r["rows"] for r in reqs):
        lens = ", ".join(f"seq {r['seq_id']}: 0..{r['len'] - 1}" for r in reqs)
        raise InfertraceError(f"--positions {ranges_text(positions)}: no request has those positions cached at this step ({lens})")
    head_dim = kv.describe()["head_dim"]
    return {"layer": layer, "head": head, "full": full, "n_values": head_dim if full else min(N_FIRST, head_dim),
            "requests": reqs}


def describe_live(ctx: Any, layer: int | None = None, head: int | None = None,
                  positions: Sequence[int] | None = None, full: bool = False) -> dict[str, Any]:
    """Dump dict from an engine step context, read from the live backend at the end of the step.

    Args:
        ctx: the :class:`~infertrace.engine.engine.StepContext` a tracer's ``end_step`` receives:
            ``step``, ``batch`` (the ScheduledBatch), ``inp`` (the step's attention inputs, None when
            idle), ``kv`` (the memory: read through ``describe``, ``snapshot``, ``dump_writes``,
            ``dump_values``), ``finished``.
        layer, head, positions, full: with ``layer`` or ``head`` given, K/V values as
            :func:`read_values` reads them.

    Returns:
        the dict of :func:`infertrace.trace.kv_dump.build_dump` (``source = "live"``; ``dtype`` the
        cache's torch dtype name, e.g. ``"float32"``).

    Raises:
        InfertraceError: ``positions`` not cached by any request (:func:`read_values`).
    """
    kv, inp, batch = ctx.kv, ctx.inp, ctx.batch
    rows, r, out_batch, writes = {}, 0, [], []
    for c in batch.chunks:
        rows[c.req.seq_id] = list(range(r, r + c.T))
        r += c.T
        out_batch.append({"seq_id": c.req.seq_id, "phase": c.phase, "C": c.C, "T": c.T, "rows": rows[c.req.seq_id]})
    phys = kv.snapshot()
    writes, heads = kv.dump_writes(inp, rows)
    phys.update(heads)  # cells: head before / after the step
    mem = kv.describe()
    values = None
    if layer is not None or head is not None:
        il = layer if layer is not None else mem["kv_layers"][0]  # hybrid: first attention layer
        values = read_values(kv, kv.phys_layer(il), head or 0, positions, full)
        values["layer"] = il
    d = build_dump(step=ctx.step, backend=mem["kind"], physical=phys, physical_shape=mem["physical_shape"],
                   dtype=mem["dtype"], n_layer=mem["n_layer"], batch=out_batch, writes=writes,
                   finished={str(k): v for k, v in ctx.finished.items()}, values=values)
    state = kv.recurrent_state()
    if state is not None:  # hybrid: the GDN state beside the KV (constant shape)
        d["state"] = state.describe_state(inp is not None)
    return d
