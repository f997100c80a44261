"""Request lanes of a real ``run --runtime vllm`` trace held to vLLM's own scheduler: every lane slot's
``C`` / ``T`` is the ``num_computed_tokens`` / ``num_scheduled_tokens`` of vLLM's ``SchedulerOutput`` for that
step (the objects its ``Scheduler.schedule`` returned, kept by the session engine as ``VllmRun.outs``), and
the kinds follow from vLLM's own numbers: a ``verify`` when vLLM scheduled spec tokens for the request (its -1
placeholder drafts beside a prompt's last token included: scheduler.py pads a new request with one token left),
else a prefill while ``num_computed_tokens`` is below the prompt length (a ``chunk`` unless one step took the
whole rest of the prompt), else ``decode``; a prefix hit is vLLM's ``num_computed_tokens`` of the
request's first schedule (``NewRequestData``).

Scenario (session engine of tests/helpers/vllm_shared.py: SmolLM2, block 32, long_prefill_token_threshold 8,
prefix caching and 3 n-gram drafts on): seq 0 = 33 tokens at step 0, seq 1 = a 19-token prompt at step 1
(vLLM chunks it while seq 0 decodes), seq 2 = seq 0's prompt again at step 6, after seq 0's first block of
32 tokens is computed and hashed (a hit of 32; vLLM pads its one token left with placeholder drafts).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.engine.sampler import SamplingParams
from infertrace.runner import PromptSpec
from tests.helpers.trace_events import check_trace_events
from tests.helpers.vllm_shared import LAYER, OPTS

pytestmark = [pytest.mark.model, pytest.mark.vllm]

P33 = "The quick brown fox jumps over the lazy dog. " * 3 + "The end."
P20 = "One, two, three, four, five, six, seven, eight, nine, ten"


@pytest.fixture(scope="module")
def served(smol, vllm_run, tmp_path_factory):
    from infertrace.runtimes.vllm.runtime import run_requests_vllm
    from infertrace.trace.store import save_trace

    p = SamplingParams(max_new_tokens=3, ignore_eos=True)
    specs = [PromptSpec(P33, p, 0), PromptSpec(P20, p, 1), PromptSpec(P33, p, 6)]
    trace = run_requests_vllm(smol, specs, OPTS, layer=LAYER, run=vllm_run)
    outs = [so for so, *_ in vllm_run.outs]
    d = tmp_path_factory.mktemp("lanes") / "vllm"
    save_trace(trace, d)
    return trace, d, outs


def _seq(rid: str) -> int:
    from infertrace.runtimes.vllm.engine import _ours

    o = _ours(rid)
    return int(o[o.rindex("s") + 1:])


def _vllm_steps(outs) -> list[dict[int, tuple[int, int, bool, bool]]]:
    """Per busy step, vLLM's own view: {seq: (num_computed_tokens, num_scheduled_tokens, new, has spec tokens)}."""
    steps = []
    for so in outs:
        if not so.num_scheduled_tokens:
            continue
        computed = {r.req_id: (r.num_computed_tokens, True) for r in so.scheduled_new_reqs}
        cr = so.scheduled_cached_reqs
        computed.update({rid: (n, False) for rid, n in zip(cr.req_ids, cr.num_computed_tokens)})
        spec = so.scheduled_spec_decode_tokens or {}
        steps.append({_seq(rid): (computed[rid][0], n, computed[rid][1], bool(spec.get(rid)))
                      for rid, n in so.num_scheduled_tokens.items()})
    return steps


def outs_spec(outs, st, sid, busy) -> list[int]:
    """vLLM's scheduled spec tokens of ``sid`` in the busy step ``st``."""
    so = [o for o in outs if o.num_scheduled_tokens][busy.index(st)]
    rid = next(r for r in so.num_scheduled_tokens if _seq(r) == sid)
    return list(so.scheduled_spec_decode_tokens[rid])


def test_lanes_are_vllms_num_computed_and_num_scheduled_tokens(served, smol):
    from infertrace.trace.lanes import build_lanes

    trace, _, outs = served
    lanes = build_lanes(trace)
    busy = [s for s in lanes.steps if lanes.at(s)]
    want = _vllm_steps(outs)
    assert len(busy) == len(want)
    n_prompt = {0: len(smol.tokenizer.encode(P33)), 1: len(smol.tokenizer.encode(P20)), 2: len(smol.tokenizer.encode(P33))}
    assert n_prompt[0] == 33
    first_c: dict[int, int] = {}
    shared = 0
    for st, v in zip(busy, want):
        got = {s.seq_id: s for s in lanes.at(st)}
        assert set(got) == set(v), st
        shared += len(v) > 1
        for sid, (C, T, new, spec) in v.items():
            s = got[sid]
            assert (s.C, s.T) == (C, T), (st, sid)
            if new:
                first_c[sid] = C
                assert s.hit == C  # vLLM's num_computed_tokens at admission = the prefix hit
            if spec:  # vLLM scheduled drafts (placeholder -1 drafts too, beside a prompt's last token): a verify
                assert s.kind == "verify" and s.drafted == len(outs_spec(outs, st, sid, busy)), (st, sid, s.kind)
            elif C < n_prompt[sid]:
                whole = C == first_c[sid] and C + T >= n_prompt[sid]
                assert s.kind == ("prefill" if whole else "chunk"), (st, sid, s.kind)
            else:
                assert s.kind == "decode", (st, sid, s.kind)
        # the trace's own copy of vLLM's scheduler records agrees too
        rec = {x["seq_id"]: (x["num_computed_tokens"], x["num_scheduled_tokens"])
               for x in trace.steps[lanes.steps.index(st)].vllm["scheduler"]["scheduled"]}
        assert rec == {sid: (C, T) for sid, (C, T, _, _) in v.items()}
    assert first_c[2] == 32 and first_c[0] == first_c[1] == 0  # seq 2 hit seq 0's hashed block
    assert shared >= 2  # seq 1's prefill chunks shared steps with seq 0's decodes
    # seq 1 (19 tokens) arrived while seq 0 ran: vLLM cut its prefill at long_prefill_token_threshold 8
    chunks1 = [s for s in lanes.by_seq[1].values() if s.kind == "chunk"]
    assert n_prompt[1] == 19 and [s.T for s in chunks1] == [8, 8, 3] and {s.chunks for s in chunks1} == {3}


def test_saved_vllm_trace_shows_and_exports_the_same_lanes(served, tmp_path):
    trace, d, outs = served
    r = CliRunner()
    res = r.invoke(app, ["show", str(d)], env={"COLUMNS": "220"})
    assert res.exit_code == 0, res.output[-2000:]
    assert res.output.index("batch composition per step") < res.output.index("worked example")
    assert "hit 32" in res.output
    out = tmp_path / "p.json"
    assert r.invoke(app, ["export", str(d), "-o", str(out)]).exit_code == 0
    doc = json.loads(out.read_text())
    tracks = check_trace_events(doc)
    assert doc["otherData"]["time_axis"] == "wall" and doc["otherData"]["runtime"] == "vllm"  # vLLM's step times recorded
    names = {e["args"]["name"]: e["tid"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    want = _vllm_steps(outs)
    got = [(e["args"]["seq_id"], e["args"]["num_computed_tokens"], e["args"]["tokens"])
           for sid in (0, 1, 2) for _, _, e in tracks[names[f"seq {sid}"]]]
    assert sorted(got) == sorted((sid, C, T) for v in want for sid, (C, T, _, _) in v.items())
