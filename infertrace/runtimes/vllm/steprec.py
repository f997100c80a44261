"""vLLM's step as plain data, and that data turned into infertrace's step record.

One conversion serves both ways of recording vLLM: ``run --runtime vllm`` (the engine core in this
process, :mod:`.engine`) and a served vLLM (the plugin, :mod:`.plugin`, writes the same data to a
spool; ``infertrace collect`` reads it back, :mod:`.collect`). Nothing here reads a live vLLM object
except :func:`scheduler_data` and :func:`pool_data`, which copy one at capture time.

The data of a step:

* ``sd`` (:func:`scheduler_data`): vLLM's ``SchedulerOutput`` (vllm/v1/core/sched/output.py) as
  JSON-able lists: ``num_scheduled_tokens`` (ordered ``[[req_id, n], ...]``), ``new``
  (``[{req_id, num_computed_tokens, block_ids, prompt_token_ids}]``), ``cached`` (``req_ids``,
  ``num_computed_tokens``, ``new_block_ids``, ``resumed``), ``spec`` (``{req_id: [draft ids]}``),
  ``preempted``, ``finished``, ``total_num_scheduled_tokens``.
* ``rec``: one worker capture (:mod:`.capture`): numpy arrays ``input_ids`` ``[T]``, ``positions``
  ``[T]``, ``query_start_loc`` ``[R+1]``, ``seq_lens`` ``[R]``, ``block_table`` ``[R, W]``,
  ``slot_mapping`` ``[T]``, ``logits`` ``[R (+ drafts), V]`` float32, ``sampled`` ``[R, 1 + k]``;
  K/V ``[T, n_kv, head_dim]`` float32 (as written and read back); scalars of the metadata.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from infertrace.engine.request import FINISHED, RUNNING, Request
from infertrace.engine.sampler import SampleResult, sample
from infertrace.engine.scheduler import ScheduledBatch, ScheduledChunk
from infertrace.errors import InfertraceError
from infertrace.kv.base import ChunkSpec, PagedInputs, ranges_text


def scheduler_data(so: Any) -> dict[str, Any]:
    """vLLM's ``SchedulerOutput`` as plain data (see the module docstring); ``None`` for ``None``."""
    if so is None:
        return None  # type: ignore[return-value]
    c = so.scheduled_cached_reqs
    resumed = set(getattr(c, "resumed_req_ids", None) or ())
    return {
        "num_scheduled_tokens": [[str(k), int(v)] for k, v in so.num_scheduled_tokens.items()],
        "new": [{"req_id": str(r.req_id), "num_computed_tokens": int(r.num_computed_tokens),
                 "block_ids": [int(b) for b in r.block_ids[0]] if r.block_ids else [],
                 "prompt_token_ids": [int(t) for t in (r.prompt_token_ids or [])]} for r in so.scheduled_new_reqs],
        "cached": {"req_ids": [str(r) for r in c.req_ids], "num_computed_tokens": [int(x) for x in c.num_computed_tokens],
                   "new_block_ids": [[int(b) for b in nb[0]] if nb else None for nb in c.new_block_ids],
                   "resumed": sorted(str(r) for r in resumed)},
        "spec": {str(k): [int(t) for t in v] for k, v in (so.scheduled_spec_decode_tokens or {}).items()},
        "preempted": sorted(str(r) for r in (so.preempted_req_ids or ())),
        "finished": sorted(str(r) for r in (so.finished_req_ids or ())),
        "total_num_scheduled_tokens": int(so.total_num_scheduled_tokens),
    }


def free_head(pool: Any, n: int = 8) -> list[int]:
    """The first ``n`` block ids of vLLM's free queue (``BlockPool.free_block_queue``, a doubly linked list
    from ``fake_free_list_head``; ``popleft`` allocates from this end: vllm/v1/core/kv_cache_utils.py)."""
    out: list[int] = []
    b = getattr(getattr(pool, "free_block_queue", None), "fake_free_list_head", None)
    b = getattr(b, "next_free_block", None)
    while b is not None and len(out) < n and b.block_id is not None and int(b.block_id) >= 0:
        out.append(int(b.block_id))
        b = b.next_free_block
    return out


