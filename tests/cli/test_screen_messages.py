"""Small on-screen errors of issue 31 item 7: the kq_mask_swa slice line on a short prompt, `report DIR` without
`-o`, the whole-run `--audit-kv` summary (`show --var foo` naming --var: tests/cli/test_run_output.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.present.render import swa_slice_text

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "golden"


def _step(positions):
    return SimpleNamespace(batch=[SimpleNamespace(positions=list(positions), seq_id=0)])


def test_swa_slice_on_a_short_prompt_names_no_window_edge():
    # Gemma 3 270M, a 6-token prompt: the printed slice is cells 0..15 of the SWA pool, 6 of them hold pos 0..5,
    # the other 10 are empty (pos -1); W = 512 and the farthest query (pos 5) is 5 positions from the first key
    kq = {"col_start": 0, "cell_pos": [0, 1, 2, 3, 4, 5] + [-1] * 10, "rows": [["0"] * 16] * 6}
    text = swa_slice_text(kq, _step(range(6)), 512)
    assert text == ("cells 0..15 (pos 0..5; 10 empty), no query reaches its window edge yet "
                    "(pos_q - pos_cell < n_swa = 512 for every key)")
    assert "-1" not in text


def test_swa_slice_past_the_window_says_edge():
    # query at pos 600 with keys from pos 80: 600 - 80 = 520 >= 512, the window cuts keys 80..88
    kq = {"col_start": 80, "cell_pos": list(range(80, 96)), "rows": [["-inf"] * 9 + ["0"] * 7]}
    assert swa_slice_text(kq, _step([600]), 512) == "cells 80..95 (pos 80..95), around the first query's window edge"


def test_report_without_o_writes_to_the_working_directory(tmp_path, monkeypatch):
    src = GOLDEN / "worked-example-cells"
    before = sorted(p.name for p in src.iterdir())
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["report", str(src)])
    assert res.exit_code == 0, res.output
    out = tmp_path / "worked-example-cells-report.html"
    assert out.is_file() and out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert res.stdout.startswith("wrote worked-example-cells-report.html (")
    assert f"in the working directory {tmp_path} (-o chooses)" in res.stdout
    assert sorted(p.name for p in src.iterdir()) == before  # nothing written into the fixture
    again = CliRunner().invoke(app, ["report", str(src)])  # an existing file is not replaced without --force
    assert again.exit_code == 2 and "--force" in again.stderr


@pytest.mark.model
def test_audit_kv_has_a_whole_run_summary(tmp_path):
    d = tmp_path / "a"
    p = "The capital of France is"
    res = CliRunner().invoke(app, ["run", "-p", p, "-p", p, "--arrival", "0", "--arrival", "2", "--prefix-cache", "on",
                                   "--audit-kv", "-n", "3", "--save", str(d), "--keep", "summary"], env={"COLUMNS": "120"})
    assert res.exit_code == 0, res.output
    m = json.loads((d / "trace.json").read_text())
    audits = [s["serving"]["audit"] for s in m["steps"] if (s.get("serving") or {}).get("audit")]
    assert len(audits) == 5  # prefill 0, decodes, seq 1's prefix hit at step 2 and its decodes: every step audited
    want = max(a["max_abs_exact"] for a in audits)  # folded here, independently of the renderer
    hit = [g for a in audits for g in a["by_provenance"] if g["provenance"].startswith("prefix hit")]
    out = res.stdout
    assert f"KV audit, whole run ({len(audits)} steps): max |Δ| {want:.3g} where the cache must match" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("prefix hit from request 0"))
    assert line.split()[-5:-3] == [str(len(hit)), str(max(g["entries"] for g in hit))]
    # the prefix hit served seq 0's layer-0 K/V: recomputing them from scratch gives the same numbers
    assert max(g["max_abs_layer0"] for g in hit) == 0
