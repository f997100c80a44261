"""pytest hooks of tests/fuzz/: bounds the peak RSS growth of every fuzz module
(:func:`fuzzkit.rss_guard`) and prints the outcome counts per fuzz target at the end of the run
(and writes them as JSON to ``INFERTRACE_FUZZ_REPORT`` when set). The shared settings and
helpers live in ``fuzzkit.py`` (``INFERTRACE_FUZZ_EXAMPLES``, default 25 inputs per target;
``INFERTRACE_FUZZ_RANDOM=1`` for fresh inputs; see README.md)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from tests.fuzz.fuzzkit import EXAMPLES, OUTCOMES, RANDOM, rss_guard


@pytest.fixture(scope="module", autouse=True)
def _bounded_rss():
    with rss_guard():
        yield


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not OUTCOMES:
        return
    terminalreporter.write_line(f"infertrace fuzz ({EXAMPLES} examples per target, "
                                f"{'random' if RANDOM else 'derandomized'}):")
    for target, outs in sorted(OUTCOMES.items()):
        total = sum(outs.values())
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(outs.items()))
        terminalreporter.write_line(f"  {target}: {total} inputs ({detail})")
    path = os.environ.get("INFERTRACE_FUZZ_REPORT")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({t: dict(o) for t, o in OUTCOMES.items()}, f, indent=1, sort_keys=True)


