"""The vLLM plugin's entry point without a server: declared in pyproject.toml under vLLM's group, found by
``importlib.metadata`` as vLLM's ``load_plugins_by_group`` finds it, a no-op (nothing of vLLM wrapped) while
``INFERTRACE_SPOOL`` is unset, and the client's mark read from ``SamplingParams.extra_args``."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from tests.helpers.vllm_served import entry_point_dir

ROOT = Path(__file__).resolve().parents[3]


def test_entry_point_declared_in_vllms_group() -> None:
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert eps["vllm.general_plugins"] == {"infertrace": "infertrace.runtimes.vllm.plugin:register"}


def test_off_without_a_spool_wraps_nothing(tmp_path: Path) -> None:
    """vLLM's own loader (``load_general_plugins``) runs the plugin in a fresh process: with ``INFERTRACE_SPOOL`` unset
    ``Scheduler.schedule`` and ``GPUModelRunner.execute_model`` are vLLM's functions; with it set they are wrapped."""
    code = ("import os, vllm.plugins as p\n"
            "from vllm.v1.core.sched.scheduler import Scheduler as S\n"
            "from vllm.v1.worker.gpu_model_runner import GPUModelRunner as G\n"
            "a, b = S.schedule, G.execute_model\n"
            "p.load_general_plugins()\n"
            "print(S.schedule is a, G.execute_model is b)\n")
    env = {"PYTHONPATH": f"{ROOT}:{entry_point_dir(tmp_path / 'ep')}", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                        env={**env, "INFERTRACE_SPOOL": str(tmp_path / "spool")})
    assert off.stdout.strip().splitlines()[-1] == "True True", off.stderr[-1500:]
    assert on.stdout.strip().splitlines()[-1] == "False False", on.stderr[-1500:]
    assert not (tmp_path / "spool").exists()  # nothing is written before a scheduler or model runner runs


def test_marked_label_reads_vllm_extra_args() -> None:
    from vllm import SamplingParams

    from infertrace.runtimes.vllm.plugin import marked_label

    assert marked_label(SamplingParams(extra_args={"infertrace": "q1"})) == "q1"
    assert marked_label(SamplingParams(extra_args={"infertrace": 1})) == "1"
    assert marked_label(SamplingParams(extra_args={"other": 1})) is None
    assert marked_label(SamplingParams(extra_args={"infertrace": "0"})) is None
    assert marked_label(SamplingParams()) is None
    assert marked_label(SamplingParams(extra_args={"infertrace": "x" * 500})) == "x" * 64
