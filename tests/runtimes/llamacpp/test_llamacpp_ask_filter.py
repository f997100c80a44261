"""The C ask filter in front of the llama.cpp eval callback (runtimes/llamacpp/ask_filter.py): the trace
is the one the Python path records, Python is called for a small fraction of llama.cpp's questions, and
a cached library that is not a regular file of ours is never loaded."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.runtimes.llamacpp import ask_filter

pytestmark = pytest.mark.model
_ORIGINAL: dict = {}


def _strip_times(x):  # a trace's JSON without its wall-clock fields
    if isinstance(x, dict):
        return {k: _strip_times(v) for k, v in x.items() if k != "time_ms"}
    return [_strip_times(v) for v in x] if isinstance(x, list) else x


def _run(monkeypatch, no_cext: bool) -> tuple[dict, dict]:
    """``run --runtime llama.cpp`` on two prompts (one arriving at step 1: a packed prefill + decode step)
    with the Python callback counted: ``(trace JSON, {"ask": n, "computed": n})``."""
    from infertrace.runtimes.llamacpp.capture import LlamaCppContext

    import infertrace.cli.common as common

    monkeypatch.setattr(common, "_LOADED", {})
    if no_cext:
        monkeypatch.setenv("INFERTRACE_NO_CEXT", "1")
    else:
        monkeypatch.delenv("INFERTRACE_NO_CEXT", raising=False)
    calls = {"ask": 0, "computed": 0}
    real = _ORIGINAL.setdefault("eval", LlamaCppContext._eval)  # not an earlier call's counting wrapper

    def counted(self, addr, ask, user_data):
        calls["ask" if ask else "computed"] += 1
        return real(self, addr, ask, user_data)

    monkeypatch.setattr(LlamaCppContext, "_eval", counted)
    res = CliRunner().invoke(app, ["run", "--runtime", "llama.cpp", "--prompt", "The capital of France is",
                                   "--prompt", "def add(a, b):", "-n", "8", "--layer", "3", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output), calls


def test_c_filter_records_the_python_paths_trace_with_few_python_calls(monkeypatch, llama_cpp) -> None:
    assert ask_filter.load() is not None, "no C compiler here: the filter cannot be tested"
    py_trace, py_calls = _run(monkeypatch, no_cext=True)
    c_trace, c_calls = _run(monkeypatch, no_cext=False)
    assert _strip_times(c_trace) == _strip_times(py_trace)
    assert c_trace["requests"][0]["output_ids"] and len(c_trace["steps"]) >= 8
    # the same nodes are read once computed; llama.cpp's ~950 questions a token reach Python only on the
    # first ubatch (read the slow way: input flags, cache sizes) and where Python has work
    assert c_calls["computed"] == py_calls["computed"] > 0
    assert c_calls["ask"] < 0.25 * py_calls["ask"], (c_calls, py_calls)


@pytest.fixture()
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("INFERTRACE_NO_CEXT", raising=False)
    monkeypatch.setattr(ask_filter, "_LIB", None)
    monkeypatch.setattr(ask_filter, "_TRIED", False)
    return tmp_path


def test_a_symlinked_cached_library_is_not_loaded(fresh_cache) -> None:
    target = ask_filter._so_path()
    target.parent.mkdir(parents=True)
    other = fresh_cache / "elsewhere.so"
    other.write_bytes(b"\x7fELF not ours")
    os.symlink(other, target)
    assert ask_filter.load() is None
    assert os.path.islink(target)  # left as found, not followed or rebuilt over


def test_a_group_writable_cached_library_is_not_loaded(fresh_cache) -> None:
    assert ask_filter.load() is not None  # built into the fresh cache
    target = ask_filter._so_path()
    os.chmod(target, 0o666)
    ask_filter._LIB, ask_filter._TRIED = None, False
    assert ask_filter.load() is None


def test_no_cext_env_keeps_the_python_path(fresh_cache, monkeypatch) -> None:
    monkeypatch.setenv("INFERTRACE_NO_CEXT", "1")
    assert ask_filter.load() is None
    assert not ask_filter._so_path().exists()
