"""The HTML report shows prefix hits, shared blocks and cells, and copies as the terminal does (issue 31 item 6).

Reference values: the trace's own serving records (``serving.prefix``: hit length, source request, shared blocks /
cells), worked by hand for the prompt below: 13 SmolLM2 tokens; 4 tokens per block -> 3 full blocks (12 tokens)
hashed, so the identical request arriving at step 3 hits 12 and computes token 12; with cells the second request
seq_cp's the first's cells 0..11 (a hit of len - 1: the last prompt token is always computed).
"""

from __future__ import annotations

import html
import json
import re

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app

pytestmark = pytest.mark.model

PROMPT = "The capital of France is Paris, and the capital of Italy is"


def _page(tmp_path, backend):
    d = tmp_path / backend
    args = ["run", "-p", PROMPT, "-p", PROMPT, "--arrival", "0", "--arrival", "3", "--prefix-cache", "on", "-n", "3",
            "--backend", backend, "--save", str(d), "--keep", "summary"]
    if backend == "paged":
        args += ["--tokens-per-block", "4"]
    assert CliRunner().invoke(app, args).exit_code == 0
    out = tmp_path / f"{backend}.html"
    assert CliRunner().invoke(app, ["report", str(d), "-o", str(out)]).exit_code == 0
    return json.loads((d / "trace.json").read_text()), html.unescape(out.read_text(encoding="utf-8"))


def _hit(m):
    return next((s["step"], p) for s in m["steps"] for sid, p in ((s.get("serving") or {}).get("prefix") or {}).items()
                if sid == "1")


def test_paged_report_shows_the_hit_and_shared_blocks(tmp_path):
    m, page = _page(tmp_path, "paged")
    step, p = _hit(m)
    assert (step, p["hit"], p["shared_blocks"]) == (3, 12, [0, 1, 2])
    assert f"seq 1 at step 3: 12 of 13 tokens from request 0, blocks [0, 1, 2] shared" in page  # run facts
    assert "seq 1 prefix lookup: hit 12 of 13 tokens from request 0 · shared blocks [0, 1, 2]" in page  # step 3 section
    assert "hit 0..11←seq 0" in page  # the worked-example table's positions cell
    assert re.search(r'id="step-3".*?class="var serving"', page, re.S)


def test_cells_report_shows_the_shared_cells(tmp_path):
    m, page = _page(tmp_path, "cells")
    step, p = _hit(m)
    assert p["hit"] == 12 and p["src"] == 0
    assert f"seq 1 at step {step}: 12 of 13 tokens from request 0, cells {p['cells']} shared (seq_cp)" in page
    assert "hit 0..11←seq 0" in page


def test_no_prefix_cache_no_line(tmp_path):
    d = tmp_path / "plain"
    assert CliRunner().invoke(app, ["run", "-p", "Hi", "-n", "1", "--save", str(d), "--keep", "summary"]).exit_code == 0
    out = tmp_path / "p.html"
    assert CliRunner().invoke(app, ["report", str(d), "-o", str(out)]).exit_code == 0
    assert "prefix cache" not in out.read_text(encoding="utf-8")
