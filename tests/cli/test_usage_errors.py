"""Usage errors of the real console entry point (``python -m infertrace``, what the ``infertrace``
script runs): one ``error:`` line naming the command's help, exit 2, no Typer box; help still exit 0."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infertrace", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, says, where", [
    (("run", "--bogus"), "No such option: --bogus", "infertrace run -h"),
    (("run", "--prompt", "x", "--max-new-tokens", "abc"), "Invalid value for '--max-new-tokens'", "infertrace run -h"),
    (("nosuch",), "No such command 'nosuch'", "infertrace -h"),
    (("run", "-n"), "Option '-n' requires an argument", "infertrace run -h"),  # click gives no context: argv names it
    (("show", "a", "b"), "Got unexpected extra argument", "infertrace show -h"),
])
def test_usage_error_is_one_line(args: tuple[str, ...], says: str, where: str) -> None:
    r = _cli(*args)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and says in lines[0] and f"see '{where}'" in lines[0]
    assert "╭" not in r.stderr and "Traceback" not in r.stderr


def test_usage_error_escapes_control_bytes() -> None:
    r = _cli("run", "--prompt", "x", "--max-new-tokens", "\x1b[31mred")
    assert r.returncode == 2 and "\x1b" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_help_and_bare_command_unchanged() -> None:
    h = _cli("show", "-h")
    assert h.returncode == 0 and "Usage: infertrace show" in h.stdout
    bare = _cli("show")  # no_args_is_help: the help, exit 2 (click's convention)
    assert bare.returncode == 2 and "Usage: infertrace show" in bare.stdout


# ----------------------------------------------------------------------------- breaker: dump-kv DIR and run options

GOLDEN_CELLS = __import__("pathlib").Path(__file__).resolve().parents[2] / "fixtures" / "golden" / "worked-example-cells"


@pytest.mark.parametrize("extra", [("--dtype", "bfloat16"), ("--backend", "paged"), ("--temperature", "-1"),
                                   ("--max-new-tokens", "5"), ("--model", "/nonexistent.gguf"), ("--ctx-size", "64")])
def test_dump_kv_of_a_saved_trace_refuses_run_options(extra: tuple[str, ...]) -> None:
    """``dump-kv DIR --step 0 --dtype bfloat16`` (or --backend, --temperature -1 ...) printed the saved step,
    exit 0: the forward-pass setting was ignored silently (an invalid value too). --prompt was refused."""
    r = _cli("dump-kv", str(GOLDEN_CELLS), "--step", "0", *extra)
    assert r.returncode == 2, r.stdout[-400:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {extra[0]} is for a live run"), r.stderr
    assert _cli("dump-kv", str(GOLDEN_CELLS), "--step", "0").returncode == 0
