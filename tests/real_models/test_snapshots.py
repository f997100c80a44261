"""Golden traces (``fixtures/golden/<name>/trace.json``) through the ``infertrace_snapshot`` fixture
of the project's pytest plugin (``infertrace.testing.plugin``, entry point ``pytest11``).

Scenarios: the study's worked example ("The capital of", prefill then 2 decode steps) and a
continuous-batching run (3 prompts arriving at steps 0, 1, 3, prefill chunk 2), each on both
backends. Floats compare within atol/rtol 1e-4, so float noise across CPUs passes.
Regenerate after an intended change: ``pytest --infertrace-update tests/real_models/test_snapshots.py``
(or ``fixtures/golden/regenerate.sh``), then review the diff and commit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infertrace.testing.plugin import Snapshot, golden_text
from infertrace.trace.store import manifest_dict

pytestmark = pytest.mark.model

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "golden"

WORKED = ["The capital of"]
BATCHING = [{"prompt": "The capital of", "arrival": 0}, {"prompt": "Hello, my name is", "arrival": 1},
            {"prompt": "1, 2, 3,", "arrival": 3}]
SCENARIOS = {
    "worked-example-cells": (WORKED, {"max_new_tokens": 3, "settings": {"backend": "cells"}}),
    "worked-example-paged": (WORKED, {"max_new_tokens": 3, "settings": {"backend": "paged", "tokens_per_block": 4}}),
    "batching-cells": (BATCHING, {"max_new_tokens": 2, "settings": {"backend": "cells", "prefill_chunk": 2}}),
    "batching-paged": (BATCHING, {"max_new_tokens": 2, "settings": {"backend": "paged", "prefill_chunk": 2, "tokens_per_block": 4}}),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_golden(infertrace_snapshot, smol, name):
    prompts, kw = SCENARIOS[name]
    trace = infertrace_snapshot.check(name, prompts, loaded=smol, **kw)
    if name.startswith("worked"):
        st = trace.steps
        assert [r.positions for s in st for r in s.batch] == [[0, 1, 2], [3], [4]]
        assert st[0].batch[0].visible == ["0", "0..1", "0..2"]


def test_goldens_are_small_and_machine_independent(smol):
    snap = Snapshot(GOLDEN, update=False)
    for name in SCENARIOS:
        p = snap.path(name)
        if not p.is_file():
            pytest.fail(f"{p} is missing; regenerate with fixtures/golden/regenerate.sh")
        text = p.read_text(encoding="utf-8")
        assert len(text.encode()) < 60_000, (name, len(text))
        d = json.loads(text)
        assert d["store"]["keep"] == "summary" and not d["store"]["tensors"]
        assert all("time_ms" not in s for s in d["steps"])
        assert "/" not in d["model"]["file"] and "/home" not in text and "/tmp" not in text and "/work" not in text


def test_snapshot_failure_names_step_and_variable(smol, tmp_path):
    snap = Snapshot(tmp_path, update=True)
    trace = snap.run(WORKED, loaded=smol, max_new_tokens=2)
    snap.compare("w", trace)  # update mode: writes the golden
    golden = snap.path("w")
    assert golden.is_file()
    snap.update = False
    snap.compare("w", trace)  # equal: passes
    d = json.loads(golden.read_text())
    d["steps"][1]["positions"]["inp_pos"][0] = 9
    golden.write_text(golden_text(d))
    with pytest.raises(pytest.fail.Exception) as e:
        snap.compare("w", trace)
    msg = str(e.value)
    assert "first difference: step 1 · seq 0 · variable positions · field inp_pos[0]" in msg
    assert "--infertrace-update" in msg
    # float noise within the tolerance passes; beyond it fails
    d = json.loads(golden_text(manifest_dict(trace)))
    d["steps"][0]["hidden"]["rows"][0]["mean"] += 5e-5
    golden.write_text(golden_text(d))
    snap.compare("w", trace)
    d["steps"][0]["hidden"]["rows"][0]["mean"] += 1e-2
    golden.write_text(golden_text(d))
    with pytest.raises(pytest.fail.Exception, match="step 0 · seq 0 · variable hidden · field rows"):
        snap.compare("w", trace)


def test_missing_golden_fails_with_hint(smol, tmp_path):
    snap = Snapshot(tmp_path, update=False)
    trace = snap.run(WORKED, loaded=smol, max_new_tokens=1)
    with pytest.raises(pytest.fail.Exception, match="--infertrace-update"):
        snap.compare("nope", trace)
