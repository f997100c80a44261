"""How many threads torch's CPU pool gets: the cores this process can actually have.

torch sizes its OpenMP pool from the machine's cores. On a shared machine that oversubscribes:
each GEMV waits at a barrier for its slowest thread, and a thread whose core is taken by another
process stalls the step for a whole scheduler slice (decode fell from ~26 to ~1.2 tokens/s beside
one busy process on 2 cores). The default here is therefore

    min(CPU affinity, cgroup CPU quota) - cores busy with other processes right now (>= 1)

where "busy" is sampled from ``/proc/stat`` over ``sample_s`` (50 ms) minus this process's own
CPU time. ``--threads N``, else ``INFERTRACE_THREADS`` or ``OMP_NUM_THREADS``, override it. Linux sources: ``os.sched_getaffinity``, cgroup v2
``cpu.max`` / v1 ``cpu.cfs_quota_us`` + ``cpu.cfs_period_us``. Torch-free until :func:`apply_threads`.

Every explicit count is bounded by :func:`max_threads` (:data:`MAX_THREADS_PER_CPU` per available
core, at least :data:`MIN_THREAD_LIMIT`) and checked by :func:`check_thread_settings` before torch,
libgomp, llama.cpp or vLLM start: ``OMP_NUM_THREADS=1000000000`` made libgomp abort allocating
216 GB, ``--threads 1000`` started 1000 threads on 2 cores, 2^63 overflowed (issue 23, X5).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from infertrace.errors import InfertraceError

#: explicit thread counts may be at most this many per available core ...
MAX_THREADS_PER_CPU = 4
#: ... but never less than this limit (a 1-core container may still ask for a few)
MIN_THREAD_LIMIT = 8
#: the variables that set a thread count (INFERTRACE_THREADS for torch here; OMP_NUM_THREADS is read
#: by libgomp when torch loads, and inherited by llama.cpp and vLLM)
THREAD_ENV = ("INFERTRACE_THREADS", "OMP_NUM_THREADS")


class ThreadCountError(InfertraceError, ValueError):
    """A thread count outside ``1..max_threads()`` or not a whole number (one line, exit 2)."""


@dataclass(frozen=True)
class ThreadChoice:
    """``n`` threads and why (one phrase, shown in the run header)."""

    n: int
    reason: str


def affinity_cpus() -> int:
    """CPUs this process may run on (``sched_getaffinity``; ``os.cpu_count()`` elsewhere)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def cgroup_cpus(root: str | Path = "/sys/fs/cgroup") -> float | None:
    """CPU quota of this process's cgroup in cores (quota / period), or None when unlimited/unknown.

    cgroup v2 ``cpu.max`` holds ``"max 100000"`` or ``"<quota> <period>"``; v1 has
    ``cpu/cpu.cfs_quota_us`` (-1 = unlimited) and ``cpu/cpu.cfs_period_us``.
    """
    root = Path(root)
    try:
        parts = (root / "cpu.max").read_text().split()
        if len(parts) == 2 and parts[0] != "max":
            q, p = float(parts[0]), float(parts[1])
            return q / p if q > 0 and p > 0 else None
        if parts:
            return None
    except (OSError, ValueError):
        pass
    for base in (root / "cpu", root / "cpu,cpuacct"):
        try:
            q = float((base / "cpu.cfs_quota_us").read_text())
            p = float((base / "cpu.cfs_period_us").read_text())
            return q / p if q > 0 and p > 0 else None
        except (OSError, ValueError):
            continue
    return None


def available_cpus(root: str | Path = "/sys/fs/cgroup") -> int:
    """``min(affinity, ceil(cgroup quota))``, at least 1."""
    n = affinity_cpus()
    q = cgroup_cpus(root)
    if q is not None:
        n = min(n, max(1, math.ceil(q - 1e-9)))
    return n


