"""Our ``paged`` backend held to vLLM: replay a saved ``--engine vllm`` trace's schedule and block ids
into our engine (``run --backend paged --replay DIR``), so the two traces ``diff`` step for step.

Why replay and not mirror. vLLM 0.32's scheduler and allocator are policies that change between
releases and depend on state our engine does not have: ``long_prefill_token_threshold`` applies only
while more than one request is eligible and is floored adaptively at ``budget / requests``, chunk
ends are re-aligned to block boundaries, blocks come from a free queue with block 0 reserved as the
null block, freed blocks go back to its tail in reverse order and keep their hash for prefix hits,
blocks for ``num_speculative_tokens`` lookahead slots are allocated with the decode token, and the
n-gram proposer has its own match rule. Mirroring every one would test our copy of vLLM's
policies. Replaying them tests the paged *mechanism* against vLLM: given vLLM's decisions (which
request runs, how many tokens, which blocks it owns, which drafts are verified, which tokens are
sampled), our engine derives positions, ``slot_mapping`` (``table[p // B] * B + p % B``),
``seq_lens``/``kv_lens``/``cu_seqlens``, the verify metadata, reuses the shared blocks of a prefix
hit without recomputing them, and computes K/V and logits with its own forward pass and paged
attention. Each of those is then compared exactly (integers) or against the noise floor (floats).

Replayed from the trace (never derived): per step the chunks ``(seq_id, C, T)``, the drafts of a
verify chunk, each request's block-table row, preemptions, the sampled / emitted tokens (teacher
forcing: our own top choice stays in ``top``), and the finish reasons. Derived by our engine:
everything else in the step record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infertrace.engine.engine import Engine, StepContext
from infertrace.engine.request import FINISHED, RUNNING
from infertrace.engine.sampler import SampleResult, sample
from infertrace.engine.scheduler import ScheduledBatch, ScheduledChunk
from infertrace.errors import InfertraceError
from infertrace.kv.base import ChunkSpec, ranges_text
from infertrace.kv.paged import PagedKV


def load_plan(directory: Path) -> dict[str, Any]:
    """The replay plan of a saved ``--engine vllm`` trace (validated by ``read_manifest``).

    Returns:
        ``{"block_size", "num_blocks", "requests": [{seq_id, prompt_ids, arrival_step}], "steps": {step: {...}}}``
        where a step holds ``chunks`` [{seq_id, C, T, token_ids, phase, need_logits, parents,
        table, sampled, emitted, accepted, finished}], ``preempted``, ``admitted``.

    Raises:
        InfertraceError: not a vLLM trace, or one recorded without the mask or kv variable.
    """
    from infertrace.trace.store import read_manifest

    return plan_from_manifest(read_manifest(directory), str(directory))


def plan_from_manifest(m: dict[str, Any], directory: str = "the trace") -> dict[str, Any]:
    """:func:`load_plan` on an already validated manifest dict (``RunTrace.to_dict()`` of a vLLM run)."""
    if m.get("runtime") != "vllm":
        raise InfertraceError(f"--replay {directory}: not a run --runtime vllm trace (runtime {m.get('runtime', 'infertrace')!r})")
    vl = m["options"].get("vllm") if isinstance(m["options"].get("vllm"), dict) else {}
    B, nb = vl.get("block_size"), vl.get("num_blocks")
    if not isinstance(B, int) or not isinstance(nb, int):
        raise InfertraceError(f"--replay {directory}: the trace has no vLLM block size / pool size")
    steps: dict[int, dict[str, Any]] = {}
    for st in m["steps"]:
        chunks = []
        tables = (st.get("mask") or {}).get("metadata", {}) if isinstance(st.get("mask"), dict) else {}
        rows = tables.get("block_tables") if isinstance(tables, dict) else None
        if st["batch"] and rows is None:
            raise InfertraceError(f"--replay {directory}: step {st['step']} has no block tables; record it with --show mask")
        for i, b in enumerate(st["batch"]):
            sp = b.get("spec")
            chunks.append({"seq_id": b["seq_id"], "C": b["C"], "T": b["T"], "token_ids": list(b["token_ids"]),
                           "phase": b["phase"], "need_logits": b.get("logits_row") is not None,
                           "parents": list(sp["parents"]) if sp else None,
                           "table": [x for x in rows[i] if x >= 0] if rows is not None else [],
                           "sampled": b.get("sampled"), "emitted": list(sp["emitted"]) if sp else None,
                           "accepted": len(sp["accepted_nodes"]) if sp else None, "finished": b.get("finished")})
        steps[st["step"]] = {"chunks": chunks, "preempted": list(st.get("preempted", [])),
                             "admitted": list(st.get("admitted", []))}
    reqs = [{"seq_id": r["seq_id"], "prompt_ids": list(r.get("prompt_ids", [])), "arrival_step": r.get("arrival_step", 0)}
            for r in m["requests"]]
    return {"block_size": B, "num_blocks": nb, "requests": reqs, "steps": steps, "last_step": max(steps, default=-1),
            "prefix_cache": vl.get("enable_prefix_caching") is True}


def prefix_record(hit: int, num_tokens: int, shared: list[int], ref_cnt: list[int], resumed: bool, B: int) -> dict[str, Any]:
    """One request's prefix lookup in vLLM's terms (also what ``--engine vllm`` records): ``hit`` tokens (whole
    blocks) of ``prompt_len`` = vLLM's ``request.num_tokens`` then (prompt + output for a request resumed
    after preemption), the ``shared`` blocks and their ``ref_cnt`` (tables holding each), the tokens left to
    compute, and where the hit stopped: vLLM caps a hit at ``num_tokens - 1`` and hits whole blocks only
    (vllm/v1/core/kv_cache_manager.py:286-298, ``max_cache_hit_length = request.num_tokens - 1``)."""
    stop = (f"block {hit // B}: the last token is recomputed for its logits and vLLM hits whole blocks only"
            if hit == (num_tokens - 1) // B * B else f"block {hit // B}: its hash is not in vLLM's cache")
    out: dict[str, Any] = {"hit": hit, "prompt_len": num_tokens, "shared_blocks": list(shared), "ref_cnt": list(ref_cnt),
                           "computed": f"{hit}..{num_tokens - 1}", "stop": stop}
    if resumed:
        out["resumed"] = True  # preempted earlier: its own full blocks were still hashed
    return out


class ReplayPagedKV(PagedKV):
    """Our paged pool whose block tables are set from the replayed trace instead of our free list
    (``_grow``); everything else -- slot mapping, lengths, metadata, the writes and the paged
    attention -- is :class:`PagedKV`'s own."""

    kind = "paged"

    def __init__(self, *a: Any, **k: Any):
        super().__init__(*a, **k)
        self.free = list(range(1, self.num_blocks))  # not used for placement; block 0 is vLLM's null block
        self.plan_tables: dict[int, list[int]] = {}
        self.prefix_cache = False  # vLLM shared prefix blocks between tables (set from the plan)

    def _grow(self, seq_id: int, n_new: int) -> None:
        tab = self.plan_tables.get(seq_id)
        need = -(-(self.lens.get(seq_id, 0) + n_new) // self.B)
        if tab is None or len(tab) < need:
            raise InfertraceError(f"replay: seq {seq_id} needs {need} blocks, the trace's table has {len(tab or [])}")
        if any(not 0 <= b < self.num_blocks for b in tab):
            raise InfertraceError(f"replay: seq {seq_id}'s block table {tab[:8]} lies outside the pool of {self.num_blocks}")
        self.tables[seq_id] = list(tab[:need])
        self.lens[seq_id] = self.lens.get(seq_id, 0) + n_new

    def attach_prefix(self, seq_id: int, C: int, table: list[int]) -> None:
        """A prefix hit at admission: the request starts with ``C`` cached tokens in the shared
        blocks ``table[:C // B]`` (their K/V were written by the request that computed them)."""
        self.tables[seq_id] = list(table[: -(-C // self.B)])
        self.lens[seq_id] = C

    def rewind(self, seq_id: int, keep: int) -> None:
        """vLLM's rewind of a verify step: ``num_computed_tokens`` drops the rejected drafts; the
        slots stay allocated (overwritten later)."""
        self.lens[seq_id] = keep

    def release(self, seq_id: int) -> None:
        self.tables.pop(seq_id, None)
        self.lens.pop(seq_id, None)

    def snapshot(self) -> dict[str, Any]:
        snap = super().snapshot()
        snap["free_list_head"] = []  # placement is replayed: no free list of ours to show
        if self.prefix_cache:  # a table may hold another request's full prefix blocks (`check` allows exactly those)
            snap["prefix_cache"] = True
            held: dict[int, int] = {}
            for tab in self.tables.values():
                for blk in tab:
                    held[blk] = held.get(blk, 0) + 1
            for v in snap["requests"].values():  # ref_cnt = the tables holding the block (vLLM's records its own)
                for blk in v["blocks"]:
                    blk["ref"] = held[blk["block"]]
        return snap


@dataclass(frozen=True)
class ReplayPool:
    """The cache config of a replay (:class:`~infertrace.engine.parts.MemoryConfig`): our paged pool of the vLLM
    trace's size and block size, its block tables set from the plan (:class:`ReplayPagedKV`)."""

    plan: dict[str, Any]

    def build(self, model: Any, opts: Any, attn_impl: str) -> ReplayPagedKV:
        """The replayed pool (every layer; the model's dtype: vLLM's ``kv_cache_dtype`` auto)."""
        cfg = model.cfg
        kv = ReplayPagedKV(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, self.plan["num_blocks"], self.plan["block_size"],
                           model.dtype, model.device, attn_impl)
        kv.prefix_cache = bool(self.plan.get("prefix_cache"))
        return kv


class ReplayEngine(Engine):
    """Our engine stepping through a vLLM trace's plan (see the module docstring).

    Args:
        model, tokenizer, opts, tracer: as :class:`Engine` (``opts.backend`` must be ``paged``
            with vLLM's block size and pool size).
        plan: :func:`load_plan`'s result.

    Raises:
        InfertraceError: options that do not match the trace (block size, pool, backend).
    """

    def __init__(self, model: Any, tokenizer: Any, opts: Any, tracer: Any, plan: dict[str, Any]):
        if opts.backend != "paged":
            raise InfertraceError("--replay holds the paged backend to vLLM: add --backend paged")
        if opts.tokens_per_block != plan["block_size"]:
            raise InfertraceError(f"--replay: the vLLM trace used blocks of {plan['block_size']} tokens; pass --tokens-per-block {plan['block_size']}")
        if opts.num_blocks is None:  # not given: the vLLM trace's pool (block 0 included, as --num-blocks counts it)
            opts.num_blocks = plan["num_blocks"]
        if opts.num_blocks != plan["num_blocks"]:
            raise InfertraceError(f"--replay: the vLLM trace's pool has {plan['num_blocks']} blocks (block 0 its null block); "
                                  f"pass --num-blocks {plan['num_blocks']} or leave it out")
        if opts.prefix_cache or opts.speculative or opts.context_shift:
            raise InfertraceError("--replay takes prefix hits and drafts from the vLLM trace; drop --prefix-cache / --speculative / --context-shift")
        super().__init__(model, tokenizer, opts, tracer, memory=ReplayPool(plan), sampler_order="hf")
        self.plan = plan

    def add_request(self, prompt_ids: list[int], params: Any = None, arrival_step: int = 0, prompt_text: str = "") -> Any:
        r = super().add_request(prompt_ids, params, arrival_step, prompt_text)
        want = next((q for q in self.plan["requests"] if q["seq_id"] == r.seq_id), None)
        if want is None or want["prompt_ids"] != list(prompt_ids) or want["arrival_step"] != arrival_step:
            raise InfertraceError(f"--replay: request {r.seq_id} differs from the vLLM trace's (prompt ids or --arrival); "
                                  "pass the same prompts and arrivals")
        return r

    def step(self) -> ScheduledBatch | None:
        """One replayed step (the plan's chunks), or None when the plan is done."""
        s = self.step_no
        if s > self.plan["last_step"]:
            return None
        t0 = time.perf_counter()
        p = self.plan["steps"].get(s, {"chunks": [], "preempted": [], "admitted": []})
        sch = self.scheduler
        while sch.future and sch.future[0].arrival_step <= s:
            sch.waiting.append(sch.future.pop(0))
        for sid in p["preempted"]:
            r = self.requests[sid]
            self.kv.release(sid)
            r.num_computed, r.num_preemptions = 0, r.num_preemptions + 1
        chunks, prefix = [], {}
        for c in p["chunks"]:
            r = self.requests[c["seq_id"]]
            if r in sch.waiting:
                sch.waiting.remove(r)
            r.status = RUNNING
            if c["C"] and self.kv.seq_len(r.seq_id) == 0:  # a prefix hit at admission or resumption: shared blocks
                self.kv.attach_prefix(r.seq_id, c["C"], c["table"])
                prefix[str(r.seq_id)] = (c["C"], len(r.all_ids), list(c["table"][: c["C"] // self.kv.B]),
                                         r.num_preemptions > 0)
            r.num_computed = c["C"]
            if self.kv.seq_len(r.seq_id) != c["C"]:
                raise InfertraceError(f"replay step {s}: seq {r.seq_id} holds {self.kv.seq_len(r.seq_id)} tokens, the trace says C={c['C']}")
            self.kv.plan_tables[r.seq_id] = c["table"]
            ids = c["token_ids"]
            own = r.all_ids[c["C"]: c["C"] + c["T"] - (len(c["parents"]) - 1 if c["parents"] else 0)]
            if ids[: len(own)] != own:
                raise InfertraceError(f"replay step {s}: seq {r.seq_id}'s tokens differ from the trace's")
            chunks.append(ScheduledChunk(r, c["phase"], c["C"], list(ids), c["need_logits"], c["parents"]))
        held = {sid: tab for sid, tab in self.kv.tables.items()}
        held.update({c["seq_id"]: c["table"] for c in p["chunks"]})  # every table after this step's allocation
        prefix = {sid: prefix_record(hit, n, shared, [sum(b in t for t in held.values()) for b in shared], resumed, self.kv.B)
                  for sid, (hit, n, shared, resumed) in prefix.items()}
        batch = ScheduledBatch(s, chunks, preempted=list(p["preempted"]), admitted=list(p["admitted"]))
        tracer = self.tracer
        if not chunks:
            if tracer.enabled:
                tracer.begin_step()
                tracer.end_step(StepContext(step=s, batch=batch, inp=None, kv=self.kv, attention=self.attn_impl, logits=None,
                                            logits_rows=[], samples={}, finished={}, requests=self.requests,
                                            time_ms=(time.perf_counter() - t0) * 1e3))
            self.step_no += 1
            return batch
        specs = [ChunkSpec(c.req.seq_id, c.C, c.T, c.parents) for c in chunks]
        inp = self.kv.prepare(specs)
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64)  # [N]
        rows, r0 = [], 0
        for c in chunks:
            if c.parents is not None:
                rows += list(range(r0, r0 + c.T))
            elif c.need_logits:
                rows.append(r0 + c.T - 1)
            r0 += c.T
        if tracer.enabled:
            tracer.begin_step()
        logits = self.model.forward(ids, inp, self.kv, torch.tensor(rows, dtype=torch.int64), tracer)  # [M, V]
        samples, finished, spec_rec, j = {}, {}, {}, 0
        for c, pc in zip(chunks, p["chunks"]):
            req = c.req
            if c.parents is not None:
                n = c.T
                lrows = logits[j: j + n]  # [T, V]
                j += n
                emitted = list(pc["emitted"])
                tops = [sample(lrows[a], req.params, req.all_ids, req.generator).top for a in range(len(emitted))]
                req.output_ids += emitted
                samples[req.seq_id] = SampleResult(emitted[-1], tops[-1])
                acc = pc["accepted"] - 1
                req.num_computed = c.C + acc + 1
                self.kv.rewind(req.seq_id, req.num_computed)
                spec_rec[str(req.seq_id)] = {"drafted": c.T - 1, "accepted": acc, "C": c.C, "tokens": list(c.token_ids),
                                             "parents": list(c.parents), "positions": [c.C + d for d in range(c.T)],
                                             "accepted_nodes": list(range(acc + 1)), "emitted": emitted,
                                             "rewind": {"op": "num_computed_tokens", "seq_id": req.seq_id,
                                                        "kept_pos": ranges_text(range(c.C + acc + 1))}}
            else:
                req.num_computed = c.C + c.T
                if c.need_logits:
                    res = self.sample_row(logits[j], req)
                    j += 1
                    tok = int(pc["sampled"])
                    samples[req.seq_id] = SampleResult(tok, res.top)
                    req.output_ids.append(tok)
            if pc["finished"]:
                finished[req.seq_id] = pc["finished"]
        spec_ctx = None
        if spec_rec:
            drafted = sum(v["drafted"] for v in spec_rec.values())
            accepted = sum(v["accepted"] for v in spec_rec.values())
            spec_ctx = {"requests": spec_rec, "drafted": drafted, "accepted": accepted,
                        "acceptance_rate": round(accepted / drafted, 4) if drafted else None}
        if tracer.enabled:
            tracer.end_step(StepContext(step=s, batch=batch, inp=inp, kv=self.kv, attention=self.attn_impl, logits=logits,
                                        logits_rows=rows, samples=samples, finished=finished, requests=self.requests,
                                        time_ms=(time.perf_counter() - t0) * 1e3, sampler_order=self.sampler_order,
                                        serving={"prefix": prefix} if prefix else None, spec=spec_ctx))
        for sid, reason in finished.items():
            req = self.requests[sid]
            req.status, req.stop_reason = FINISHED, reason
            self.kv.release(sid)
            if req in sch.running:
                sch.running.remove(req)
        self.step_no += 1
        return batch
