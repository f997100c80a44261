"""Thread policy (:mod:`infertrace.threads`): cgroup quotas read from hand-written v1/v2 files,
affinity, the explicit settings that win, the busy-core sample against a real spinning process,
and ``--threads`` on the CLI (one-line error for 0; the header states the count, ``show`` too).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from infertrace import threads as th
from infertrace.cli.app import app


def test_cgroup_v2_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert th.cgroup_cpus(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert th.cgroup_cpus(tmp_path) is None


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert th.cgroup_cpus(tmp_path) == 0.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert th.cgroup_cpus(tmp_path) is None
    assert th.cgroup_cpus(tmp_path / "missing") is None


def test_available_is_affinity_capped_by_quota(tmp_path):
    aff = len(os.sched_getaffinity(0))
    assert th.available_cpus(tmp_path / "none") == aff == th.affinity_cpus()
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a core still gets one thread
    assert th.available_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{(aff + 7) * 100000} 100000\n")  # a quota above affinity changes nothing
    assert th.available_cpus(tmp_path) == aff


def test_explicit_settings_win(monkeypatch):
    monkeypatch.delenv("INFERTRACE_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert th.choose_threads(3) == th.ThreadChoice(3, "--threads")
    with pytest.raises(ValueError):
        th.choose_threads(0)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert th.choose_threads() == th.ThreadChoice(5, "OMP_NUM_THREADS")
    monkeypatch.setenv("INFERTRACE_THREADS", "2")
    assert th.choose_threads() == th.ThreadChoice(2, "INFERTRACE_THREADS")
    assert th.choose_threads(1).n == 1


def test_policy_gives_up_a_core_to_a_busy_process(monkeypatch):
    """With every core spinning in other processes, the policy falls to fewer threads than cores;
    the sample sees roughly the number of spinning processes."""
    monkeypatch.delenv("INFERTRACE_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    n = th.available_cpus()
    if n < 2:  # one core: the policy keeps its floor of one thread, whatever else runs
        assert th.choose_threads(sample_s=0.05).n == 1
        return
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.3)
        busy = th.busy_elsewhere(0.3)
        choice = th.choose_threads(sample_s=0.3)
    finally:
        for p in spin:
            p.kill()
            p.wait()
    assert busy >= n - 0.6  # n spinning processes (plus whatever else runs here)
    assert choice.n < n and "busy with other processes" in choice.reason


def test_cli_threads_option(monkeypatch):
    res = CliRunner().invoke(app, ["run", "--prompt", "hi", "--threads", "0"])
    assert res.exit_code == 2 and res.stderr.strip() == "error: --threads must be >= 1 (got 0)"
    res = CliRunner().invoke(app, ["dump-kv", "--step", "0", "--prompt", "hi", "--threads", "0"])
    assert res.exit_code == 2 and res.stderr.strip() == "error: --threads must be >= 1 (got 0)"


@pytest.mark.model
def test_run_header_states_threads_and_show_repeats_it(tmp_path):
    import torch

    before = torch.get_num_threads()
    try:
        res = CliRunner().invoke(app, ["run", "--prompt", "hi", "--max-new-tokens", "1", "--threads", "1",
                                       "--save", str(tmp_path / "t")], env={"COLUMNS": "120"})
        assert res.exit_code == 0, res.output
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    line = next(x for x in res.stdout.splitlines() if "│ cpu " in x)
    assert "1 thread (--threads)" in line
    shown = CliRunner().invoke(app, ["show", str(tmp_path / "t")], env={"COLUMNS": "120"})
    assert shown.exit_code == 0 and shown.stdout == res.stdout
    assert "threads" not in (tmp_path / "t" / "trace.json").read_text()  # a machine fact, not trace content