def pool_data(pool: Any, n: int = 8) -> tuple[int, dict[int, int], list[int]]:
    """vLLM's block pool after a schedule: (free count, ``{block_id: ref_cnt}`` of held blocks (how many
    requests hold each), the first ``n`` block ids of its free queue, the order it hands them out)."""
    refs = {int(b.block_id): int(b.ref_cnt) for b in pool.blocks if b.ref_cnt > 0 and not b.is_null}
    return int(pool.get_num_free_blocks()), refs, free_head(pool, n)


def ours(rid: str) -> str:
    """Our request id from vLLM's internal one (``LLMEngine.add_request`` appends ``-<8 hex>``)."""
    head, sep, tail = str(rid).rpartition("-")
    return head if sep and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail) else str(rid)


def _view(sd: dict[str, Any] | None, by_id: dict[str, Request]) -> dict[str, Any]:
    """The scheduler facts ``record_step`` uses, keyed by our request ids."""
    if sd is None:
        return {"spec": {}, "new": {}, "resumed": {}, "preempted": [], "order": None, "finished": [], "total": None,
                "new_blocks": {}}
    c = sd["cached"]
    res = set(c["resumed"])
    new_blocks: dict[str, list[int]] = {}
    for r in sd["new"]:
        if ours(r["req_id"]) in by_id:
            new_blocks[str(by_id[ours(r["req_id"])].seq_id)] = list(r["block_ids"])
    for rid, nb in zip(c["req_ids"], c["new_block_ids"]):
        if ours(rid) in by_id and nb:
            new_blocks[str(by_id[ours(rid)].seq_id)] = list(nb)
    return {"spec": {ours(k): list(v) for k, v in sd["spec"].items()},
            "new": {ours(r["req_id"]): int(r["num_computed_tokens"]) for r in sd["new"]},
            # a preempted request coming back: with prefix caching its own full blocks are still hashed, so it
            # can resume with num_computed_tokens > 0 (a prefix hit on itself) instead of recomputing from 0
            "resumed": {ours(rid): int(n) for rid, n in zip(c["req_ids"], c["num_computed_tokens"]) if rid in res},
            "preempted": sorted(by_id[ours(x)].seq_id for x in sd["preempted"] if ours(x) in by_id),
            "order": [ours(k) for k, _ in sd["num_scheduled_tokens"]],
            "finished": sorted(by_id[ours(x)].seq_id for x in sd["finished"] if ours(x) in by_id),
            "total": int(sd["total_num_scheduled_tokens"]), "new_blocks": new_blocks}


def _chunks(step: int, rec: dict[str, Any], by_id: dict[str, Request], sv: dict[str, Any]) -> tuple:
    """The scheduled chunks of one step from the capture's rows: (chunks, specs, known_of, logits_idx)."""
    qsl, vseq = rec["query_start_loc"], rec["seq_lens"]
    chunks, specs, known_of, logits_idx, row = [], [], {}, [], 0
    for i, rid in enumerate(rec["req_ids"]):
        req = by_id.get(rid)
        if req is None:
            raise InfertraceError(f"vLLM scheduled an unknown request {rid!r}")
        T = int(qsl[i + 1] - qsl[i])
        C = int(vseq[i]) - T
        drafts = sv["spec"].get(rid, [])
        known = len(req.all_ids)
        known_of[rid] = known  # vLLM's request.num_tokens before this step (prompt + output so far)
        parents = [-1] + list(range(len(drafts))) if drafts else None
        # a new request with one token left to compute is padded to 1 + K rows with -1 placeholder drafts
        # (vllm/v1/core/sched/scheduler.py:1133-1153, 1371-1375); the forward embeds them as id 0
        # (vllm/v1/worker/gpu_model_runner.py:3310-3311 clamp_(min=0)): the trace's ids are the forward's
        fed = [max(int(d), 0) for d in drafts]
        ids = (req.all_ids[C:C + T - len(drafts)] + fed) if drafts else req.all_ids[C:C + T]
        ids_vllm = rec["input_ids"][int(qsl[i]):int(qsl[i + 1])].tolist() if rec.get("input_ids") is not None else ids
        if ids_vllm != ids:
            raise InfertraceError(f"step {step}: vLLM packed ids {ids_vllm[:8]} for seq {req.seq_id}, expected {ids[:8]}")
        complete = C + T - len(drafts) >= known
        phase = "decode" if (drafts or (T == 1 and req.output_ids and C == known - 1)) else "prefill"
        chunks.append(ScheduledChunk(req, phase, C, ids, complete, parents))
        specs.append(ChunkSpec(req.seq_id, C, T, parents))
        if req.status != RUNNING:
            req.status = RUNNING
        if rid in sv["new"] and sv["new"][rid] != C:
            raise InfertraceError(f"step {step}: seq {req.seq_id} admitted with num_computed_tokens {sv['new'][rid]}, "
                                  f"metadata says {C}")
        n_rows = 1 + len(drafts)
        logits_idx += list(range(row + T - n_rows, row + T))
        row += T
    return chunks, specs, known_of, logits_idx


