"""infertrace check: every golden trace satisfies the invariants, and each kind of corruption is caught
with its step, seq and variable (exit 1), through the CLI."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.trace.check import check_trace, parse_ranges

GOLDEN = Path(__file__).resolve().parents[3] / "fixtures" / "golden"
GOLDENS = sorted(p.name for p in GOLDEN.iterdir() if (p / "trace.json").is_file())


def _load(name: str) -> dict:
    return json.loads((GOLDEN / name / "trace.json").read_text(encoding="utf-8"))


def test_there_are_goldens() -> None:
    assert {"worked-example-cells", "worked-example-paged", "batching-cells", "batching-paged"} <= set(GOLDENS)


@pytest.mark.parametrize("name", GOLDENS)
def test_golden_traces_pass(name: str) -> None:
    res = CliRunner().invoke(app, ["check", str(GOLDEN / name)])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("ok: ") and "no violation" in res.output


def _step(m: dict, n: int) -> dict:
    return next(s for s in m["steps"] if s["step"] == n)


def _corrupt_cross_seq(m: dict) -> None:  # batching-cells step 1: seq 0's query keeps a cell of seq 1
    st = _step(m, 1)
    st["mask"]["kq_mask"]["rows"][0][3] = "0"


def _corrupt_position_gap(m: dict) -> None:  # seq 1's second chunk starts one position late
    st = _step(m, 2)
    r = next(r for r in st["batch"] if r["seq_id"] == 1)
    r["C"] += 1
    r["positions"] = [p + 1 for p in r["positions"]]


def _corrupt_rope(m: dict) -> None:
    _step(m, 1)["positions"]["cos_sin"][0]["cos"][1] = 0.5


def _corrupt_future_key(m: dict) -> None:
    st = _step(m, 1)
    r = next(r for r in st["batch"] if r["seq_id"] == 1)
    r["visible"][0] = "0..1"


def _corrupt_double_cell(m: dict) -> None:  # two cells claim seq 0 pos 0
    cells = _step(m, 2)["kv"]["physical"]["cells"]
    cells.append({"cell": 99, "pos": 0, "seq_ids": [0]})


CASES = [
    ("batching-cells", _corrupt_cross_seq, "violation: step 1 seq 0 mask: no cross-sequence visibility: kq_mask row 0 (pos 2) keeps cell 3, owned by seq [1]"),
    ("batching-cells", _corrupt_position_gap, "violation: step 2 seq 1 positions: contiguous across chunks: chunk starts at position 3, the previous chunk of this sequence ended at 1"),
    ("batching-cells", _corrupt_rope, "violation: step 1 positions: RoPE angle consistent with position: pos 2 pair 1"),
    ("batching-cells", _corrupt_future_key, "violation: step 1 seq 1 mask: causality: query pos 0 sees key pos 1"),
    ("batching-cells", _corrupt_double_cell, "violation: step 2 seq 0 kv: one cell per (seq, pos): pos 0 is in cells 0 and 99"),
]


@pytest.mark.parametrize("name,corrupt,expected", CASES, ids=[c[1].__name__ for c in CASES])
def test_corruption_is_caught(tmp_path: Path, name: str, corrupt, expected: str) -> None:
    m = _load(name)
    assert check_trace(m)[0] is None
    bad = copy.deepcopy(m)
    corrupt(bad)
    d = tmp_path / "bad"
    shutil.copytree(GOLDEN / name, d)
    (d / "trace.json").write_text(json.dumps(bad), encoding="utf-8")
    res = CliRunner().invoke(app, ["check", str(d)])
    assert res.exit_code == 1
    assert res.output.strip().startswith(expected), res.output


def test_paged_slot_mapping_corruption(tmp_path: Path) -> None:
    m = _load("batching-paged")
    st = _step(m, 0)
    st["kv"]["per_request"][0]["slot_mapping"][1] += 1
    v, _ = check_trace(m)
    assert v is not None and (v.step, v.seq_id, v.variable, v.rule) == (0, 0, "kv", "slot = table[p // B] * B + p % B")


def test_malformed_fields_are_violations_not_crashes() -> None:
    m = _load("worked-example-cells")
    m["steps"][0]["batch"][0]["visible"][0] = "9..1"
    v, _ = check_trace(m)
    assert v is not None and v.rule == "schema"
    assert check_trace({"steps": "x"})[0].rule == "schema"


def test_control_characters_are_escaped(tmp_path: Path) -> None:
    m = _load("batching-cells")
    _step(m, 1)["mask"]["kq_mask"]["cell_seq"][3] = ["\x1b[31mX"]
    _step(m, 1)["mask"]["kq_mask"]["rows"][0][3] = "0"
    d = tmp_path / "t"
    shutil.copytree(GOLDEN / "batching-cells", d)
    (d / "trace.json").write_text(json.dumps(m), encoding="utf-8")
    res = CliRunner().invoke(app, ["check", str(d)])
    # a seq_id that is not an integer fails the trace schema: unreadable (exit 2), shown escaped
    assert res.exit_code == 2 and "\x1b" not in res.output and "\\x1b" in res.output


def test_parse_ranges() -> None:
    assert parse_ranges("0..2,5") == [0, 1, 2, 5] and parse_ranges("-") == []
    with pytest.raises(ValueError):
        parse_ranges("3..1")


def test_schema_consistency_is_a_violation(tmp_path: Path) -> None:
    """A trace whose types are fine but whose fields disagree (N != sum of T) is a violation (exit 1),
    located by step, not an unreadable file (exit 2)."""
    m = _load("batching-cells")
    _step(m, 2)["N"] += 1
    d = tmp_path / "t"
    shutil.copytree(GOLDEN / "batching-cells", d)
    (d / "trace.json").write_text(json.dumps(m), encoding="utf-8")
    res = CliRunner().invoke(app, ["check", str(d)])
    assert res.exit_code == 1, res.output
    assert res.output.startswith("violation: step 2 trace.json: cross-field consistency:"), res.output
