"""llama.cpp as a :class:`~infertrace.runtimes.api.Runtime`: infertrace's scheduler and step loop, llama.cpp's
``llama_decode`` and cache (:class:`~infertrace.runtimes.llamacpp.engine.LlamaCppEngine`), the ordinary recorder.

What it refuses (:meth:`LlamaCppRuntime.check`), in its own words: the paged convention, a device or
dtype other than llama.cpp's CPU float32 backend, infertrace's serving mechanisms (prefix cache,
context shift, KV audit), a cache dtype or linear kernels of infertrace's, speculative decoding,
tensors of several layers, a Gated DeltaNet layer as the recorded layer. Its native setting is
``flash_attn`` (``auto`` | ``on`` | ``off``); its native trace section is ``options.llama_cpp``
(version, context settings, cache types, whether tokens were forced).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

from infertrace.runtimes.api import (REGISTRY, RunSettings, RuntimeHeader, RuntimeInfo, SettingRefused, StepRecord,
                                     check_declared, request_record)


class LlamaCppRuntime:
    """llama.cpp behind the Runtime protocol (see :mod:`infertrace.runtimes.api`).

    Args:
        loaded: the GGUF model (infertrace's tokenizer and config; llama.cpp loads the same file).
        settings: checked by :meth:`check` (``native["flash_attn"]``; ``forced``: teacher forcing).
        tensors: layer ``settings.layer``'s tensors are copied into it when given.

    Raises:
        InfertraceError: llama-cpp-python missing, a non-GGUF model, a llama_decode failure.
    """

    info: ClassVar[RuntimeInfo] = REGISTRY["llama.cpp"]

    @classmethod
    def check(cls, settings: RunSettings, model_config: Any | None = None) -> RunSettings:
        """Refuse what llama.cpp does not run here; normalise ``flash_attn``.

        Raises:
            SettingRefused: see the module docstring (``setting`` names the refused field).
            InfertraceError: llama-cpp-python missing; a bad ``flash_attn`` value.
        """
        from infertrace.runtimes.llamacpp.capture import check_flash_attn, import_llama_cpp

        name, opts = cls.info.name, settings.opts
        import_llama_cpp()  # fail before loading anything
        if opts.backend != "cells":
            raise SettingRefused(name, "opts.backend", "llama.cpp records its own cells cache, not the paged convention")
        if settings.device != "cpu" or settings.dtype.lower() not in ("float32", "fp32"):
            raise SettingRefused(name, "device", "llama.cpp computes on its CPU backend in float32")
        if opts.prefix_cache or opts.context_shift or opts.audit_kv:
            raise SettingRefused(name, "serving", "llama.cpp's own cache is recorded as it is, without infertrace's "
                                                  "serving mechanisms")
        if opts.kv_dtype is not None:
            raise SettingRefused(name, "opts.kv_dtype", "llama.cpp keeps its own cache type (its type_k/type_v are in "
                                                        "the trace header, options.llama_cpp)")
        if settings.weights.strip().lower() != "auto":
            raise SettingRefused(name, "weights", "llama.cpp computes on the GGUF's own tensor types with its own kernels")
        if opts.speculative:
            raise SettingRefused(name, "opts.speculative", "llama.cpp runs llama_decode one token per step here")
        check_declared(cls.info, settings)
        native = {"flash_attn": check_flash_attn(settings.native.get("flash_attn", "auto"))}
        if model_config is not None:
            cls._check_model(model_config, settings)
        return replace(settings, native=native)

    @staticmethod
    def _check_model(cfg: Any, settings: RunSettings) -> None:
        """The model-level refusal: a Gated DeltaNet layer as the recorded layer (sliding-window layers with one
        stream per sequence are refused by :class:`~infertrace.runtimes.llamacpp.engine.LlamaCppEngine`)."""
        from infertrace.errors import InfertraceError

        layer = settings.layer
        if getattr(cfg, "is_hybrid", False) and cfg.is_linear(layer):
            attn = [i for i in range(cfg.n_layer) if not cfg.is_linear(i)]
            raise InfertraceError(f"--layer {layer} is a Gated DeltaNet layer (no K/V for llama.cpp to show); pass --layer "
                                  f"{attn[0] if attn else 0} (attention layers: {attn})")

    @classmethod
    def run_output(cls, console: Any) -> Any:
        """Nothing of its own is printed while it runs."""
        from contextlib import nullcontext

        return nullcontext()

    def __init__(self, loaded: Any, settings: RunSettings, tensors: dict[str, Any] | None = None):
        from infertrace.capture.recorder import Recorder
        from infertrace.runtimes.llamacpp.engine import LlamaCppEngine

        s = self.settings = settings
        self.tok = loaded.tokenizer
        #: layers whose tensors are kept (``--keep tensors --layers``); their nodes are asked for only then
        self.tap_layers = tuple(s.tensor_layers or (s.layer,)) if tensors is not None else ()
        self.rec = Recorder(self.tok, loaded.config, layer=s.layer, show=tuple(s.show), layers=self.tap_layers or [s.layer],
                            tensors=tensors)
        self.eng = LlamaCppEngine(loaded, s.opts, self.rec, s.layer, dict(s.forced) if s.forced else None,
                                  n_seq_max=max(1, s.n_requests), flash_attn=s.native.get("flash_attn", "auto"),
                                  tap_layers=self.tap_layers)
        self._closed = False

    def add_request(self, request: Any) -> int:
        """Queue ``request`` (:class:`~infertrace.engine.drive.EncodedRequest`); returns its seq_id."""
        return self.eng.add_request(request.ids, request.params, request.arrival_step, request.text).seq_id

    def step(self) -> StepRecord | None:
        """One engine step = one ``llama_batch``; its StepTrace."""
        n, step_no = len(self.rec.steps), self.eng.step_no
        if self.eng.step() is None:
            return None
        return StepRecord(step_no, self.rec.steps[-1] if len(self.rec.steps) > n else None)

    def requests(self) -> list[dict[str, Any]]:
        """The requests in seq_id order."""
        return [request_record(r, self.tok) for r in self.eng.requests.values()]

    def header(self) -> RuntimeHeader:
        """cells / llama.cpp, the engine options (no cache dtype: llama.cpp's own), the sampler order and
        ``options.llama_cpp`` (version, context settings, teacher forcing)."""
        from dataclasses import asdict

        from infertrace.runtimes.llamacpp.engine import _version, run_notes

        s, eng = self.settings, self.eng
        engine_opts = {k: v for k, v in asdict(s.opts).items()  # llama.cpp's cache type: llama_cpp.type_k
                       if k != "kv_dtype" and (k != "kv_unified" or not v)}  # kv_unified recorded only when off
        native = {"version": _version(), **eng.lctx.settings(), "teacher_forced": bool(s.forced)}
        options: dict[str, Any] = {"sampler_order": eng.sampler_order, self.info.native: native}
        notes = list(run_notes(eng, s.opts))
        if self.tap_layers:  # --keep tensors: where each saved tap came from, and what the last layer lacks
            options["tap_sources"] = tap_sources()
            last = self.rec.cfg.n_layer - 1
            if last in self.tap_layers:
                notes.append(f"layer {last} (the last): llama.cpp computes its FFN (and Gemma 3 its post-attention norm) for "
                             "the output rows only (inp_out_ids, ggml_get_rows): its mlp_out / resid_post are saved only on "
                             "steps where every token has a logits row")
        return RuntimeHeader(backend="cells", attention="llama.cpp", settings=engine_opts, options=options,
                             notes=tuple(notes), layer=s.layer)

    def close(self) -> None:
        """Free llama.cpp's context (idempotent)."""
        if not self._closed:
            self._closed = True
            self.eng.close()


def tap_sources() -> dict[str, str]:
    """``options.tap_sources`` of a llama.cpp run: saved tap name -> the graph node(s) of llama.cpp's eval callback
    it is read from (:data:`~infertrace.runtimes.llamacpp.capture.TAP_NODES`, ``N`` = the layer)."""
    from infertrace.capture.recorder import TENSOR_NAMES
    from infertrace.model.taps import K, K_ROT, Q, Q_ROT, V
    from infertrace.runtimes.llamacpp.capture import TAP_NODES

    qkv = {Q: "Qcur-N, first node (the projection)", Q_ROT: "Qcur-N, last node (after RoPE)",
           K: "Kcur-N, first node (the projection)", K_ROT: "Kcur-N, last node (after RoPE)", V: "Vcur-N"}
    out = {TENSOR_NAMES[t]: f"llama.cpp graph node {src} (eval callback)" for t, src in qkv.items()}
    for tap, nodes in TAP_NODES.items():
        out[TENSOR_NAMES[tap]] = f"llama.cpp graph node {' or '.join(f'{n}-N' for n in nodes)} (eval callback; first present)"
    return out


# ----------------------------------------------------------------------------- diff-runtimes llama.cpp (registry hooks)
# infertrace's cells backend against llama.cpp, the float noise floor measured
def check_comparison(settings: RunSettings, atol: float | None) -> RunSettings:
    """Before anything loads: llama-cpp-python importable, no tolerance given (it is measured), ``flash_attn`` valid.

    Raises:
        SettingRefused: ``atol`` given. InfertraceError: llama-cpp-python missing, a bad ``flash_attn``.
    """
    from infertrace.errors import InfertraceError
    from infertrace.runtimes.llamacpp.capture import check_flash_attn

    if atol is not None:
        raise SettingRefused(LlamaCppRuntime.info.name, "atol", "its tolerance is a measured noise floor")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise InfertraceError("diff-runtimes llama.cpp needs llama-cpp-python: run `make setup-dev` in the infertrace checkout "
                              "(or `.venv/bin/pip install -e '.[llamacpp]'` there)") from None
    return replace(settings, native={"flash_attn": check_flash_attn(settings.native.get("flash_attn", "auto"))})


def compare(loaded: Any, specs: list[Any], settings: RunSettings, atol: float | None) -> dict[str, Any]:
    """:func:`~infertrace.compare.llamacpp.compare_with_llamacpp` (the cells backend in float32 only).

    Raises:
        InfertraceError: another backend or dtype, any run error.
    """
    from infertrace.compare.llamacpp import compare_with_llamacpp
    from infertrace.errors import InfertraceError

    if settings.opts.backend != "cells" or settings.dtype.lower() not in ("float32", "fp32"):
        raise InfertraceError("diff-runtimes llama.cpp compares the cells backend in float32 (the base side); drop --backend/--dtype")
    return compare_with_llamacpp(loaded, specs, settings.opts, layer=settings.layer,
                                 flash_attn=settings.native.get("flash_attn", "auto"))


def render_comparison(console: Any, rep: dict[str, Any]) -> None:
    """:func:`~infertrace.present.render_llamacpp.render_llamacpp_diff`."""
    from infertrace.present.render_llamacpp import render_llamacpp_diff

    render_llamacpp_diff(console, rep)
