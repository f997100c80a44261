"""Shared pieces of the check-consistency and check-mutant tests: drive the CLI in-process, read a saved
trace's manifest, and write a tampered copy of it (the mutation under test) beside the original."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from infertrace.cli.app import app


def invoke(*args) -> object:
    """``infertrace ARGS...`` through typer's runner (same process, output captured)."""
    return CliRunner().invoke(app, [str(a) for a in args])


def load_manifest(t: Path) -> dict:
    """The saved trace's ``trace.json`` as a dict (the test mutates it)."""
    return json.loads((t / "trace.json").read_text(encoding="utf-8"))


def tampered(t: Path, d: dict, tmp_path: Path) -> Path:
    """A copy of trace directory ``t`` under ``tmp_path/tampered`` whose ``trace.json`` is ``d``."""
    out = tmp_path / "tampered"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(t, out)
    (out / "trace.json").write_text(json.dumps(d), encoding="utf-8")
    return out


def assert_mutant_caught(t: Path, mutate, codes: tuple[int, ...], phrase: str, tmp_path: Path) -> None:
    """Apply ``mutate`` to a copy of trace ``t``: ``check`` exits with one of ``codes`` in one line naming
    ``phrase`` (no escape byte), and a schema refusal (exit 2) is also ``show``'s, in the same words."""
    d = load_manifest(t)
    mutate(d)
    bad = tampered(t, d, tmp_path)
    res = invoke("check", bad)
    out = res.output.strip()
    assert res.exit_code in codes, (res.exit_code, out)
    assert len(out.splitlines()) == 1 and phrase in out, out
    assert "\x1b" not in out
    if res.exit_code == 2:  # refused by the schema: every reader refuses it the same way
        show = invoke("show", bad)
        assert show.exit_code == 2 and phrase in show.output, show.output
