"""Iteration-level (continuous) batching scheduler with chunked prefill and preemption.

Each step: decode tokens of running requests first, then prefill chunks (partially
prefilled running requests, then waiting ones, first come first served), under a token
budget ``max_batch_tokens`` and a per-request ``prefill_chunk``. When the KV storage cannot
hold a running request's next tokens, the most recently admitted other request is
preempted: its cache is freed and it is recomputed later (vLLM ``Scheduler._preempt`` in
recompute mode; TensorRT-LLM ``MaxUtilizationScheduler``). Mirrors nano-vllm's
``scheduler.py`` loop shape.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from infertrace.engine.request import FINISHED, RUNNING, WAITING, Request
from infertrace.engine.config import SchedulerConfig
from infertrace.errors import InfertraceError
from infertrace.kv.base import ChunkSpec, KVBackend


@dataclass
class ScheduledChunk:
    """Tokens ``all_ids[C : C+T]`` of ``req`` computed this step."""

    req: Request
    phase: str
    C: int
    token_ids: list[int]
    need_logits: bool
    parents: list[int] | None = None  # speculative verify chunk: [-1, parent of draft 1, ...] (chunk-local)

    @property
    def T(self) -> int:
        return len(self.token_ids)

    def depths(self) -> list[int]:
        """Depth of each token in its draft tree (``0..T-1`` for a plain chunk)."""
        return ChunkSpec(self.req.seq_id, self.C, self.T, self.parents).depths()


@dataclass
class ScheduledBatch:
    """What one step computes: chunks in packed order, plus requests preempted to make room.

    ``serving``: a serving record the scheduler made itself (a replayed vLLM trace's prefix hits,
    ``{"prefix": {seq_id: lookup}}``); the engine puts it into the step's ``StepContext.serving``."""

    step: int
    chunks: list[ScheduledChunk]
    preempted: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    stopped: dict[int, str] = field(default_factory=dict)  # requests stopped by the scheduler (kv_full: pool full)
    serving: dict[str, Any] | None = None

    @property
    def N(self) -> int:
        return sum(c.T for c in self.chunks)


