"""The v2 words on the command line: ``run --runtime NAME`` (``--engine``, its old name, hidden and still
honoured), ``diff-runtimes NAME`` (``diff-backends --against NAME``, its old form, hidden and still honoured).
Everything here stops before a model loads."""

from __future__ import annotations

from typer.testing import CliRunner

from infertrace.cli.app import app

ENV = {"COLUMNS": "200"}


def _run(*args: str):
    return CliRunner().invoke(app, list(args), env=ENV)


def _error(res) -> str:
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.output
    return lines[0]


def test_help_names_the_new_words_only():
    run = _run("run", "--help").stdout
    assert "--runtime" in run and "--engine" not in run
    db = _run("diff-backends", "--help").stdout
    assert "--against" not in db and "diff-runtimes NAME" in db
    dr = _run("diff-runtimes", "--help")
    assert dr.exit_code == 0 and "NAME" in dr.stdout and "--against" not in dr.stdout
    assert "diff-runtimes" in _run("--help").stdout


def test_runtime_and_its_old_name_refuse_alike():
    new = _error(_run("run", "-p", "x", "--runtime", "infertrace", "--padding", "right"))
    old = _error(_run("run", "-p", "x", "--engine", "infertrace", "--padding", "right"))
    assert new == old == "error: --padding needs --runtime hf (padding is a setting of hf, not of infertrace)"
    assert "--runtime must be one of infertrace, llama.cpp, vllm, hf (got 'nope')" in _error(_run("run", "-p", "x", "--engine", "nope"))


def test_runtime_and_engine_naming_two_runtimes_are_refused():
    line = _error(_run("run", "-p", "x", "--runtime", "llama.cpp", "--engine", "vllm"))
    assert "--engine is the old name of --runtime" in line
    same = _error(_run("run", "-p", "x", "--runtime", "infertrace", "--engine", "infertrace", "--padding", "right"))
    assert "--padding needs --runtime hf" in same  # the same runtime twice is one runtime


def test_diff_runtimes_and_the_old_against():
    assert "diff-runtimes NAME must be one of hf, llama.cpp, vllm (got 'tensorrt')" in \
        _error(_run("diff-runtimes", "tensorrt", "-p", "hi"))
    new = _error(_run("diff-runtimes", "vllm", "-p", "x", "--weights", "quant"))
    old = _error(_run("diff-backends", "--against", "vllm", "-p", "x", "--weights", "quant"))
    assert new == old and "does not apply to diff-runtimes vllm" in new
