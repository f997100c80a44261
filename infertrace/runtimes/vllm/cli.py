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
            engine, ``--teacher-force``, a tensor-parallel size below 1 or above the cores available.
    """
    check_tp_cores(tp)  # a plain bound: before vLLM is imported
    from infertrace.runtimes.vllm import import_vllm

    import_vllm()  # fail before loading anything
    if device != "cpu":
        raise InfertraceError("--engine vllm: the device is vLLM's (its CPU build here); drop --device")
    if context_shift or audit_kv:
        raise InfertraceError("--engine vllm records vLLM's own cache as it is; drop --context-shift and --audit-kv "
                              "(they are this engine's serving mechanisms)")
    if teacher_force is not None:
        raise InfertraceError("--teacher-force needs --engine llama.cpp; vLLM samples its own tokens")
    return "paged"


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def check_tp_cores(tp: int) -> None:
    """``--tensor-parallel-size`` between 1 and the cores available: vLLM's CPU executor starts one worker
    process per rank and binds each to its own cores (``VLLM_CPU_OMP_THREADS_BIND``), so more ranks than cores
    is a run that cannot be placed (and a process count the user did not mean).

    Raises:
        InfertraceError: below 1, or above :func:`available_cores`, naming both.
    """
    if tp < 1:
        raise InfertraceError(f"--tensor-parallel-size must be >= 1 (got {tp})")
    cores = available_cores()
    if tp > cores:
        raise InfertraceError(f"--tensor-parallel-size {tp} is more than the {cores} CPU core(s) available to this process "
                              f"(vLLM's CPU build runs one worker per rank, each on its own cores); use at most {cores}")
