"""Bounds of ``run --runtime vllm``'s options checked before vLLM is imported (torch-free); its other refusals
are :meth:`infertrace.runtimes.vllm.runtime.VllmRuntime.check`."""

from __future__ import annotations


from infertrace.errors import InfertraceError


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