def _verify_sample(ch: ScheduledChunk, lrows: torch.Tensor, toks: list[int]) -> tuple[SampleResult, dict[str, Any], list[int]]:
    """A verify chunk's accepted tokens appended to its request: (last sample, spec record, accepted nodes)."""
    req = ch.req
    acc = len(toks) - 1
    nodes = list(range(acc + 1))
    tops = [sample(lrows[a], req.params, req.all_ids, req.generator).top for a in range(len(toks))]
    out = [SampleResult(t, tp) for t, tp in zip(toks, tops)]
    emitted = []
    for res in out:
        emitted.append(res.token)
        req.output_ids.append(res.token)
        if len(req.output_ids) >= req.params.max_new_tokens:
            break
    rec = {"drafted": len(ch.parents) - 1, "accepted": acc, "C": ch.C, "tokens": list(ch.token_ids),
           "parents": list(ch.parents), "positions": [ch.C + d for d in range(ch.T)], "accepted_nodes": nodes,
           "emitted": emitted, "rewind": {"op": "num_computed_tokens", "seq_id": req.seq_id,
                                          "kept_pos": ranges_text(range(ch.C + acc + 1))}}
    req.num_computed = ch.C + acc + 1
    return out[len(emitted) - 1], rec, nodes


def _samples(chunks: list[ScheduledChunk], rec: dict[str, Any], logits_idx: list[int]) -> tuple:
    """vLLM's sampled tokens appended to the requests: (samples, used_rows, used_logits, acc_nodes, spec_rec, logits)."""
    logits = torch.from_numpy(rec["logits"])  # [R (+ drafts), V] float32: one row per request (+ its drafts)
    sampled = rec["sampled"]
    samples, used_rows, used_logits, acc_nodes, spec_rec = {}, [], [], {}, {}
    j = 0
    for i, ch in enumerate(chunks):
        req = ch.req
        n_rows = 1 + (len(ch.parents) - 1 if ch.parents else 0)
        lrows = logits[j:j + n_rows]  # [n_rows, V]
        j += n_rows
        if not ch.need_logits:
            continue  # a partial prefill: vLLM computed the row and dropped the sample
        toks = [int(t) for t in sampled[i] if t >= 0]
        packed0 = logits_idx[j - n_rows]
        if ch.parents is not None:
            used_rows += list(range(packed0, packed0 + n_rows))
            used_logits.append(lrows)
            samples[req.seq_id], spec_rec[str(req.seq_id)], acc_nodes[req.seq_id] = _verify_sample(ch, lrows, toks)
            continue
        used_rows.append(packed0 + n_rows - 1)
        used_logits.append(lrows[-1:])
        tok = int(toks[0])
        res = sample(lrows[-1], req.params, req.all_ids, req.generator)
        samples[req.seq_id] = SampleResult(tok, res.top)
        req.output_ids.append(tok)
        req.num_computed = ch.C + ch.T
    for ch in chunks:
        if not ch.need_logits:
            ch.req.num_computed = ch.C + ch.T
    return samples, used_rows, used_logits, acc_nodes, spec_rec, logits


