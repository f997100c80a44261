"""Checks of ``run --engine vllm``'s options before anything loads (torch-free)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from infertrace.errors import InfertraceError


def check_vllm_options(backend: str, device: str, dtype: str, context_shift: bool, audit_kv: bool,
                       teacher_force: Optional[Path], tp: int) -> str:
    """Refuse what ``--engine vllm`` does not run; returns the backend recorded: ``paged`` (vLLM's cache
    is paged; ``--backend`` names our engine's convention and does not apply to vLLM).

    Raises:
        InfertraceError: vLLM missing, ``--device`` other than cpu, a serving mechanism of this
            engine, ``--teacher-force``, a tensor-parallel size below 1.
    """
    from infertrace.runtimes.vllm import import_vllm

    import_vllm()  # fail before loading anything
    if device != "cpu":
        raise InfertraceError("--engine vllm: the device is vLLM's (its CPU build here); drop --device")
    if context_shift or audit_kv:
        raise InfertraceError("--engine vllm records vLLM's own cache as it is; drop --context-shift and --audit-kv "
                              "(they are this engine's serving mechanisms)")
    if teacher_force is not None:
        raise InfertraceError("--teacher-force needs --engine llama.cpp; vLLM samples its own tokens")
    if tp < 1:
        raise InfertraceError(f"--tensor-parallel-size must be >= 1 (got {tp})")
    return "paged"
