"""Hostile traces through the lane views (batch composition of ``show``, the report's lane timeline,
``export --format perfetto``): strings that break HTML, terminals and JSON, broken step times, and huge
step counts, each bounded or made inert.

Reference: the golden batching trace (three requests, fixtures/golden/batching-paged) with its strings
replaced by tests/helpers/hostile.py payloads; the views must keep every payload inert (HTML escaped, control
characters visible, JSON parseable and ASCII) and bounded (tables and grids cut with "… N more").
"""

from __future__ import annotations

import copy
import json

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.present import perfetto
from infertrace.present.perfetto import trace_events
from infertrace.present.render_lanes import MAX_LANES, MAX_ROWS, composition_notes, composition_table
from infertrace.present.report_lanes import MAX_LANE_CELLS, MAX_LANE_ROWS, MAX_LANE_STEPS, lanes_section
from infertrace.safe_text import visible
from infertrace.trace.lanes import build_lanes
from infertrace.trace.records import ReqStep, RunTrace, StepTrace
from tests.helpers import hostile as H
from tests.helpers.trace_events import check_trace_events
from tests.hostile.test_trace_files import check_inert, no_control

JSON_BREAK = '"},{"ph":"X"]\\u0000\\\n\u2028'
PAYLOAD = H.HTML_PAYLOAD + H.TERM_PAYLOAD + JSON_BREAK


def invoke(*args, width=200):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": str(width)})


def _hostile(tmp_path):
    d = copy.deepcopy(H.load("batching-paged"))
    for st in d["steps"]:
        for r in st["batch"]:
            r["sampled_piece"] = PAYLOAD if r.get("sampled") is not None else None
            if r.get("finished"):
                r["finished"] = PAYLOAD
    d["model"]["file"] = PAYLOAD
    return H.write_trace(d, tmp_path / "hostile")


def test_hostile_strings_stay_inert_in_every_lane_view(tmp_path):
    t = _hostile(tmp_path)
    res = invoke("show", t)
    assert res.exit_code == 0, res.output[-1500:]
    assert "batch composition per step" in res.stdout
    no_control(res.stdout)
    assert visible(PAYLOAD)[:30] in "".join(res.stdout.split("\n"))  # the stop reason shown, visibly
    page = tmp_path / "r.html"
    assert invoke("report", t, "-o", page).exit_code == 0
    html = page.read_text(encoding="utf-8")
    assert 'id="lanes"' in html
    check_inert(html)
    out = tmp_path / "p.json"
    res = invoke("export", t, "-o", out)
    assert res.exit_code == 0, res.output[-1500:]
    raw = out.read_bytes()
    assert raw.isascii()
    doc = json.loads(raw)
    check_trace_events(doc)
    pieces = [e["args"].get("sampled_piece") for e in doc["traceEvents"] if e["ph"] == "X" and "sampled_piece" in e.get("args", {})]
    assert pieces and all(p == visible(PAYLOAD)[:199] + "…" or p == visible(PAYLOAD) for p in pieces)
    assert all(not H.BAD_TERMINAL.search(p) for p in pieces)
    fins = [e["args"]["finished"] for e in doc["traceEvents"] if e["ph"] == "X" and "finished" in e.get("args", {})]
    assert len(fins) == 3 and all(len(f) <= 80 for f in fins)


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-5", "1e300"])
def test_broken_step_times_fall_back_to_step_numbers(tmp_path, bad):
    """timing.json is untrusted: a NaN / infinite / negative / absurd step time is no measurement, so the
    time axis falls back to step numbers, and the JSON stays strict (no NaN)."""
    t = H.write_trace(H.load("batching-paged"), tmp_path / "t")
    steps = [{"step": i, "time_ms": 3.0} for i in range(8)]
    text = json.dumps({"steps": steps}).replace('"time_ms": 3.0}]', f'"time_ms": {bad}}}]')
    (t / "timing.json").write_text(text)
    out = tmp_path / "p.json"
    assert invoke("export", t, "-o", out).exit_code == 0
    doc = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    check_trace_events(doc)
    assert doc["otherData"]["time_axis"] == "step"


def _synthetic(n_steps: int, n_req: int) -> RunTrace:
    """n_steps steps, each decoding two requests that change every step (no row folds), positions growing."""
    steps = []
    for k in range(n_steps):
        batch = [ReqStep(seq_id=s, phase="decode", C=10 + k, T=1, token_ids=[1], pieces=["x"], positions=[10 + k],
                         visible=["0..1"], cache_before="0", cache_after="0..1", rows=[i], logits_row=i, sampled=1,
                         sampled_piece="x") for i, s in enumerate(sorted({k % n_req, (k + 1) % n_req}))]
        steps.append(StepTrace(step=k, backend="cells", attention="torch", N=2, batch=batch, time_ms=1.0))
    return RunTrace(model={"file": "m"}, config={}, options={}, notes=[], steps=steps,
                    requests=[{"seq_id": s} for s in range(n_req)])


def test_huge_step_counts_are_bounded(monkeypatch):
    tr = _synthetic(3000, 20)
    lanes = build_lanes(tr)
    assert len(lanes.steps) == 3000 and len(lanes.seqs) == 20
    t = composition_table(lanes)
    note = composition_notes(lanes)
    assert t.row_count == MAX_ROWS and "2800 more rows (steps 200..2999)" in note and "4 more requests" in note
    assert len(t.columns) == 2 + MAX_LANES
    sec = str(lanes_section(tr))
    assert sec.count("<th>") == MAX_LANE_STEPS and f"{3000 - MAX_LANE_STEPS} more steps" in sec
    monkeypatch.setattr(perfetto, "MAX_SLICES", 1000)
    doc = trace_events(tr)
    check_trace_events(doc)
    x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(x) == 1000 and doc["otherData"]["truncated_slices"] == 3000 + 6000 - 1000
    many = _synthetic(600, 1000)  # 1000 requests: 256 rows drawn, 40000 // 256 = 156 steps
    sec = str(lanes_section(many))
    assert sec.count('<tr data-seq=') == MAX_LANE_ROWS and sec.count("<th>") == MAX_LANE_CELLS // MAX_LANE_ROWS
    assert "444 more steps, 744 more requests not drawn" in sec and len(sec) < 4_000_000
