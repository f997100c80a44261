"""Request lanes of a real ``run --runtime llama.cpp`` trace: our scheduler decides who runs, llama.cpp computes, so
the lanes are the hand-worked CHUNKED schedule of tests/unit/present/test_lanes.py, and every slot's positions
``C..C+T-1`` are the ``inp_pos`` values llama.cpp's own graph held for that request's rows of the ubatch
(read from its tensors into ``step.positions.inp_pos``, packed rows ``ReqStep.rows``)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.engine.options import EngineOptions
from infertrace.runner import PromptSpec
from tests.helpers.trace_events import check_trace_events
from tests.unit.present.test_lanes import CHUNKED, CHUNKED_N, _p, _table

pytestmark = pytest.mark.model


def test_llamacpp_lanes_are_the_hand_worked_schedule(smol, llama_cpp, tmp_path):
    from infertrace.runtimes.llamacpp.engine import run_requests_llamacpp
    from infertrace.trace.lanes import build_lanes
    from infertrace.trace.store import save_trace

    A = smol.tokenizer.encode("The capital of France is Paris")[:6]
    B = smol.tokenizer.encode("Hello, my name is Alex")[:5]
    assert (len(A), len(B)) == (6, 5)
    specs = [PromptSpec("", _p(3), 0, ids=A), PromptSpec("", _p(3), 2, ids=B)]
    trace = run_requests_llamacpp(smol, specs, EngineOptions(max_batch_tokens=4, ctx_size=256), layer=0)
    assert trace.runtime == "llama.cpp"
    assert _table(trace) == CHUNKED
    lanes = build_lanes(trace)
    assert [lanes.n_tokens[s] for s in lanes.steps] == CHUNKED_N
    for st in trace.steps:
        inp_pos = st.positions.inp_pos  # llama.cpp's inp_pos tensor of the step
        for r in st.batch:
            s = lanes.by_seq[r.seq_id][st.step]
            assert [inp_pos[i] for i in r.rows] == list(range(s.C, s.C + s.T))
    d = tmp_path / "lc"
    save_trace(trace, d)
    res = CliRunner().invoke(app, ["show", str(d)], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "batch composition per step" in res.output
    out = tmp_path / "p.json"
    assert CliRunner().invoke(app, ["export", str(d), "-o", str(out)]).exit_code == 0
    doc = json.loads(out.read_text())
    check_trace_events(doc)
    assert doc["otherData"]["runtime"] == "llama.cpp"
