"""``run --runtime hf`` through the CLI (the registry, the one loop, ``--padding``): a right-padded batch of a
5-token and a 1-token prompt, checked against hand-worked values — row 1 holds its one real token at column 0
and pads at columns 1..4, its positions are [0] then 1, 2 for the decodes; the saved trace passes ``check``."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app

pytestmark = pytest.mark.hf


def test_run_engine_hf_right_padding_through_the_cli(tmp_path, hf_smol):
    d = tmp_path / "hf"
    r = CliRunner().invoke(app, ["run", "--runtime", "hf", "-p", "The capital of France is", "-p", "Hi", "-n", "3",
                                 "--padding", "right", "--save", str(d)])
    assert r.exit_code == 0, r.output
    assert (d / "tensors.safetensors").exists()  # --keep's default: tensors of --layer, from HF's own hooks
    t = json.loads((d / "trace.json").read_text())
    assert t["runtime"] == "hf" and t["options"]["hf"]["padding"] == "right"
    s0 = t["steps"][0]
    assert s0["backend"] == "dense"
    assert s0["hf"]["attention_mask"] == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert s0["hf"]["position_ids"] == [[0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
    seq1 = [next(b for b in s["batch"] if b["seq_id"] == 1)["positions"] for s in t["steps"]]
    assert seq1 == [[0], [1], [2]]
    # logits_row indexes the step's logits rows (as in every convention): the decode step's two rows are 0 and 1
    assert [b["logits_row"] for b in t["steps"][1]["batch"]] == [0, 1] and t["steps"][1]["decode"]["logits_rows"] == [0, 1]
    c = CliRunner().invoke(app, ["check", str(d)])
    assert c.exit_code == 0, c.output


def test_keep_summary_writes_no_tensors_file(tmp_path, hf_smol):
    d = tmp_path / "t"
    r = CliRunner().invoke(app, ["run", "--runtime", "hf", "-p", "x", "-n", "1", "--save", str(d), "--keep", "summary"])
    assert r.exit_code == 0, r.output
    assert not (d / "tensors.safetensors").exists() and "tap_sources" not in json.loads((d / "trace.json").read_text())["options"]


def test_padding_needs_engine_hf():
    r = CliRunner().invoke(app, ["run", "-p", "x", "-n", "1", "--padding", "left"])
    assert r.exit_code == 2 and "--padding needs --runtime hf" in r.output
