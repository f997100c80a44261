"""infertrace as a vLLM general plugin: record a served vLLM (``vllm serve``) into a spool.

vLLM calls every entry point of the group ``vllm.general_plugins`` in every process it starts (API
server, engine core, workers; vllm/plugins/__init__.py ``load_general_plugins``; ``VLLM_PLUGINS`` is an
allow-list). :func:`register` does nothing unless ``INFERTRACE_SPOOL`` names a spool directory; then it
wraps, at class level and without changing any result:

==========================================  ==========================================================
vLLM 0.32 method                            recorded (process)
==========================================  ==========================================================
``Scheduler.schedule``                      every step: the ``SchedulerOutput`` as data (who ran, tokens,
                                            num_computed_tokens, new/cached block ids, preemptions,
                                            finished), the new requests' prompt ids and sampling
                                            params, the block pool (free count, ref_cnt per held block,
                                            free-queue head, blocks freed since the last step) (engine core)
``Scheduler.update_from_output``            the step's sampled tokens, finish reasons and
                                            ``num_cached_tokens`` per request (engine core)
``GPUModelRunner.execute_model`` /          for steps holding a marked request: the capture of
``sample_tokens``                           :mod:`.capture` (packed ids, positions, attention metadata,
                                            block table, slot mapping, layer K/V written and read back,
                                            logits rows, samples) (each worker: vLLM 0.32 CPU
                                            serves through its ``mp`` executor, one worker also
                                            at TP=1; the engine core under ``uni``)
==========================================  ==========================================================

A request is marked from the client with vLLM's per-request extra arguments: ``"vllm_xargs":
{"infertrace": "<label>"}`` in the OpenAI request body (vllm/entrypoints/openai/completion/protocol.py
``vllm_xargs`` -> ``SamplingParams.extra_args``). Environment: ``INFERTRACE_SPOOL`` (the directory),
``INFERTRACE_LAYER`` (the captured layer, default 0), ``INFERTRACE_SPOOL_MB`` (per-process limit,
default 256), ``INFERTRACE_WHOLE_BATCH=1`` (keep every row of a captured step, not only the marked
requests' rows; the batch's request ids and counts are kept either way). Any exception in a hook disables recording in that process with one log line; the
server keeps serving. The plugin opens no port and reads no network input.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

#: environment variable naming the spool directory (unset: the plugin does nothing)
ENV_SPOOL = "INFERTRACE_SPOOL"
#: ``vllm_xargs`` key that marks a request
MARK = "infertrace"
#: fault injection for the tests: with ``INFERTRACE_FAULT=worker`` the sampler hook raises in a step holding a
#: request marked ``inject-fault``; with ``core`` the engine core's hook raises at the first step
ENV_FAULT = "INFERTRACE_FAULT"
FAULT_LABEL = "inject-fault"

log = logging.getLogger("vllm.infertrace")


class _State:
    spool: str | None = None
    disabled = False
    limit = 256 << 20
    layer = 0
    core: Any = None


ST = _State()


def disable(where: str, e: BaseException) -> None:
    """Turn recording off in this process, saying so once (the server keeps serving)."""
    if not ST.disabled:
        ST.disabled = True
        log.warning("infertrace: recording disabled in pid %d after an error in %s (%s: %s); the server keeps serving",
                    os.getpid(), where, type(e).__name__, str(e)[:200])


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install the recording hooks when ``INFERTRACE_SPOOL`` is set."""
    spool = os.environ.get(ENV_SPOOL)
    if not spool or ST.spool is not None:
        return
    try:
        ST.spool = spool
        ST.layer = int(os.environ.get("INFERTRACE_LAYER", "0"))
        ST.limit = int(float(os.environ.get("INFERTRACE_SPOOL_MB", "256")) * (1 << 20))
        _patch_scheduler()
        _patch_runner()
    except Exception as e:  # a vLLM without these classes: never stop the server
        disable("register", e)