def _proc_stat() -> tuple[float, float] | None:
    """(busy, total) jiffies over all CPUs from the first line of ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            v = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(v) < 4:
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0.0)  # idle + iowait
    total = sum(v[:8])  # guest time is already counted in user
    return total - idle, total


def busy_elsewhere(sample_s: float = 0.05) -> float:
    """Cores kept busy by other processes during a ``sample_s`` window (0.0 when unknown)."""
    a = _proc_stat()
    c0 = time.process_time()
    time.sleep(sample_s)
    b = _proc_stat()
    own = time.process_time() - c0
    if a is None or b is None or b[1] <= a[1]:
        return 0.0
    n_all = os.cpu_count() or 1
    busy = (b[0] - a[0]) / (b[1] - a[1]) * n_all - own / max(sample_s, 1e-6)
    return max(0.0, busy)


def max_threads() -> int:
    """The largest thread count accepted: ``max(MAX_THREADS_PER_CPU * available_cpus(), MIN_THREAD_LIMIT)``."""
    return max(MAX_THREADS_PER_CPU * available_cpus(), MIN_THREAD_LIMIT)


def check_count(n: int, source: str) -> int:
    """``n`` when ``1 <= n <= max_threads()``.

    Raises:
        ThreadCountError: naming ``source`` (``--threads``, an environment variable) and the limit.
    """
    if n < 1:
        raise ThreadCountError(f"{source} must be >= 1 (got {n})")
    limit = max_threads()
    if n > limit:
        shown = str(n) if n < 10**12 else f"{str(n)[:6]}..."
        raise ThreadCountError(f"{source} {shown} is more than {limit} threads ({MAX_THREADS_PER_CPU} per available core, "
                               f"{available_cpus()} here); use at most {limit}")
    return n


def env_threads(var: str) -> int | None:
    """The thread count the environment variable ``var`` sets (None when unset or empty).

    Raises:
        ThreadCountError: not a whole decimal number (``1e9``, ``-3``, ``4,2``), or out of
            ``1..max_threads()``.
    """
    raw = os.environ.get(var, "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()):
        raise ThreadCountError(f"{var}={raw[:40]!r} is not a thread count; set a whole number in 1..{max_threads()} "
                               "or unset it")
    digits = raw.lstrip("0") or "0"  # libgomp reads 0002 as 2: leading zeros never make a count large
    return check_count(int(digits[:40]), f"{var}=")  # 40 digits are over any limit: no need to parse more


def check_thread_settings(requested: int | None = None) -> None:
    """Check ``--threads`` (``requested``) and every variable of :data:`THREAD_ENV` before anything
    starts a thread pool (commands call it first, before torch is imported).

    Raises:
        ThreadCountError: the first bad setting, one line.
    """
    if requested is not None:
        check_count(requested, "--threads")
    for var in THREAD_ENV:
        env_threads(var)
    if "OMP_NUM_THREADS" in os.environ and not os.environ["OMP_NUM_THREADS"].strip():
        del os.environ["OMP_NUM_THREADS"]  # blank = unset here; libgomp would print "Invalid value" when torch loads


def choose_threads(requested: int | None = None, sample_s: float = 0.05) -> ThreadChoice:
    """The thread count for torch: ``requested`` when given, else ``INFERTRACE_THREADS`` or
    ``OMP_NUM_THREADS`` when set, else the available cores minus those busy elsewhere (rounded
    to the nearest core), at least 1.

    Raises:
        ThreadCountError: (a ValueError) ``requested`` or a variable outside ``1..max_threads()``
            or not a whole number.
    """
    check_thread_settings(requested)
    if requested is not None:
        return ThreadChoice(requested, "--threads")
    for var in THREAD_ENV:  # an explicit setting wins over the policy
        n = env_threads(var)
        if n is not None:
            return ThreadChoice(n, var)
    avail = available_cpus()
    busy = busy_elsewhere(sample_s) if avail > 1 else 0.0
    n = max(1, min(avail, int(math.floor(avail - busy + 0.5))))
    why = f"{avail} core{'s' if avail != 1 else ''} available"
    if n < avail:
        why += f", {busy:.1f} busy with other processes"
    return ThreadChoice(n, why)


_APPLIED: ThreadChoice | None = None


def apply_threads(choice: ThreadChoice) -> None:
    """``torch.set_num_threads(choice.n)`` (imports torch) and remember the choice."""
    global _APPLIED
    import torch

    torch.set_num_threads(choice.n)
    _APPLIED = choice


def current() -> ThreadChoice:
    """The choice applied in this process, or torch's own setting ("torch default")."""
    import torch

    n = torch.get_num_threads()
    if _APPLIED is not None and _APPLIED.n == n:
        return _APPLIED
    return ThreadChoice(n, "torch default" if _APPLIED is None else "set by the caller")
