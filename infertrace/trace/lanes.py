"""Request lanes: who ran in each step, and how, from a saved trace of any runtime (torch-free).

One :class:`Slot` per (request, step) in which the request was scheduled or preempted, built only from
the step records every engine writes (``StepTrace.batch`` rows, ``preempted``, ``admitted``, the prefix
lookup of a row, the ``kv.physical`` snapshot, ``time_ms``), so the same code reads our engine's traces,
``run --runtime llama.cpp`` and ``run --runtime vllm`` traces, and a collected served vLLM trace alike.

Kinds of a slot (vLLM / TensorRT-LLM words):

- ``prefill``: the whole prompt (what is left of it after a prefix hit) computed in this one step;
- ``chunk``: one piece of a chunked prefill (``chunk k/n`` = the k-th of the n prefill steps of one
  admission; a request preempted mid-prefill has an admission that ends without a sampled token);
- ``decode``: one new token;
- ``verify``: a speculative verify chunk (the pending token plus drafts; ``accepted`` / ``drafted``);
- ``preempted``: the scheduler preempted the request in this step (its cache freed, recomputed later).

A request with no slot in a step was not scheduled (waiting for arrival or budget, or already finished).
``finished`` marks the step in which the request emitted its last token (the stop reason), ``hit`` the
tokens its prefix lookup supplied when it was admitted (``ReqStep.prefix.hit``; blocks shared or cells
copied in ``hit_blocks``).

Positions are ``C .. C+T-1`` (``C`` = vLLM ``num_computed_tokens`` before the step, ``T`` =
``num_scheduled_tokens``). Time: ``time_ms`` is each step's recorded wall time (``timing.json``); the
lanes' time axis (:func:`step_starts`) lays the steps end to end on it, or on step numbers when a trace
carries no timings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from infertrace.trace.records import ReqStep, RunTrace, StepTrace

#: a step time above this (one day) is not a measurement: read as not recorded
MAX_STEP_MS = 86_400_000.0
KINDS = ("prefill", "chunk", "decode", "verify", "preempted")


@dataclass
class Slot:
    """One request's part of one step.

    Attributes:
        seq_id / step: whose lane, which column.
        kind: one of :data:`KINDS`.
        C / T: tokens cached before the step (vLLM ``num_computed_tokens``) and computed in it
            (``num_scheduled_tokens``); 0 / 0 for ``preempted``.
        chunk / chunks: for ``chunk``: this is prefill step ``chunk`` of ``chunks`` of one admission.
        hit: prefix-cache tokens supplied at admission (0: none or not this step); hit_blocks: the shared
            blocks (paged) or the copied cells range (cells) of that hit, as text.
        blocks: the request's block table after the step (paged) or its cells (cells), as text; "" unknown.
        sampled / piece: the sampled token id and its piece (None: no logits row this step).
        finished: stop reason when the request ended in this step.
        drafted / accepted: speculative verify counts (``verify`` only).
        rows: packed-batch rows (``first..last``) the request occupied; "" for ``preempted``.
    """

    seq_id: int
    step: int
    kind: str
    C: int = 0
    T: int = 0
    chunk: int = 0
    chunks: int = 0
    hit: int = 0
    hit_blocks: str = ""
    blocks: str = ""
    sampled: int | None = None
    piece: str | None = None
    finished: str | None = None
    drafted: int = 0
    accepted: int = 0
    rows: str = ""

    @property
    def positions(self) -> str:
        """``"C..C+T-1"`` (``"C"`` for one token, ``""`` for none)."""
        if self.T <= 0:
            return ""
        return str(self.C) if self.T == 1 else f"{self.C}..{self.C + self.T - 1}"

    def label(self) -> str:
        """Short text of the slot: ``prefill T=6``, ``chunk 1/2 T=4``, ``decode @6``, ``verify T=4 acc 2/3``,
        ``preempted`` (``T`` tokens computed; ``@p`` the position of a decode)."""
        if self.kind == "preempted":
            return "preempted"
        if self.kind == "decode":
            return f"decode @{self.C}"
        if self.kind == "chunk":
            return f"chunk {self.chunk}/{self.chunks} T={self.T}"
        if self.kind == "verify":
            return f"verify T={self.T} acc {self.accepted}/{self.drafted}"
        return f"prefill T={self.T}"


@dataclass
class Lanes:
    """Every request's slots: ``by_seq[seq_id][step] -> Slot``, ``seqs`` in first-seen order, ``steps`` the step
    numbers in trace order, ``n_tokens[step]`` the packed batch size N of each step, ``time_ms[step]`` its
    recorded wall time (0.0 when not recorded)."""

    seqs: list[int]
    steps: list[int]
    by_seq: dict[int, dict[int, Slot]] = field(default_factory=dict)
    n_tokens: dict[int, int] = field(default_factory=dict)
    time_ms: dict[int, float] = field(default_factory=dict)
    #: a collected served trace (``step.vllm.served.batch``): per step, the requests the server ran beside the
    #: marked ones (``(count, tokens)``); empty for every other trace
    unmarked: dict[int, tuple[int, int]] = field(default_factory=dict)

    def at(self, step: int) -> list[Slot]:
        """The slots of one step, in lane order (the batch composition of that step)."""
        return [self.by_seq[s][step] for s in self.seqs if step in self.by_seq.get(s, {})]

    @property
    def timed(self) -> bool:
        """True when the trace recorded step wall times (every non-idle step has ``time_ms > 0``)."""
        busy = [t for st, t in self.time_ms.items() if self.at(st)]
        return bool(busy) and all(t > 0 for t in busy)


def _text(x: Any, limit: int = 120) -> str:
    t = str(x)
    return t if len(t) <= limit else t[: limit - 1] + "…"


def _blocks_of(st: StepTrace, seq_id: int) -> str:
    """The request's block table (paged) or cells (cells) after the step, from ``kv.physical``; "" when not kept."""
    ph = st.kv.physical if st.kv is not None and isinstance(st.kv.physical, dict) else {}
    for key, field_ in (("requests", "block_table"), ("seqs", "cells")):
        per = ph.get(key)
        if isinstance(per, dict):
            v = per.get(str(seq_id), per.get(seq_id))
            if isinstance(v, dict) and v.get(field_) is not None:
                return _text(v[field_])
    return ""


