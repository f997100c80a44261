"""What a trace, ``dump-kv`` and ``diff-backends`` show of a memory: the views, kept out of the memory.

The memory classes (:mod:`infertrace.kv`) hold only the memory's operations (llama.cpp
``src/llama-memory.h`` ``llama_memory_i``: batch preparation, the forward's write / attend,
sequence operations, lookup, state read and ``snapshot``); what one step looks like to a reader
(``llama_memory_context_i``'s side: where each chunk's K/V went, the heads, the physical summary,
the K/V values of one head) is read here from the memory's state, by its ``layout``:

============== ===================================================== ===========================
``layout``     memory (:mod:`infertrace.kv`)                         storage read
============== ===================================================== ===========================
``cells``      ``CellsKV`` (llama.cpp ``llama_kv_cache``, unified)   ``k``/``v`` ``[size, n_kv_heads, hd]``, ``pos``, ``seq``, ``head``
``cells_iswa`` ``IswaCellsKV`` (``llama_kv_cache_iswa``)             the base pool, and ``swa`` for windowed layers
``cells_streams`` ``CellsStreamsKV`` (``kv_unified = false``)        ``streams[s]``: one ``cells`` memory per sequence
``paged``      ``PagedKV`` (vLLM / TensorRT-LLM block pool)          ``pool[layer]`` ``[num_blocks, 2, n_kv_heads, B, hd]``, ``tables``
``hybrid``     ``HybridKV`` (``llama_memory_hybrid``)                 its attention part ``attn``
============== ===================================================== ===========================

Nothing here imports the memory classes or changes a memory; :func:`describe_live` and
:func:`read_values` are the live source of ``dump-kv`` (:mod:`infertrace.trace.kv_dump` holds the
dict, its layout and the saved-trace source): :func:`infertrace.runner.dump_kv_at_step` steps an
engine up to and including step N and :func:`describe_live` describes the memory at the end of that
step (before requests finishing at N are freed, the same moment
:class:`~infertrace.trace.records.KVRec` ``physical`` is taken).

What the dump mirrors: for ``cells``, llama.cpp ``src/llama-kv-cache.cpp`` ``find_slot`` debug print
(``LLAMA_KV_CACHE_DEBUG``: ``n = used_max_p1, used, head, size``, a character per cell, ``.``
empty, the owner's seq_id, ``M`` for several owners, then per-seq pos min/max); for ``paged``,
TensorRT-LLM ``_torch/pyexecutor/resource_manager.py`` ``KVCacheManager`` (pool, free blocks,
per-request block offsets) and vLLM's block manager ``slot_mapping``.
"""

from __future__ import annotations

from typing import Any, Sequence

from infertrace.capture.mask_views import inputs_summary
from infertrace.errors import InfertraceError
from infertrace.ranges import ranges_text
from infertrace.trace.kv_dump import N_FIRST, build_dump


def _layout(kv: Any) -> str:
    """The memory's ``layout`` (module table).

    Raises:
        InfertraceError: a memory of a layout these views do not know.
    """
    lay = getattr(kv, "layout", None)
    if lay not in ("cells", "cells_iswa", "cells_streams", "paged", "hybrid"):
        raise InfertraceError(f"internal: no view of a memory of layout {lay!r} ({type(kv).__name__})")
    return lay


def _chunks(inp: Any) -> list[Any]:
    return list(inp.chunks) if inp is not None else []


def conventions(kv: Any) -> dict[str, str]:
    """The memory's storage and mask conventions in one line each, for a reader (``diff-backends``):
    ``{"tensors", "mask"}``."""
    lay = _layout(kv)
    if lay == "hybrid":
        return conventions(kv.attn)
    if lay == "paged":
        return {"tensors": "pool per layer", "mask": "no dense tensor: mask_type causal + seq_lens, kv_lens, cu_seqlens, block tables"}
    if lay == "cells_streams":
        return {"tensors": "k_l, v_l per layer, ne = [n_embd_gqa, kv_size, n_stream]",
                "mask": "explicit kq_mask ne = [n_kv, n_tokens_per_stream, 1, n_stream of the ubatch], 0 / -inf"}
    mask = "explicit kq_mask ne = [n_kv, n_tokens_pad, 1, n_stream], 0 / -inf"
    if lay == "cells_iswa":
        mask += "; windowed layers: kq_mask_swa over the SWA pool"
    return {"tensors": "k_l, v_l per layer", "mask": mask}


# ----------------------------------------------------------------------------- one step, as the trace shows it


