"""One step as plain data: what the recorder needs of a step, copied out of the runtime's live objects.

:func:`infertrace.capture.probe.probe` fills a :class:`StepData` from the live step (the engine's
:class:`~infertrace.engine.step.StepContext`: its batch, the memory, the attention inputs, the samples,
the recorder's taps); :meth:`infertrace.capture.recorder.Recorder.record` turns it into the trace's
:class:`~infertrace.trace.records.StepTrace` and reads nothing else. Between the two the data may cross
a process boundary: :meth:`StepData.to_wire` gives a JSON-safe dict and a dict of tensors (for
``safetensors.torch.save``), :meth:`StepData.from_wire` reads them back and validates them as untrusted
input (vLLM's ``SchedulerOutput`` / ``ModelRunnerOutput`` play this part between its engine core and
its workers).

Plain data only: ints, floats, strings, lists and dicts of them (the trace's own sections, already in
the trace's words: the memory's ``describe`` / ``snapshot``, each chunk's placement, the mask record,
the serving and speculative records), and torch tensors for the payloads (the tap tensors, the
recorded layer's K/V rows, the logical masks, the top-k logits). Nothing here imports the memory or
the engine.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import torch

from infertrace.errors import InfertraceError
from infertrace.limits import LIMITS
from infertrace.model.taps import K, K_ROT, Q, Q_ROT, V
from infertrace.safe_text import visible

#: wire format version of :meth:`StepData.to_wire`
WIRE_VERSION = 1
#: elements any one tensor of the wire may hold (2^28: a 1 GiB float32 tensor)
MAX_TENSOR_ELEMENTS = 1 << 28
#: nodes (values, keys included) of any one open JSON section of the wire
MAX_JSON_NODES = 1 << 22
#: tensor dtypes the wire carries (safetensors names them all)
WIRE_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                         torch.int16, torch.int8, torch.uint8, torch.bool})
#: the open sections of a step (already in the trace's words; checked as bounded JSON, not field by field)
_OPEN = ("serving", "spec", "mask", "mask_swa", "recurrent", "vllm")


@dataclass(frozen=True)
class ChunkData:
    """One scheduled chunk of the step, packed order (engine ``ScheduledChunk`` + what the memory shows of it).

    Attributes:
        seq_id, phase (``prefill`` | ``decode``), C (tokens cached before), T (tokens computed),
        token_ids ``[T]``, need_logits, parents (a speculative verify chunk's chunk-local draft tree,
        ``-1`` for the root; None for a plain chunk), depths ``[T]`` (``0..T-1``; a verify tree:
        the node's depth): the scheduler's chunk (TensorRT-LLM ``LlmRequest`` context chunk / vLLM
        ``num_scheduled_tokens``).
        logical: ``[T, L]`` bool, key ``j`` visible to query ``i`` (the memory's ``logical_mask``, L =
        the request's cached length); logical_swa: the same on the windowed layers (None without them).
        verify: a verify chunk's mask as attention consumed it (the inputs' ``verify_record``: cells
        ``kq_mask`` block, paged ``spec_decoding_position_offsets`` / packed mask), else None.
        placement: where the chunk's K/V went (cells ``{"cells"}``, streams ``+ "stream"``, paged
        ``{"slot_mapping", "block_table"}``); None unless the step records ``kv``.
        k_rows, v_rows: ``[n, n_kv, head_dim]`` of the recorded layer, cache rows ``C .. C+n-1`` after the
        step (the memory's ``read``; its dtype; n = min(T, len - C): a verify step keeps only the accepted);
        None when neither ``kv`` nor the RoPE evidence needs them.
    """

    seq_id: int
    phase: str
    C: int
    T: int
    token_ids: tuple[int, ...]
    need_logits: bool
    parents: tuple[int, ...] | None
    depths: tuple[int, ...]
    logical: torch.Tensor
    logical_swa: torch.Tensor | None = None
    verify: dict[str, Any] | None = None
    placement: dict[str, Any] | None = None
    k_rows: torch.Tensor | None = None
    v_rows: torch.Tensor | None = None


@dataclass(frozen=True)
class SampleData:
    """One request's draw (engine ``SampleResult``): the chosen ``token`` and ``top`` = ``(id, raw logit,
    prob)`` of the final distribution, best first; ``sampler`` the request's sampling settings as the trace
    writes them (``SamplingParams.to_dict`` plus the run's ``order`` when it samples)."""

    token: int
    top: tuple[tuple[int, float, float], ...]
    sampler: dict[str, Any]


@dataclass(frozen=True)
class KVData:
    """The memory as the step leaves it (state after the step's writes, before finished requests are freed):
    ``describe`` (kind, dtype, layers, ``physical_shape``), ``snapshot`` (the cells / block tables, plus
    the heads a unified cells cache moved: ``head_before`` / ``head_after``)."""

    describe: dict[str, Any]
    snapshot: dict[str, Any]


@dataclass(frozen=True)
class StepData:
    """What the recorder needs of one step (see the module docstring).

    Attributes:
        step, backend (the memory's convention: ``cells`` | ``paged``), attention (impl name), N (tokens
        computed), time_ms (wall time), preempted / admitted (seq_ids).
        chunks: :class:`ChunkData` per chunk, packed order (empty for an idle step).
        positions: ``[N]`` int64 position of each packed token (None for an idle step).
        logits_shape / logits_dtype: the step's logits ``[M, V]`` (None when idle); logits_rows: packed
        row of each logits row.
        samples: seq_id -> :class:`SampleData`; finished: seq_id -> stop reason.
        serving: the serving record (prefix hits, context shifts, evictions, audit) or None; spec: the
        speculative record (``requests`` by seq_id: verify records; ``drafted``, ``accepted``, ...) or None.
        mask: ``{"convention", "rule", "cells", "paged"}`` of the mask record; mask_swa: its sliding-window
        part (None without windowed layers or without ``mask``).
        kv: :class:`KVData` (None unless ``kv`` is recorded).
        recurrent: a hybrid memory's recurrent state summary (``describe_state``) or None.
        vllm: vLLM's native step section (``StepContext.vllm``: its scheduler output and attention metadata in
            its own names), copied to ``StepTrace.vllm``; None for the other runtimes. Read back as bounded JSON.
        taps: ``(tap name, layer)`` -> tensor (:mod:`infertrace.model.taps`; the embedding under layer None,
            ``[N, H]``; Q/K ``[N, heads, head_dim]``; None for a tap whose fields are not tensors: ``ssm_state``,
            whose presence names the GDN layer tapped); embed_ids: the embedding's input ids ``[N]`` or None.
        cache: ``(layer, seq_id)`` -> ``(k, v)`` ``[len, n_kv, head_dim]`` of every request holding cache
            (only for ``--keep tensors``).
        logits_topk: ``(values float32, ids int64)`` ``[M, k]`` (only for ``--keep tensors``).
        logits: the step's full logits ``[M, V]`` in the forward's dtype (only when :attr:`Want.logits`: a
            comparison of the floats, e.g. ``diff-runtimes vllm``); None otherwise and when idle.
    """

    step: int
    backend: str
    attention: str
    N: int
    time_ms: float
    preempted: tuple[int, ...] = ()
    admitted: tuple[int, ...] = ()
    chunks: tuple[ChunkData, ...] = ()
    positions: torch.Tensor | None = None
    logits_shape: tuple[int, ...] | None = None
    logits_dtype: str | None = None
    logits_rows: tuple[int, ...] = ()
    samples: dict[int, SampleData] = field(default_factory=dict)
    finished: dict[int, str] = field(default_factory=dict)
    serving: dict[str, Any] | None = None
    spec: dict[str, Any] | None = None
    mask: dict[str, Any] | None = None
    mask_swa: dict[str, Any] | None = None
    kv: KVData | None = None
    recurrent: dict[str, Any] | None = None
    vllm: dict[str, Any] | None = None
    taps: dict[tuple[str, int | None], torch.Tensor | None] = field(default_factory=dict)
    embed_ids: torch.Tensor | None = None
    cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    logits_topk: tuple[torch.Tensor, torch.Tensor] | None = None
    logits: torch.Tensor | None = None

    @property
    def idle(self) -> bool:
        """Nothing was scheduled (waiting for an arrival): no chunks, no positions."""
        return self.positions is None

    # ------------------------------------------------------------------ wire
    def to_wire(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The step as ``(JSON-safe dict, {name: tensor})``; the tensors are CPU, contiguous, own their
        memory (ready for ``safetensors.torch.save``) and keep their dtypes. Read back with :meth:`from_wire`."""
        tensors: dict[str, torch.Tensor] = {}

        def put(name: str, t: torch.Tensor | None) -> str | None:
            if t is None:
                return None
            tensors[name] = t.detach().to("cpu").contiguous().clone()
            return name

        chunks = []
        for i, c in enumerate(self.chunks):
            chunks.append({"seq_id": c.seq_id, "phase": c.phase, "C": c.C, "T": c.T, "token_ids": list(c.token_ids),
                           "need_logits": c.need_logits, "parents": None if c.parents is None else list(c.parents),
                           "depths": list(c.depths), "verify": c.verify, "placement": c.placement,
                           "logical": put(f"chunk{i}/logical", c.logical),
                           "logical_swa": put(f"chunk{i}/logical_swa", c.logical_swa),
                           "k_rows": put(f"chunk{i}/k_rows", c.k_rows), "v_rows": put(f"chunk{i}/v_rows", c.v_rows)})
        taps = [[name, layer, put(f"tap/{name}/{'-' if layer is None else layer}", t)]
                for (name, layer), t in self.taps.items()]
        cache = [[il, sid, put(f"cache/{il}/{sid}/k", k), put(f"cache/{il}/{sid}/v", v)]
                 for (il, sid), (k, v) in self.cache.items()]
        d = {
            "version": WIRE_VERSION, "step": self.step, "backend": self.backend, "attention": self.attention,
            "N": self.N, "time_ms": float(self.time_ms), "preempted": list(self.preempted), "admitted": list(self.admitted),
            "chunks": chunks, "positions": put("positions", self.positions),
            "logits_shape": None if self.logits_shape is None else list(self.logits_shape),
            "logits_dtype": self.logits_dtype, "logits_rows": list(self.logits_rows),
            "samples": [[sid, s.token, [[int(i), float(lg), float(p)] for i, lg, p in s.top], s.sampler]
                        for sid, s in self.samples.items()],
            "finished": [[sid, r] for sid, r in self.finished.items()],
            "serving": self.serving, "spec": self.spec, "mask": self.mask, "mask_swa": self.mask_swa,
            "kv": None if self.kv is None else {"describe": self.kv.describe, "snapshot": self.kv.snapshot},
            "recurrent": self.recurrent, "vllm": self.vllm, "taps": taps, "embed_ids": put("embed_ids", self.embed_ids), "cache": cache,
            "logits_topk": (None if self.logits_topk is None else
                            [put("logits_topk/values", self.logits_topk[0]), put("logits_topk/ids", self.logits_topk[1])]),
            "logits": put("logits", self.logits),
        }
        return d, tensors

    @classmethod
    def from_wire(cls, d: Any, tensors: Mapping[str, Any]) -> StepData:
        """A :class:`StepData` from :meth:`to_wire`'s pair, read as untrusted input: every field's type and
        size is checked (bounds of :data:`~infertrace.limits.LIMITS`, :data:`MAX_TENSOR_ELEMENTS`), every
        tensor named once and of a wire dtype, the open sections bounded JSON.

        Raises:
            InfertraceError: one line naming the field and what is wrong with it.
        """
        r = _Reader(tensors)
        r.obj(d, "step data", {f.name for f in fields(cls)} | {"version"})
        if d.get("version") != WIRE_VERSION:
            raise _bad("version", f"is {_show(d.get('version'))}, this reader reads {WIRE_VERSION}")
        N = r.int(d.get("N"), "N", LIMITS["MAX_CTX"])
        chunks = tuple(r.chunk(c, f"chunks[{i}]") for i, c in enumerate(r.list(d.get("chunks"), "chunks")))
        pos = r.tensor(d.get("positions"), "positions", optional=True, dtypes=(torch.int64, torch.int32), ndim=1)
        if pos is not None and pos.shape[0] != N:
            raise _bad("positions", f"has {pos.shape[0]} entries for N = {N}")
        if sum(c.T for c in chunks) != (N if pos is not None else 0):
            raise _bad("chunks", f"hold {sum(c.T for c in chunks)} tokens for N = {N}")
        samples = {}
        for i, s in enumerate(r.list(d.get("samples"), "samples")):
            s = r.list(s, f"samples[{i}]", 4, 4)
            top = tuple((r.int(t[0], f"samples[{i}].top id", LIMITS["MAX_ID"]), r.float(t[1], f"samples[{i}].top logit"),
                         r.float(t[2], f"samples[{i}].top prob"))
                        for t in (r.list(x, f"samples[{i}].top", 3, 3) for x in r.list(s[2], f"samples[{i}].top")))
            sid = r.int(s[0], f"samples[{i}] seq_id", LIMITS["MAX_SEQ_ID"])
            if sid in samples:
                raise _bad(f"samples[{i}]", f"repeats seq {sid}")
            samples[sid] = SampleData(
                r.int(s[1], f"samples[{i}].token", LIMITS["MAX_ID"]), top, r.json(s[3], f"samples[{i}].sampler", dict))
        finished = {r.int(x[0], f"finished[{i}] seq_id", LIMITS["MAX_SEQ_ID"]): r.str(x[1], f"finished[{i}]")
                    for i, x in enumerate(r.list(y, f"finished[{j}]", 2, 2) for j, y in enumerate(r.list(d.get("finished"), "finished")))}
        kv = d.get("kv")
        if kv is not None:
            r.obj(kv, "kv", {"describe", "snapshot"})
            kv = KVData(r.json(kv.get("describe"), "kv.describe", dict), r.json(kv.get("snapshot"), "kv.snapshot", dict))
        taps = {}
        for i, t in enumerate(r.list(d.get("taps"), "taps")):
            t = r.list(t, f"taps[{i}]", 3, 3)
            key = (r.str(t[0], f"taps[{i}] name", 64), None if t[1] is None else r.int(t[1], f"taps[{i}] layer", LIMITS["MAX_DIM"]))
            if key in taps:
                raise _bad(f"taps[{i}]", f"repeats tap {_show(key[0])} of layer {key[1]}")
            taps[key] = r.tensor(t[2], f"taps[{i}]", optional=True)
        cache = {}
        for i, c in enumerate(r.list(d.get("cache"), "cache")):
            c = r.list(c, f"cache[{i}]", 4, 4)
            key = (r.int(c[0], f"cache[{i}] layer", LIMITS["MAX_DIM"]), r.int(c[1], f"cache[{i}] seq_id", LIMITS["MAX_SEQ_ID"]))
            if key in cache:
                raise _bad(f"cache[{i}]", f"repeats layer {key[0]} seq {key[1]}")
            cache[key] = (r.tensor(c[2], f"cache[{i}].k", ndim=3), r.tensor(c[3], f"cache[{i}].v", ndim=3))
        topk = d.get("logits_topk")
        if topk is not None:
            topk = r.list(topk, "logits_topk", 2, 2)
            topk = (r.tensor(topk[0], "logits_topk.values", ndim=2), r.tensor(topk[1], "logits_topk.ids", ndim=2, dtypes=(torch.int64,)))
        shape = d.get("logits_shape")
        logits = r.tensor(d.get("logits"), "logits", optional=True, ndim=2)
        if logits is not None and (shape is None or list(logits.shape) != shape):
            raise _bad("logits", f"tensor has shape {list(logits.shape)}, logits_shape says {_show(shape)}")
        out = cls(
            step=r.int(d.get("step"), "step", LIMITS["MAX_STEPS"]), backend=r.str(d.get("backend"), "backend", 64),
            attention=r.str(d.get("attention"), "attention", 256), N=N, time_ms=r.float(d.get("time_ms"), "time_ms", finite=True),
            preempted=r.ints(d.get("preempted"), "preempted", LIMITS["MAX_SEQ_ID"]),
            admitted=r.ints(d.get("admitted"), "admitted", LIMITS["MAX_SEQ_ID"]), chunks=chunks, positions=pos,
            logits_shape=None if shape is None else r.ints(shape, "logits_shape", LIMITS["MAX_ID"], 2),
            logits_dtype=None if d.get("logits_dtype") is None else r.str(d["logits_dtype"], "logits_dtype", 64),
            logits_rows=r.ints(d.get("logits_rows"), "logits_rows", LIMITS["MAX_CTX"]), samples=samples, finished=finished,
            kv=kv, taps=taps, embed_ids=r.tensor(d.get("embed_ids"), "embed_ids", optional=True, ndim=1), cache=cache,
            logits_topk=topk, logits=logits, **{k: r.json(d.get(k), k, dict, optional=True) for k in _OPEN},
        )
        unused = sorted(set(tensors) - r.used)
        if unused:
            raise _bad("tensors", f"{len(unused)} not named by the step data (first: {_show(unused[0])})")
        return out

    def require(self, want: Want) -> None:
        """Check that the step holds what a recorder asking ``want`` reads (the probe copies exactly that; data
        read with :meth:`from_wire` may lack it), and that the sections it indexes have their keys.

        Raises:
            InfertraceError: one line naming what is missing.
        """
        if self.kv is not None:
            _keys(self.kv.describe, "kv.describe", ("kind", "dtype", "kv_layers", "physical_shape"))
        elif "kv" in want.show:
            raise _bad("kv", "is missing (the recorder records kv)")
        if self.idle:
            return
        if self.logits_shape is None or self.logits_dtype is None:
            raise _bad("logits_shape", "is missing for a step that computed tokens")
        if "mask" in want.show:
            if self.mask is None:
                raise _bad("mask", "is missing (the recorder records mask)")
            _keys(self.mask, "mask", ("convention", "rule", "cells", "paged"))
        evidence = "positions" in want.show and all(self.taps.get((n, want.layer)) is not None
                                                    for n in (Q, K, V, Q_ROT, K_ROT))
        for i, c in enumerate(self.chunks):
            if c.k_rows is None and ("kv" in want.show or evidence):
                raise _bad(f"chunks[{i}].k_rows", "are missing (the recorder records kv or the RoPE evidence)")
            if evidence and c.k_rows is not None:  # compared row by row with the recorded layer's K/V taps
                kv_shape = tuple(self.taps[(K, want.layer)].shape[1:])  # [n_kv, head_dim]
                if tuple(c.k_rows.shape[1:]) != kv_shape or (c.parents is None and c.k_rows.shape[0] != c.T) \
                        or (c.T and not c.k_rows.shape[0]):
                    raise _bad(f"chunks[{i}].k_rows", f"have shape {list(c.k_rows.shape)}, not [T = {c.T}, "
                               f"{', '.join(map(str, kv_shape))}] as the layer's K tap")
            if want.windowed and c.logical_swa is None:
                raise _bad(f"chunks[{i}].logical_swa", "is missing (the model has sliding-window layers)")
            if c.logical.shape[0] != c.T:
                raise _bad(f"chunks[{i}].logical", f"has {c.logical.shape[0]} rows for T = {c.T}")
        if self.serving is not None:
            if not isinstance(self.serving.get("prefix", {}), dict):
                raise _bad("serving.prefix", "is not an object (seq_id -> prefix hit)")
            ops = self.serving.get("ops_before_step", [])
            if not isinstance(ops, list) or not all(isinstance(op, dict) for op in ops):
                raise _bad("serving.ops_before_step", "is not a list of objects")
        reqs = (self.spec or {}).get("requests") or {}
        if not isinstance(reqs, dict):
            raise _bad("spec.requests", f"is a {type(reqs).__name__}, not an object (seq_id -> verify record)")
        for sid, v in reqs.items():
            _keys(v, f"spec.requests[{_show(sid)}]", ("accepted_nodes", "emitted", "parents", "drafted", "accepted"))
            for k in ("accepted_nodes", "emitted", "parents"):
                if not isinstance(v[k], list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v[k]):
                    raise _bad(f"spec.requests[{_show(sid)}].{k}", "is not a list of integers")


def _keys(d: Any, where: str, keys: tuple[str, ...]) -> None:
    if not isinstance(d, dict):
        raise _bad(where, f"is a {type(d).__name__}, not an object")
    missing = [k for k in keys if k not in d]
    if missing:
        raise _bad(where, f"has no {missing[0]!r}")


def _show(x: Any) -> str:
    return visible(repr(x)[:80])


def _bad(where: str, what: str) -> InfertraceError:
    return InfertraceError(f"step data: {where} {what}")


class _Reader:
    """The checks of :meth:`StepData.from_wire` (each raises one :class:`InfertraceError` line)."""

    def __init__(self, tensors: Mapping[str, Any]):
        if not isinstance(tensors, Mapping):
            raise _bad("tensors", f"are a {type(tensors).__name__}, not a mapping of names to tensors")
        self.tensors, self.used = tensors, set()

    def obj(self, d: Any, where: str, allowed: set[str]) -> None:
        if not isinstance(d, dict):
            raise _bad(where, f"is a {type(d).__name__}, not an object")
        extra = sorted(str(k) for k in d if k not in allowed)
        if extra:
            raise _bad(where, f"has unknown field {_show(extra[0])}")

    def int(self, x: Any, where: str, hi: int, lo: int = 0) -> int:
        if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
            raise _bad(where, f"is {_show(x)}, not an integer in {lo}..{hi}")
        return x

    def float(self, x: Any, where: str, finite: bool = False) -> float:
        """A number as float (an int past float's range is refused, not an OverflowError); ``finite``:
        NaN and ±inf refused too (a wall time; a logit may be -inf)."""
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise _bad(where, f"is {_show(x)}, not a number")
        try:
            f = float(x)
        except OverflowError:
            raise _bad(where, f"is {_show(x)}, outside the range of a float") from None
        if finite and not math.isfinite(f):
            raise _bad(where, f"is {_show(x)}, not a finite number")
        return f

    def str(self, x: Any, where: str, max_len: int = LIMITS["MAX_STR"]) -> str:
        if not isinstance(x, str) or len(x) > max_len:
            raise _bad(where, f"is {_show(x)}, not a string of at most {max_len} characters")
        return x

    def list(self, x: Any, where: str, lo: int = 0, hi: int = LIMITS["MAX_LIST"]) -> list[Any]:
        if not isinstance(x, list):
            raise _bad(where, f"is a {type(x).__name__}, not a list")
        if not lo <= len(x) <= hi:
            raise _bad(where, f"has {len(x)} items, not {lo}..{hi}")
        return x

    def ints(self, x: Any, where: str, hi: int, n: int | None = None, lo: int = 0) -> tuple[int, ...]:
        xs = self.list(x, where, *((n, n) if n is not None else ()))
        return tuple(self.int(v, f"{where}[{i}]", hi, lo) for i, v in enumerate(xs))

    def json(self, x: Any, where: str, kind: type, optional: bool = False) -> Any:
        """An open section: JSON values only (string keys), at most :data:`MAX_JSON_NODES` nodes, nested at
        most ``MAX_DEPTH`` deep, strings of at most ``MAX_STR`` characters, finite or not floats."""
        if x is None and optional:
            return None
        if not isinstance(x, kind):
            raise _bad(where, f"is a {type(x).__name__}, not a {kind.__name__}")
        todo, n = [(x, 0)], 0
        while todo:
            v, depth = todo.pop()
            n += 1
            if n > MAX_JSON_NODES or depth > LIMITS["MAX_DEPTH"]:
                raise _bad(where, f"is larger than {MAX_JSON_NODES} values or deeper than {LIMITS['MAX_DEPTH']}")
            if isinstance(v, dict):
                for k, w in v.items():
                    if not isinstance(k, str) or len(k) > LIMITS["MAX_STR"]:
                        raise _bad(where, f"has a key {_show(k)} that is not a string")
                    todo.append((w, depth + 1))
            elif isinstance(v, list):
                if len(v) > LIMITS["MAX_LIST"]:
                    raise _bad(where, f"has a list of {len(v)} items (at most {LIMITS['MAX_LIST']})")
                todo += [(w, depth + 1) for w in v]
            elif isinstance(v, str):
                if len(v) > LIMITS["MAX_STR"]:
                    raise _bad(where, f"has a string of {len(v)} characters (at most {LIMITS['MAX_STR']})")
            elif not (v is None or isinstance(v, (bool, int, float))):
                raise _bad(where, f"holds a {type(v).__name__}, not a JSON value")
        return x

    def tensor(self, name: Any, where: str, optional: bool = False, dtypes: tuple[torch.dtype, ...] | None = None,
               ndim: int | None = None) -> torch.Tensor | None:
        if name is None and optional:
            return None
        if not isinstance(name, str) or name not in self.tensors:
            raise _bad(where, f"names tensor {_show(name)}, which the tensors do not hold")
        if name in self.used:
            raise _bad(where, f"names tensor {_show(name)} a second time")
        self.used.add(name)
        t = self.tensors[name]
        if isinstance(t, torch.Tensor) and (t.layout != torch.strided or t.is_meta):  # no data to read
            raise _bad(where, f"tensor {_show(name)} is a {t.layout} tensor on {t.device}, not a dense one with data")
        if not isinstance(t, torch.Tensor) or t.dtype not in (dtypes or WIRE_DTYPES):
            kind = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise _bad(where, f"tensor {_show(name)} is {kind}, not one of {sorted(str(x) for x in (dtypes or WIRE_DTYPES))}")
        if ndim is not None and t.dim() != ndim:
            raise _bad(where, f"tensor {_show(name)} has shape {list(t.shape)}, not {ndim} dims")
        if t.numel() > MAX_TENSOR_ELEMENTS:
            raise _bad(where, f"tensor {_show(name)} has shape {list(t.shape)}, at most {MAX_TENSOR_ELEMENTS} elements")
        return t

    def chunk(self, c: Any, where: str) -> ChunkData:
        self.obj(c, where, {f.name for f in fields(ChunkData)})
        T = self.int(c.get("T"), f"{where}.T", LIMITS["MAX_CTX"])
        C = self.int(c.get("C"), f"{where}.C", LIMITS["MAX_CTX"])
        ids = self.ints(c.get("token_ids"), f"{where}.token_ids", LIMITS["MAX_ID"], T)
        depths = self.ints(c.get("depths"), f"{where}.depths", LIMITS["MAX_CTX"], T)
        parents = c.get("parents")
        if parents is not None:
            parents = self.ints(parents, f"{where}.parents", LIMITS["MAX_CTX"], T, lo=-1)
        if not isinstance(c.get("need_logits"), bool):
            raise _bad(f"{where}.need_logits", f"is {_show(c.get('need_logits'))}, not true / false")
        logical = self.tensor(c.get("logical"), f"{where}.logical", dtypes=(torch.bool,), ndim=2)
        swa = self.tensor(c.get("logical_swa"), f"{where}.logical_swa", optional=True, dtypes=(torch.bool,), ndim=2)
        for name, m in (("logical", logical), ("logical_swa", swa)):
            if m is not None and m.shape[0] != T:
                raise _bad(f"{where}.{name}", f"has {m.shape[0]} rows for T = {T}")
        k, v = (self.tensor(c.get(x), f"{where}.{x}", optional=True, ndim=3) for x in ("k_rows", "v_rows"))
        if (k is None) != (v is None) or (k is not None and (k.shape != v.shape or k.shape[0] > T)):  # type: ignore[union-attr]
            raise _bad(f"{where}.k_rows", "and v_rows differ, or hold more rows than T")
        return ChunkData(self.int(c.get("seq_id"), f"{where}.seq_id", LIMITS["MAX_SEQ_ID"]),
                         self.str(c.get("phase"), f"{where}.phase", 16), C, T, ids, c["need_logits"], parents, depths,
                         logical, swa, self.json(c.get("verify"), f"{where}.verify", dict, optional=True),
                         self.json(c.get("placement"), f"{where}.placement", dict, optional=True), k, v)


@dataclass(frozen=True)
class Want:
    """What the recorder asks the probe to copy out of a step (:func:`infertrace.capture.probe.probe`).

    Attributes:
        layer: the recorded layer (RoPE evidence, K/V rows). show: the variables recorded
        (:data:`~infertrace.trace.records.VARIABLES`). tensor_layers: layers whose tensors are kept
        (``--keep tensors``; None: no tensor is kept). top_k_tensors: logits kept per row with tensors.
        mask_rows, mask_cols: size of the ``kq_mask`` slice kept. windowed: the model has sliding-window
        layers (the mask's SWA side). hybrid: the model has recurrent (GDN) layers (the state summary).
        logits: copy the step's full logits ``[M, V]`` (:attr:`StepData.logits`; for a float comparison).
    """

    layer: int
    show: frozenset[str]
    tensor_layers: tuple[int, ...] | None = None
    top_k_tensors: int = 20
    mask_rows: int = 8
    mask_cols: int = 16
    windowed: bool = False
    hybrid: bool = False
    logits: bool = False
