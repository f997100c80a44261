"""vLLM's own output goes to a log file named in one line (issue 31 item 9): its logger (bound to sys.stdout at
import), prints, warnings, tqdm bars on sys.stderr and C-level writes to descriptors 1 and 2 all land in the
file; our progress console and everything after the block reach the terminal again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r'''
import logging, os, sys, warnings
from rich.console import Console
from infertrace.runtimes.vllm.logfile import vllm_log
lg = logging.getLogger("vllm"); lg.addHandler(logging.StreamHandler(sys.stdout)); lg.setLevel(logging.INFO)
con = Console(stderr=True, force_terminal=False)
with vllm_log(con) as p:
    lg.warning("vllm-logger-line")
    print("print-line"); sys.stderr.write("tqdm-bar-line\n")
    os.write(1, b"fd1-line\n"); os.write(2, b"fd2-line\n")
    warnings.warn("warn-line")
    con.print("our-progress-line")
print("after-out"); lg.warning("after-logger")
'''


def test_vllm_output_goes_to_the_named_log(tmp_path):
    log = tmp_path / "vllm.log"
    env = {**os.environ, "INFERTRACE_VLLM_LOG": str(log), "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    text = log.read_text()
    for line in ("vllm-logger-line", "print-line", "tqdm-bar-line", "fd1-line", "fd2-line", "UserWarning: warn-line"):
        assert line in text, line
    assert p.stdout.splitlines() == ["after-out", "after-logger"]  # the logger is restored after the block
    err = p.stderr.splitlines()
    assert err == ["our-progress-line", f"vLLM's own log (its warnings and progress bars): {log}"]  # named once it ran
    assert (log.stat().st_mode & 0o777) == 0o600


def test_a_symlinked_log_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / "vllm.log").symlink_to(target)
    env = {**os.environ, "INFERTRACE_VLLM_LOG": str(tmp_path / "vllm.log"), "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode != 0 and target.read_text() == ""


REFUSAL = r'''
import os, sys
from infertrace.errors import InfertraceError
from infertrace.runtimes.vllm.logfile import vllm_log
quiet = sys.argv[1] == "quiet"
try:
    with vllm_log():
        if not quiet:
            os.write(2, b"vllm-wrote-this\n")
        raise InfertraceError("refused-here")
except InfertraceError as e:
    print("error: " + e.message, file=sys.stderr)
'''


def test_a_refusal_stays_one_line_naming_the_log_only_when_vllm_wrote(tmp_path):
    """A refusal inside the block is the only stderr line: the log is named inside it when vLLM wrote to the
    log, not at all when it did not (a conversion-cache refusal before vLLM starts)."""
    log = tmp_path / "vllm.log"
    env = {**os.environ, "INFERTRACE_VLLM_LOG": str(log), "PYTHONPATH": os.pathsep.join(sys.path)}
    for mode, want in (("wrote", f"error: refused-here (vLLM's own log: {log})"), ("quiet", "error: refused-here")):
        p = subprocess.run([sys.executable, "-c", REFUSAL, mode], capture_output=True, text=True, env=env, timeout=120)
        assert p.stderr.splitlines() == [want], (mode, p.stderr)
        log.unlink()