def marked_label(sampling_params: Any) -> str | None:
    """The client's mark of a request (``vllm_xargs["infertrace"]``), as text, or None."""
    xa = getattr(sampling_params, "extra_args", None)
    if isinstance(xa, dict) and xa.get(MARK) not in (None, "", 0, "0", False):
        return str(xa[MARK])[:64]
    return None


# ----------------------------------------------------------------------------- engine core
def _patch_scheduler() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    sched_orig, upd_orig = Scheduler.schedule, Scheduler.update_from_output

    def schedule(self: Any, *a: Any, **k: Any) -> Any:
        so = sched_orig(self, *a, **k)
        if not ST.disabled:
            try:
                _core(self).on_schedule(self, so)
            except Exception as e:
                disable("Scheduler.schedule", e)
        return so

    def update_from_output(self: Any, so: Any, mro: Any) -> Any:
        outs = upd_orig(self, so, mro)
        if not ST.disabled:
            try:
                _core(self).on_update(self, outs)
            except Exception as e:
                disable("Scheduler.update_from_output", e)
        return outs

    Scheduler.schedule, Scheduler.update_from_output = schedule, update_from_output


def _core(sched: Any) -> "CoreRecorder":
    if ST.core is None:
        ST.core = CoreRecorder(sched)
    return ST.core


def _params(sp: Any) -> dict[str, Any]:
    if sp is None:
        return {}
    return {"max_tokens": sp.max_tokens, "temperature": float(sp.temperature), "top_p": float(sp.top_p),
            "top_k": int(sp.top_k or 0), "min_p": float(sp.min_p), "seed": sp.seed, "ignore_eos": bool(sp.ignore_eos),
            "repetition_penalty": float(sp.repetition_penalty), "logprobs": sp.logprobs}


def header(vc: Any) -> dict[str, Any]:
    """The settings of a served vLLM that change its numbers or its schedule (recorded in the trace)."""
    from vllm import __version__
    from vllm.platforms import current_platform

    cc, sc, mc, pc = vc.cache_config, vc.scheduler_config, vc.model_config, vc.parallel_config
    spec = vc.speculative_config
    return {"version": __version__, "device": str(current_platform.device_type), "model": str(mc.model),
            "dtype": str(mc.dtype).replace("torch.", ""), "block_size": int(cc.block_size),
            "cache_dtype": str(cc.cache_dtype), "enable_prefix_caching": bool(cc.enable_prefix_caching),
            "max_num_batched_tokens": int(sc.max_num_batched_tokens), "max_num_seqs": int(sc.max_num_seqs),
            "max_model_len": int(mc.max_model_len), "long_prefill_token_threshold": sc.long_prefill_token_threshold,
            "enable_chunked_prefill": bool(sc.enable_chunked_prefill), "async_scheduling": bool(sc.async_scheduling),
            "tensor_parallel_size": int(pc.tensor_parallel_size),
            "distributed_executor_backend": str(pc.distributed_executor_backend),
            "enforce_eager": bool(mc.enforce_eager), "seed": mc.seed,
            "speculative": None if spec is None else {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens},
            "prefix_caching_hash_algo": str(getattr(cc, "prefix_caching_hash_algo", ""))}


