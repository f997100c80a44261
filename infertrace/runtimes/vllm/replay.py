"""Our ``paged`` backend held to vLLM: replay a saved ``--runtime vllm`` trace's schedule and block ids
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

The replay is the ordinary :class:`~infertrace.engine.engine.Engine` (its ``step`` unchanged) with
injected parts (:func:`replay_engine`): the schedule is a scheduler (:class:`ReplayScheduler`), the
sampled / emitted tokens and each verify's outcome a sampler
(:class:`~infertrace.engine.parts.ForcedSampler`, :func:`plan_sampler`), the finish reasons a stop
rule (:class:`PlanStops`), the pool a cache config (:class:`ReplayPool`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from infertrace.engine.engine import Engine
from infertrace.engine.parts import ForcedSampler
from infertrace.engine.request import FINISHED, RUNNING, Request
from infertrace.engine.scheduler import ScheduledBatch, ScheduledChunk
from infertrace.errors import InfertraceError
from infertrace.kv.given import GivenTablesKV
from infertrace.safe_text import visible


def load_plan(directory: Path) -> dict[str, Any]:
    """The replay plan of a saved ``--runtime vllm`` trace (validated by ``read_manifest``).

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
        if rows is not None and len(rows) != len(st["batch"]):
            raise InfertraceError(f"--replay {directory}: step {st['step']} has {len(rows)} block tables for "
                                  f"{len(st['batch'])} scheduled requests; the trace is not a consistent vLLM trace")
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
    """One request's prefix lookup in vLLM's terms (also what ``--runtime vllm`` records): ``hit`` tokens (whole
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


@dataclass(frozen=True)
class ReplayPool:
    """The cache config of a replay (:class:`~infertrace.engine.parts.MemoryConfig`): our paged pool of the vLLM
    trace's size and block size, its block tables set from the plan (:class:`GivenTablesKV`)."""

    plan: dict[str, Any]

    def build(self, model: Any, opts: Any, attn_impl: str) -> GivenTablesKV:
        """The replayed pool (every layer; the model's dtype: vLLM's ``kv_cache_dtype`` auto)."""
        cfg = model.cfg
        return GivenTablesKV(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, self.plan["num_blocks"], self.plan["block_size"],
                             model.dtype, model.device, attn_impl, prefix_cache=bool(self.plan.get("prefix_cache")))


#: a step the plan does not name: nothing scheduled (an idle step)
IDLE_STEP: dict[str, Any] = {"chunks": [], "preempted": [], "admitted": []}


