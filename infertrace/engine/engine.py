"""The engine loop: schedule -> prepare -> forward -> sample -> update, one step at a time.

Mirrors TensorRT-LLM ``PyExecutor._executor_loop`` (schedule, prepare resources, forward,
sample, update requests) and llama.cpp server ``update_slots`` -> ``llama_decode`` ->
``common_sampler_sample``. One request is a batch of one: there is no other path.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from infertrace.engine.options import EngineOptions  # noqa: F401 - torch-free home; re-exported
from infertrace.engine.parts import sample_request
from infertrace.engine.request import Request
from infertrace.engine.sampler import (SampleResult, SamplingParams, check_penalties, default_order,  # noqa: F401
                                       mask_padded_rows, penalty_window, sample)
from infertrace.engine.step import StepContext  # noqa: F401 - re-exported (engine/step.py)
from infertrace.engine.scheduler import ScheduledBatch, Scheduler
from infertrace.engine.serving import Serving
from infertrace.engine.speculative import rewind_chunk, verify_chunk
from infertrace.errors import ConfigError, InfertraceError
from infertrace.kv.base import AttnInputs, ChunkSpec
from infertrace.kv.cells import CellsKV
from infertrace.kv.prefix_cache import CachingCellsKV, SharedPagedKV
from infertrace.model.decoder import DecoderModel
from infertrace.model.taps import NULL_TRACER


#: idle steps (waiting for an arrival) recorded one by one; a longer wait is skipped in one jump.
MAX_IDLE_RECORDED = 64


def padded_vocab(model: DecoderModel, tokenizer: Any) -> dict[str, Any] | None:
    """A padded vocabulary: the lm head has more rows (``cfg.vocab_size``) than the tokenizer has
    tokens (e.g. HF ``vocab_size`` rounded up for GPU tiles). Returns ``{"rows", "tokens", "policy",
    "masked"}`` (policy ``masked``: the rows past the tokenizer are set to -inf before sampling), or
    None when the sizes agree (or the tokenizer's size is unknown).

    The padded rows are untrained and have no text: an id sampled there cannot be detokenized (HF
    decodes it to '', llama.cpp has no such token) and would be fed back as an untrained embedding.
    vLLM keeps sampling within the vocabulary it can detokenize (vllm PR 24483: mask logits at ids
    >= min(model vocab, tokenizer vocab)); structured-output backends mask the padded columns the same
    way. So here, too: masked out of sampling, for every sampler order, speculative verify and draft."""
    n_tok = getattr(tokenizer, "vocab_size", None)
    rows = int(model.cfg.vocab_size)
    if not isinstance(n_tok, int) or n_tok <= 0 or rows <= n_tok:
        return None
    return {"rows": rows, "tokens": n_tok, "policy": "masked", "masked": f"{n_tok}..{rows - 1}"}


def make_kv(model: DecoderModel, opts: EngineOptions, attn_impl: str):
    """Build the KV backend named by ``opts.backend``.

    Raises:
        ConfigError: what :meth:`EngineOptions.validate` refuses, or a setting this model cannot run.
        InfertraceError: the cache does not fit in memory.
    """
    cfg = model.cfg
    opts.validate()  # ConfigError: the field (engine/config.py)
    from infertrace.kv.budget import check_kv_budget

    check_kv_budget(cfg, opts, model.dtype, model.device)  # refuse before allocating, with the size and the limit
    try:
        return _make_kv(model, opts, attn_impl)
    except (RuntimeError, OverflowError, MemoryError, TypeError) as e:
        if isinstance(e, InfertraceError):
            raise
        raise InfertraceError(
            f"cannot allocate the KV cache ({type(e).__name__}); lower --ctx-size / --num-blocks / --tokens-per-block"
        ) from None


def _make_kv(model: DecoderModel, opts: EngineOptions, attn_impl: str):
    cfg = model.cfg
    if cfg.is_hybrid:
        from infertrace.kv.budget import spec_snapshots
        from infertrace.kv.recurrent import HybridKV, RecurrentState

        if opts.context_shift:
            raise ConfigError("serving.context_shift", "cannot be used with a hybrid model: a recurrent (GDN) state cannot "
                                                       "drop its oldest tokens (llama.cpp refuses partial seq_rm on recurrent memory)")
        if not opts.kv_unified:
            raise ConfigError("cache.kv_unified", "off is not implemented for hybrid models (their recurrent cells are "
                                                  "per sequence already)")
        attn_layers = [i for i in range(cfg.n_layer) if not cfg.is_linear(i)]
        attn_kv = _make_attn_kv(model, replace(opts, prefix_cache=False), attn_impl, n_layer=len(attn_layers))
        state = RecurrentState([i for i in range(cfg.n_layer) if cfg.is_linear(i)], cfg.conv_dim, cfg.ssm_conv_kernel,
                               cfg.ssm_n_v_heads, cfg.ssm_k_head_dim, cfg.ssm_v_head_dim, opts.n_seq_max, opts.backend,
                               model.dtype, model.device, n_snap=spec_snapshots(opts))  # verify: a state per candidate
        return HybridKV(attn_kv, state, attn_layers)
    return _make_attn_kv(model, opts, attn_impl)


def _make_attn_kv(model: DecoderModel, opts: EngineOptions, attn_impl: str, n_layer: int | None = None):
    """The KV backend; ``n_layer`` (hybrid models: the attention layers only) defaults to every layer.
    K/V are stored in ``opts.kv_dtype`` (:func:`~infertrace.kv.budget.kv_cache_dtype`; default the model dtype)."""
    from infertrace.kv.budget import kv_cache_dtype

    cfg = model.cfg
    kv_dtype = kv_cache_dtype(opts, model.dtype)
    windows = ([cfg.layer_window(i) for i in range(cfg.n_layer)] if n_layer is None else [0] * n_layer)  # 0 = full attention
    if opts.backend == "cells" and not opts.kv_unified:
        return _make_streams_kv(cfg, opts, windows, kv_dtype, model.device)
    if opts.backend == "cells":
        if any(windows) and not opts.prefix_cache:  # llama.cpp's iSWA cache: a second, smaller pool for the windowed layers
            from infertrace.kv.iswa import IswaCellsKV

            return IswaCellsKV(len(windows), cfg.n_head_kv, cfg.head_dim, opts.ctx_size, opts.n_seq_max, kv_dtype, model.device,
                               windows=windows, n_ubatch=max(1, min(opts.max_batch_tokens, opts.ctx_size)))
        cls = CachingCellsKV if opts.prefix_cache else CellsKV
        return cls(len(windows), cfg.n_head_kv, cfg.head_dim, opts.ctx_size, opts.n_seq_max, kv_dtype, model.device,
                   windows=windows)
    if opts.backend == "paged":
        nb = opts.num_blocks if opts.num_blocks is not None else -(-opts.ctx_size // opts.tokens_per_block)
        return SharedPagedKV(len(windows), cfg.n_head_kv, cfg.head_dim, nb, opts.tokens_per_block, kv_dtype, model.device,
                             attn_impl, caching=opts.prefix_cache, windows=windows)
    raise InfertraceError(f"unknown backend {opts.backend!r}; use cells or paged")


def _make_streams_kv(cfg: Any, opts: EngineOptions, windows: list[int], kv_dtype: Any, device: Any):
    """``--kv-unified off``: llama.cpp's non-unified cache, ``n_seq_max`` streams of ``n_ctx_seq`` cells
    (llama.cpp pads ``n_ctx`` and then ``n_ctx / n_seq_max`` to multiples of 256: :func:`~infertrace.kv.streams.n_ctx_seq`).

    Raises:
        ConfigError: a model with sliding-window layers (llama.cpp's iSWA pool per stream is not modelled); prefix
            reuse and speculation across streams are refused by :meth:`EngineOptions.validate`.
    """
    from infertrace.kv.streams import CellsStreamsKV, n_ctx_seq

    if any(w > 0 for w in windows):  # llama.cpp: llama_kv_cache_iswa, a base and a SWA pool per stream
        raise ConfigError("cache.kv_unified", "off on a model with sliding-window layers is not modelled (llama.cpp "
                                              "keeps an iSWA pool per stream)")
    return CellsStreamsKV(len(windows), cfg.n_head_kv, cfg.head_dim, n_ctx_seq(opts.ctx_size, opts.n_seq_max),
                          opts.n_seq_max, kv_dtype, device, windows=windows)


def logits_rows(batch: ScheduledBatch) -> list[int]:
    """Rows of the packed batch ``[N]`` whose logits are computed: every candidate of a verify chunk, the
    last token of a chunk that needs logits (a prompt's end, a decode token), in packed order."""
    rows, r = [], 0
    for c in batch.chunks:
        r += c.T
        if c.parents is not None:
            rows += list(range(r - c.T, r))  # a verify chunk: logits at every candidate
        elif c.need_logits:
            rows.append(r - 1)
    return rows


class Engine:
    """Runs requests to completion over one model and one KV backend.

    Variation is injected, never subclassed: the memory comes from a cache config, tokens from a
    sampler, the attention label from whoever computes the forward.

    Args:
        model: :class:`DecoderModel` (or anything with its ``forward``, ``cfg``, ``dtype``, ``device``:
            llama.cpp's decode, ``runtimes/llamacpp/engine.py``).
        tokenizer: for EOG ids.
        opts: :class:`EngineOptions`.
        tracer: a :class:`~infertrace.capture.recorder.Recorder` or the null tracer.
        memory: a cache config (:class:`~infertrace.engine.parts.MemoryConfig`: ``build(model, opts,
            attn_impl)`` -> the memory); None: :func:`make_kv` from ``opts``.
        sampler: ``(logits [V], request, order) -> SampleResult`` (e.g.
            :class:`~infertrace.engine.parts.ForcedSampler`); None: :func:`~infertrace.engine.sampler.sample`.
        attention: the attention implementation that runs when it is not this engine's (``"llama.cpp"``).
        sampler_order: the default sampler order when ``opts.sampler_order`` is unset (None: the backend's).
        scheduler: a scheduler config (``build(memory, opts) -> Scheduler``, e.g. a replayed schedule:
            ``runtimes/vllm/replay.py``); None: :class:`~infertrace.engine.scheduler.Scheduler`.
        stop: the stop rule, ``(request, token) -> reason | None`` after each emitted token is appended
            (a replay: the trace's finish reasons); None: :meth:`stop_reason` (eos, max_new_tokens, ctx_full).

    A verify chunk's outcome is the sampler's when it forces one (``sampler.verify``), else the
    speculative tree walk (:func:`~infertrace.engine.speculative.verify_chunk`).
    """

    def __init__(self, model: DecoderModel, tokenizer: Any, opts: EngineOptions | None = None, tracer: Any = NULL_TRACER,
                 *, memory: Any = None, sampler: Any = None, attention: str | None = None,
                 sampler_order: str | None = None, scheduler: Any = None, stop: Any = None):
        self.model = model
        self.tok = tokenizer
        self.opts = opts or EngineOptions()
        #: why a requested feature is off for this model (stated in the trace), e.g. prefix reuse on a hybrid model
        self.disabled: dict[str, str] = {}
        if model.cfg.is_hybrid:
            from infertrace.kv.recurrent import NO_REUSE_REASON

            self.disabled["prefix_cache"] = NO_REUSE_REASON
            if self.opts.prefix_cache:
                self.opts = replace(self.opts, prefix_cache=False)
        self.attn_impl = attention or self._resolve_attention(self.opts.attention)
        self.kv = memory.build(model, self.opts, self.attn_impl) if memory is not None else make_kv(model, self.opts, self.attn_impl)
        self.sampler = sampler or sample_request
        self.stop_rule = stop or self.stop_reason
        self.scheduler = (scheduler.build(self.kv, self.opts) if scheduler is not None
                          else Scheduler(self.kv, self.opts.max_batch_tokens, self.opts.prefill_chunk))
        self.scheduler.split_equal = not self.opts.kv_unified  # non-unified KV: one split_equal ubatch per step
        self.tracer = tracer
        self.requests: dict[int, Request] = {}
        self.step_no = 0
        self.eog = set(getattr(tokenizer, "eog_ids", ()) or ())
        self.sampler_order = self.opts.sampler_order or sampler_order or default_order(self.opts.backend)
        #: the lm head has rows past the tokenizer (padded vocabulary): they are masked out of sampling
        self.padded_vocab = padded_vocab(model, tokenizer)
        self.n_sample_rows = self.padded_vocab["tokens"] if self.padded_vocab else None
        self.serving = Serving(self)  # prefix cache, context shift, KV audit (engine/serving.py)
        if self.serving.prefix_on:
            self.scheduler.on_admit = self.serving.on_admit
        self.spec = None
        if self.opts.speculative:
            from infertrace.engine.speculative import Speculator

            self.spec = Speculator(self)

    def sample_row(self, logits: torch.Tensor, req: Request) -> SampleResult:
        """The next token of ``req`` from its logits row ``[V]`` (the injected sampler: sampled or forced)."""
        return self.sampler(logits, req, self.sampler_order)

    def _resolve_attention(self, req: str) -> str:
        if self.opts.backend == "cells":
            if req == "triton":
                raise ConfigError("attention", "triton reads the paged pool; it needs backend paged")
            return "torch"
        tree = self.opts.spec_tree if self.opts.speculative else None
        if tree is not None and list(tree) != list(range(-1, len(tree) - 1)):  # a branching draft tree
            # the Triton kernel reads causal lengths only; the tree mask needs the torch attention
            if req == "triton":
                raise ConfigError("speculative.spec_tree", "with branches needs the torch attention (the Triton "
                                                           "kernel reads causal lengths only)")
            if req == "auto":
                return "torch"
        try:
            from infertrace.attention.select import resolve_attention
        except ImportError:  # pragma: no cover - select.py ships with the package
            return "torch"
        return resolve_attention(req, self.model.device)

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None, arrival_step: int = 0,
                    prompt_text: str = "") -> Request:
        """Queue a request. seq_ids are assigned 0, 1, 2 ... in call order.

        Raises:
            InfertraceError: empty prompt, a token id outside the model's embedding rows, prompt longer
                than the context, or a penalty the sampler order lacks
                (:func:`~infertrace.engine.options.check_penalties`).

        The request's ``penalty_last_n`` is resolved here (the order's default when unset; ``-1`` in the
        llama.cpp order is ``ctx_size``, as llama.cpp's ``common_init_from_params`` sets it to ``n_ctx``),
        so the trace records the window it ran with.
        """
        params = (params or SamplingParams()).validate()
        window = penalty_window(params, self.sampler_order)
        if window < 0 and self.sampler_order == "llama.cpp":  # llama.cpp: -1 -> n_ctx (common_init_from_params,
            window = self.opts.ctx_size  # server params_from_json_cmpl); differs from "all seen" after a context shift
        params = replace(params, penalty_last_n=window)  # recorded as run
        check_penalties(params, self.sampler_order)
        if not prompt_ids:
            raise InfertraceError("the prompt is empty after tokenization; pass some text with --prompt")
        rows = int(self.model.cfg.vocab_size)
        if max(prompt_ids) >= rows or min(prompt_ids) < 0:  # a tokenizer larger than the embedding (vLLM: "out of vocabulary")
            bad = max(prompt_ids) if max(prompt_ids) >= rows else min(prompt_ids)
            raise InfertraceError(f"prompt token id {bad} is outside the model's embedding rows 0..{rows - 1} (its tokenizer has "
                                  f"{getattr(self.tok, 'vocab_size', '?')} tokens); use the tokenizer the model was trained with")
        limit = min(self.opts.ctx_size, self.kv.capacity_tokens)
        mem = self.kv.describe()
        if len(prompt_ids) >= limit and mem.get("n_stream"):
            raise InfertraceError(  # --kv-unified off: llama.cpp's n_ctx_seq = pad256(pad256(n_ctx) / n_seq_max)
                f"prompt has {len(prompt_ids)} tokens but its stream holds {limit} cells (--kv-unified off splits "
                f"--ctx-size {self.opts.ctx_size} over {mem['n_stream']} sequences, llama.cpp's n_ctx_seq; the prompt "
                "plus one generated token must fit); raise --ctx-size or use --kv-unified on"
            )
        if len(prompt_ids) >= limit and self.kv.capacity_tokens < self.opts.ctx_size:  # case P5: name the pool
            B = max(1, mem["block_size"])
            raise InfertraceError(
                f"prompt has {len(prompt_ids)} tokens but the KV pool holds {limit} ({self.kv.capacity_tokens // B} "
                f"blocks × {B} tokens; the prompt plus one generated token must fit); raise --num-blocks"
            )
        if len(prompt_ids) >= limit:
            raise InfertraceError(
                f"prompt has {len(prompt_ids)} tokens but the context holds {limit} (the prompt plus at least one "
                "generated token must fit); shorten the prompt or raise --ctx-size"
            )
        seq_id = len(self.requests)
        if mem["n_seq_max"] is not None and seq_id >= mem["n_seq_max"]:
            raise InfertraceError(f"too many requests for the {mem['kind']} backend (n_seq_max = {mem['n_seq_max']})")
        r = Request(seq_id, list(prompt_ids), params, arrival_step, prompt_text)
        self.requests[seq_id] = r
        self.scheduler.add(r)
        return r

    def step(self) -> ScheduledBatch | None:
        """Run one step. Returns the scheduled batch, or None when all requests are done.

        A step with no runnable request (waiting for a later arrival) computes nothing; an
        enabled tracer still gets ``end_step`` with ``inp=None`` and an empty batch (an idle step).
        """
        if not self.scheduler.has_work():
            return None
        t0 = time.perf_counter()
        if self.spec is not None:
            self.spec.propose(self)  # drafts of running decode requests, packed by the scheduler as verify chunks
        batch = self.scheduler.schedule(self.step_no)
        if not batch.chunks:  # idle: waiting for a later arrival; recorded so the step numbers have no gaps
            return self._idle_step(batch, t0)
        specs = [ChunkSpec(c.req.seq_id, c.C, c.T, c.parents) for c in batch.chunks]
        inp = self.kv.prepare(specs)
        ids = torch.tensor([t for c in batch.chunks for t in c.token_ids], dtype=torch.int64)  # [N]
        rows = logits_rows(batch)
        tracer = self.tracer
        if tracer.enabled:
            tracer.begin_step()
        hid: list[torch.Tensor] | None = [] if self.spec is not None and self.spec.wants_hidden else None
        logits = self.model.forward(ids, inp, self.kv, torch.tensor(rows, dtype=torch.int64), tracer,
                                    **({"hidden_out": hid} if hid is not None else {}))  # [M, V]
        if rows and not bool(torch.isfinite(logits).all()):
            raise InfertraceError(
                f"the model produced NaN/inf logits at step {self.step_no}; its weights or hyper-parameters "
                "(rope theta, rms epsilon) are broken - check the file with infertrace inspect"
            )
        logits = mask_padded_rows(logits, self.n_sample_rows)  # [M, V]: where logits become samples (plain, verify)
        samples, finished, j = {}, {}, 0
        verifying = self.spec is not None or any(c.parents is not None for c in batch.chunks)
        spec_rec: dict[str, Any] | None = {} if verifying else None
        row0 = 0
        for c in batch.chunks:
            req = c.req
            req.num_computed += c.T
            row0 += c.T
            if c.parents is not None:  # speculative verify (engine/speculative.py)
                j = self._verify(c, logits, j, inp, row0 - c.T, samples, finished, spec_rec)
                continue
            if not c.need_logits:
                continue
            res = self.sample_row(logits[j], req)
            j += 1
            samples[req.seq_id] = res
            if c.phase == "decode" and self.spec is not None:
                self.spec.note(req.seq_id, c, [0], 1)
            reason = self._emit(req, res.token)
            if reason:
                finished[req.seq_id] = reason
        if hid is not None:  # the MTP drafter's input: final-normed hidden rows of the kept positions
            self.spec.keep_hidden(batch, hid[0], spec_rec)
        if spec_rec is not None:
            spec_rec = self._spec_step(batch, spec_rec, finished)
        if self.serving.active:
            self.serving.after_forward(batch, inp)
        serving = self._serving_record(batch)
        if tracer.enabled:
            tracer.end_step(StepContext(step=self.step_no, batch=batch, inp=inp, kv=self.kv, attention=self.attn_impl,
                                        logits=logits, logits_rows=rows, samples=samples, finished=finished,
                                        requests=self.requests, time_ms=(time.perf_counter() - t0) * 1e3,
                                        sampler_order=self.sampler_order, serving=serving, spec=spec_rec))
        for sid, reason in finished.items():
            self.scheduler.finish(self.requests[sid], reason)
            if self.spec is not None:
                self.spec.drafter.release(sid)  # the drafter's own cache / buffers of a finished request
        if self.serving.active:
            self.serving.after_finish(batch, finished)
        self.step_no += 1
        return batch

    def _idle_step(self, batch: ScheduledBatch, t0: float) -> ScheduledBatch:
        """Record an idle step (nothing scheduled) and advance; a long wait for the next arrival of the
        scheduler's ``future`` is fast-forwarded (one idle record, then a gap in the step numbers)."""
        if self.tracer.enabled:
            self.tracer.begin_step()
            self.tracer.end_step(StepContext(step=self.step_no, batch=batch, inp=None, kv=self.kv,
                                             attention=self.attn_impl, logits=None, logits_rows=[], samples={},
                                             finished={}, requests=self.requests,
                                             time_ms=(time.perf_counter() - t0) * 1e3,
                                             serving=self._serving_record(batch)))
        sch = self.scheduler
        if not sch.running and not sch.waiting and sch.future and sch.future[0].arrival_step - self.step_no > MAX_IDLE_RECORDED:
            self.step_no = sch.future[0].arrival_step  # fast-forward a long wait (one idle record, then a gap)
        else:
            self.step_no += 1
        return batch

    @property
    def ctx_limit(self) -> int:
        """The context one request may fill, in tokens: ``ctx_size``; with ``--kv-unified off`` its own
        stream, ``n_ctx_seq`` = ``pad256(pad256(ctx_size) // n_seq_max)`` (llama.cpp's server slot context
        is ``n_ctx_seq``; :func:`~infertrace.kv.streams.n_ctx_seq`)."""
        if self.opts.kv_unified:
            return self.opts.ctx_size
        from infertrace.kv.streams import n_ctx_seq

        return n_ctx_seq(self.opts.ctx_size, self.opts.n_seq_max)

    def _emit(self, req: Request, token: int) -> str | None:
        """Append one generated token; returns the stop reason it causes, if any (the stop rule's)."""
        req.output_ids.append(token)
        return self.stop_rule(req, token)

    def stop_reason(self, req: Request, token: int) -> str | None:
        """The default stop rule, after ``token`` was appended to ``req.output_ids``: ``eos`` (an end-of-generation
        id, unless ``ignore_eos``), ``max_new_tokens``, or ``ctx_full`` (the context is full and no context shift)."""
        if token in self.eog and not req.params.ignore_eos:
            return "eos"
        if len(req.output_ids) >= req.params.max_new_tokens:
            return "max_new_tokens"
        if len(req.cache_ids) >= self.ctx_limit and not self.opts.context_shift:
            return "ctx_full"
        return None

    def _verify(self, c: Any, logits: torch.Tensor, j: int, inp: AttnInputs, row: int, samples: dict,
                finished: dict, spec_rec: dict) -> int:
        """Accept the longest valid prefix of ``c``'s drafts, emit the tokens, rewind the rest;
        returns the next logits row."""
        req = c.req
        out, accepted = verify_chunk(self, c, logits[j : j + c.T])  # logits [T, V]: forced, or the tree walk
        emitted = []
        for res in out:
            emitted.append(res.token)
            reason = self._emit(req, res.token)
            if reason:
                finished[req.seq_id] = reason
                break
        samples[req.seq_id] = out[len(emitted) - 1]
        # also when finishing: the trace shows the rewound cache
        rewind = (self.spec.rewind(self, c, accepted, inp, row) if self.spec is not None
                  else rewind_chunk(self.kv, c, accepted, inp, row))
        counts = (self.spec.note(req.seq_id, c, accepted, len(emitted)) if self.spec is not None
                  else {"drafted": c.T - 1, "accepted": len(accepted) - 1})
        spec_rec[req.seq_id] = {**counts, "C": c.C, "tokens": list(c.token_ids), "parents": list(c.parents),
                                "positions": [c.C + d for d in c.depths()], "accepted_nodes": accepted,
                                "emitted": emitted, "rewind": rewind}
        drec = self.spec.draft_record(req.seq_id) if self.spec is not None else None
        if drec:  # --speculative mtp: which hidden state and token each MTP row read
            spec_rec[req.seq_id]["mtp"] = drec
        return j + c.T

    def _spec_step(self, batch: ScheduledBatch, reqs: dict, finished: dict) -> dict[str, Any] | None:
        """Per-step speculative counters; counts the target forward when a decode / verify chunk ran."""
        n_tok = sum(len(r["emitted"]) for r in reqs.values()) + sum(
            1 for c in batch.chunks if c.parents is None and c.phase == "decode" and c.need_logits)
        if self.spec is not None and any(c.phase == "decode" for c in batch.chunks):
            self.spec.target_forwards += 1
            self.spec.decode_tokens += n_tok
        if not reqs:
            return None
        drafted = sum(r["drafted"] for r in reqs.values())
        accepted = sum(r["accepted"] for r in reqs.values())
        return {"requests": {str(k): v for k, v in reqs.items()}, "drafted": drafted, "accepted": accepted,
                "acceptance_rate": round(accepted / drafted, 4) if drafted else None}

    def _serving_record(self, batch: ScheduledBatch) -> dict[str, Any] | None:
        """The step's serving record: the scheduler's (``batch.serving``: a replayed prefix hit), then the serving
        mechanisms' (engine/serving.py), then requests the scheduler stopped (``kv_full``: case P5)."""
        serving = self.serving.take_record(batch)
        if batch.serving:
            serving = {**batch.serving, **(serving or {})}
        return self._stopped_record(batch, serving)

    def _stopped_record(self, batch: ScheduledBatch, serving: dict[str, Any] | None) -> dict[str, Any] | None:
        """The step's serving record plus requests the scheduler stopped (``kv_full``: case P5)."""
        if not batch.stopped:
            return serving
        return {**(serving or {}), "stopped": {str(k): v for k, v in batch.stopped.items()},
                "pool_tokens": self.kv.capacity_tokens}

    def run(self, max_steps: int = 100_000) -> list[Request]:
        """Step until every request finished (or ``max_steps``); returns requests by seq_id."""
        for _ in range(max_steps):
            if self.step() is None:
                break
        return [self.requests[k] for k in sorted(self.requests)]
