"""`make setup-dev` shows the llama.cpp build's progress (issue 31 item 8): pip runs verbose into a log (no `pip -q`
hiding a 40-minute build) and a line per interval names the build step reached; a failure prints the log's tail;
the Makefile gives one measured duration. Run here with a stand-in pip that prints ninja's own progress format
(``[k/n] Building CXX object ...``) so the recipe itself is exercised, not a copy of it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

PIP = """#!/bin/sh
case "$*" in *llamacpp*) ;; *) exit 0 ;; esac
echo "  Running command Building editable for infertrace"
echo "  [1/3] Building CXX object vendor/llama.cpp/ggml/src/CMakeFiles/ggml-base.dir/ggml.c.o"
sleep 2
echo "  [2/3] Building CXX object vendor/llama.cpp/src/CMakeFiles/llama.dir/llama.cpp.o"
sleep 2
echo "  [3/3] Linking CXX shared library vendor/llama.cpp/bin/libllama.so"
exit ${FAKE_RC:-0}
"""


@pytest.fixture
def fake_venv(tmp_path):
    if shutil.which("make") is None:
        pytest.fail("make not on PATH: the Makefile recipe under test needs GNU make", pytrace=False)
    b = tmp_path / "venv" / "bin"
    b.mkdir(parents=True)
    (b / "pip").write_text(PIP)
    (b / "python").write_text("#!/bin/sh\nexit 0\n")
    for f in ("pip", "python"):
        (b / f).chmod(0o755)
    return tmp_path / "venv"


def make(venv: Path, tmp: Path, **env):
    return subprocess.run(["make", "-s", "-C", str(ROOT), "setup-dev", "-o", "setup", f"VENV={venv}",
                           f"SETUP_LOG={tmp / 'setup.log'}", "PROGRESS_EVERY=1"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def test_setup_dev_prints_build_progress(fake_venv, tmp_path):
    r = make(fake_venv, tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("installing the dev, llamacpp and") and f"full log: {tmp_path / 'setup.log'}" in lines[0]
    steps = [x for x in lines if re.match(r"\s+\d+ min: ", x)]
    assert len(steps) >= 3  # one per interval while the build runs (5 s of stand-in build, 1 s interval)
    assert any("[2/3] Building CXX object" in x for x in steps)
    assert steps[-1].endswith("[3/3] Linking CXX shared library vendor/llama.cpp/bin/libllama.so")  # ninja's last step
    assert lines[-1].startswith("  done in")
    assert "[3/3]" in (tmp_path / "setup.log").read_text()  # the whole build output is kept in the log


def test_setup_dev_failure_prints_the_log_tail(fake_venv, tmp_path):
    r = make(fake_venv, tmp_path, FAKE_RC="3")
    assert r.returncode != 0
    assert "[3/3] Linking CXX shared library vendor/llama.cpp/bin/libllama.so" in r.stdout  # the tail of the log


def test_makefile_names_one_measured_duration_and_hides_no_build():
    text = (ROOT / "Makefile").read_text()
    flat = " ".join(x.lstrip("# ").strip() for x in text.splitlines())
    assert "Measured: the whole `make setup-dev` took 15 min 22 s on 2026-12-02" in flat
    install = [x for x in text.splitlines() if "llamacpp" in x and "pip install" in x]
    assert install and all(" -q" not in x and " -v " in x for x in install)
