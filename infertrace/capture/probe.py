"""The runtime side of recording: copy what the recorder needs out of one live step into a :class:`StepData`.

:func:`probe` reads the step the engine hands its tracer (``StepContext``: the batch, the attention inputs,
the memory after the step's writes, the logits, the samples) and the recorder's taps, by duck typing on the
memory protocol (``logical_mask``, ``read``, ``seq_len``, ``holds_values``, ``describe``, ``snapshot``,
``recurrent_state``) and on the views of :mod:`infertrace.capture.kv_views` / :mod:`~infertrace.capture.mask_views`;
it imports neither the memory (:mod:`infertrace.kv`) nor the engine. What it returns is plain data
(:mod:`infertrace.capture.step_data`): :meth:`~infertrace.capture.recorder.Recorder.record` builds the trace
from it alone, here or in another process (:meth:`StepData.to_wire`).

Read-only: nothing here changes the memory, the inputs or a tensor the engine uses.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from infertrace.capture.kv_views import heads, placement
from infertrace.capture.mask_views import mask_record, swa_record
from infertrace.capture.spec_capture import MAX_MASK_NODES
from infertrace.capture.step_data import ChunkData, KVData, SampleData, StepData, Want
from infertrace.errors import InfertraceError
from infertrace.model.taps import ATTN_OUT, EMBED, K, K_ROT, MLP_OUT, Q, Q_ROT, RESID_POST, RESID_PRE, V

#: ``--keep tensors``: block tap -> the name its tensor is saved under (``step{s}/layer{l}/NAME``)
TENSOR_NAMES = {RESID_PRE: "hidden_in", Q: "q_pre_rope", Q_ROT: "q_post_rope", K: "k_pre_rope", K_ROT: "k_post_rope",
                V: "v", ATTN_OUT: "attn_out", MLP_OUT: "mlp_out", RESID_POST: "resid_post"}
#: the taps of the recorded layer whose presence makes the RoPE evidence (and its cache reads) happen
EVIDENCE = (Q, K, V, Q_ROT, K_ROT)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def probe(ctx: Any, want: Want, taps: Mapping[tuple[str, int | None], Mapping[str, Any]]) -> StepData:
    """One step as :class:`StepData`.

    Args:
        ctx: the engine's step context (``step``, ``batch``, ``inp`` (None when idle), ``kv``, ``attention``,
            ``logits`` ``[M, V]``, ``logits_rows``, ``samples``, ``finished``, ``requests``, ``time_ms``,
            ``sampler_order``, ``serving``, ``spec``, ``vllm``: the runtime's native section, copied as is).
        want: what to copy (the recorder's :class:`Want`).
        taps: the step's taps, ``(name, layer) -> {"value": tensor, ...}`` (the embedding: layer None, with
            ``ids``).

    Raises:
        InfertraceError: the attention inputs' chunks do not match the scheduled batch (an internal error), or
            whatever the memory raises reading a layer it does not hold.
    """
    batch, inp, kv = ctx.batch, ctx.inp, ctx.kv
    tap_values = {k: f["value"] for k, f in taps.items()}
    embed = taps.get((EMBED, None))
    common = dict(step=ctx.step, backend=kv.kind, attention=ctx.attention, time_ms=float(ctx.time_ms),
                  preempted=tuple(batch.preempted), admitted=tuple(batch.admitted), serving=ctx.serving or None,
                  vllm=ctx.get("vllm") or None, taps=tap_values, embed_ids=None if embed is None else embed.get("ids"))
    state = kv.recurrent_state() if want.hybrid else None
    recurrent = state.describe_state(inp is not None) if state is not None else None
    if inp is None:  # idle step: nothing scheduled; only the cache state
        kvd = KVData(kv.describe(), {**kv.snapshot(), **heads(kv, None)}) if "kv" in want.show else None
        return StepData(N=0, kv=kvd, recurrent=recurrent, **common)
    _check_chunks(batch, inp)
    spec = ctx.get("spec") or None
    vrecs = (spec or {}).get("requests", {})
    logical = kv.logical_mask(inp)  # per chunk [T, L] bool
    logical_swa = kv.logical_mask(inp, swa=True) if want.windowed else None
    rows_needed = "kv" in want.show or ("positions" in want.show and
                                        all(tap_values.get((n, want.layer)) is not None for n in EVIDENCE))
    places = placement(kv, inp) if "kv" in want.show else []  # cells: the cells written; paged: slots, block table
    chunks, row = [], 0
    for i, ch in enumerate(batch.chunks):
        vrec = vrecs.get(str(ch.req.seq_id)) if ch.parents is not None else None
        k_rows = v_rows = None
        if rows_needed:
            k, v = kv.read(want.layer, ch.req.seq_id)  # [C+T, n_kv, hd] each (a verify step: after the rewind)
            k_rows, v_rows = k[ch.C : ch.C + ch.T], v[ch.C : ch.C + ch.T]  # [n, n_kv, hd]
        chunks.append(ChunkData(
            seq_id=ch.req.seq_id, phase=ch.phase, C=ch.C, T=ch.T, token_ids=tuple(int(t) for t in ch.token_ids),
            need_logits=bool(ch.need_logits), parents=None if ch.parents is None else tuple(ch.parents),
            depths=tuple(ch.depths()), logical=logical[i], logical_swa=None if logical_swa is None else logical_swa[i],
            verify=inp.verify_record(i, row, min(ch.T, MAX_MASK_NODES)) if vrec else None,
            placement=places[i] if i < len(places) else None, k_rows=k_rows, v_rows=v_rows))
        row += ch.T
    samples = {}
    for sid, s in ctx.samples.items():
        sampler: dict[str, Any] = {}
        if "decode" in want.show and sid in ctx.requests:
            req = ctx.requests[sid]
            sampler = req.params.to_dict()
            if not req.params.greedy and ctx.sampler_order:  # the order only matters when sampling
                sampler["order"] = ctx.sampler_order
        samples[sid] = SampleData(int(s.token), tuple((int(i), float(lg), float(p)) for i, lg, p in s.top), sampler)
    mask = mask_swa = None
    if "mask" in want.show:
        convention, rule, cells, paged = mask_record(inp, want.mask_rows, want.mask_cols)
        mask = {"convention": convention, "rule": rule, "cells": cells, "paged": paged}
        mask_swa = swa_record(inp, want.mask_rows, want.mask_cols) if want.windowed else None
    kvd = KVData(kv.describe(), {**kv.snapshot(), **heads(kv, inp)}) if "kv" in want.show else None
    cache, topk = _tensors(ctx, want, tap_values) if want.tensor_layers is not None else ({}, None)
    logits = ctx.logits  # [M, V]
    return StepData(N=batch.N, chunks=tuple(chunks), positions=inp.positions, logits_shape=tuple(logits.shape),
                    logits_dtype=_dtype(logits), logits_rows=tuple(ctx.logits_rows), samples=samples,
                    finished=dict(ctx.finished), spec=spec, mask=mask, mask_swa=mask_swa, kv=kvd, recurrent=recurrent,
                    cache=cache, logits_topk=topk, logits=logits if want.logits else None, **common)


def _check_chunks(batch: Any, inp: Any) -> None:
    """The inputs' chunks are the batch's, in order (the engine prepares one spec per scheduled chunk).

    Raises:
        InfertraceError: they differ (the record would mix two orders).
    """
    a = [(c.req.seq_id, c.C, c.T, None if c.parents is None else list(c.parents)) for c in batch.chunks]
    b = [(c.seq_id, c.C, c.T, None if c.parents is None else list(c.parents)) for c in inp.chunks]
    if a != b:
        raise InfertraceError(f"internal: the attention inputs' chunks {b[:4]} are not the scheduled batch's {a[:4]}")


def _tensors(ctx: Any, want: Want, taps: Mapping[tuple[str, int | None], torch.Tensor]) -> tuple[dict, Any]:
    """``--keep tensors``: the cache ``(k, v)`` ``[len, n_kv, hd]`` of every request holding one, per tapped
    layer of ``want.tensor_layers`` the memory holds values of, and the top-k logits ``[M, k]``
    (float32 values, int64 ids)."""
    kv, cache = ctx.kv, {}
    for il in want.tensor_layers or ():
        if not any((tap, il) in taps for tap in TENSOR_NAMES):  # the layer was not computed here (a captured runtime taps one)
            continue
        for sid in sorted(ctx.requests):  # every request holding cache, computed this step or not
            if kv.seq_len(sid) == 0 or not kv.holds_values(il):  # GDN layer: no K/V; llama.cpp: one layer
                continue
            cache[(il, sid)] = kv.read(il, sid)  # [len, n_kv, hd] each
    logits, topk = ctx.logits, None  # [M, V]
    if logits.shape[0]:
        vals, ids = torch.topk(logits.float(), min(want.top_k_tensors, logits.shape[-1]), dim=-1)  # [M, k]
        topk = (vals, ids.to(torch.int64))
    return cache, topk