def _hit_of(r: ReqStep) -> tuple[int, str]:
    p = r.prefix if isinstance(r.prefix, dict) else None
    if p is None or not isinstance(p.get("hit"), int) or isinstance(p.get("hit"), bool) or p["hit"] <= 0:
        return 0, ""
    if p.get("shared_blocks"):
        return p["hit"], "blocks " + _text(p["shared_blocks"])
    if p.get("cells"):
        return p["hit"], "cells " + _text(p["cells"])
    return p["hit"], ""


def _slot(st: StepTrace, r: ReqStep) -> Slot:
    sp = r.spec if isinstance(r.spec, dict) else None
    kind = "verify" if sp is not None and r.phase == "decode" else "decode" if r.phase == "decode" else "prefill"
    hit, hit_blocks = _hit_of(r)
    rows = "" if not r.rows else str(r.rows[0]) if len(r.rows) == 1 else f"{r.rows[0]}..{r.rows[-1]}"
    return Slot(seq_id=r.seq_id, step=st.step, kind=kind, C=r.C, T=r.T, hit=hit, hit_blocks=hit_blocks,
                blocks=_blocks_of(st, r.seq_id), sampled=r.sampled, piece=r.sampled_piece, finished=r.finished,
                drafted=int(sp.get("drafted") or 0) if sp else 0, accepted=int(sp.get("accepted") or 0) if sp else 0,
                rows=rows)


def _name_chunks(prefills: list[Slot]) -> None:
    """Split one request's prefill slots into admissions (an admission ends with a sampled token, a
    preemption, or a prefill that does not continue where the last one stopped) and name them: a one-step
    admission that sampled is ``prefill``, every other step ``chunk k/n``."""
    groups: list[list[Slot]] = []
    for s in prefills:
        g = groups[-1] if groups else None
        if g is None or g[-1].kind == "preempted" or g[-1].sampled is not None or g[-1].finished \
                or s.kind == "preempted" or g[-1].C + g[-1].T != s.C:
            groups.append([s])
        else:
            g.append(s)
    for g in groups:
        rows = [s for s in g if s.kind != "preempted"]
        if len(rows) == 1 and (rows[0].sampled is not None or rows[0].finished):
            continue
        for k, s in enumerate(rows, 1):
            s.kind, s.chunk, s.chunks = "chunk", k, len(rows)


