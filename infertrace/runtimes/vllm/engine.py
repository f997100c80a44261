"""``run --runtime vllm``: vLLM's own engine, driven step by step in this process, every variable of
the trace read from vLLM's objects (:mod:`.capture`), written as an ordinary paged trace with
``runtime: vllm``.

The loop: at step s, requests whose arrival step is s are added (``LLMEngine.add_request`` with our
token ids, so both sides see the same ids); one ``LLMEngine.step()`` = one ``EngineCore.step``: one
``Scheduler.schedule()`` (wrapped: the ``SchedulerOutput`` and the block pool's free count are
copied), one model execution (the worker hooks record it), ``update_from_output``. A step with
nothing to run (waiting for an arrival) is recorded idle, as our engine does.

Conventions mapped (the trace keeps our paged names; vLLM's own are in each step's ``vllm``
section, unchanged):

==========================  ==========================================================
trace (TensorRT-LLM names)  vLLM
==========================  ==========================================================
``seq_lens`` (query T)      ``query_start_loc[i+1] - query_start_loc[i]``
``kv_lens`` (C + T)         ``seq_lens`` (= num_computed_tokens + num_scheduled_tokens)
``cu_seqlens``              ``query_start_loc``
``block_tables`` row        ``block_table[i, :ceil(kv_len / block_size)]`` (vLLM pads with
                            block 0, its null block; we pad with -1)
``slot_mapping``            ``slot_mapping``
logits rows                 rows whose sample is kept; vLLM computes one row per scheduled
                            request (``logits_indices``) and drops the sample of a partial
                            prefill (recorded as ``vllm.logits_indices``)
verify chunk                ``scheduled_spec_decode_tokens`` (a chain: parents -1, 0, 1, ..)
placeholder drafts          ``-1`` in ``scheduled_spec_decode_tokens`` (a new request with one
                            token left, padded to 1 + K rows): ``token_ids`` hold the id 0 its
                            forward embeds, ``vllm.scheduler.scheduled[].spec_tokens`` the -1
==========================  ==========================================================
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch

from infertrace.engine.options import EngineOptions
from infertrace.engine.request import Request
from infertrace.engine.scheduler import ScheduledBatch
from infertrace.errors import InfertraceError
from infertrace.kv.base import ChunkSpec
from infertrace.kv.paged import PagedKV
from infertrace.runtimes.readback import ReadBack
from infertrace.runtimes.vllm import ENGINE, import_vllm, vllm_version
from infertrace.runtimes.vllm.steprec import ours as _ours  # noqa: F401 - re-exported (tests)
from infertrace.runtimes.vllm.steprec import pool_data, record_step, scheduler_data
from infertrace.runtimes.vllm.tp import kv_heads_of_rank, merge_ranks

#: vLLM's CPU attention backend needs block sizes that are multiples of this (``CPU_ATTN``)
CPU_BLOCK_MULTIPLE = 32
#: GiB of KV cache vLLM's CPU worker reserves when the user set none (``VLLM_CPU_KVCACHE_SPACE``)
DEFAULT_KV_SPACE_GIB = "1"
#: vLLM finish reasons -> ours
FINISH = {"length": "max_new_tokens", "stop": "eos", "abort": "aborted"}


class VllmKV(ReadBack):
    """vLLM's paged cache as read back at run time, in the ``paged`` shape infertrace records.

    Not a memory our engine computes with, and not a subclass of one: it holds a
    :class:`~infertrace.kv.paged.PagedKV` mirror (:attr:`mirror`: block tables, lengths and one pool
    ``[num_blocks, 2, n_kv_heads, block_size, head_dim]`` float32 for the captured layer) and answers
    what the recorder's probe reads of a memory (:mod:`infertrace.capture.probe`: ``kind``, ``layout``,
    ``logical_mask``, ``read``, ``seq_len``, ``holds_values``, ``describe``, ``snapshot``,
    ``recurrent_state``; ``tables`` for the placement view), plus the bookkeeping the vLLM loop does
    (:meth:`apply`, :meth:`rewind`, :meth:`release`).

    Placement is never chosen here: block tables come from vLLM's attention metadata and the K/V
    of layer ``layer`` are vLLM's cache read back at ``slot_mapping`` (:mod:`.layout`).
    """

    kind = "paged"
    runtime = "vllm"
    layout = "paged"  # what the views read (infertrace.capture.kv_views)

    def __init__(self, cfg: Any, num_blocks: int, block_size: int, layer: int, n_kv_heads: int):
        self.mirror = PagedKV(1, n_kv_heads, cfg.head_dim, num_blocks, block_size, torch.float32, "cpu")
        self.n_layer = cfg.n_layer  # vLLM caches every layer; the mirror holds the captured one
        self.num_blocks, self.B, self.layer = num_blocks, block_size, layer
        self.free_count = num_blocks - 1  # from vLLM's block pool (its free queue is not mirrored)
        self.prefix_cache = False  # vLLM's enable_prefix_caching: tables may share full prefix blocks
        self.ref_cnt: dict[int, int] = {}  # vLLM's block pool after this step's schedule: block -> ref_cnt
        self.free_head: list[int] = []  # the first blocks of vLLM's free queue after this step's schedule

    @property
    def tables(self) -> dict[int, list[int]]:
        """seq_id -> vLLM's block table row (the blocks holding its positions)."""
        return self.mirror.tables

    def apply(self, chunks: list[ChunkSpec], bt: np.ndarray, slots: np.ndarray, k: np.ndarray | None,
              v: np.ndarray | None) -> None:
        """Take vLLM's block tables (rows in ``chunks`` order) and store the read-back K/V
        ``[T, n_kv, hd]`` at ``slots`` ``[T]``."""
        m = self.mirror
        for c, row in zip(chunks, bt):
            n = -(-(c.C + c.T) // self.B)
            m.tables[c.seq_id] = [int(b) for b in row[:n]]
            m.lens[c.seq_id] = c.C + c.T
        if k is not None and v is not None and len(slots):
            s = torch.from_numpy(slots)
            pool = m.pool[0]
            pool[s // self.B, 0, :, s % self.B, :] = torch.from_numpy(k).to(pool.dtype)
            pool[s // self.B, 1, :, s % self.B, :] = torch.from_numpy(v).to(pool.dtype)

    def rewind(self, seq_id: int, keep: int) -> None:
        """A verify step keeps ``keep`` tokens: vLLM's ``num_computed_tokens`` drops the rejected
        drafts (their slots are overwritten later)."""
        self.mirror.lens[seq_id] = keep

    def release(self, seq_id: int) -> None:
        """Forget ``seq_id``'s table (vLLM freed its blocks: ``free_count`` comes from its pool)."""
        self.mirror.tables.pop(seq_id, None)
        self.mirror.lens.pop(seq_id, None)

    def read(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[len, n_kv_heads, head_dim]`` float32 of ``seq_id`` in the captured layer, by position.

        Raises:
            ConfigError: ``layer`` is not the captured one.
        """
        self.check_layer(layer)
        return self.mirror.read(0, seq_id)

    def snapshot(self) -> dict[str, Any]:
        """As :meth:`PagedKV.snapshot`, with vLLM's block pool: free / used blocks and the head of its free queue
        (and, with prefix caching, each held block's ``ref_cnt``)."""
        snap = self.mirror.snapshot()
        snap.update({"free_blocks": self.free_count, "used_blocks": self.num_blocks - self.free_count,
                     "free_list_head": list(self.free_head)})
        if self.prefix_cache:  # as PrefixPagedKV marks it: `check` then allows shared prefix blocks
            snap["prefix_cache"] = True
            for v in snap["requests"].values():  # vLLM's own ref_cnt of every held block
                for blk in v["blocks"]:
                    blk["ref"] = self.ref_cnt.get(blk["block"], 0)
        return snap


class _Shim:
    """What the recorder reads of a model: its config (the tokenizer and config are ours)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg


def _env(tp: int = 1) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core, scheduler and model runner in this process
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:  # one core per rank unless the user bound them
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KV_SPACE_GIB)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of our hook functions (TP workers)


def max_num_seqs(opts: EngineOptions, n_requests: int | None) -> int:
    """vLLM's ``max_num_seqs`` for a run: at most ``n_seq_max`` (64), and no more than the run's requests
    (``n_requests``; None: not known yet), so a small ``--max-batch-tokens`` is not refused over a value the
    user never set.

    Raises:
        InfertraceError: the requests that may run at once exceed ``--max-batch-tokens``: vLLM requires
            ``max_num_batched_tokens >= max_num_seqs`` (vllm/config/scheduler.py:328, ``SchedulerConfig``).
    """
    n = max(1, min(opts.n_seq_max, n_requests) if n_requests else opts.n_seq_max)
    if opts.max_batch_tokens < n:
        raise InfertraceError(f"--runtime vllm: vLLM requires max_num_batched_tokens >= max_num_seqs; --max-batch-tokens "
                              f"{opts.max_batch_tokens} is below the {n} requests this run may hold at once "
                              f"(max_num_seqs {n}); raise --max-batch-tokens to {n} or give fewer requests")
    return n


def engine_args(opts: EngineOptions, dtype: str, tp: int = 1, n_requests: int | None = None) -> dict[str, Any]:
    """vLLM ``LLM(...)`` keyword arguments for our options (``n_requests``: see :func:`max_num_seqs`).

    Raises:
        InfertraceError: a setting vLLM's CPU build cannot run as asked (block size, token budget).
    """
    B = opts.tokens_per_block
    if B % CPU_BLOCK_MULTIPLE:
        raise InfertraceError(f"--runtime vllm: vLLM's CPU attention needs --tokens-per-block a multiple of "
                              f"{CPU_BLOCK_MULTIPLE} (got {B})")
    kw: dict[str, Any] = {
        "dtype": {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                  "float16": "float16", "fp16": "float16"}[dtype.lower()],
        "block_size": B, "enforce_eager": True, "async_scheduling": False, "seed": 0,
        "max_model_len": opts.ctx_size, "max_num_batched_tokens": opts.max_batch_tokens,
        "max_num_seqs": max_num_seqs(opts, n_requests), "enable_prefix_caching": bool(opts.prefix_cache),
        "enable_chunked_prefill": True, "tensor_parallel_size": tp, "disable_log_stats": True,
    }
    if opts.prefill_chunk is not None:
        kw["long_prefill_token_threshold"] = opts.prefill_chunk
    if opts.num_blocks is not None:
        if opts.num_blocks < 2:
            raise InfertraceError("--runtime vllm: --num-blocks must be >= 2 (vLLM keeps block 0 as its null block)")
        kw["num_gpu_blocks_override"] = opts.num_blocks
        # vLLM refuses a max_model_len its pool cannot hold once; block 0 is never allocated
        kw["max_model_len"] = min(opts.ctx_size, (opts.num_blocks - 1) * B)
    if opts.speculative == "ngram":
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": opts.num_spec_tokens,
                                    "prompt_lookup_min": opts.ngram_min, "prompt_lookup_max": opts.ngram_max}
    elif opts.speculative:
        raise InfertraceError("--runtime vllm runs --speculative ngram only here; drop --speculative draft")
    return kw


class VllmRun:
    """vLLM loaded in this process with the capture installed (one per model and settings; the
    tests share one across cases).

    Args:
        hf_dir: the HF model directory vLLM loads.
        opts: our engine options (see :func:`engine_args`); dtype: compute dtype; layer: the
            captured layer; tp: tensor-parallel size.

    Raises:
        InfertraceError: vLLM missing or refusing the model / settings.
    """

    def __init__(self, hf_dir: Any, opts: EngineOptions, dtype: str = "float32", layer: int = 0, tp: int = 1,
                 n_requests: int | None = None):
        _env(tp)
        vllm = import_vllm()
        self.opts, self.layer, self.dtype, self.tp = opts, layer, dtype, tp
        self.kw = engine_args(opts, dtype, tp, n_requests)
        import torch

        set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it process-wide (cpu_worker.py)
        try:
            self.llm = vllm.LLM(model=str(hf_dir), **self.kw)
        except InfertraceError:
            raise
        except Exception as e:  # vLLM raises many kinds for a configuration it refuses
            raise InfertraceError(f"vLLM refused the model or settings ({type(e).__name__}: {str(e)[:200]})") from None
        finally:
            # in-process vLLM must not change how the rest of this process (our engine, later runs) sets
            # torch's thread count: put torch's own function back
            torch.set_num_threads = set_threads
        from infertrace.runtimes.vllm import capture

        self.capture = capture
        self.ranks = self.llm.collective_rpc(capture.install, args=(layer,))
        self.eng = self.llm.llm_engine
        mc = self.eng.model_config
        self.head_dim = int(mc.get_head_size())
        self.max_model_len = int(mc.max_model_len)  # vLLM's own, after its derivation from the model config
        self.core = self.eng.engine_core.engine_core
        self.sched = self.core.scheduler
        self.outs: list[Any] = []
        orig = self.sched.schedule

        def schedule(*a: Any, **k: Any) -> Any:
            so = orig(*a, **k)
            # after allocation: the free count and each held block's ref_cnt (how many requests hold it); the
            # SchedulerOutput as data at once (steprec.scheduler_data), the object kept for the tests that read it
            free, refs, head = pool_data(self.sched.kv_cache_manager.block_pool)
            self.outs.append((so, free, refs, head, scheduler_data(so)))
            return so

        self.sched.schedule = schedule
        self.num_blocks = int(self.sched.kv_cache_manager.block_pool.num_gpu_blocks)
        self.block_size = opts.tokens_per_block
        self.runs = 0

    def header(self) -> dict[str, Any]:
        """vLLM facts of the run: version, backend class, ISA, block size, dtype, pool, per rank."""
        h = self.ranks[0]
        return {"version": vllm_version(), "backend": h["backend"], "isa": h["isa"], "block_size": self.block_size,
                "dtype": self.kw["dtype"], "cache_dtype": h["cache_dtype"], "num_blocks": self.num_blocks,
                "null_block": 0, "max_num_batched_tokens": self.kw["max_num_batched_tokens"],
                "max_num_seqs": self.kw["max_num_seqs"], "max_model_len": self.max_model_len,
                "long_prefill_token_threshold": self.kw.get("long_prefill_token_threshold"),
                "enable_prefix_caching": self.kw["enable_prefix_caching"],
                "speculative": self.kw.get("speculative_config"), "tensor_parallel_size": self.tp,
                "ranks": [{"tp_rank": r["tp_rank"], "num_kv_heads": r["num_kv_heads"], "num_heads": r["num_heads"],
                           "cache_shape": r["cache_shape"], "layer_name": r["layer_name"]} for r in self.ranks],
                "kv_cache_layout": "[num_blocks, num_kv_heads, block_size, 2*head_dim]; K half [head_dim, block_size] "
                                   "(transposed), V half [block_size, head_dim] (runtimes/vllm/layout.py)"}

    def close(self) -> None:
        """Drop the engine (vLLM frees its memory when the object goes)."""
        self.llm = self.eng = self.core = self.sched = None


def _vllm_params(p: Any) -> Any:
    from vllm import SamplingParams as VSP

    kw: dict[str, Any] = {"max_tokens": p.max_new_tokens, "temperature": p.temperature, "top_p": p.top_p,
                          "min_p": p.min_p, "repetition_penalty": p.repetition_penalty, "ignore_eos": p.ignore_eos,
                          "seed": p.seed}
    if p.top_k:
        kw["top_k"] = p.top_k
    return VSP(**kw)


def drive(run: VllmRun, requests: list[Request], tracer: Any, on_step: Callable[[Any], None] | None = None,
          max_steps: int = 100_000) -> list[dict[str, Any]]:
    """Run ``requests`` through vLLM step by step (:func:`drive_steps` to the end); the recorder gets one
    ``end_step`` per step, ``on_step`` each recorded step's StepTrace.

    Returns:
        per step the raw vLLM record (scheduler output summary + rank 0's capture), for
        :mod:`infertrace.runtimes.vllm.compare`.

    Raises:
        InfertraceError: a capture that does not line up with the scheduler output.
    """
    raw_steps = []
    for raw in drive_steps(run, requests, tracer, max_steps):
        raw_steps.append(raw)
        if on_step is not None and not raw.get("idle") and getattr(tracer, "steps", None):
            on_step(tracer.steps[-1])
    return raw_steps


def drive_steps(run: VllmRun, requests: list[Request], tracer: Any, max_steps: int = 100_000) -> Iterator[dict[str, Any]]:
    """One vLLM step per ``next()``: requests arriving at the step are added (``LLMEngine.add_request`` with
    our token ids), one ``LLMEngine.step()`` runs, the recorder gets its ``end_step``; yields the step's raw
    record (``{"step", "idle": True}`` for a step with nothing to run). At the end each request holds
    ``vllm_num_cached_tokens`` (vLLM's own count of prompt tokens served from its prefix cache).

    Raises:
        InfertraceError: a capture that does not line up with the scheduler output, or more than ``max_steps`` steps.
    """
    from vllm.inputs import TokensPrompt

    run.runs += 1
    tag = f"r{run.runs}"
    by_id = {f"{tag}s{r.seq_id}": r for r in requests}
    kv = VllmKV(tracer.cfg, run.num_blocks, run.block_size, run.layer, tracer.cfg.n_head_kv)
    kv.prefix_cache = bool(run.kw["enable_prefix_caching"])
    future = sorted(requests, key=lambda r: (r.arrival_step, r.seq_id))
    cached_tokens: dict[int, int] = {}
    live: set[int] = set()
    step = 0
    run.llm.collective_rpc(run.capture.take)  # drop anything left from an earlier run
    if run.runs > 1 and run.kw.get("enable_prefix_caching"):  # a reused engine starts each run as a fresh one does:
        run.llm.reset_prefix_cache()  # no hit on an earlier run's blocks (vLLM's LLM.reset_prefix_cache)
    run.outs.clear()
    while future or live:
        if step >= max_steps:
            raise InfertraceError(f"vLLM run did not finish in {max_steps} steps")
        while future and future[0].arrival_step <= step:
            r = future.pop(0)
            run.eng.add_request(f"{tag}s{r.seq_id}", TokensPrompt(prompt_token_ids=list(r.prompt_ids)),
                                _vllm_params(r.params))
            live.add(r.seq_id)
        if not live:  # idle: waiting for a later arrival
            _idle(tracer, step, kv, requests, 0.0)
            yield {"step": step, "idle": True}
            step += 1
            continue
        n_out = len(run.outs)
        t0 = time.perf_counter()
        outputs = _vllm_step(run, step)
        time_ms = (time.perf_counter() - t0) * 1e3  # one EngineCore.step: schedule, forward, sample, update
        recs = run.llm.collective_rpc(run.capture.take)
        _, free, refs, head, sd = run.outs[-1] if len(run.outs) > n_out else (None, None, None, [], None)
        rec = merge_ranks([r[-1] for r in recs if r], tracer.cfg.n_head_kv) if recs and recs[0] else None
        finished = _finished(outputs, by_id, cached_tokens)
        if rec is None:  # nothing ran (vLLM bookkeeping step)
            _idle(tracer, step, kv, requests, time_ms)
            yield {"step": step, "idle": True}
            step += 1
            continue
        kv.ref_cnt, kv.free_head = refs or {}, head
        raw = record_step(run, tracer, step, sd, free, rec, by_id, kv, finished, time_ms)
        for sid in finished:
            live.discard(sid)
            kv.release(sid)
        yield raw
        step += 1
    for r in requests:
        r.vllm_num_cached_tokens = cached_tokens.get(r.seq_id)  # type: ignore[attr-defined]


def _finished(outputs: list[Any], by_id: dict[str, Request], cached_tokens: dict[int, int]) -> dict[int, str]:
    """The requests vLLM finished in this step's outputs, with our stop reasons; notes each request's
    ``num_cached_tokens`` (prompt tokens served from vLLM's prefix cache) into ``cached_tokens``."""
    finished = {}
    for o in outputs:
        r = by_id.get(o.request_id)
        if r is None:
            continue
        if o.finished:
            finished[r.seq_id] = FINISH.get(str(o.outputs[0].finish_reason), str(o.outputs[0].finish_reason))
        if getattr(o, "num_cached_tokens", None) is not None:
            cached_tokens[r.seq_id] = int(o.num_cached_tokens)
    return finished


def _vllm_step(run: VllmRun, step: int) -> list[Any]:
    """One ``LLMEngine.step()``; an exception vLLM raises while stepping (a kernel refusing a head size,
    a scheduler assertion) becomes one line naming it.

    Raises:
        InfertraceError: whatever vLLM raised, with its type and message (and, for a head size its CPU
            attention does not list, the sizes it supports).
    """
    try:
        return run.eng.step()
    except InfertraceError:
        raise
    except Exception as e:  # vLLM raises many kinds (RuntimeError from its C++ ops, AssertionError, ValueError)
        msg = " ".join(str(e).split())[:300]
        extra = ""
        sizes = _cpu_head_sizes()
        hd = run.head_dim
        if sizes and hd is not None and hd not in sizes:
            extra = (f"; vLLM's CPU attention supports head sizes {sizes} (CPUAttentionBackend.get_supported_head_sizes, "
                     f"vllm/v1/attention/backends/cpu_attn.py), the model's is {hd}")
        raise InfertraceError(f"vLLM failed at step {step} ({type(e).__name__}: {msg}){extra}") from None


def _cpu_head_sizes() -> list[int] | None:
    """vLLM's CPU attention backend's head sizes, or None when it cannot be imported."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return list(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # pragma: no cover - another vLLM build
        return None


def _idle(tracer: Any, step: int, kv: VllmKV, requests: list[Request], time_ms: float) -> None:
    from infertrace.engine.engine import StepContext

    if tracer.enabled:
        tracer.begin_step()
        tracer.end_step(StepContext(step=step, batch=ScheduledBatch(step, []), inp=None, kv=kv, attention="vllm",
                                    logits=None, logits_rows=[], samples={}, finished={},
                                    requests={r.seq_id: r for r in requests}, time_ms=time_ms))


def run_notes(run: VllmRun, opts: EngineOptions, cfg: Any, raw: list[dict[str, Any]]) -> list[str]:
    """The trace notes of a vLLM run: the engine core and its pool, the logits rows vLLM computes, tensor
    parallelism (which KV heads each rank holds), and placeholder drafts vLLM padded a request with."""
    notes = [f"engine vLLM ({vllm_version()}): in-process engine core, one EngineCore.step per step, "
             f"{run.header()['backend'].rsplit('.', 1)[-1]} ISA {run.header()['isa']}, block {run.block_size}, "
             f"{run.num_blocks} blocks (block 0 is vLLM's null block: {run.num_blocks - 1} usable; --num-blocks counts "
             "block 0 under every engine, and the paged backend uses every block)"
             + ("" if opts.num_blocks is not None else
                f"; --num-blocks not given: vLLM sized the pool from VLLM_CPU_KVCACHE_SPACE "
                f"({os.environ.get('VLLM_CPU_KVCACHE_SPACE')} GiB)"),
             "vLLM computes a logits row for every scheduled request (also a partial prefill, whose sample it drops); "
             "the trace's logits rows are the rows whose sample is kept, vLLM's rows are in step.vllm.logits_indices"]
    if run.tp > 1:
        notes.append(_tp_note(run, cfg))
    placeholders = [(x["step"], sc["seq_id"], len(sc["spec_tokens"])) for x in raw if not x.get("idle")
                    for sc in x["vllm"]["scheduler"]["scheduled"] if sc["spec_tokens"] and min(sc["spec_tokens"]) < 0]
    if placeholders:
        notes.append("vLLM padded a request with one token left to compute to 1 + K rows of placeholder drafts (-1 in "
                     "step.vllm.scheduler.scheduled spec_tokens, embedded as token id 0, never accepted): "
                     + ", ".join(f"step {s} seq {q} ({k} placeholders)" for s, q, k in placeholders))
    return notes


def _tp_note(run: VllmRun, cfg: Any) -> str:
    """The note of a tensor-parallel run: per rank its KV heads, query heads and cache shape."""
    def held(r: int) -> str:
        hs = kv_heads_of_rank(r, run.tp, cfg.n_head_kv)
        return f"{hs[0]}..{hs[-1]}" if len(hs) > 1 else str(hs[0])

    rep = run.tp // cfg.n_head_kv if run.tp > cfg.n_head_kv else 1
    return (f"tensor parallel {run.tp} through vLLM's executor: " + "; ".join(
        f"rank {r['tp_rank']} holds KV heads {held(r['tp_rank'])} "
        f"({r['num_kv_heads']} of {cfg.n_head_kv}), {r['num_heads']} query heads, cache {r['cache_shape']}"
        for r in run.ranks) + "; every rank builds the same metadata (step.vllm.tp_ranks), K/V are its heads' shard"
        + (f"; {cfg.n_head_kv} KV head(s) on {run.tp} ranks: vLLM replicates each on {rep} ranks "
           "(QKVParallelLinear num_kv_head_replicas), the trace's K/V are each head's first holder's" if rep > 1 else ""))