def placement(kv: Any, inp: Any) -> list[dict[str, Any]]:
    """Per chunk of the step (packed order), where its K/V went, as the trace shows it: cells
    ``{"cells": ranges}`` (streams: global rows, and ``"stream"``); paged ``{"slot_mapping", "block_table"}``
    (a verify chunk: the table its slots were written through). ``[]`` for an idle step."""
    lay = _layout(kv)
    if lay == "hybrid":
        return placement(kv.attn, inp)
    if inp is None:
        return []
    if lay == "cells_streams":
        idx, t = inp.cell_idx.tolist(), inp.n_tps
        return [{"cells": ranges_text(idx[j * t : (j + 1) * t]), "stream": s} for j, s in enumerate(inp.streams)]
    out, r = [], 0
    if lay == "paged":
        sm = inp.slot_mapping.tolist()
        for i, c in enumerate(inp.chunks):
            out.append({"slot_mapping": sm[r : r + c.T],
                        "block_table": (list(kv.tables[c.seq_id]) if c.parents is None else
                                        [b for b in inp.block_tables[i].tolist() if b >= 0])})
            r += c.T
        return out
    idx = inp.cell_idx.tolist()
    for c in inp.chunks:
        out.append({"cells": ranges_text(idx[r : r + c.T])})
        r += c.T
    return out


def heads(kv: Any, inp: Any) -> dict[str, Any]:
    """What the snapshot adds for the step: a unified cells cache's ``head_before`` / ``head_after``
    (llama.cpp's next-slot search start); nothing for a pool or per-stream heads (see ``streams`` of
    the snapshot)."""
    lay = _layout(kv)
    if lay == "hybrid":
        return heads(kv.attn, inp)
    if lay not in ("cells", "cells_iswa"):
        return {}
    return {"head_before": inp.head_before, "head_after": inp.head_after} if inp is not None else \
        {"head_before": kv.head, "head_after": kv.head}


def step_summary(kv: Any, inp: Any) -> dict[str, Any]:
    """The physical side of one step for the backend diff (``diff-backends``): storage shape, what is
    used, each request's cells / slots this step, the heads or block tables, and what attention got
    (:func:`~infertrace.capture.mask_views.inputs_summary`: ``kq_mask`` shape and ``n_kv``, or the lengths
    and mask type)."""
    lay = _layout(kv)
    if lay == "hybrid":
        return step_summary(kv.attn, inp)
    chunks = _chunks(inp)
    if lay == "paged":
        sm = inp.slot_mapping.tolist() if inp is not None else []
        per, r = {}, 0
        for c in chunks:
            per[str(c.seq_id)] = ranges_text(sm[r : r + c.T])
            r += c.T
        d = {"storage": list(kv.pool[0].shape), "used_blocks": kv.num_blocks - len(kv.free), "slots": per,
             "block_tables": {str(s): list(t) for s, t in sorted(kv.tables.items())}}
    else:
        per = {str(c.seq_id): p["cells"] for c, p in zip(chunks, placement(kv, inp))}
        if lay == "cells_streams":
            d = {"storage": [kv.n_stream, kv.size, *kv.streams[0].k[0].shape[1:]], "used": kv.used,
                 "head": [st.head for st in kv.streams], "cells": per}
        else:
            d = {"storage": [kv.size, *kv.k[0].shape[1:]], "used": kv.used, "head": kv.head, "cells": per}
    if inp is not None:
        d.update(inputs_summary(inp))
    if lay == "cells_iswa":  # llama.cpp's SWA pool beside the base pool
        sinp = getattr(inp, "swa", None)
        d["swa_pool"] = {"size": kv.swa.size, "used": kv.swa.used, "head": kv.swa.head,
                         "cells": ranges_text(sinp.cell_idx.tolist()) if sinp is not None else "-"}
    return d


# ----------------------------------------------------------------------------- dump-kv


