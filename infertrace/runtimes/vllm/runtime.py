"""vLLM as a :class:`~infertrace.runtimes.api.Runtime`: vLLM's own engine core in this process, one
``EngineCore.step`` per step (:func:`~infertrace.runtimes.vllm.engine.drive_steps`), every variable read
from vLLM's objects.

What it refuses (:meth:`VllmRuntime.check`), in its own words: a device other than its CPU build,
infertrace's context shift and KV audit, a cache dtype (vLLM keeps ``kv_cache_dtype`` ``auto``) or
quantised kernels of infertrace's, speculative methods other than ngram, tensors of several layers,
hybrid and sliding-window models, a tensor-parallel size the model's heads or the cores cannot take.
Its convention is always ``paged``. Its native trace sections are ``options.vllm`` (the run's vLLM
facts) and each step's ``vllm`` (scheduler output and attention metadata in vLLM's names).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

from infertrace.runtimes.api import (REGISTRY, RunSettings, RuntimeHeader, RuntimeInfo, SettingRefused, StepRecord,
                                     check_declared, request_record)


class VllmRuntime:
    """vLLM behind the Runtime protocol (see :mod:`infertrace.runtimes.api`).

    Args:
        loaded: the model (infertrace's tokenizer and config; vLLM loads the same weights, a GGUF through
            :func:`infertrace.runtimes.vllm.convert.hf_dir_for`).
        settings: checked by :meth:`check`.
        tensors: layer ``settings.layer``'s tensors are copied into it when given.
        run: an already loaded :class:`~infertrace.runtimes.vllm.engine.VllmRun` with the same options
            (tests share one; it is not closed here).

    Attributes:
        raw: per step vLLM's raw record (for :mod:`infertrace.runtimes.vllm.compare`; never serialised).

    Raises:
        InfertraceError: vLLM missing or refusing the model / settings.
    """

    info: ClassVar[RuntimeInfo] = REGISTRY["vllm"]

    @classmethod
    def check(cls, settings: RunSettings, model_config: Any | None = None) -> RunSettings:
        """Refuse what vLLM does not run here; the convention becomes ``paged`` (vLLM's cache is paged).

        Raises:
            SettingRefused: see the module docstring.
            InfertraceError: vLLM missing; a tensor-parallel size above the cores or not dividing the heads.
        """
        from infertrace.runtimes.vllm import import_vllm
        from infertrace.runtimes.vllm.cli import check_tp_cores

        name = cls.info.name
        check_tp_cores(settings.tensor_parallel_size)  # a plain bound: before vLLM is imported
        import_vllm()  # fail before loading anything
        settings = replace(settings, opts=replace(settings.opts, backend="paged"))
        opts = settings.opts
        if settings.device != "cpu":
            raise SettingRefused(name, "device", "the device is vLLM's (its CPU build here)")
        if opts.context_shift or opts.audit_kv:
            raise SettingRefused(name, "serving", "vLLM's own cache is recorded as it is, without infertrace's context "
                                                  "shift and KV audit")
        if opts.kv_dtype is not None:
            raise SettingRefused(name, "opts.kv_dtype", "vLLM keeps its kv_cache_dtype 'auto' (the model dtype; recorded "
                                                        "as options.vllm.cache_dtype in the trace header)")
        if settings.weights.strip().lower() == "quant":
            raise SettingRefused(name, "weights", "vLLM computes on its own dequantised float copy of the GGUF "
                                                  "(options.vllm.dtype in the trace header)")
        check_declared(cls.info, settings)
        if model_config is not None:
            cls._check_model(model_config, settings)
        return settings

    @staticmethod
    def _check_model(cfg: Any, settings: RunSettings) -> None:
        """Full-attention decoders only; the tensor-parallel size must divide the model's heads."""
        from infertrace.errors import InfertraceError
        from infertrace.runtimes.vllm.tp import check_tensor_parallel

        if getattr(cfg, "is_hybrid", False) or cfg.windowed_layers:
            raise InfertraceError("--runtime vllm records full-attention decoder models here (no hybrid / sliding-window layers)")
        check_tensor_parallel(cfg.n_head, cfg.n_head_kv, settings.tensor_parallel_size)

    @classmethod
    def run_output(cls, console: Any) -> Any:
        """vLLM's logger, warnings and bars go to a file named in one line (:func:`~infertrace.runtimes.vllm.logfile.vllm_log`)."""
        from infertrace.runtimes.vllm.logfile import vllm_log

        return vllm_log(console)

    def __init__(self, loaded: Any, settings: RunSettings, tensors: dict[str, Any] | None = None, run: Any = None):
        from infertrace.capture.recorder import Recorder
        from infertrace.runtimes.vllm.engine import VllmRun

        s = self.settings = settings
        self.loaded, self.tok = loaded, loaded.tokenizer
        self.owned = run is None
        if run is None:
            from infertrace.runtimes.vllm.convert import hf_dir_for

            run = VllmRun(hf_dir_for(loaded.ckpt.path), s.opts, s.dtype, s.layer, s.tensor_parallel_size,
                          n_requests=s.n_requests)
        self.run = run
        #: layers whose block outputs are kept (``--keep tensors --layers``); hooked only for this run
        self.tap_layers = tuple(s.tensor_layers or (s.layer,)) if tensors is not None else ()
        run.llm.collective_rpc(run.capture.set_taps, args=(list(self.tap_layers),))
        self.rec = Recorder(self.tok, loaded.config, layer=s.layer, show=tuple(s.show), layers=self.tap_layers or [s.layer],
                            tensors=tensors)
        self.reqs: list[Any] = []
        self.raw: list[dict[str, Any]] = []
        self._steps: Any = None

    def add_request(self, request: Any) -> int:
        """Queue ``request`` (:class:`~infertrace.engine.drive.EncodedRequest`); added to vLLM at its arrival step."""
        from infertrace.engine.request import Request

        seq_id = len(self.reqs)
        self.reqs.append(Request(seq_id, list(request.ids), request.params.validate(), request.arrival_step, request.text))
        return seq_id

    def step(self) -> StepRecord | None:
        """One ``LLMEngine.step()`` (or an idle step); its StepTrace and vLLM's own section (``native``)."""
        from infertrace.runtimes.vllm.engine import drive_steps

        if self._steps is None:
            self._steps = drive_steps(self.run, self.reqs, self.rec)
        n = len(self.rec.steps)
        raw = next(self._steps, None)
        if raw is None:
            return None
        self.raw.append(raw)
        return StepRecord(raw["step"], self.rec.steps[-1] if len(self.rec.steps) > n else None, raw.get("vllm"))

    def requests(self) -> list[dict[str, Any]]:
        """The requests in seq_id order, with vLLM's ``num_cached_tokens`` (``vllm_num_cached_tokens``)."""
        return [request_record(r, self.tok, vllm_num_cached_tokens=getattr(r, "vllm_num_cached_tokens", None))
                for r in self.reqs]

    def header(self) -> RuntimeHeader:
        """paged / vllm, the engine options (``num_blocks``: vLLM's pool when not given), the sampler order,
        ``options.vllm`` and the notes (the engine core, tensor parallelism, placeholder drafts)."""
        from dataclasses import asdict

        from infertrace.runtimes.vllm.engine import run_notes

        eng_opts = asdict(self.settings.opts)
        if eng_opts["num_blocks"] is None:  # vLLM sized its pool itself (VLLM_CPU_KVCACHE_SPACE): record that pool
            eng_opts["num_blocks"] = self.run.num_blocks
        options: dict[str, Any] = {"sampler_order": "hf", self.info.native: self.run.header()}
        notes = list(run_notes(self.run, self.settings.opts, self.loaded.config, self.raw))
        if self.tap_layers:  # --keep tensors: which vLLM module each saved tap is read from
            options["tap_sources"] = dict(TAP_SOURCES)
            if self.settings.tensor_parallel_size > 1:  # each rank holds a shard of the heads (tp.merge_ranks)
                notes.append("layer taps under tensor parallelism: only the all-reduced block outputs (hidden_in, attn_out, "
                             "mlp_out, resid_post) are saved for --layers; Q/K are head shards per rank (--layer's are merged)")
        return RuntimeHeader(backend="paged", attention="vllm", settings=eng_opts, options=options,
                             notes=tuple(notes),
                             layer=self.settings.layer)

    def close(self) -> None:
        """Stop the step generator; drop vLLM when this runtime loaded it (idempotent)."""
        if self._steps is not None:
            self._steps.close()
            self._steps = None
        if self.owned and self.run is not None:
            self.run.close()
            self.run = None


#: saved tap name -> the vLLM tensor it is (``options.tap_sources``; infertrace/runtimes/vllm/capture.py)
TAP_SOURCES = {
    "hidden_in": "vLLM decoder layer input: hidden_states + residual (forward pre-hook; layer 0: hidden_states)",
    "q_pre_rope": "vLLM rotary_emb input query of this layer's call (forward pre-hook)",
    "k_pre_rope": "vLLM rotary_emb input key of this layer's call (forward pre-hook)",
    "q_post_rope": "vLLM rotary_emb output query of this layer's call (forward hook)",
    "k_post_rope": "vLLM rotary_emb output key of this layer's call (forward hook)",
    "v": "vLLM attention impl do_kv_cache_update value input (--layer only)",
    "attn_out": "vLLM self_attn output after o_proj (Gemma 3: post_attention_layernorm output)",
    "mlp_out": "vLLM mlp output (Gemma 3: post_feedforward_layernorm output)",
    "resid_post": "vLLM decoder layer output hidden_states + residual (the fused add-RMSNorm returns them apart)",
}


def run_requests_vllm(loaded: Any, prompts: list[Any], opts: Any, layer: int = 0,
                      show: tuple[str, ...] | None = None, on_step: Any = None,
                      options_for_record: dict[str, Any] | None = None, tensors: dict[str, Any] | None = None,
                      dtype: str = "float32", tp: int = 1, run: Any = None) -> Any:
    """:func:`infertrace.runner.run_requests` with vLLM computing and scheduling: the same records,
    ``engine = "vllm"`` in the header, vLLM's own values per step in ``step.vllm``
    (:func:`~infertrace.runtimes.loop.record_run` on :class:`~infertrace.runtimes.vllm.runtime.VllmRuntime`).

    Args:
        loaded: the model (our tokenizer and config; vLLM loads the same weights, a GGUF through
            :func:`infertrace.runtimes.vllm.convert.hf_dir_for`).
        run: an already loaded :class:`~infertrace.runtimes.vllm.engine.VllmRun` with the same options (tests share one).

    Returns:
        the RunTrace; its ``_vllm_raw`` holds vLLM's raw step records (for the comparison, never serialised).

    Raises:
        InfertraceError: bad layer, vLLM missing, refused settings, capture mismatch.
    """
    from infertrace.capture.recorder import VARIABLES
    from infertrace.runtimes.loop import checked_settings, record_run

    settings = RunSettings(opts=opts, layer=layer, show=tuple(show or VARIABLES), tensor_layers=(layer,), dtype=dtype,
                           tensor_parallel_size=tp, record=dict(options_for_record or {}))
    settings = checked_settings(VllmRuntime, loaded, prompts, settings)
    rt = VllmRuntime(loaded, settings, tensors, run=run)  # opened here to keep its raw records (run: a shared engine)
    trace = record_run(rt, loaded, prompts, settings, on_step, tensors)
    trace._vllm_raw = rt.raw  # type: ignore[attr-defined]  # for the comparison, never serialised
    return trace
