"""Bounds on a run from what its trace and the machine can hold (issue 31 item 16):

* a ``--context-shift`` run is bounded by ``-n`` alone; it is refused up front when even the
  smallest trace it can write (256 bytes a generated row, 384 a step) is over the 256 MiB
  ``trace.json`` that ``show`` reads (``MAX_MANIFEST_BYTES``), and stopped in one line the moment
  its trace passes that cap while it runs — ``run --save`` never writes what ``show`` refuses;
* ``--tensor-parallel-size`` is capped by the CPU cores this process may use.
"""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.safe_io import MAX_MANIFEST_BYTES
from tests.helpers.tiny import make_weights, write_gguf

ENV = {"COLUMNS": "120", "INFERTRACE_NO_CACHE": "1"}


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def _one_line(res, code: int = 2) -> str:
    assert res.exit_code == code, (res.output, res.exception)
    assert "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    w, s = make_weights(seed=1)
    return write_gguf(tmp_path_factory.mktemp("m") / "t.gguf", w, s)


def test_context_shift_run_over_the_read_cap_is_refused_up_front(model):
    assert MAX_MANIFEST_BYTES == 256 << 20
    # -n 1,000,000 was accepted (its 1,000,000 steps are under MAX_STEPS = 2^20) and ran for hours; its trace
    # holds at least 1e6 rows x 256 B + 1e6 steps x 384 B = 640,000,000 B = 610 MiB > 256 MiB
    line = _one_line(invoke("run", "--model", model, "--prompt", "a", "--max-new-tokens", "1000000", "--context-shift",
                            "--ctx-size", "16"))
    assert "610 MiB" in line and "256 MiB" in line and "MAX_MANIFEST_BYTES" in line and "--max-new-tokens" in line
    # 32 requests x 32,000 tokens: 1,024,000 steps at most (under MAX_STEPS, which is checked first), and at least
    # 32 x 32,000 rows x 256 B + 32,000 steps x 384 B = 262,144,000 + 12,288,000 = 274,432,000 B = 261 MiB > 256 MiB
    many = [a for i in range(32) for a in ("--prompt", f"p{i}")]
    line = _one_line(invoke("run", "--model", model, *many, "--max-new-tokens", "32000", "--context-shift", "--ctx-size", "64"))
    assert "261 MiB" in line and "32 request(s)" in line
    # over MAX_STEPS the step bound speaks first (its own message, unchanged)
    line = _one_line(invoke("run", "--model", model, "--prompt", "a", "--max-new-tokens", "2000000", "--context-shift"))
    assert "more than the 1048576 a trace holds" in line


def test_without_context_shift_the_context_bounds_the_run(model, tmp_path):
    """The up-front trace bound is for --context-shift only: without it a request stops at ctx_full."""
    res = invoke("run", "--model", model, "--prompt", "a", "--max-new-tokens", "1000000", "--ctx-size", "8",
                 "--ignore-eos", "--keep", "summary", "--save", tmp_path / "t")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "t" / "trace.json").stat().st_size < MAX_MANIFEST_BYTES


@pytest.mark.parametrize("keep", ["summary", "tensors"])
def test_context_shift_run_stops_when_its_trace_passes_the_cap(model, tmp_path, monkeypatch, keep):
    """The running count follows the real trace.json: with the cap set 5 % under the size a saved run's
    trace.json has on disk (measured, not computed by the counter), the same run stops in one line and
    writes nothing; with the cap 5 % over it, it runs and saves."""
    from infertrace.engine import trace_budget

    d = tmp_path / "ref"
    args = ["run", "--model", model, "--prompt", "ab", "--max-new-tokens", 40, "--ignore-eos", "--context-shift",
            "--ctx-size", "16", "--keep", keep]
    res = invoke(*args, "--save", d)
    assert res.exit_code == 0, res.output
    size = (d / "trace.json").stat().st_size
    assert size > 40 * 1000  # ~4 KB a step: a real trace, not a stub
    monkeypatch.setattr(trace_budget, "manifest_cap", lambda: int(size * 0.95))
    line = _one_line(invoke(*args, "--save", tmp_path / "under"))
    assert "--max-new-tokens: with a context shift the trace passed" in line and "MAX_MANIFEST_BYTES" in line
    assert not (tmp_path / "under").exists()
    monkeypatch.setattr(trace_budget, "manifest_cap", lambda: int(size * 1.05))
    res = invoke(*args, "--save", tmp_path / "over")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "over" / "trace.json").stat().st_size == size


def test_tensor_parallel_size_is_capped_by_the_cores():
    cores = len(os.sched_getaffinity(0))
    line = _one_line(invoke("run", "--runtime", "vllm", "--prompt", "a", "--tensor-parallel-size", cores + 1))
    assert f"--tensor-parallel-size {cores + 1} is more than the {cores} CPU core(s)" in line
    assert f"use at most {cores}" in line
    line = _one_line(invoke("run", "--runtime", "vllm", "--prompt", "a", "--tensor-parallel-size", 4096))
    assert "4096" in line and f"at most {cores}" in line
    assert "must be >= 1" in _one_line(invoke("run", "--runtime", "vllm", "--prompt", "a", "--tensor-parallel-size", 0))


# ----------------------------------------------------------------------------- breaker: a --prompts line's limits


@pytest.mark.parametrize("kv, want", [
    ('"top_k": 3000000000', "p.jsonl line 2: 'top_k' 3000000000 is over the limit of 2147483648"),
    ('"max_new_tokens": 99999999999999999999', "p.jsonl line 2: 'max_new_tokens' 99999999999999999999 is over the limit"),
    ('"arrival": 99999999999999999999', "p.jsonl line 2: 'arrival' 99999999999999999999 is over the limit"),
])
def test_prompts_file_value_over_a_trace_limit_names_the_key_and_line(tmp_path, kv, want):
    """A --prompts line's top_k / max_new_tokens / arrival over the trace format's limit was reported as
    '--top-k 3000000000 is over the limit ...': a flag the user never passed, no file, no line."""
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "Hi"}\n{"prompt": "Yo", %s}\n' % kv)
    res = invoke("run", "--prompts", p, "-n", "2")
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert "\n" not in line and line.startswith("error: " + want) and "--" not in line, line
