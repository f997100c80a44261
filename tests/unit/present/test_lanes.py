"""Request lanes (trace/lanes.py) and their three views: the batch composition table of ``show`` / ``run``,
the report's lane timeline and the Perfetto export, on schedules worked by hand.

Engine: our scheduler on a tiny random checkpoint (tests/helpers/tiny.py; scheduling does not depend on the
weights), prompts given as token ids so their lengths are known.

Hand-worked schedule CHUNKED (``--max-batch-tokens 4``, no prefill chunk limit, 3 new tokens each, EOS ignored):
A = 6 ids arrives at 0, B = 5 ids arrives at 2. The scheduler serves running requests first (decode or the rest of a
prefill), then admits waiting ones, under a budget of 4 tokens per step:

    step 0: A prefill 0..3 (4: the budget; no logits)                      N = 4
    step 1: A prefill 4..5 (2, ends the prompt: token 1)                   N = 2
    step 2: A decode @6 (token 2) · B admitted, prefill 0..2 (the 3 left)  N = 4
    step 3: A decode @7 (token 3: finished) · B prefill 3..4 (token 1)     N = 3
    step 4: B decode @5                                                    N = 1
    step 5: B decode @6 (token 3: finished)                                N = 1

Paged, 4 tokens per block, lowest free block first: A [0] then [0, 1]; B [2] at step 2 and [2, 3] from step 3
(position 4 opens its second block). Cells (llama.cpp find_slot from head): A cells 0..5, its decode at cell 6,
B's prefill at cells 7..9, step 3 puts A @7 at cell 10 and B 3..4 at cells 11..12.

Hand-worked PREEMPT (paged, 4 tokens per block, a pool of 3 blocks, 4 new tokens each, both arrive at 0):
A = 5 ids, B = 4 ids. Step 0 admits both (2 + 1 blocks: the pool is full). Step 1: A's decode @5 fits its
second block; B's @4 needs a block, none is free and A is already scheduled, so B preempts itself (vLLM's rule);
its 4 prompt + 1 output tokens (2 blocks) do not fit beside A until A finishes at step 3 (@7). Step 4 recomputes
B's 5 tokens in one prefill; steps 5, 6 decode @5, @6 (B's tokens 2..4; finished at 6).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.engine.drive import PromptSpec
from infertrace.engine.options import EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.present.perfetto import trace_events
from infertrace.present.report import build_report
from infertrace.trace.lanes import build_lanes, composition
from infertrace.trace.store import load_trace, save_trace
from tests.helpers.trace_events import check_trace_events

A, B = [10, 20, 30, 40, 50, 60], [11, 21, 31, 41, 51]

#: CHUNKED by hand: step -> {seq: (kind, C, T, chunk k/n or "", finished)}
CHUNKED = {
    0: {0: ("chunk", 0, 4, "1/2", None)},
    1: {0: ("chunk", 4, 2, "2/2", None)},
    2: {0: ("decode", 6, 1, "", None), 1: ("chunk", 0, 3, "1/2", None)},
    3: {0: ("decode", 7, 1, "", "max_new_tokens"), 1: ("chunk", 3, 2, "2/2", None)},
    4: {1: ("decode", 5, 1, "", None)},
    5: {1: ("decode", 6, 1, "", "max_new_tokens")},
}
CHUNKED_N = [4, 2, 4, 3, 1, 1]
#: blocks (paged) / cells after each step, by hand (see the module docstring)
PAGED_BLOCKS = {0: {0: "[0]"}, 1: {0: "[0, 1]"}, 2: {0: "[0, 1]", 1: "[2]"}, 3: {0: "[0, 1]", 1: "[2, 3]"},
                4: {1: "[2, 3]"}, 5: {1: "[2, 3]"}}
CELLS_AFTER = {0: {0: "0..3"}, 1: {0: "0..5"}, 2: {0: "0..6", 1: "7..9"}, 3: {0: "0..6,10", 1: "7..9,11..12"}}
PREEMPT = {
    0: {0: ("prefill", 0, 5, "", None), 1: ("prefill", 0, 4, "", None)},
    1: {0: ("decode", 5, 1, "", None), 1: ("preempted", 0, 0, "", None)},
    2: {0: ("decode", 6, 1, "", None)},
    3: {0: ("decode", 7, 1, "", "max_new_tokens")},
    4: {1: ("prefill", 0, 5, "", None)},
    5: {1: ("decode", 5, 1, "", None)},
    6: {1: ("decode", 6, 1, "", "max_new_tokens")},
}


def _p(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from infertrace.runner import load_model
    from tests.helpers.tiny import make_weights, write_gguf

    w, s = make_weights(seed=3)
    return load_model(write_gguf(tmp_path_factory.mktemp("tiny") / "m.gguf", w, s))


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """The hand-worked schedules, each run once and saved: {name: (live trace, saved directory)}."""
    from infertrace.runner import run_requests

    cases = {
        "chunked-cells": ([PromptSpec("", _p(3), 0, ids=A), PromptSpec("", _p(3), 2, ids=B)],
                          EngineOptions(backend="cells", max_batch_tokens=4, ctx_size=64)),
        "chunked-paged": ([PromptSpec("", _p(3), 0, ids=A), PromptSpec("", _p(3), 2, ids=B)],
                          EngineOptions(backend="paged", max_batch_tokens=4, tokens_per_block=4, ctx_size=64)),
        "preempt": ([PromptSpec("", _p(4), 0, ids=A[:5]), PromptSpec("", _p(4), 0, ids=B[:4])],
                    EngineOptions(backend="paged", tokens_per_block=4, num_blocks=3, ctx_size=12)),
        "single": ([PromptSpec("", _p(2), 0, ids=A)], EngineOptions(backend="cells", ctx_size=64)),
    }
    root = tmp_path_factory.mktemp("lanes")
    out = {}
    for name, (specs, opts) in cases.items():
        tr = run_requests(tiny, specs, opts)
        save_trace(tr, root / name)
        out[name] = (tr, root / name)
    return out


def _table(trace) -> dict:
    lanes = build_lanes(trace)
    return {st: {s.seq_id: (s.kind, s.C, s.T, f"{s.chunk}/{s.chunks}" if s.chunks else "", s.finished) for s in lanes.at(st)}
            for st in lanes.steps}


@pytest.mark.parametrize("name", ["chunked-cells", "chunked-paged"])
def test_chunked_schedule_lanes_are_the_hand_worked_ones(runs, name):
    tr, d = runs[name]
    for t in (tr, load_trace(d)):  # live and saved alike
        assert _table(t) == CHUNKED
        assert [build_lanes(t).n_tokens[s] for s in range(6)] == CHUNKED_N
    lanes = build_lanes(tr)
    want = PAGED_BLOCKS if name.endswith("paged") else CELLS_AFTER
    for st, per in want.items():
        assert {s: lanes.by_seq[s][st].blocks for s in per} == per, st
    assert lanes.by_seq[0][1].sampled is not None and lanes.by_seq[0][0].sampled is None  # no logits before the prompt ends
    assert composition(tr, 2) == [
        {"seq_id": 0, "kind": "decode", "label": "decode @6", "C": 6, "T": 1, "hit": 0, "finished": None},
        {"seq_id": 1, "kind": "chunk", "label": "chunk 1/2 T=3", "C": 0, "T": 3, "hit": 0, "finished": None}]


def test_preemption_lanes_are_the_hand_worked_ones(runs):
    tr, _ = runs["preempt"]
    assert _table(tr) == PREEMPT
    assert tr.requests[1]["num_preemptions"] == 1 and tr.steps[1].preempted == [1]


def test_prefix_hit_marked_on_the_admission_slot(tiny):
    """13 ids twice, arrivals 0 and 3, prefix cache on, 4 tokens per block: the first request finishes at step 2
    (prefill + 2 decodes); the second hits its 3 full blocks [0, 1, 2] = 12 tokens and computes position 12 only."""
    from infertrace.runner import run_requests

    P = list(range(100, 113))
    tr = run_requests(tiny, [PromptSpec("", _p(3), 0, ids=P), PromptSpec("", _p(3), 3, ids=P)],
                      EngineOptions(backend="paged", tokens_per_block=4, ctx_size=64, prefix_cache=True))
    s = build_lanes(tr).by_seq[1][3]
    assert (s.kind, s.C, s.T, s.hit, s.hit_blocks) == ("prefill", 12, 1, 12, "blocks [0, 1, 2]")
    assert s.blocks.startswith("[0, 1, 2, ")  # the shared blocks head its table
    from rich.console import Console

    from infertrace.present.render_lanes import composition_table

    con = Console(width=200, record=True)
    con.print(composition_table(build_lanes(tr)))
    row = next(x for x in con.export_text().splitlines() if x.strip().startswith("3 "))
    assert "prefill T=1 [12] hit 12" in row


# ----------------------------------------------------------------------------- show / run: the composition table


def _show(d, width=200):
    res = CliRunner().invoke(app, ["show", str(d)], env={"COLUMNS": str(width)})
    assert res.exit_code == 0, res.output[-2000:]
    return res.output


def test_show_starts_with_the_batch_composition(runs):
    out = _show(runs["chunked-paged"][1])
    assert out.index("batch composition per step") < out.index("worked example")
    rows = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\d+)\s+(\d+)\s{2,}(.*)$", line)
        if m and "batch composition" in out[:out.index(line)] and out.index(line) < out.index("worked example"):
            rows[int(m.group(1))] = (int(m.group(2)), " ".join(m.group(3).split()))
    assert rows == {
        0: (4, "chunk 1/2 T=4 [0..3]"),
        1: (2, "chunk 2/2 T=2 [4..5]"),
        2: (4, "decode @6 chunk 1/2 T=3 [0..2]"),
        3: (3, "decode @7 ■ max_new_tokens chunk 2/2 T=2 [3..4]"),
        4: (1, "decode @5"),
        5: (1, "decode @6 ■ max_new_tokens"),
    }


def test_show_of_one_request_has_no_composition_table(runs):
    out = _show(runs["single"][1])
    assert "batch composition" not in out and "worked example" in out


def test_plain_decode_runs_fold_into_one_row(tiny, tmp_path):
    """Two 1-token prompts decoding side by side for 6 steps: step 0 prefills both, steps 1..4 are plain decodes
    of the same two requests (one row), step 5 finishes both."""
    from rich.console import Console

    from infertrace.present.render_lanes import composition_table
    from infertrace.runner import run_requests

    tr = run_requests(tiny, [PromptSpec("", _p(6), 0, ids=[5]), PromptSpec("", _p(6), 0, ids=[6])],
                      EngineOptions(backend="cells", ctx_size=64))
    con = Console(width=200, record=True)
    con.print(composition_table(build_lanes(tr)))
    lines = [" ".join(x.split()) for x in con.export_text().splitlines()]
    assert "1..4 2/step decode ×4 @1..4 decode ×4 @1..4" in lines
    assert "5 2 decode @5 ■ max_new_tokens decode @5 ■ max_new_tokens" in lines


# ----------------------------------------------------------------------------- report: the lane timeline


def _grid(html: str) -> dict[int, list[str]]:
    sec = html[html.index('<section id="lanes">'):]
    sec = sec[:sec.index("</section>")]
    out = {}
    for sid, body in re.findall(r'<tr data-seq="(\d+)">(.*?)</tr>', sec, re.S):
        out[int(sid)] = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>.*?</td>", body, re.S)]
    return out


def test_report_lanes_chunked_and_preempted(runs):
    html = build_report(runs["chunked-paged"][0])
    assert _grid(html) == {0: ["C1", "C2", "D", "D■", "", ""], 1: ["", "", "C1", "C2", "D", "D■"]}
    assert html.index('id="lanes"') < html.index('id="worked-example"')
    assert _grid(build_report(runs["preempt"][0])) == {0: ["P", "D", "D", "D■", "", "", ""],
                                                      1: ["P", "✗", "", "", "P", "D", "D■"]}
    assert 'id="lanes"' not in build_report(runs["single"][0])


def test_report_cell_title_holds_the_facts(runs):
    html = build_report(runs["chunked-paged"][0])
    sec = html[html.index('<section id="lanes">'):]
    cell = re.search(r'<tr data-seq="1">.*?<td class="ln-chunk" title="([^"]*)">C2</td>', sec, re.S).group(1)
    assert "step 3 · seq 1 · chunk 2/2 T=2" in cell and "positions 3..4" in cell and "blocks / cells after: [2, 3]" in cell


# ----------------------------------------------------------------------------- export: Perfetto


def _by_name(doc) -> dict[str, int]:
    return {e["args"]["name"]: e["tid"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}


def test_perfetto_lanes_on_the_recorded_wall_times(runs):
    tr, d = runs["chunked-paged"]
    t = load_trace(d)  # time_ms merged back from timing.json
    times = json.loads((d / "timing.json").read_text())["steps"]
    ms = {x["step"]: x["time_ms"] for x in times}
    assert all(v > 0 for v in ms.values())
    doc = trace_events(t, str(d))
    tracks = check_trace_events(doc)
    assert doc["otherData"]["time_axis"] == "wall" and "time_ms" in doc["otherData"]["time_axis_meaning"]
    tid = _by_name(doc)
    assert set(tid) == {"steps (whole batch)", "seq 0", "seq 1"}
    start = {s: sum(ms[k] for k in ms if k < s) * 1000 for s in ms}  # end to end, in microseconds
    for seq in (0, 1):
        xs = tracks[tid[f"seq {seq}"]]
        want = {st: per[seq] for st, per in CHUNKED.items() if seq in per}
        assert [e["args"]["step"] for _, _, e in xs] == sorted(want)
        for ts, dur, e in xs:
            st = e["args"]["step"]
            kind, C, T, chunk, fin = want[st]
            assert ts == pytest.approx(start[st], abs=1e-3) and dur == pytest.approx(ms[st] * 1000, abs=1e-3)
            a = e["args"]
            assert (a["kind"], a["num_computed_tokens"], a["tokens"], a.get("chunk", ""), a.get("finished")) == (kind, C, T, chunk, fin)
            assert a["positions"] == (f"{C}..{C + T - 1}" if T > 1 else str(C))
            assert a["blocks_or_cells_after"] == PAGED_BLOCKS[st][seq]
            assert a["shared_with"] == [x for x in CHUNKED[st] if x != seq]
    steps = tracks[tid["steps (whole batch)"]]
    assert [e["args"]["batch_tokens_N"] for _, _, e in steps] == CHUNKED_N


def test_perfetto_without_timings_uses_step_numbers(runs, tmp_path):
    d = tmp_path / "t"
    shutil.copytree(runs["preempt"][1], d)
    (d / "timing.json").unlink()
    doc = trace_events(load_trace(d))
    tracks = check_trace_events(doc)
    assert doc["otherData"]["time_axis"] == "step"
    seq1 = tracks[_by_name(doc)["seq 1"]]
    assert [(ts, dur, e["cat"]) for ts, dur, e in seq1] == [(0.0, 1000.0, "prefill"), (1000.0, 1000.0, "preempted"),
                                                           (4000.0, 1000.0, "prefill"), (5000.0, 1000.0, "decode"),
                                                           (6000.0, 1000.0, "decode")]


def test_the_trace_event_check_rejects_what_the_format_forbids():
    """The structural check itself fails on overlapping slices, ts going back, a track without a name, a bad phase."""
    meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "seq 0"}}]
    x = lambda ts, dur, tid=1: {"name": "s", "ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": tid}  # noqa: E731
    check_trace_events({"traceEvents": meta + [x(0, 10), x(10, 5)]})
    for bad in ([x(0, 10), x(5, 5)], [x(10, 1), x(0, 1)], [x(0, 1, tid=2)], [{**x(0, 1), "ph": "B"}], [{**x(0, 1), "dur": -1}],
                [{**x(0, 1), "ts": "0"}]):
        with pytest.raises(AssertionError):
            check_trace_events({"traceEvents": meta + bad})


def test_served_steps_show_the_unmarked_requests_beside_the_marked():
    """A collected served step (step.vllm.served.batch, vLLM's own request ids and token counts) that ran two
    unmarked requests (3 + 4 tokens) beside the marked one: the table gets an 'unmarked' column '2 req, 7 tok'."""
    from types import SimpleNamespace

    from rich.console import Console

    from infertrace.present.render_lanes import composition_table
    from infertrace.trace.lanes import _unmarked

    st = SimpleNamespace(vllm={"served": {"batch": [{"request_id": "cmpl-a", "num_scheduled_tokens": 1},
                                                    {"request_id": "cmpl-b", "num_scheduled_tokens": 3},
                                                    {"request_id": "cmpl-c", "num_scheduled_tokens": 4}]}})
    assert _unmarked(st, {"cmpl-a"}) == (2, 7)
    assert _unmarked(st, {"cmpl-a", "cmpl-b", "cmpl-c"}) is None
    assert _unmarked(SimpleNamespace(vllm=None), {"cmpl-a"}) is None
    from infertrace.trace.lanes import Lanes, Slot

    lanes = Lanes(seqs=[0, 1], steps=[0], by_seq={0: {0: Slot(seq_id=0, step=0, kind="decode", C=5, T=1)}},
                  n_tokens={0: 1}, unmarked={0: (2, 7)})
    c = Console(width=120, record=True)
    c.print(composition_table(lanes))
    out = c.export_text()
    assert "unmarked" in out and "2 req, 7 tok" in out