class CoreRecorder:
    """The engine core's records: one per ``schedule()`` call (the engine step), completed by
    ``update_from_output``; written in segments of up to 16 steps (at once when the scheduler is idle)."""

    def __init__(self, sched: Any):
        from infertrace.runtimes.vllm.spool import SpoolWriter

        self.w = SpoolWriter(ST.spool, "core", ST.limit)
        self.step = 0
        self.buf: list[dict[str, Any]] = []
        self.cur: dict[str, Any] | None = None
        self.held: set[int] = set()
        hd = header(sched.vllm_config)
        hd["num_blocks"] = int(sched.kv_cache_manager.block_pool.num_gpu_blocks)
        self.w.write([{"kind": "header", **hd}])

    def on_schedule(self, sched: Any, so: Any) -> None:
        from infertrace.runtimes.vllm.steprec import pool_data, scheduler_data

        free, refs, head = pool_data(sched.kv_cache_manager.block_pool)
        new = {str(r.req_id): {"marked": marked_label(r.sampling_params), "params": _params(r.sampling_params)}
               for r in so.scheduled_new_reqs}
        held = set(refs)
        freed = sorted(self.held - held)  # blocks some request held after the last schedule and none holds now
        self.held = held
        self.cur = {"kind": "step", "step": self.step, "time": time.time(), "sd": scheduler_data(so), "free": free,
                    "refs": sorted([b, c] for b, c in refs.items()), "free_head": head, "requests": new, "freed": freed}
        self.step += 1

    def on_update(self, sched: Any, outs: Any) -> None:
        if self.cur is None:
            return
        if os.environ.get(ENV_FAULT) == "core":
            raise RuntimeError("fault injected by INFERTRACE_FAULT=core")
        got = {}
        for eco in (outs or {}).values():
            for o in eco.outputs:
                got[str(o.request_id)] = {"new_token_ids": [int(t) for t in o.new_token_ids],
                                          "finish_reason": None if o.finish_reason is None else str(o.finish_reason),
                                          "num_cached_tokens": int(getattr(o, "num_cached_tokens", 0) or 0)}
        self.cur["outputs"] = got
        self.buf.append(self.cur)
        self.cur = None
        if len(self.buf) >= 16 or not sched.has_unfinished_requests():
            self.w.write(self.buf)
            self.buf = []


# ----------------------------------------------------------------------------- model runner
def _patch_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    exec_orig, sample_orig = GPUModelRunner.execute_model, GPUModelRunner.sample_tokens

    def execute_model(self: Any, scheduler_output: Any, *a: Any, **k: Any) -> Any:
        rw = None
        if not ST.disabled:
            try:
                rw = _runner_rec(self)
                rw.before(scheduler_output)
            except Exception as e:
                disable("GPUModelRunner.execute_model", e)
        out = exec_orig(self, scheduler_output, *a, **k)
        if rw is not None and not ST.disabled:
            rw.flush()
        return out

    def sample_tokens(self: Any, *a: Any, **k: Any) -> Any:
        out = sample_orig(self, *a, **k)
        rw = getattr(self, "_infertrace_rec", None)
        if rw is not None and not ST.disabled:
            rw.flush()
        return out

    GPUModelRunner.execute_model, GPUModelRunner.sample_tokens = execute_model, sample_tokens


def _runner_rec(mr: Any) -> "RunnerRecorder":
    rw = getattr(mr, "_infertrace_rec", None)
    if rw is None:
        rw = RunnerRecorder(mr)
        mr._infertrace_rec = rw
    return rw


def _guarded(name: str):
    def wrap(self: Any, *a: Any) -> Any:
        if ST.disabled or not self.active:
            self.cur = None
            return None
        try:
            return getattr(super(SafeCapture, self), name)(*a)
        except Exception as e:
            self.cur = None
            disable(f"capture.{name}", e)
            return None
    return wrap