class ReplayScheduler:
    """The vLLM trace's schedule as the engine's scheduler: step ``s`` runs the plan's chunks ``(seq_id, C, T,
    token_ids, phase, need_logits, parents)``, its preemptions and admissions; a step the plan does not
    name is idle. Mirrors nothing of vLLM's policy (the module docstring says why): it replays its outcome.

    Per step, before the batch is returned: preempted requests' blocks are released (vLLM's recompute
    mode: ``num_computed_tokens`` 0), a request that starts with ``C > 0`` and holds nothing gets the
    prefix hit's shared blocks (``kv.attach_prefix``; its lookup in vLLM's terms goes in
    ``batch.serving["prefix"]``, :func:`prefix_record`), and each chunk's block-table row is handed to the
    pool (``kv.set_table``: :class:`GivenTablesKV` places the step's K/V there).

    ``future`` stays empty (every request is known from the start): the plan decides which steps are idle,
    so the engine never fast-forwards a wait. ``has_work`` is true until the plan's last step.

    Args:
        kv: :class:`GivenTablesKV`. plan: :func:`load_plan`'s result.

    Raises:
        InfertraceError: (``add``) a request that differs from the trace's; (``schedule``) a chunk whose ``C``
            is not what the request holds, or whose tokens differ from the request's.
    """

    def __init__(self, kv: GivenTablesKV, plan: dict[str, Any]):
        self.kv, self.plan = kv, plan
        self.future: list[Request] = []  # stays empty: the plan decides idle steps
        self.waiting: deque[Request] = deque()  # added, not scheduled yet (or preempted)
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.next_step = 0
        self.on_admit = None  # the engine's prefix-cache hook: unused, hits come from the plan
        self.split_equal = False  # set by the engine; vLLM has no ubatch split
        self.remainder: list[tuple[Request, int]] = []

    def add(self, req: Request) -> None:
        """Queue ``req`` after checking it is the trace's request ``seq_id`` (prompt ids, arrival step)."""
        want = next((q for q in self.plan["requests"] if q["seq_id"] == req.seq_id), None)
        if want is None or want["prompt_ids"] != list(req.prompt_ids) or want["arrival_step"] != req.arrival_step:
            raise InfertraceError(f"--replay: request {req.seq_id} differs from the vLLM trace's (prompt ids or --arrival); "
                                  "pass the same prompts and arrivals")
        self.requests[req.seq_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        """True until the plan's last step has been scheduled.

        Raises:
            InfertraceError: the plan is over while a request has not finished (a vLLM trace cut short: replaying
                it would pass a partial run off as the whole one).
        """
        if self.next_step <= self.plan["last_step"]:
            return True
        left = sorted(sid for sid, r in self.requests.items() if r.status != FINISHED)
        if left:
            raise InfertraceError(f"--replay: the vLLM trace ends after step {self.plan['last_step']} before seq {left[0]} "
                                  "finished (a truncated trace); replay a whole trace")
        return False

    def _request(self, step: int, sid: Any, what: str) -> Any:
        """The added request ``sid`` the plan's ``step`` names.

        Raises:
            InfertraceError: no such request has arrived (a plan naming an unknown or not yet arrived seq_id).
        """
        r = self.requests.get(sid) if isinstance(sid, int) else None
        if r is None:
            raise InfertraceError(f"replay step {step}: the vLLM trace {what} seq {visible(repr(sid)[:40])}, which has not "
                                  "arrived in this run; pass the trace's prompts and arrivals")
        return r

    def schedule(self, step: int) -> ScheduledBatch:
        """The plan's batch of ``step`` (see the class docstring)."""
        self.next_step = step + 1
        p = self.plan["steps"].get(step, IDLE_STEP)
        kv = self.kv
        for sid in p["preempted"]:
            r = self._request(step, sid, "preempts")
            kv.release(sid)
            r.num_computed, r.num_preemptions = 0, r.num_preemptions + 1
            if r in self.running:
                self.running.remove(r)
                self.waiting.appendleft(r)
        chunks, prefix = [], {}
        for c in p["chunks"]:
            r = self._request(step, c["seq_id"], "schedules")
            if r in self.waiting:
                self.waiting.remove(r)
                self.running.append(r)
            r.status = RUNNING
            if c["C"] and kv.seq_len(r.seq_id) == 0:  # a prefix hit at admission or resumption: shared blocks
                kv.attach_prefix(r.seq_id, c["C"], c["table"])
                prefix[str(r.seq_id)] = (c["C"], len(r.all_ids), list(c["table"][: c["C"] // kv.B]), r.num_preemptions > 0)
            r.num_computed = c["C"]
            if kv.seq_len(r.seq_id) != c["C"]:
                raise InfertraceError(f"replay step {step}: seq {r.seq_id} holds {kv.seq_len(r.seq_id)} tokens, the trace says C={c['C']}")
            kv.set_table(r.seq_id, c["table"])
            ids = c["token_ids"]
            own = r.all_ids[c["C"]: c["C"] + c["T"] - (len(c["parents"]) - 1 if c["parents"] else 0)]
            if ids[: len(own)] != own:
                raise InfertraceError(f"replay step {step}: seq {r.seq_id}'s tokens differ from the trace's")
            chunks.append(ScheduledChunk(r, c["phase"], c["C"], list(ids), c["need_logits"], c["parents"]))
        held = {sid: tab for sid, tab in kv.tables.items()}
        held.update({c["seq_id"]: c["table"] for c in p["chunks"]})  # every table after this step's allocation
        prefix = {sid: prefix_record(hit, n, shared, [sum(b in t for t in held.values()) for b in shared], resumed, kv.B)
                  for sid, (hit, n, shared, resumed) in prefix.items()}
        return ScheduledBatch(step, chunks, preempted=list(p["preempted"]), admitted=list(p["admitted"]),
                              serving={"prefix": prefix} if prefix else None)

    def finish(self, req: Request, reason: str) -> None:
        """Mark ``req`` finished with the trace's ``reason`` and release its blocks."""
        req.status, req.stop_reason = FINISHED, reason
        self.kv.release(req.seq_id)
        if req in self.running:
            self.running.remove(req)


@dataclass(frozen=True)
class ReplaySchedule:
    """The scheduler config of a replay (``Engine(scheduler=...)``): :class:`ReplayScheduler` over the plan."""

    plan: dict[str, Any]

    def build(self, kv: GivenTablesKV, opts: Any) -> ReplayScheduler:
        return ReplayScheduler(kv, self.plan)


@dataclass(frozen=True)
class PlanStops:
    """The stop rule of a replay (``Engine(stop=...)``): request ``seq_id`` stops with ``reason`` once it holds
    ``n`` output tokens (the trace's finish, after that step's sampled / emitted tokens); never otherwise
    (vLLM decided: no eos / max_new_tokens rule of ours).

    Attributes:
        stops: ``{seq_id: (n output tokens, reason)}``.
    """

    stops: Mapping[int, tuple[int, str]] = field(default_factory=dict)

    def __call__(self, req: Request, token: int) -> str | None:
        got = self.stops.get(req.seq_id)
        return got[1] if got is not None and len(req.output_ids) >= got[0] else None


def plan_sampler(plan: dict[str, Any]) -> tuple[ForcedSampler, PlanStops]:
    """The replayed tokens as a sampler and a stop rule: per request, in step order, the sampled token of each
    chunk that needs logits and the emitted tokens of each verify chunk (forced: our own top stays in ``top``),
    each verify's ``(emitted, accepted nodes)`` by ``(seq_id, step)``, and the output length at which the trace
    finished it.

    Raises:
        InfertraceError: a sampling chunk without a sampled token in the trace.
    """
    forced: dict[int, list[int]] = {}
    verified: dict[tuple[int, int], tuple[list[int], int]] = {}
    stops: dict[int, tuple[int, str]] = {}
    for s in sorted(plan["steps"]):
        for c in plan["steps"][s]["chunks"]:
            out = forced.setdefault(c["seq_id"], [])
            if c["parents"] is not None:
                verified[(c["seq_id"], s)] = (list(c["emitted"]), int(c["accepted"]))
                out += [int(t) for t in c["emitted"]]
            elif c["need_logits"]:
                if c["sampled"] is None:
                    raise InfertraceError(f"replay step {s}: seq {c['seq_id']} has a logits row but no sampled token in the trace")
                out.append(int(c["sampled"]))
            if c["finished"]:
                stops[c["seq_id"]] = (len(out), c["finished"])
    return ForcedSampler(forced, verified), PlanStops(stops)


def check_replay_options(opts: Any, plan: dict[str, Any]) -> None:
    """Options that match the trace: backend ``paged``, vLLM's block size and pool (``opts.num_blocks`` set
    to the trace's when None), and no prefix cache / speculation / context shift of ours (the trace has them).

    Raises:
        InfertraceError: options that do not match the trace (block size, pool, backend).
    """
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


def replay_engine(model: Any, tokenizer: Any, opts: Any, tracer: Any, plan: dict[str, Any]) -> Engine:
    """Our engine stepping through a vLLM trace's plan (see the module docstring): :class:`Engine` with the
    replayed pool, schedule, tokens and finish reasons injected, sampler order ``hf`` (vLLM's).

    Args:
        model, tokenizer, opts, tracer: as :class:`Engine` (``opts.backend`` must be ``paged``
            with vLLM's block size and pool size; ``opts.num_blocks`` None is set to the trace's).
        plan: :func:`load_plan`'s result.

    Raises:
        InfertraceError: options that do not match the trace (:func:`check_replay_options`).
    """
    check_replay_options(opts, plan)
    sampler, stops = plan_sampler(plan)
    return Engine(model, tokenizer, opts, tracer, memory=ReplayPool(plan), scheduler=ReplaySchedule(plan),
                  sampler=sampler, stop=stops, sampler_order="hf")