def _unmarked(st: Any, marked: set[Any]) -> tuple[int, int] | None:
    """``(requests, tokens)`` the served step ran beside the trace's marked requests (``step.vllm.served.batch``,
    validated by the schema), or None when the step has no served record or nothing else ran."""
    served = (st.vllm or {}).get("served") if isinstance(getattr(st, "vllm", None), dict) else None
    batch = served.get("batch") if isinstance(served, dict) else None
    if not isinstance(batch, list):
        return None
    rest = [b for b in batch if isinstance(b, dict) and b.get("request_id") not in marked]
    if not rest:
        return None
    return len(rest), sum(int(b.get("num_scheduled_tokens") or 0) for b in rest)


def build_lanes(trace: RunTrace) -> Lanes:
    """The lanes of ``trace``: one :class:`Slot` per request per step it was scheduled or preempted in.

    Lane order: the trace's requests (``requests[].seq_id``), then any other seq_id in first-seen order.
    Pure function of the step records (no tensors); O(total batch rows).
    """
    seqs: list[int] = []
    seen: set[int] = set()
    for r in trace.requests:
        sid = r.get("seq_id") if isinstance(r, dict) else None
        if isinstance(sid, int) and not isinstance(sid, bool) and sid not in seen:
            seen.add(sid)
            seqs.append(sid)
    lanes = Lanes(seqs=seqs, steps=[st.step for st in trace.steps])
    marked = {r.get("vllm_request_id") for r in trace.requests if isinstance(r, dict)}
    order: dict[int, list[Slot]] = {}
    for st in trace.steps:
        lanes.n_tokens[st.step] = int(st.N or 0)
        others = _unmarked(st, marked)
        if others is not None:
            lanes.unmarked[st.step] = others
        t = float(st.time_ms or 0.0)
        lanes.time_ms[st.step] = t if math.isfinite(t) and 0.0 <= t <= MAX_STEP_MS else 0.0  # timing.json is untrusted
        for r in st.batch:
            s = _slot(st, r)
            lanes.by_seq.setdefault(r.seq_id, {})[st.step] = s
            order.setdefault(r.seq_id, []).append(s)
        for sid in st.preempted:
            if st.step not in lanes.by_seq.get(sid, {}):  # a row and a preemption in one step: the row stays
                s = Slot(seq_id=sid, step=st.step, kind="preempted", blocks=_blocks_of(st, sid))
                lanes.by_seq.setdefault(sid, {})[st.step] = s
                order.setdefault(sid, []).append(s)
    for sid, slots in order.items():
        if sid not in seen:
            seen.add(sid)
            lanes.seqs.append(sid)
        prefills: list[Slot] = []
        for s in slots:
            if s.kind in ("prefill", "preempted"):
                prefills.append(s)
            elif prefills:
                _name_chunks(prefills)
                prefills = []
        if prefills:
            _name_chunks(prefills)
    return lanes


def step_starts(lanes: Lanes) -> tuple[dict[int, float], dict[int, float], str]:
    """The time axis: ``(start_ms, duration_ms, axis)`` per step.

    With recorded step times (:attr:`Lanes.timed`), steps are laid end to end on their wall times
    (``start = sum of earlier steps' time_ms``; an idle step keeps its own recorded time), ``axis`` =
    ``"wall"``. Without, every step lasts 1 ms and starts at ``step`` ms (``axis`` = ``"step"``).
    """
    if not lanes.timed:
        return ({s: float(s) for s in lanes.steps}, {s: 1.0 for s in lanes.steps}, "step")
    start, dur, t = {}, {}, 0.0
    for s in lanes.steps:
        start[s] = t
        dur[s] = max(float(lanes.time_ms.get(s, 0.0)), 0.0)
        t += dur[s]
    return start, dur, "wall"


def composition(trace: RunTrace, step: int) -> list[dict[str, Any]]:
    """The batch a trace ran at ``step``, JSON-ready: per request ``seq_id``, ``kind`` (:data:`KINDS`),
    ``C``, ``T``, ``hit`` (prefix tokens), ``finished``; [] for an idle or unknown step (for ``bisect``:
    "the batch each runtime ran")."""
    return [{"seq_id": s.seq_id, "kind": s.kind, "label": s.label(), "C": s.C, "T": s.T, "hit": s.hit,
             "finished": s.finished} for s in build_lanes(trace).at(step)]
