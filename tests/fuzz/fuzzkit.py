"""Shared helpers of the fuzz targets in tests/fuzz/ (import them as ``from tests.fuzz.fuzzkit import ...``;
``conftest`` is not importable by name, tests/conftest.py shadows it).

:func:`fuzz_settings` (hypothesis settings from the environment), :func:`record` (count an
outcome under a target name), :func:`check_cli_result` (the invariant: exit 0 — or one of ``ok``
— or exit 2 with exactly one ``error:`` line, no internal error, no traceback, within
:data:`TIME_BOUND_S`), :func:`time_bound` (interrupt one input past :data:`TIME_BOUND_S`) and
:func:`rss_guard` (peak RSS growth over a module, bounded by :data:`RSS_GROWTH_MB`; tests/fuzz/conftest.py
applies it to every fuzz module). Environment: see tests/fuzz/README.md.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import signal
from collections import defaultdict
from typing import Any, Iterator

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("INFERTRACE_FUZZ_EXAMPLES", "25"))
RANDOM = os.environ.get("INFERTRACE_FUZZ_RANDOM") == "1"
#: seconds one input may take in one consumer before it counts as a hang
TIME_BOUND_S = float(os.environ.get("INFERTRACE_FUZZ_TIME_BOUND", "20"))
#: MB the process' peak RSS may grow over one fuzz module (a leak or an unbounded allocation)
RSS_GROWTH_MB = 1024

#: target -> outcome -> count
OUTCOMES: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))


def fuzz_settings(**kw: Any) -> settings:
    """hypothesis settings: EXAMPLES inputs, no per-example deadline (the time bound is checked
    explicitly), derandomized unless INFERTRACE_FUZZ_RANDOM=1, no example database."""
    base = dict(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])
    base.update(kw)
    return settings(**base)


def record(target: str, outcome: str) -> None:
    OUTCOMES[target][outcome] += 1


def check_cli_result(target: str, res: Any, elapsed: float, ok: tuple[int, ...] = (0,)) -> None:
    """Assert the fuzz invariant on a ``CliRunner`` result and count its outcome."""
    assert elapsed < TIME_BOUND_S, f"{target}: took {elapsed:.1f}s (bound {TIME_BOUND_S}s)"
    code = res.exit_code
    err = res.stderr if hasattr(res, "stderr") else ""
    assert code in (*ok, 2), (target, code, err[-1000:], res.exception)
    assert "Traceback" not in err and "internal error" not in err, err[-1000:]
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err[-1000:]
    record(target, f"exit {code}")


@contextlib.contextmanager
def time_bound(seconds: float = TIME_BOUND_S) -> Iterator[None]:
    """Raise ``TimeoutError`` in the main thread when the block runs longer than ``seconds``
    (SIGALRM): a hang fails the example instead of stalling the run."""
    def boom(*_: Any) -> None:
        raise TimeoutError(f"example ran longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(max(1, math.ceil(seconds)))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def peak_rss_mb() -> float:
    """The process' peak resident set size in MB (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@contextlib.contextmanager
def rss_guard(limit_mb: float = RSS_GROWTH_MB) -> Iterator[None]:
    """Assert that the peak RSS grew by less than ``limit_mb`` over the block."""
    rss0 = peak_rss_mb()
    yield
    grown = peak_rss_mb() - rss0
    assert grown < limit_mb, f"peak RSS grew by {grown:.0f} MB (bound {limit_mb} MB)"
