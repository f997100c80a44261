"""``dump-kv``: the KV cache right after step N, as one JSON-ready dict.

The live source of the dump dict (:mod:`infertrace.trace.kv_dump` holds the dict itself, its
layout and the saved-trace source): :func:`dump_kv_at_step` steps an engine up to and including
step N and describes the backend at the end of that step (before requests finishing at N are
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
    from infertrace.engine.engine import StepContext


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


def describe_live(ctx: StepContext, layer: int | None = None, head: int | None = None,
                  positions: Sequence[int] | None = None, full: bool = False) -> dict[str, Any]:
    """Dump dict from an engine step context, read from the live backend at the end of the step.

    Args:
        ctx: the :class:`~infertrace.engine.engine.StepContext` a tracer's ``end_step`` receives:
            ``step``, ``batch`` (the ScheduledBatch), ``inp`` (the step's AttnInputs; None when idle:
            cells ``extra["cell_idx"]`` int64 ``[N]``, paged ``extra["slot_mapping"]`` int64 ``[N]``),
            ``kv`` (CellsKV or PagedKV), ``finished``.
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
    d = build_dump(step=ctx.step, backend=kv.kind, physical=phys, physical_shape=shape,
                   dtype=str(dtype).replace("torch.", ""), n_layer=len(kv.k) if kv.kind == "cells" else len(kv.pool),
                   batch=out_batch, writes=writes, finished={str(k): v for k, v in ctx.finished.items()},
                   values=values)
    if getattr(kv, "state", None) is not None:  # hybrid: the GDN state beside the KV (constant shape)
        from infertrace.capture.hybrid_rec import state_summary

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
        """Tap points are ignored (the tracer protocol of :class:`~infertrace.capture.recorder.Recorder`)."""
        return None

    def begin_step(self) -> None:
        """Nothing to prepare."""
        return None

    def end_step(self, ctx: StepContext) -> None:
        """Keep ``fn(ctx)`` when ``ctx.step`` is the target step."""
        if ctx.step == self.target:
            self.result = self.fn(ctx)


def dump_kv_at_step(loaded: Any, prompts: list[Any], opts: Any, step: int, layer: int | None = None,
                    head: int | None = None, positions: Sequence[int] | None = None, full: bool = False) -> dict[str, Any]:
    """Run ``prompts`` up to and including ``step`` and return the cache right after it.

    Args:
        loaded: from :func:`infertrace.runner.load_model`.
        prompts: :class:`~infertrace.engine.drive.PromptSpec` list (seq_ids in list order).
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
    from infertrace.engine.drive import drive, encode_requests
    from infertrace.engine.engine import Engine  # the engine imports the backends: import it here, not at module level

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
    drive(eng, encode_requests(loaded.tokenizer, prompts), last_step=step, max_steps=None)
    if probe.result is None:
        raise InfertraceError(f"step {step} out of range: the run has steps 0..{eng.step_no - 1}")
    probe.result["attention"] = eng.attn_impl
    return probe.result
