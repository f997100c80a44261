"""The snapshot plugin's copy-paste example (docs/snapshot-testing.md, issue 31 item 10), run as written: its three files
are copied verbatim from the page into an empty project, then the documented workflow runs there in a pytest
subprocess: without goldens the tests fail naming --infertrace-update; with it they write the goldens under the
ini's infertrace_golden_dir; then they pass; a golden changed by hand (a token) fails naming the step and field.
Reference value: SmolLM2-135M greedy continues "The capital of" with " the United States" (HF transformers on the
same GGUF; fixtures/golden/worked-example-cells holds the same tokens 260, 1797, 1918)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "snapshot-testing.md"


def blocks() -> dict[str, str]:
    """``{file name: text}`` of the page's fenced blocks that carry ``title="..."``."""
    return {m.group(1): m.group(2) for m in re.finditer(r'```\w+ title="([^"]+)"\n(.*?)```', PAGE.read_text(), re.S)}


def pytest_in(project: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + sys.path)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=project,
                          capture_output=True, text=True, timeout=900, env=env)


def test_the_documented_example_runs_as_written(tmp_path):
    files = blocks()
    assert set(files) == {"pytest.ini", "conftest.py", "test_traces.py"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    golden = tmp_path / "tests" / "golden"
    first = pytest_in(tmp_path)
    assert first.returncode == 1 and "no golden trace" in first.stdout and "pytest --infertrace-update" in first.stdout
    upd = pytest_in(tmp_path, "--infertrace-update", "test_traces.py")
    assert upd.returncode == 0, upd.stdout[-3000:]
    assert "infertrace: wrote 2 golden trace(s):" in upd.stdout
    g = golden / "worked-example" / "trace.json"
    assert g.is_file() and (golden / "two-requests-paged" / "trace.json").is_file()
    d = json.loads(g.read_text())
    assert d["requests"][0]["output_ids"] == [260, 1797, 1918]  # = fixtures/golden/worked-example-cells
    ok = pytest_in(tmp_path)
    assert ok.returncode == 0 and "2 passed" in ok.stdout, ok.stdout[-3000:]
    d["steps"][1]["batch"][0]["token_ids"] = [261]  # a changed golden: step 1 fed another token
    g.write_text(json.dumps(d))
    bad = pytest_in(tmp_path, "test_traces.py::test_worked_example")
    assert bad.returncode == 1
    assert "trace differs from golden 'worked-example'" in bad.stdout
    assert "first difference: step 1 · seq 0 · variable hidden · field batch[0].token_ids[0]" in bad.stdout
    assert "A      261" in bad.stdout and "B      260" in bad.stdout  # golden vs this run
    assert "pytest --infertrace-update" in bad.stdout