def _inputs(chunks: list[ScheduledChunk], specs: list[ChunkSpec], rec: dict[str, Any], B: int) -> PagedInputs:
    """Our paged inputs (TensorRT-LLM names) from vLLM's attention metadata."""
    from infertrace.kv.spec_meta import spec_metadata

    qsl, vseq = rec["query_start_loc"], rec["seq_lens"]
    pos = torch.from_numpy(rec["positions"].astype(np.int64))  # [T]
    seq_ids = torch.tensor([c.req.seq_id for c in chunks for _ in range(c.T)], dtype=torch.int64)  # [T]
    bt_ours = torch.full((len(chunks), max(1, max(-(-int(s) // B) for s in vseq))), -1, dtype=torch.int32)  # [R, W]
    for i, s in enumerate(vseq):
        n = -(-int(s) // B)
        bt_ours[i, :n] = torch.from_numpy(rec["block_table"][i, :n].astype(np.int32))
    T_list = [c.T for c in chunks]
    types = ["generation" if c.parents is not None else "context" if (c.C == 0 or c.T > 1) else "generation" for c in chunks]
    return PagedInputs(specs, pos, seq_ids, "paged", **spec_metadata(specs),
                       slot_mapping=torch.from_numpy(rec["slot_mapping"].astype(np.int64)),  # [T]
                       block_tables=bt_ours, seq_lens=torch.tensor(T_list, dtype=torch.int32),  # [R]
                       kv_lens=torch.from_numpy(vseq.astype(np.int32)), cu_seqlens=torch.from_numpy(qsl.astype(np.int32)),
                       request_types=types, num_contexts=sum(t == "context" for t in types), mask_type="causal",
                       tokens_per_block=B, attention_window={})


def _vllm_section(chunks: list[ScheduledChunk], rec: dict[str, Any], sv: dict[str, Any], by_id: dict[str, Request],
                  free: int | None, logits_idx: list[int], readback: Any, B: int) -> dict[str, Any]:
    """``step.vllm``: vLLM's own scheduler output and attention metadata, unchanged names."""
    qsl, vseq = rec["query_start_loc"], rec["seq_lens"]
    T_all = int(rec["num_actual_tokens"])
    # the scheduler's order (SchedulerOutput.num_scheduled_tokens: running requests, then the waiting ones it
    # admitted), not the model runner's packed-row order (its input batch may hold them in another order)
    order = sv["order"] if sv["order"] is not None else list(rec["req_ids"])
    row_of = {rid: i for i, rid in enumerate(rec["req_ids"])}
    sched_rows = [row_of[r] for r in order if r in row_of] + [i for r, i in row_of.items() if r not in order]
    vsec = {
        "scheduler": {"scheduled": [{"seq_id": chunks[i].req.seq_id, "num_scheduled_tokens": chunks[i].T,
                                     "num_computed_tokens": chunks[i].C, "phase": chunks[i].phase,
                                     "spec_tokens": list(sv["spec"].get(rec["req_ids"][i], []))} for i in sched_rows],
                      "new": [{"seq_id": by_id[r].seq_id, "num_computed_tokens": c} for r, c in sv["new"].items() if r in by_id],
                      "new_block_ids": sv["new_blocks"],
                      "resumed": [{"seq_id": by_id[r].seq_id, "num_computed_tokens": c} for r, c in sv["resumed"].items()
                                  if r in by_id],
                      "preempted": sv["preempted"], "finished_before_step": sv["finished"],
                      "total_num_scheduled_tokens": sv["total"] if sv["total"] is not None else T_all,
                      "free_blocks": free},
        "attn_metadata": {"class": rec["metadata_class"], "query_start_loc": qsl.tolist(), "seq_lens": vseq.tolist(),
                          "block_table": [r[: max(1, -(-int(s) // B))].tolist() for r, s in zip(rec["block_table"], vseq)],
                          "block_table_width": int(rec["block_table"].shape[1]) if rec["block_table"].ndim == 2 else 0,
                          "slot_mapping": rec["slot_mapping"].tolist(), "num_actual_tokens": T_all,
                          "max_query_len": rec["max_query_len"], "max_seq_len": rec["max_seq_len"],
                          "causal": rec["causal"], "num_decode_tokens": rec["num_decode_tokens"]},
        "logits_indices": logits_idx, "logits_shape": list(rec["logits"].shape),
        "sampled_token_ids": rec["sampled"].tolist(), "kv_readback": readback,
    }
    if rec.get("ranks"):
        vsec["tp_ranks"] = rec["ranks"]
    return vsec


def _serving(sv: dict[str, Any], known_of: dict[str, int], rec: dict[str, Any], by_id: dict[str, Request], kv: Any,
             B: int) -> dict[str, Any] | None:
    """The step's serving record: the prefix hit of each request admitted (or resumed) with cached tokens."""
    hits = {str(by_id[r].seq_id): _hit_record(r, c, r in sv["resumed"], known_of.get(r, len(by_id[r].prompt_ids)), rec, kv, B)
            for r, c in {**sv["new"], **sv["resumed"]}.items() if c > 0 and r in by_id}
    return {"prefix": hits} if hits else None


def _spec_ctx(sv: dict[str, Any], spec_rec: dict[str, Any]) -> dict[str, Any] | None:
    if not (sv["spec"] or spec_rec) or not spec_rec:
        return None
    drafted = sum(v["drafted"] for v in spec_rec.values())
    accepted = sum(v["accepted"] for v in spec_rec.values())
    return {"requests": spec_rec, "drafted": drafted, "accepted": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None}


def record_step(run: Any, tracer: Any, step: int, sd: dict[str, Any] | None, free: int | None, rec: dict[str, Any],
                by_id: dict[str, Request], kv: Any, finished: dict[int, str], time_ms: float = 0.0,
                served: dict[str, Any] | None = None) -> dict[str, Any]:
    """Turn one vLLM step (plain data: scheduler data ``sd``, capture ``rec``) into our step context, hand it to
    the recorder, update the requests. vLLM's own section (:func:`_vllm_section`) travels in the context
    (``StepContext.vllm``): the recorder writes it into the step record; nothing is set on the record after.

    Args:
        run: anything with ``block_size`` and ``layer`` (the captured layer).
        kv: the trace's view of vLLM's pool (:class:`~infertrace.runtimes.vllm.engine.VllmKV`).
        finished: seq_id -> our stop reason, of the requests this step finished.
        served: a served vLLM's facts of the step (``infertrace collect``: the engine step, the whole batch, the
            request ids; :mod:`.collect`), kept as ``step.vllm.served``; None for ``run --runtime vllm``.

    Raises:
        InfertraceError: a capture that does not line up with the scheduler data (unknown request, ids or
            num_computed_tokens differing).
    """
    from infertrace.engine.engine import StepContext

    rec["req_ids"] = [ours(x) for x in rec["req_ids"]]
    sv = _view(sd, by_id)
    for sid in sv["preempted"]:
        kv.release(sid)
        r = next(r for r in by_id.values() if r.seq_id == sid)
        r.num_preemptions += 1
        r.num_computed = 0
    chunks, specs, known_of, logits_idx = _chunks(step, rec, by_id, sv)
    samples, used_rows, used_logits, acc_nodes, spec_rec, logits = _samples(chunks, rec, logits_idx)
    batch = ScheduledBatch(step, chunks, preempted=sv["preempted"], admitted=[by_id[r].seq_id for r in sv["new"] if r in by_id])
    B = run.block_size
    inp = _inputs(chunks, specs, rec, B)
    kv.apply(specs, rec["block_table"], rec["slot_mapping"], rec.get("k_cache", rec.get("k_written")),
             rec.get("v_cache", rec.get("v_written")))
    if free is not None:
        kv.free_count = free
    readback = None
    if "k_cache" in rec:
        readback = {"k_max_abs": float(np.abs(rec["k_cache"] - rec["k_written"]).max(initial=0.0)),
                    "v_max_abs": float(np.abs(rec["v_cache"] - rec["v_written"]).max(initial=0.0))}
    tracer.begin_step()
    taps(tracer, rec, run.layer)
    lg = torch.cat(used_logits) if used_logits else torch.zeros(0, logits.shape[-1])  # [M, V]
    reqs = {r.seq_id: r for r in by_id.values()}
    serving = _serving(sv, known_of, rec, by_id, kv, B)
    vsec = _vllm_section(chunks, rec, sv, by_id, free, logits_idx, readback, B)
    if served is not None:
        vsec["served"] = served
    for sid in acc_nodes:  # a verify step keeps C + accepted + 1 tokens (vLLM's num_computed_tokens)
        kv.rewind(sid, reqs[sid].num_computed)
    tracer.end_step(StepContext(step=step, batch=batch, inp=inp, kv=kv, attention="vllm", logits=lg,
                                logits_rows=used_rows, samples=samples, finished=finished, requests=reqs,
                                sampler_order="hf", serving=serving, spec=_spec_ctx(sv, spec_rec), time_ms=time_ms,
                                vllm=vsec))
    for sid in finished:
        reqs[sid].status = FINISHED
        reqs[sid].stop_reason = finished[sid]
    return {"step": step, "idle": False, "rec": rec, "chunks": [(c.req.seq_id, c.C, c.T) for c in chunks],
            "logits": lg, "logits_rows": used_rows, "vllm": vsec}


def _hit_record(rid: str, hit: int, resumed: bool, num_tokens: int, rec: dict[str, Any], kv: Any, B: int) -> dict[str, Any]:
    """The prefix lookup of one request as vLLM did it (:func:`~infertrace.runtimes.vllm.replay.prefix_record`),
    with vLLM's own block table row and ``ref_cnt`` (its block pool after this step's schedule)."""
    from infertrace.runtimes.vllm.replay import prefix_record

    i = rec["req_ids"].index(rid)
    shared = [int(b) for b in rec["block_table"][i, : hit // B]]
    return prefix_record(hit, num_tokens, shared, [kv.ref_cnt.get(b, 0) for b in shared], resumed, B)


def taps(tracer: Any, rec: dict[str, Any], layer: int) -> None:
    """Hand vLLM's captured tensors to the recorder under the tap vocabulary (:mod:`infertrace.model.taps`):
    the embedding and, for the captured layer, Q/K before and after RoPE and V as written."""
    from infertrace.model.taps import EMBED, K, K_ROT, Q, Q_ROT, V

    cfg = tracer.cfg
    if rec.get("hidden") is not None:
        tracer.tap(EMBED, value=torch.from_numpy(rec["hidden"]))  # [T, H]
    if all(rec.get(k) is not None for k in ("q_pre", "q_rot", "k_pre", "k_rot", "v_written")):
        T = rec["q_pre"].shape[0]
        hd = cfg.head_dim

        def h(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a.reshape(T, -1, hd))  # [T, heads, hd]

        got = {Q: h(rec["q_pre"]), Q_ROT: h(rec["q_rot"]), K: h(rec["k_pre"]), K_ROT: h(rec["k_rot"]), V: h(rec["v_written"])}
        for name, value in got.items():
            if layer in tracer.layers and name in tracer.taps:
                tracer.tap(name, layer=layer, value=value)
    layer_taps(tracer, rec.get("taps") or {}, cfg.head_dim)


#: saved tap name (capture.py's record keys) -> the tap point of :mod:`infertrace.model.taps` it is recorded as
LAYER_TAPS = {"hidden_in": "resid_pre", "q_pre_rope": "q", "k_pre_rope": "k", "q_post_rope": "q_rot",
              "k_post_rope": "k_rot", "attn_out": "attn_out", "mlp_out": "mlp_out", "resid_post": "resid_post"}


def layer_taps(tracer: Any, taps: dict[str, np.ndarray], hd: int) -> None:
    """The per-layer taps of ``--keep tensors --layers`` (``"{layer}/{name}"`` -> ``[T, ...]`` float32, vLLM's
    packed row order) handed to the recorder; Q/K as heads ``[T, heads, hd]``."""
    for key, a in taps.items():
        il, _, name = key.partition("/")
        tap = LAYER_TAPS.get(name)
        if tap is None or not il.isdigit() or int(il) not in tracer.layers or tap not in tracer.taps:
            continue
        t = torch.from_numpy(a)  # [T, H]
        tracer.tap(tap, layer=int(il), value=t.reshape(t.shape[0], -1, hd) if name.endswith("rope") else t)
