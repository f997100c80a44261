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
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Protocol, Sequence

from infertrace.errors import InfertraceError

if TYPE_CHECKING:
    from infertrace.engine.drive import EncodedRequest
    from infertrace.engine.options import EngineOptions
    from infertrace.trace.records import StepTrace


@dataclass(frozen=True)
class RuntimeInfo:
    """A registry entry: what a runtime is, before its module is imported.

    Attributes:
        name: the runtime's name as flags and traces spell it (``--engine NAME``, ``RunTrace.engine``).
        summary: one line for ``--help`` (who computes, what is recorded).
        target: ``"module:Class"`` of the :class:`Runtime` implementation (imported lazily).
        conventions: the KV conventions it runs (``--backend`` values); the first is its default.
        own_weights: True when the runtime loads the checkpoint itself (infertrace loads only the
            header, config and tokenizer); False for infertrace's engine.
        all_layers: True when ``--keep tensors --layers`` may name any layers (False: one layer, ``--layer``).
        install: the pip extra that provides it (``""`` when always present), named in the refusal.
        native: the name of the runtime's own section in each step record and in the trace options
            (``"vllm"``, ``"llama_cpp"``), or ``""`` when it has none.
    """

    name: str
    summary: str
    target: str
    conventions: tuple[str, ...]
    own_weights: bool
    all_layers: bool = False
    install: str = ""
    native: str = ""

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
    """

    opts: "EngineOptions"
    layer: int = 0
    show: tuple[str, ...] = ()
    tensor_layers: tuple[int, ...] | None = None
    dtype: str = "float32"
    device: str = "cpu"
    tensor_parallel_size: int = 1
    forced: Mapping[int, Sequence[int]] | None = None
    native: Mapping[str, Any] = field(default_factory=dict)
    record: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepRecord:
    """One engine step as data: what the recorder keeps, nothing live.

    Attributes:
        step: the engine step number (0-based; idle steps count).
        trace: the step's records (:class:`~infertrace.trace.records.StepTrace`: plain data, JSON as
            ``trace.json`` holds it).
        native: the runtime's own values of this step under :attr:`RuntimeInfo.native` (vLLM's
            scheduler output and attention metadata in its names; llama.cpp's graph inputs), or None.
    """

    step: int
    trace: "StepTrace"
    native: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class RuntimeHeader:
    """What ran, said by the runtime at the end of a run (the trace header's runtime part).

    Attributes:
        backend: the convention that ran (``cells`` / ``paged`` / ``dense``).
        attention: the attention implementation that ran (``sdpa``, ``triton``, ``llama.cpp``, ``vllm``, ...).
        engine_options: ``trace.options["engine"]``: the engine options as this runtime honoured them.
        options: further ``trace.options`` fields, in order, after ``layer`` and ``show``
            (e.g. ``sampler_order``, the runtime's native section).
        notes: lines for ``trace.notes`` after the model's own notes.
        layer: the layer actually recorded (a Gated DeltaNet ``--layer`` is moved to an attention layer).
        spec: the speculative-decoding summary, or None.
    """

    backend: str
    attention: str
    engine_options: Mapping[str, Any]
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

    def add_request(self, request: "EncodedRequest") -> int:
        """Queue one request (arrival step, sampling settings included); returns its seq_id."""
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


#: every runtime infertrace records, by name (``--engine NAME``; ``RunTrace.engine``)
REGISTRY: dict[str, RuntimeInfo] = {
    "infertrace": RuntimeInfo(
        "infertrace", "this engine (PyTorch on CPU, Triton on GPU): every variable computed and recorded here",
        "infertrace.runtimes.ours:OurRuntime", ("cells", "paged"), own_weights=False, all_layers=True),
    "llama.cpp": RuntimeInfo(
        "llama.cpp", "llama.cpp itself via llama-cpp-python (GGUF only): its inp_pos, kq_mask, cells, K/V and logits",
        "infertrace.runtimes.llamacpp.runtime:LlamaCppRuntime", ("cells",), own_weights=True,
        install="llamacpp", native="llama_cpp"),
    "vllm": RuntimeInfo(
        "vllm", "vLLM itself, in-process, step by step: its scheduler output, block tables, slot mapping, K/V and logits",
        "infertrace.runtimes.vllm.runtime:VllmRuntime", ("paged",), own_weights=True, install="vllm", native="vllm"),
    "hf": RuntimeInfo(
        "hf", "HF transformers, one padded [B, T] batch with its DynamicCache: its input_ids, attention_mask, position_ids, "
        "masks per layer type, cache lengths, K/V and logits",
        "infertrace.runtimes.hf.runtime:HfRuntime", ("dense",), own_weights=True, install="dev", native="hf"),
}


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
