"""The Runtime seam: one protocol every runtime implements, and the registry that names them.

A *runtime* is who computes (infertrace's own engine, llama.cpp, vLLM, HF transformers); a
*convention* (``--backend``) is how its KV memory is laid out (``cells`` as llama.cpp,
``paged`` as vLLM / TensorRT-LLM, ``dense`` as HF's padded ``[B, T]`` batches). This module
owns both words: :data:`REGISTRY` is the only place a runtime's name is bound to code, and
``cli/``, ``present/``, ``compare/`` and ``trace/`` ask it instead of naming engines.

The protocol mirrors the split of vLLM v1 (``EngineCore.step`` -> ``SchedulerOutput`` /
``ModelRunnerOutput``, typed data crossing a process boundary) and nano-vllm's
``LLMEngine.step``: the runtime is opened on a loaded model, requests are added, ``step()``
returns one :class:`StepRecord` (plain data) per engine step until there is no work, then
:meth:`Runtime.header` says what ran and :meth:`Runtime.close` frees it. The one loop that
drives any runtime and assembles the :class:`~infertrace.trace.records.RunTrace` is
:func:`infertrace.runtimes.loop.record_run`.

Torch-free and import-light: a runtime's module is imported only when it is opened.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager, Mapping, Protocol, Sequence

from infertrace.errors import ConfigError, InfertraceError

if TYPE_CHECKING:  # the trace layer imports this registry: nothing of the engine side, even for types
    from infertrace.trace.records import StepTrace


@dataclass(frozen=True)
class RuntimeInfo:
    """A registry entry: what a runtime is, before its module is imported.

    Attributes:
        name: the runtime's name as flags and traces spell it (``--runtime NAME``, ``RunTrace.runtime``).
        summary: one line for ``--help`` (who computes, what is recorded).
        target: ``"module:Class"`` of the :class:`Runtime` implementation (imported lazily).
        conventions: the KV conventions it runs (``--backend`` values); the first is its default.
        own_weights: True when the runtime loads the checkpoint itself (infertrace loads only the
            header, config and tokenizer); False for infertrace's engine.
        all_layers: True when ``--keep tensors --layers`` may name any layers (False: one layer, ``--layer``).
        install: the pip extra that provides it (``""`` when always present), named in the refusal.
        native: the name of the runtime's own section in each step record and in the trace options
            (``"vllm"``, ``"llama_cpp"``), or ``""`` when it has none.
        native_settings: the keys of :attr:`RunSettings.native` this runtime takes (another runtime's
            key is refused by :func:`check_native`, naming the runtime that takes it).
        forces_tokens: True when the runtime can emit given tokens instead of sampling (:attr:`RunSettings.forced`).
        speculative: the speculative-decoding methods it runs (``EngineOptions.speculative`` values).
        kv_dtype: True when the runtime takes a cache dtype (``EngineOptions.kv_dtype``); False: it keeps its own.
        tensor_parallel: True when it runs several tensor-parallel ranks (:attr:`RunSettings.tensor_parallel_size`).
        ctx_note: why the default context is lowered to the model's trained one for this runtime (a note's tail).
        comparison: the module whose ``check_comparison(settings, atol)``, ``compare(loaded, specs, settings,
            atol)`` and ``render_comparison(console, report)`` compare infertrace's engine with this runtime
            (``diff-runtimes NAME``), or ``""`` when it cannot be compared.
    """

    name: str
    summary: str
    target: str
    conventions: tuple[str, ...]
    own_weights: bool
    all_layers: bool = False
    install: str = ""
    native: str = ""
    native_settings: tuple[str, ...] = ()
    forces_tokens: bool = False
    speculative: tuple[str, ...] = ()
    kv_dtype: bool = False
    tensor_parallel: bool = False
    ctx_note: str = ""
    comparison: str = ""

    @property
    def convention(self) -> str:
        """The default convention (``--backend``) of this runtime."""
        return self.conventions[0]


@dataclass(frozen=True)
class RunSettings:
    """Everything a runtime is opened with, typed (the CLI maps its flags onto these fields).

    Attributes:
        opts: the engine options (cache / scheduler / speculative settings).
        layer: the layer whose RoPE evidence and K/V values are recorded.
        show: the variables recorded (``VARIABLES`` subset).
        tensor_layers: layers whose full tensors are kept (``--keep tensors``), None = none kept.
        dtype, device: the activation dtype and device asked for (``--dtype``, ``--device``).
        tensor_parallel_size: ranks (vLLM's distributed executor; 1 elsewhere).
        forced: teacher forcing: seq_id -> the tokens to emit instead of sampling, or None.
        native: runtime-specific settings by name (e.g. ``{"flash_attn": "auto"}`` for llama.cpp,
            ``{"replay": Path}`` for infertrace's engine); each runtime validates its own keys in
            :meth:`Runtime.check` and refuses unknown ones.
        record: fields recorded verbatim at the front of ``trace.options`` (``dtype``, ``device``,
            ``weights``) — what the user asked for, beside what ran.
        weights: the linear kernels asked for (``auto`` | ``float`` | ``quant``; infertrace's engine only).
        n_requests: requests the run will hold (set by the loop: sizes llama.cpp's ``n_seq_max`` and
            vLLM's ``max_num_seqs``).
        trace: record per-step records (False: outputs only, no steps).
    """

    opts: Any  # infertrace.engine.options.EngineOptions
    layer: int = 0
    show: tuple[str, ...] = ()
    tensor_layers: tuple[int, ...] | None = None
    dtype: str = "float32"
    device: str = "cpu"
    tensor_parallel_size: int = 1
    forced: Mapping[int, Sequence[int]] | None = None
    native: Mapping[str, Any] = field(default_factory=dict)
    record: Mapping[str, Any] = field(default_factory=dict)
    weights: str = "auto"
    n_requests: int = 1
    trace: bool = True


class SettingRefused(InfertraceError):
    """A runtime cannot honour one setting, said in the library's words.

    Attributes:
        setting: the :class:`RunSettings` field, ``EngineOptions`` field (``opts.backend``) or native key
            (``native.flash_attn``) refused; the CLI names its flag from it.
        runtime: the refusing runtime's name.
    """

    def __init__(self, runtime: str, setting: str, message: str):
        super().__init__(message)
        self.runtime, self.setting = runtime, setting


@dataclass(frozen=True)
class StepRecord:
    """One engine step as data: what the recorder keeps, nothing live.

    Attributes:
        step: the engine step number (0-based; idle steps count).
        trace: the step's records (:class:`~infertrace.trace.records.StepTrace`: plain data, JSON as
            ``trace.json`` holds it), or None when the run records no steps (``RunSettings.trace`` False).
        native: the runtime's own values of this step under :attr:`RuntimeInfo.native` (vLLM's
            scheduler output and attention metadata in its names; llama.cpp's graph inputs), or None.
    """

    step: int
    trace: "StepTrace | None"
    native: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class RuntimeHeader:
    """What ran, said by the runtime at the end of a run (the trace header's runtime part).

    Attributes:
        backend: the convention that ran (``cells`` / ``paged`` / ``dense``).
        attention: the attention implementation that ran (``sdpa``, ``triton``, ``llama.cpp``, ``vllm``, ...).
        settings: ``trace.options["settings"]``: the engine settings (``EngineOptions``) as this runtime honoured them.
        options: further ``trace.options`` fields, in order, after ``layer`` and ``show``
            (e.g. ``sampler_order``, the runtime's native section).
        notes: lines for ``trace.notes`` after the model's own notes.
        layer: the layer actually recorded (a Gated DeltaNet ``--layer`` is moved to an attention layer).
        spec: the speculative-decoding summary, or None.
    """

    backend: str
    attention: str
    settings: Mapping[str, Any]
    options: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    layer: int | None = None
    spec: Mapping[str, Any] | None = None


class Runtime(Protocol):
    """What every runtime implements (infertrace's engine, llama.cpp, vLLM, HF transformers).

    Lifecycle: ``check`` (class level, before the model loads) -> ``Runtime(loaded, settings,
    tensors)`` -> ``add_request`` for each request -> ``step()`` until it returns None ->
    ``requests()`` and ``header()`` -> ``close()`` (always, also after an error).
    """

    info: ClassVar[RuntimeInfo]

    @classmethod
    def check(cls, settings: RunSettings, model_config: Any | None = None) -> RunSettings:
        """Validate and normalise ``settings`` for this runtime (``model_config`` None: before loading).

        Raises:
            InfertraceError: a setting this runtime cannot honour, in the runtime's own words
                (one line; the CLI names the flag).
        """
        ...

    @classmethod
    def run_output(cls, console: Any) -> ContextManager[Any]:
        """Where the runtime's own output (its logger, warnings, progress bars) goes while it runs; ``console``
        (the caller's progress display) keeps the terminal. Most runtimes print nothing: ``nullcontext()``."""
        ...

    def add_request(self, request: Any) -> int:
        """Queue one request (:class:`~infertrace.engine.drive.EncodedRequest`: ids, sampling settings, arrival
        step, text); returns its seq_id."""
        ...

    def step(self) -> StepRecord | None:
        """Run one engine step and return its record, or None when every request has finished."""
        ...

    def requests(self) -> list[dict[str, Any]]:
        """The finished requests as ``trace.requests`` holds them (seq_id order)."""
        ...

    def header(self) -> RuntimeHeader:
        """What ran (after the last step)."""
        ...

    def close(self) -> None:
        """Free the runtime's resources (idempotent)."""
        ...


#: every runtime infertrace records, by name (``--runtime NAME``; ``RunTrace.runtime``)
REGISTRY: dict[str, RuntimeInfo] = {
    "infertrace": RuntimeInfo(
        "infertrace", "this engine (PyTorch on CPU, Triton on GPU): every variable computed and recorded here",
        "infertrace.runtimes.ours:OurRuntime", ("cells", "paged"), own_weights=False, all_layers=True,
        native_settings=("replay",), speculative=("ngram", "draft", "mtp"), kv_dtype=True, forces_tokens=True),
    "llama.cpp": RuntimeInfo(
        "llama.cpp", "llama.cpp itself via llama-cpp-python (GGUF only): its inp_pos, kq_mask, cells, K/V and logits",
        "infertrace.runtimes.llamacpp.runtime:LlamaCppRuntime", ("cells",), own_weights=True, all_layers=True,
        install="llamacpp", native="llama_cpp", native_settings=("flash_attn",), forces_tokens=True,
        comparison="infertrace.runtimes.llamacpp.runtime"),
    "vllm": RuntimeInfo(
        "vllm", "vLLM itself, in-process, step by step: its scheduler output, block tables, slot mapping, K/V and logits",
        "infertrace.runtimes.vllm.runtime:VllmRuntime", ("paged",), own_weights=True, all_layers=True, install="vllm",
        native="vllm",
        speculative=("ngram",), tensor_parallel=True,
        ctx_note=" (vLLM refuses a max_model_len above the one it derives from the model)",
        comparison="infertrace.runtimes.vllm.compare"),
    "hf": RuntimeInfo(
        "hf", "HF transformers, one padded [B, T] batch with its DynamicCache: its input_ids, attention_mask, position_ids, "
        "masks per layer type, cache lengths, K/V and logits",
        "infertrace.runtimes.hf.runtime:HfRuntime", ("dense",), own_weights=True, install="dev", native="hf",
        native_settings=("padding",), all_layers=True, forces_tokens=True),
}


def comparison(name: str) -> Any:
    """The comparison module of the runtime ``name`` (:attr:`RuntimeInfo.comparison`), imported, or None.

    Raises:
        InfertraceError: unknown name.
    """
    entry = info(name)
    return importlib.import_module(entry.comparison) if entry.comparison else None


def names() -> tuple[str, ...]:
    """The registered runtime names, in registry order."""
    return tuple(REGISTRY)


def info(name: str) -> RuntimeInfo:
    """The registry entry of ``name``.

    Raises:
        InfertraceError: unknown name (the message lists the registered ones).
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise InfertraceError(f"unknown runtime {name!r}; choose from {', '.join(REGISTRY)}") from None


def runtime_class(name: str) -> type:
    """Import and return the :class:`Runtime` implementation registered as ``name``.

    Raises:
        InfertraceError: unknown name, or the runtime's package is not installed (the message
            names the pip extra).
    """
    entry = info(name)
    module, _, cls = entry.target.partition(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        extra = f"; install it with pip install 'infertrace[{entry.install}]'" if entry.install else ""
        raise InfertraceError(f"runtime {name} needs the package {e.name!r}{extra}") from None
    return getattr(mod, cls)


def native_of(name: Any) -> str:
    """The native section (:attr:`RuntimeInfo.native`) of the runtime named ``name`` (a trace's ``runtime``,
    untrusted: anything not registered has none, ``""``)."""
    entry = REGISTRY.get(name) if isinstance(name, str) else None
    return entry.native if entry is not None else ""


def owner_of(native_key: str) -> str | None:
    """The runtime that takes the native setting ``native_key`` (``flash_attn`` -> ``llama.cpp``), or None."""
    return next((n for n, e in REGISTRY.items() if native_key in e.native_settings), None)


def takers(setting: str) -> tuple[str, ...]:
    """The runtimes that take ``setting`` when only some do (a :class:`SettingRefused` ``setting``:
    ``native.KEY``, ``forced``, ``tensor_parallel_size``), in registry order; () for any other setting."""
    if setting.startswith("native."):
        owner = owner_of(setting.split(".", 1)[1])
        return (owner,) if owner else ()
    flag = {"forced": "forces_tokens", "tensor_parallel_size": "tensor_parallel"}.get(setting)
    return tuple(n for n, e in REGISTRY.items() if flag and getattr(e, flag)) if flag else ()


def check_declared(info_: RuntimeInfo, settings: RunSettings) -> RunSettings:
    """The checks every runtime makes from its registry entry (before the model loads): the convention,
    native settings, forced tokens, speculative method, cache dtype and tensor layers it declares.

    Returns:
        ``settings`` unchanged.

    Raises:
        SettingRefused: a setting the entry does not declare (``setting`` names it).
    """
    name, opts = info_.name, settings.opts
    if opts.backend not in info_.conventions:
        raise SettingRefused(name, "opts.backend", f"{name} runs the {' or '.join(info_.conventions)} convention, "
                                                   f"not {opts.backend}")
    for key in settings.native:
        if key not in info_.native_settings:
            owner = owner_of(key)
            raise SettingRefused(name, f"native.{key}", f"{key} is a setting of {owner or 'no runtime'}, not of {name}")
    if settings.forced is not None and not info_.forces_tokens:
        raise SettingRefused(name, "forced", f"{name} samples its own tokens (no teacher forcing)")
    if settings.tensor_parallel_size != 1 and not info_.tensor_parallel:
        raise SettingRefused(name, "tensor_parallel_size", f"{name} runs one rank (no tensor parallelism)")
    if opts.speculative and opts.speculative not in info_.speculative:
        runs = f"runs speculative {', '.join(info_.speculative)} only" if info_.speculative else "runs no speculative decoding"
        raise SettingRefused(name, "opts.speculative", f"{name} {runs} here, not {opts.speculative}")
    if opts.kv_dtype is not None and not info_.kv_dtype:
        raise SettingRefused(name, "opts.kv_dtype", f"{name} keeps its own cache dtype")
    tl = settings.tensor_layers
    if tl is not None and not info_.all_layers and list(tl) != [settings.layer]:
        raise SettingRefused(name, "tensor_layers", f"{name} captures one layer's tensors: layer {tl[0]}, not several")
    return settings


def check_run(model_config: Any, prompts: Sequence[Any], settings: RunSettings, variables: Sequence[str]) -> None:
    """The checks of every run, whatever runtime: the recorded layer and tensor layers within the model,
    known variables, at least one prompt.

    Raises:
        ConfigError: ``run.layer`` / ``run.tensor_layers`` out of range, ``run.show`` an unknown variable,
            ``run.prompts`` empty (the CLI names the flag).
    """
    n = model_config.n_layer
    if not 0 <= settings.layer < n:
        raise ConfigError("run.layer", f"{settings.layer} out of range: the model has layers 0..{n - 1}")
    for li in settings.tensor_layers or ():
        if not 0 <= li < n:
            raise ConfigError("run.tensor_layers", f"{li} out of range: the model has layers 0..{n - 1}")
    bad = [v for v in settings.show if v not in variables]
    if bad:
        raise ConfigError("run.show", f"unknown variable {bad[0]!r}; choose from {', '.join(variables)}")
    if not prompts:
        raise ConfigError("run.prompts", "no prompt given; give at least one prompt")


def request_record(r: Any, tokenizer: Any, **native: Any) -> dict[str, Any]:
    """One finished request as ``trace.requests`` holds it (every runtime the same way; ``native``: the
    runtime's own fields after the common ones, e.g. vLLM's ``vllm_num_cached_tokens``).

    Args:
        r: a request (``seq_id``, ``prompt_text``, ``prompt_ids``, ``output_ids``, ``stop_reason``,
            ``arrival_step``, ``num_preemptions``, ``params``: :class:`~infertrace.engine.request.Request`).
        tokenizer: decodes ``output_ids`` to the recorded ``text``.
    """
    return {"seq_id": r.seq_id, "prompt": r.prompt_text, "prompt_ids": r.prompt_ids, "output_ids": r.output_ids,
            "text": tokenizer.decode(r.output_ids), "stop_reason": r.stop_reason, "arrival_step": r.arrival_step,
            "num_preemptions": r.num_preemptions, "params": r.params.to_dict(), **native}