def dump_writes(kv: Any, inp: Any, rows: dict[int, list[int]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """For ``dump-kv``: per chunk ``{"seq_id", "pos", "cells"}`` (streams: global rows and ``"stream"``;
    paged: ``"slots"``) with ``rows`` the chunk's packed rows per seq_id, and what the snapshot adds
    (a unified cells cache: ``head_before`` / ``head_after``)."""
    lay = _layout(kv)
    if lay == "hybrid":
        return dump_writes(kv.attn, inp, rows)
    chunks = _chunks(inp)
    if lay == "paged":
        sm = inp.slot_mapping.tolist() if inp is not None else []
        return [{"seq_id": c.seq_id, "pos": list(range(c.C, c.C + c.T)), "slots": [sm[i] for i in rows[c.seq_id]]}
                for c in chunks], {}
    idx = inp.cell_idx.tolist() if inp is not None else []
    if lay == "cells_streams":
        return [{"seq_id": c.seq_id, "pos": list(range(c.C, c.C + c.T)), "cells": [idx[i] for i in rows[c.seq_id]],
                 "stream": c.seq_id} for c in chunks], {}
    writes = [{"seq_id": c.seq_id, "pos": list(range(c.C, c.C + c.T)), "cells": [idx[i] for i in rows[c.seq_id]]}
              for c in chunks]
    return writes, {"head_before": inp.head_before if inp is not None else kv.head, "head_after": kv.head}


def _cells_values(kv: Any, layer: int, head: int, n: int | None, wanted: set[int] | None) -> list[dict[str, Any]]:
    """Per sequence holding cells of a ``cells`` memory: ``{"seq_id", "len", "rows": [{"pos", "cell", "k", "v"}]}``."""
    reqs = []
    for sid in sorted({s for c in kv.snapshot()["cells"] for s in c["seq_ids"]}):
        cells = kv.cells_of(sid)  # [(cell, pos)] ordered by pos
        rows = [{"pos": p, "cell": cell, "k": kv.k[layer][cell, head, :n].float().tolist(),
                 "v": kv.v[layer][cell, head, :n].float().tolist()}
                for cell, p in cells if wanted is None or p in wanted]
        reqs.append({"seq_id": sid, "len": len(cells), "rows": rows})
    return reqs


def _paged_values(kv: Any, layer: int, head: int, n: int | None, wanted: set[int] | None) -> list[dict[str, Any]]:
    """Per sequence of a ``paged`` memory: ``{"seq_id", "len", "rows": [{"pos", "slot", "block", "offset", "k", "v"}]}``."""
    reqs = []
    for sid in sorted(kv.tables):
        L = kv.seq_len(sid)
        rows = []
        for p in range(L):
            if wanted is not None and p not in wanted:
                continue
            slot = kv.slot(sid, p)
            blk, off = divmod(slot, kv.B)
            rows.append({"pos": p, "slot": slot, "block": blk, "offset": off,
                         "k": kv.pool[layer][blk, 0, head, off, :n].float().tolist(),
                         "v": kv.pool[layer][blk, 1, head, off, :n].float().tolist()})
        reqs.append({"seq_id": sid, "len": L, "rows": rows})
    return reqs


def dump_values(kv: Any, layer: int, head: int, n: int | None, wanted: set[int] | None) -> list[dict[str, Any]]:
    """For ``dump-kv``: K/V values (the first ``n``, all when None) of KV head ``head`` of physical layer
    ``layer`` per sequence and cached position (``wanted``: only those positions), read at their
    physical place: cells ``{"pos", "cell", "k", "v"}`` (streams: global rows, ``"stream"`` per sequence;
    iSWA: a windowed layer's rows from the SWA pool), paged ``{"pos", "slot", "block", "offset", "k", "v"}``."""
    lay = _layout(kv)
    if lay == "hybrid":
        return dump_values(kv.attn, layer, head, n, wanted)
    if lay == "paged":
        return _paged_values(kv, layer, head, n, wanted)
    if lay == "cells_streams":
        reqs = []
        for s, st in enumerate(kv.streams):
            for r in _cells_values(st, layer, head, n, wanted):
                for row in r["rows"]:
                    row["cell"] += s * kv.size
                reqs.append({**r, "stream": s})
        return reqs
    if lay == "cells_iswa" and kv.windows[layer]:
        return _cells_values(kv.swa, layer, head, n, wanted)
    return _cells_values(kv, layer, head, n, wanted)


def read_values(kv: Any, layer: int, head: int, positions: Sequence[int] | None, full: bool) -> dict[str, Any]:
    """K/V of kv head ``head`` in ``layer`` for the chosen positions of every request in the cache,
    read at their physical location (cell index, or slot ``= block * B + offset``).

    Args:
        kv: the memory (any layout of the module table).
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
    reqs = dump_values(kv, layer, head, n, wanted)
    if positions is not None and reqs and not any(r["rows"] for r in reqs):
        lens = ", ".join(f"seq {r['seq_id']}: 0..{r['len'] - 1}" for r in reqs)
        raise InfertraceError(f"--positions {ranges_text(positions)}: no request has those positions cached at this step ({lens})")
    head_dim = kv.describe()["head_dim"]
    return {"layer": layer, "head": head, "full": full, "n_values": head_dim if full else min(N_FIRST, head_dim),
            "requests": reqs}


def describe_live(ctx: Any, layer: int | None = None, head: int | None = None,
                  positions: Sequence[int] | None = None, full: bool = False) -> dict[str, Any]:
    """Dump dict from an engine step context, read from the live memory at the end of the step.

    Args:
        ctx: the :class:`~infertrace.engine.engine.StepContext` a tracer's ``end_step`` receives:
            ``step``, ``batch`` (the ScheduledBatch), ``inp`` (the step's attention inputs, None when
            idle), ``kv`` (the memory: read through ``describe``, ``snapshot`` and the views here),
            ``finished``.
        layer, head, positions, full: with ``layer`` or ``head`` given, K/V values as
            :func:`read_values` reads them.

    Returns:
        the dict of :func:`infertrace.trace.kv_dump.build_dump` (``source = "live"``; ``dtype`` the
        cache's torch dtype name, e.g. ``"float32"``).

    Raises:
        InfertraceError: ``positions`` not cached by any request (:func:`read_values`).
    """
    kv, inp, batch = ctx.kv, ctx.inp, ctx.batch
    rows, r, out_batch = {}, 0, []
    for c in batch.chunks:
        rows[c.req.seq_id] = list(range(r, r + c.T))
        r += c.T
        out_batch.append({"seq_id": c.req.seq_id, "phase": c.phase, "C": c.C, "T": c.T, "rows": rows[c.req.seq_id]})
    phys = kv.snapshot()
    writes, hd = dump_writes(kv, inp, rows)
    phys.update(hd)  # cells: head before / after the step
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
