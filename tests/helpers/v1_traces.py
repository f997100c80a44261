"""The saved schema 1 traces (``fixtures/traces/v1``) and their schema 2 regenerations (``fixtures/golden``), and a
writer of a trace directory from a (possibly mutated) ``trace.json`` dict, shared by the schema 1 tests."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
V1 = ROOT / "fixtures" / "traces" / "v1"
GOLDEN = ROOT / "fixtures" / "golden"
ENV = {"COLUMNS": "120"}


def v1_manifest(name: str) -> dict:
    """The schema 1 ``trace.json`` of fixture ``name`` as a dict (read as JSON, not upgraded)."""
    return json.loads((V1 / name / "trace.json").read_text(encoding="utf-8"))


def write_trace(tmp_path: Path, d: dict, name: str = "t") -> Path:
    """A trace directory ``tmp_path/name`` holding ``d`` as its ``trace.json``."""
    out = tmp_path / name
    out.mkdir()
    (out / "trace.json").write_text(json.dumps(d), encoding="utf-8")
    return out