def _safe_capture_class() -> type:
    from infertrace.runtimes.vllm.capture import WorkerCapture

    class _Safe(WorkerCapture):
        """:class:`~infertrace.runtimes.vllm.capture.WorkerCapture` whose hooks never raise and copy only
        while ``active`` (a step holding a marked request)."""

        active = False
        step = -1
        labels: frozenset = frozenset()

        def _kv_update(self, layer: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
            self._orig_update(layer, key, value, kv_cache, slot_mapping)  # vLLM's write, always
            if not ST.disabled and self.active:
                try:
                    self._kv_copy(layer, key, value, kv_cache, slot_mapping)
                except Exception as e:
                    self.cur = None
                    disable("capture._kv_update", e)

        def _sampler_post(self, module: Any, args: tuple, out: Any) -> None:
            if self.cur is not None and os.environ.get(ENV_FAULT) == "worker" and FAULT_LABEL in self.labels:
                raise RuntimeError("fault injected by INFERTRACE_FAULT=worker")
            super()._sampler_post(module, args, out)

    for n in ("_pre_forward", "_embed", "_rope_pre", "_rope_post", "_sampler_pre", "_rej_pre", "_rej_post"):
        setattr(_Safe, n, _guarded(n))
    orig_post = _Safe._sampler_post
    _Safe._sampler_post = lambda self, *a: _guarded_call(self, orig_post, "_sampler_post", *a)
    return _Safe


def _guarded_call(self: Any, fn: Any, name: str, *a: Any) -> None:
    if ST.disabled or not self.active:
        self.cur = None
        return
    try:
        fn(self, *a)
    except Exception as e:
        self.cur = None
        disable(f"capture.{name}", e)


SafeCapture: Any = None


class RunnerRecorder:
    """The records of one model runner (one per worker process; in the engine core under the uni executor): a capture per step
    that holds a marked request, one segment per such step."""

    def __init__(self, mr: Any):
        global SafeCapture
        from infertrace.runtimes.vllm.spool import SpoolWriter

        if SafeCapture is None:
            SafeCapture = _safe_capture_class()
        self.cap = SafeCapture(mr, ST.layer)
        self.rank = 0
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            self.rank = int(get_tensor_model_parallel_rank())
        except Exception:  # pragma: no cover - no distributed state
            pass
        self.w = SpoolWriter(ST.spool, f"rank{self.rank}", ST.limit)
        self.step = -1
        self.spec: dict[str, list[int]] = {}
        self.whole_batch = os.environ.get("INFERTRACE_WHOLE_BATCH") == "1"  # keep every row of a captured step
        self.marked: dict[str, str] = {}
        self.w.write([{"kind": "header", **self.cap.header, "tp_rank": self.rank, "layer": ST.layer}])

    def before(self, so: Any) -> None:
        self.step += 1
        for r in so.scheduled_new_reqs:
            lab = marked_label(r.sampling_params)
            if lab is not None:
                self.marked[str(r.req_id)] = lab
        for r in so.finished_req_ids or ():
            self.marked.pop(str(r), None)
        here = [self.marked[str(r)] for r in so.num_scheduled_tokens if str(r) in self.marked]
        self.cap.active, self.cap.labels = bool(here), frozenset(here)
        self.cap.step = self.step
        self.sched = [[str(k), int(v)] for k, v in so.num_scheduled_tokens.items()] if self.cap.active else None
        self.spec = {str(k): list(v) for k, v in (so.scheduled_spec_decode_tokens or {}).items()} if self.cap.active else {}

    def flush(self) -> None:
        recs = self.cap.take()
        if not recs:
            return
        import numpy as np

        arrays, docs = {}, []
        if not self.whole_batch:  # the marked rows only (collect.rows_of); the batch's ids and counts stay as data
            from infertrace.runtimes.vllm.collect import rows_of

            try:
                recs = [rows_of(r, set(self.marked) & set(r["req_ids"]), self.spec) for r in recs]
            except Exception as e:
                disable("capture rows", e)
                return
        for i, r in enumerate(recs):
            doc = {"kind": "capture", "step": self.step, "tp_rank": self.rank, "num_scheduled_tokens": self.sched,
                   "marked": {k: v for k, v in self.marked.items() if k in r.get("req_ids", [])}}
            for k, v in r.items():
                if isinstance(v, np.ndarray):
                    arrays[f"{i}.{k}"] = v
                else:
                    doc[k] = v
            docs.append(doc)
        try:
            self.w.write(docs, arrays)
        except Exception as e:
            disable("spool write", e)