class Scheduler:
    """Args: kv backend (capacity checks), ``max_batch_tokens`` budget per step,
    ``prefill_chunk`` (max prompt tokens per request per step; None = budget)."""

    def __init__(self, kv: KVBackend, max_batch_tokens: int = 2048, prefill_chunk: int | None = None):
        SchedulerConfig(max_batch_tokens, prefill_chunk).validate()  # ConfigError: scheduler.<field>
        self.kv = kv
        self.max_batch_tokens = max_batch_tokens
        self.prefill_chunk = prefill_chunk
        self.future: list[Request] = []  # not arrived yet
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        #: prefix-cache hook (engine/serving.py): called with a request about to be admitted with
        #: nothing cached; attaches cached K/V and sets ``num_computed`` to the hit length.
        self.on_admit = None
        #: non-unified KV (``--kv-unified off``): each step is cut to the first ubatch llama.cpp's
        #: ``split_equal(sequential=true)`` would make of it (:meth:`_split_equal`)
        self.split_equal = False
        #: what the last cut left of the batch, ``[(request, tokens left)]`` in packed order: the next
        #: steps are its ubatches, before anything new is scheduled (llama.cpp decodes the rest of a
        #: ``llama_batch`` as the next ubatches of the same ``llama_decode``)
        self.remainder: list[tuple[Request, int]] = []

    def add(self, req: Request) -> None:
        """Queue ``req``; it becomes schedulable at its ``arrival_step``."""
        self.future.append(req)
        self.future.sort(key=lambda r: (r.arrival_step, r.seq_id))

    def has_work(self) -> bool:
        """True while any request is not finished (arrived or not)."""
        return bool(self.future or self.waiting or self.running)

    def _take(self, req: Request, budget: int) -> int:
        n = min(req.num_pending + (len(req.draft) if req.phase == "decode" else 0), budget)
        if req.phase == "prefill" and self.prefill_chunk is not None:
            n = min(n, self.prefill_chunk)
        return n

    def _preempt(self, victim: Request) -> None:
        self.kv.release(victim.seq_id)
        victim.num_computed = 0
        victim.status = WAITING
        victim.num_preemptions += 1
        victim.draft, victim.draft_parents = [], []
        self.running.remove(victim)
        self.waiting.appendleft(victim)

    def schedule(self, step: int) -> ScheduledBatch:
        """Choose this step's chunks. Mutates request status (admission, preemption).

        Raises:
            InfertraceError: a single request cannot fit even with everything else preempted.
        """
        batch = ScheduledBatch(step, [])
        while self.future and self.future[0].arrival_step <= step:
            self.waiting.append(self.future.pop(0))
        if self.split_equal and self.remainder:  # the rest of the last batch: its next ubatch
            return self._rest_of_batch(batch)
        budget = self.max_batch_tokens
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted meanwhile
                continue
            n = self._take(req, budget)
            if n <= 0:
                continue
            while not self.kv.can_fit(self._plan(batch, req, n)):
                if req.phase == "decode" and n > req.num_pending:
                    # drafts are optional: a verify chunk that does not fit drops its last draft nodes
                    # (a prefix of the tree is a tree) before anyone is preempted or stopped with kv_full
                    n -= 1
                    continue
                scheduled = [c.req for c in batch.chunks]
                victims = [r for r in self.running if r is not req and r not in scheduled]
                if not victims:
                    if len(self.running) == 1 and not batch.chunks:
                        # alone and still too big: the pool is full (case P5): stop it, never abort the run
                        self.finish(req, "kv_full")
                        batch.stopped[req.seq_id] = "kv_full"
                        break
                    # lowest priority left is the request itself: preempt it (vLLM does the same)
                    victims = [req]
                v = victims[-1]
                self._preempt(v)
                batch.preempted.append(v.seq_id)
                if v is req:
                    break
            if req.status != RUNNING or not self.kv.can_fit(self._plan(batch, req, n)):
                continue
            batch.chunks.append(self._chunk(req, n))
            budget -= n
        while self.waiting and budget > 0:
            req = self.waiting[0]
            hit = self.on_admit(req) if self.on_admit is not None and req.num_computed == 0 else 0
            n = self._take(req, budget)
            if not self.kv.can_fit(self._plan(batch, req, n)):
                if hit:  # undo the prefix attachment (not retained: cells kept would be a seq_cp no step shows)
                    self.kv.forget(req.seq_id)
                    req.num_computed = 0
                if not self.running and not batch.chunks:
                    if not req.output_ids:
                        raise InfertraceError(
                            f"request {req.seq_id} needs more KV storage than exists ({self.kv.capacity_tokens} tokens); raise --ctx-size / --num-blocks"
                        )
                    # a preempted request whose tokens no longer fit the whole pool: stop it (case P5)
                    self.waiting.popleft()
                    self.finish(req, "kv_full")
                    batch.stopped[req.seq_id] = "kv_full"
                    continue
                break
            self.waiting.popleft()
            req.status = RUNNING
            self.running.append(req)
            batch.admitted.append(req.seq_id)
            batch.chunks.append(self._chunk(req, n))
            budget -= n
        if self.split_equal:
            self._split_equal(batch)
        return batch

    def _split_equal(self, batch: ScheduledBatch) -> None:
        """Cut ``batch`` to one llama.cpp ``split_equal`` ubatch (non-unified KV: one stream per
        sequence): the chunks of consecutive seq_ids from the first one, each cut to the shortest
        (:func:`~infertrace.kv.streams.split_equal_chunks`); the rest is kept in :attr:`remainder`
        and forms the next steps (llama.cpp decodes it as the next ubatches of the same ``llama_decode``)."""
        from infertrace.kv.streams import split_equal_chunks

        keep, n_tps = split_equal_chunks([c.req.seq_id for c in batch.chunks], [c.T for c in batch.chunks])
        out, rest = [], []
        for i, c in enumerate(batch.chunks):
            if i not in keep:
                rest.append((c.req, c.T))
                continue
            if c.T > n_tps:  # a prefill chunk cut to n_tps tokens: logits only if it now ends the prompt
                rest.append((c.req, c.T - n_tps))
                c = ScheduledChunk(c.req, c.phase, c.C, c.token_ids[:n_tps], c.C + n_tps == len(c.req.cache_ids),
                                   c.parents[:n_tps] if c.parents is not None else None)
            out.append(c)
        batch.chunks, self.remainder = out, rest

    def _rest_of_batch(self, batch: ScheduledBatch) -> ScheduledBatch:
        """The next ubatch of :attr:`remainder` (requests still running, their tokens already fitted)."""
        rest, self.remainder = self.remainder, []
        batch.chunks = [self._chunk(req, n) for req, n in rest if req.status == RUNNING]
        self._split_equal(batch)
        return batch

    @staticmethod
    def _plan(batch: ScheduledBatch, req: Request, n: int) -> list[tuple[int, int]]:
        return [(c.req.seq_id, c.T) for c in batch.chunks] + [(req.seq_id, n)]

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        C = req.num_computed
        cache_ids = req.cache_ids  # all_ids unless a context shift dropped some
        if req.phase == "decode" and req.draft:  # verify: the pending token + drafts whose parents fit the budget
            # chunk-local: the pending token is node 0, draft i is node i + 1; nodes follow their parents, so
            # any prefix (a budget cut) is still a tree
            parents = [-1] + [p + 1 for p in req.draft_parents[: n - 1]]
            return ScheduledChunk(req, "decode", C, cache_ids[C:] + req.draft[: len(parents) - 1], True, parents)
        ids = cache_ids[C : C + n]
        return ScheduledChunk(req, req.phase, C, ids, need_logits=(C + n == len(cache_ids)))

    def finish(self, req: Request, reason: str) -> None:
        """Mark ``req`` finished with ``reason`` and free its cells/blocks (TensorRT-LLM ``free_resources``)."""
        req.status = FINISHED
        req.stop_reason = reason
        self.kv.release(req.seq_id)
        if req in self.running:
            self.running.remove(req)
