"""infertrace's own engine as a :class:`~infertrace.runtimes.api.Runtime`: :class:`~infertrace.engine.engine.Engine`
fed by the :class:`~infertrace.capture.recorder.Recorder`, every variable computed here.

The cells or paged convention (``opts.backend``), the serving mechanisms, speculative decoding and
``--replay`` of a vLLM trace (the native setting ``replay``: a path, or a plan from
:func:`~infertrace.runtimes.vllm.replay.load_plan`) all run through the same ``Engine.step``.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, ClassVar

from infertrace.runtimes.api import (REGISTRY, RunSettings, RuntimeHeader, RuntimeInfo, SettingRefused, StepRecord,
                                     check_declared, request_record)

#: EngineOptions fields of the serving mechanisms and their off values (engine/serving.py)
SERVING_DEFAULTS = {"prefix_cache": False, "context_shift": False, "n_keep": 0, "n_discard": 0, "audit_kv": False}
#: EngineOptions fields of speculative decoding and their defaults (recorded only when speculative is on)
SPEC_DEFAULTS = {"speculative": None, "num_spec_tokens": 3, "spec_tree": None, "draft_model": None, "draft_layers": None,
                 "ngram_min": 1, "ngram_max": 3}


class OurRuntime:
    """infertrace's engine behind the Runtime protocol (see :mod:`infertrace.runtimes.api`).

    Args:
        loaded: :class:`~infertrace.loading.model.Loaded` (model, tokenizer, config).
        settings: checked by :meth:`check` (``native["replay"]``: a vLLM trace directory or plan).
        tensors: each step's kept tensors are copied into it when given (``--keep tensors``).

    Raises:
        InfertraceError: as :class:`~infertrace.engine.engine.Engine` (cache too small, bad attention, ...).
    """

    info: ClassVar[RuntimeInfo] = REGISTRY["infertrace"]

    @classmethod
    def check(cls, settings: RunSettings, model_config: Any | None = None) -> RunSettings:
        """The registry's declared checks, and (with the model) llama.cpp's ``n_seq_max`` rule for the iSWA pool.

        Raises:
            SettingRefused: a setting this engine does not take.
        """
        from infertrace.engine.options import EngineOptions

        check_declared(cls.info, settings)
        opts = settings.opts
        if settings.forced is not None and opts.speculative:  # a verify step accepts drafts by its own rule
            raise SettingRefused(cls.info.name, "forced", "teacher forcing feeds one token per step; it does not "
                                 "combine with speculative decoding (drop --speculative)")
        if settings.forced is not None and settings.native.get("replay") is not None:
            raise SettingRefused(cls.info.name, "forced", "a replay already emits the vLLM trace's tokens (drop --teacher-force)")
        replay = settings.native.get("replay")
        if replay is not None:
            if opts.kv_dtype is not None:
                raise SettingRefused(cls.info.name, "opts.kv_dtype", "a replay rebuilds vLLM's pool in the model dtype")
            if not isinstance(replay, dict):  # the vLLM trace is read and checked before the model loads
                from infertrace.runtimes.vllm.replay import load_plan

                settings = replace(settings, native={**settings.native, "replay": load_plan(replay)})
        if model_config is not None and opts.backend == "cells" and getattr(model_config, "windowed_layers", None) \
                and opts.n_seq_max == EngineOptions.n_seq_max:
            # llama.cpp's n_seq_max is the number of parallel sequences (llama-cli 1, --parallel N), and it sizes the
            # iSWA cache's SWA pool (kv/iswa.py): one per request here, as --runtime llama.cpp runs them
            settings = replace(settings, opts=replace(opts, n_seq_max=settings.n_requests))
        return settings

    @classmethod
    def run_output(cls, console: Any) -> Any:
        """Nothing of its own is printed while it runs."""
        from contextlib import nullcontext

        return nullcontext()

    def __init__(self, loaded: Any, settings: RunSettings, tensors: dict[str, Any] | None = None):
        from infertrace.capture.recorder import Recorder
        from infertrace.engine.engine import Engine
        from infertrace.model.taps import NULL_TRACER

        self.loaded, self.settings, self.tok = loaded, settings, loaded.tokenizer
        s = settings
        self.rec = (Recorder(self.tok, loaded.config, layer=s.layer, show=tuple(s.show), layers=s.tensor_layers,
                             tensors=tensors) if s.trace else NULL_TRACER)
        replay = s.native.get("replay")
        if replay is not None:
            from infertrace.runtimes.vllm.replay import load_plan, replay_engine

            self.eng = replay_engine(loaded.model, self.tok, s.opts, self.rec,
                                     load_plan(replay) if not isinstance(replay, dict) else replay)
        else:
            from infertrace.engine.parts import ForcedSampler

            self.eng = Engine(loaded.model, self.tok, s.opts, self.rec,
                              sampler=ForcedSampler(dict(s.forced)) if s.forced else None)
        self.budget = None
        if s.trace and s.opts.context_shift:  # bounded by -n alone: stop once the trace passes what a saved trace may hold
            from infertrace.engine.trace_budget import TraceBudget

            self.budget = TraceBudget(self.rec.steps, tensors, 0)

    def add_request(self, request: Any) -> int:
        """Queue ``request`` (:class:`~infertrace.engine.drive.EncodedRequest`); returns its seq_id."""
        r = self.eng.add_request(request.ids, request.params, request.arrival_step, request.text)
        if self.budget is not None:
            self.budget.total += (len(request.text) or len(request.ids)) * 16 + request.params.max_new_tokens * 16
        return r.seq_id

    def step(self) -> StepRecord | None:
        """One ``Engine.step``; its StepTrace (None when the run records no steps)."""
        n = len(getattr(self.rec, "steps", ()))
        step_no = self.eng.step_no
        if self.eng.step() is None:
            return None
        if self.budget is not None:
            self.budget()
        steps = getattr(self.rec, "steps", None)
        return StepRecord(step_no, steps[-1] if steps is not None and len(steps) > n else None)

    def requests(self) -> list[dict[str, Any]]:
        """The requests in seq_id order."""
        return [request_record(self.eng.requests[k], self.tok) for k in sorted(self.eng.requests)]

    def header(self) -> RuntimeHeader:
        """Backend, attention, the engine options (defaults of unset mechanisms pruned), padded vocabulary and notes."""
        eng, s = self.eng, self.settings
        opts = s.opts  # as asked (Engine may switch a mechanism off for this model: the note says so)
        engine_opts = recorded_settings(opts)
        options: dict[str, Any] = {}
        notes = []
        pv = eng.padded_vocab
        if pv:  # case T3: lm head rows past the tokenizer (engine.padded_vocab says why they are masked)
            options["padded_vocab"] = pv
            notes.append(f"padded vocabulary: the lm head has {pv['rows']} rows, the tokenizer {pv['tokens']} tokens; "
                         f"rows {pv['masked']} masked out of sampling (-inf logits; as vLLM, ids past the tokenizer "
                         "are never sampled, drafted or accepted)")
        layer = getattr(self.rec, "layer", s.layer)
        if s.trace and layer != s.layer:
            notes.append(f"layer {s.layer} is a Gated DeltaNet layer (no K/V, no RoPE): evidence from layer {layer}, "
                         "the first full-attention layer")
        if not opts.kv_unified:
            notes.append(kv_streams_note(opts))
        if s.trace and getattr(self.rec, "tensors", None) is not None:  # --keep tensors: where each saved tap came from
            options["tap_sources"] = tap_sources()
        if opts.prefix_cache and "prefix_cache" in eng.disabled:
            notes.append(f"--prefix-cache on ignored: {eng.disabled['prefix_cache']}")
            engine_opts.pop("prefix_cache", None)  # record what ran: no prefix cache (off is recorded by omission)
        return RuntimeHeader(backend=s.opts.backend, attention=eng.attn_impl, settings=engine_opts, options=options,
                             notes=tuple(notes), layer=layer, spec=eng.spec.summary() if eng.spec is not None else None)

    def close(self) -> None:
        """Nothing to free (the engine's tensors go with it)."""
        return None


def recorded_settings(opts: Any) -> dict[str, Any]:
    """``trace.options["settings"]`` of this engine: the options as run, each mechanism recorded only when set
    (so traces from before an option existed compare equal)."""
    engine_opts = asdict(opts)
    for k, default in SERVING_DEFAULTS.items():  # serving options recorded only when set (older traces compare equal)
        if engine_opts.get(k) == default:
            engine_opts.pop(k, None)
    if opts.kv_dtype is None:  # --kv-dtype recorded only when set (the cache is then in the model dtype, "dtype")
        engine_opts.pop("kv_dtype", None)
    if opts.kv_unified:  # --kv-unified recorded only when off (a unified trace reads as before the option)
        engine_opts.pop("kv_unified", None)
    if not opts.speculative:
        for k in SPEC_DEFAULTS:
            engine_opts.pop(k, None)
    elif opts.spec_tree is not None:
        engine_opts["spec_tree"] = list(opts.spec_tree)
    return engine_opts


def tap_sources() -> dict[str, str]:
    """``options.tap_sources`` of this engine: saved tap name -> the decoder's tap point it is read at
    (:mod:`infertrace.model.taps`, ``step{s}/layer{l}/NAME`` as :data:`~infertrace.capture.recorder.TENSOR_NAMES` saves it)."""
    from infertrace.capture.recorder import TENSOR_NAMES
    from infertrace.model.taps import BLOCK_TAPS

    return {name: f"infertrace decoder tap {tap}: {BLOCK_TAPS[tap]}"[:400] for tap, name in TENSOR_NAMES.items()}


def kv_streams_note(opts: Any) -> str:
    """The trace note of ``--kv-unified off``: streams, cells per stream, and the ubatch rule."""
    from infertrace.kv.streams import n_ctx_seq

    return (f"non-unified KV (--kv-unified off, llama.cpp kv_unified = false): {opts.n_seq_max} streams of "
            f"{n_ctx_seq(opts.ctx_size, opts.n_seq_max)} cells, one per sequence; each step is one llama.cpp split_equal "
            "ubatch (consecutive seq_ids, equal token counts; the rest stays pending for the next step), kq_mask "
            "ne = [n_kv, n_tokens_per_stream, 1, n_stream of the ubatch], n_kv = the largest padded used_max_p1 of its streams")
