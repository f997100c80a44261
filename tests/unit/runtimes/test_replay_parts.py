"""``--replay`` without vLLM: the replay is the ordinary :class:`Engine` with injected parts
(runtimes/vllm/replay.py: :class:`ReplayScheduler`, a :class:`ForcedSampler` of the plan's tokens and verify
outcomes, :class:`PlanStops`, :class:`ReplayPool`). A paged run of ours on a tiny random model -- chunked
prefill with arrivals, a prefix-cache hit, n-gram verify chunks with rejections, a preemption -- is relabelled
as a vLLM trace (``runtime`` vllm, ``options.vllm`` block size / pool) and replayed: every step's chunks,
positions, block tables, slot mapping, logits rows, sampled / emitted tokens, verify records and prefix hits
equal the source's, and the request outputs and stop reasons too. (The real vLLM replays:
tests/runtimes/vllm/test_vllm.py.)"""

from __future__ import annotations

import pytest

from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.parts import ForcedSampler
from infertrace.engine.sampler import SamplingParams
from infertrace.errors import InfertraceError
from infertrace.runner import PromptSpec

A = [72, 101, 108, 108, 111, 72, 101, 108, 108, 111, 72, 101]  # repeats itself: n-gram drafts
B = [33, 34, 35, 36, 37, 38, 39]
SHARED = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]  # 13 tokens: a hit of 3 whole blocks (vLLM hits whole blocks)


def _p(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


CASES = {
    "chunked": ([PromptSpec("", _p(4), 0, ids=A), PromptSpec("", _p(4), 1, ids=B)],
                EngineOptions(backend="paged", tokens_per_block=4, num_blocks=16, prefill_chunk=3, ctx_size=64)),
    "prefix": ([PromptSpec("", _p(8), 0, ids=SHARED), PromptSpec("", _p(3), 4, ids=SHARED)],
               EngineOptions(backend="paged", tokens_per_block=4, num_blocks=16, prefix_cache=True, ctx_size=64)),
    "spec": ([PromptSpec("", _p(10), 0, ids=A)],
             EngineOptions(backend="paged", tokens_per_block=4, num_blocks=16, speculative="ngram", num_spec_tokens=3,
                           ctx_size=64)),
    "preempt": ([PromptSpec("", _p(6), 0, ids=A[:5]), PromptSpec("", _p(6), 0, ids=B[:4])],
                EngineOptions(backend="paged", tokens_per_block=4, num_blocks=4, ctx_size=16)),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from infertrace.runner import load_model
    from tests.helpers.tiny import make_weights, write_gguf

    w, s = make_weights(seed=5, n_layer=2)
    return load_model(write_gguf(tmp_path_factory.mktemp("tiny") / "m.gguf", w, s))


def _as_vllm(m: dict, opts: EngineOptions) -> dict:
    """Our paged trace dict relabelled as a vLLM one (what plan_from_manifest reads)."""
    return {**m, "runtime": "vllm", "options": {**m["options"], "vllm": {
        "block_size": opts.tokens_per_block, "num_blocks": opts.num_blocks, "enable_prefix_caching": opts.prefix_cache}}}


def _rows(m: dict) -> list:
    keys = ("seq_id", "phase", "C", "T", "token_ids", "positions", "logits_row", "sampled", "finished")
    return [(s["step"], s["preempted"], s["admitted"], s["mask"]["metadata"] if s["batch"] else None,
             [s2["slot_mapping"] for s2 in s["kv"]["per_request"]] if s["batch"] else None,
             [{k: r.get(k) for k in keys} for r in s["batch"]]) for s in m["steps"]]


@pytest.fixture(scope="module")
def replays(tiny):
    from infertrace.runner import run_requests
    from infertrace.runtimes.vllm.replay import plan_from_manifest

    out = {}
    for name, (specs, opts) in CASES.items():
        src = run_requests(tiny, specs, opts).to_dict()
        plan = plan_from_manifest(_as_vllm(src, opts))
        o = EngineOptions(backend="paged", tokens_per_block=opts.tokens_per_block, ctx_size=opts.ctx_size,
                          max_batch_tokens=opts.max_batch_tokens, prefill_chunk=opts.prefill_chunk)
        out[name] = (src, run_requests(tiny, specs, o, replay=plan).to_dict())
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_replay_reproduces_the_schedule_and_tokens(case, replays) -> None:
    src, rep = replays[case]
    assert rep["runtime"] == "infertrace" and len(rep["steps"]) == len(src["steps"])
    assert _rows(rep) == _rows(src)
    assert [(q["output_ids"], q["stop_reason"]) for q in rep["requests"]] == \
        [(q["output_ids"], q["stop_reason"]) for q in src["requests"]]


def test_each_case_exercises_its_part(replays) -> None:
    """The cases do what they are named for, in the source and in the replay."""
    for name, want in (("chunked", "chunk"), ("prefix", "prefix"), ("spec", "spec"), ("preempt", "preempted")):
        for m in replays[name]:
            rows = [r for s in m["steps"] for r in s["batch"]]
            got = {"chunk": any(r["phase"] == "prefill" and r["C"] > 0 for r in rows),
                   "prefix": any((r.get("prefix") or {}).get("hit") for r in rows),
                   "spec": any(r.get("spec") and r["spec"]["accepted"] < r["spec"]["drafted"] for r in rows)
                   and any(r.get("spec") and r["spec"]["accepted"] > 0 for r in rows),
                   "preempted": any(s["preempted"] for s in m["steps"])}[want]
            assert got, (name, m["runtime"])


def test_replayed_verify_and_prefix_records(replays) -> None:
    """A verify's drafts, accepted nodes and emitted tokens, and a prefix hit's shared blocks (held by both
    requests: ref_cnt 2), are the source's."""
    for name, key in (("spec", "spec"), ("prefix", "prefix")):
        src, rep = replays[name]
        for a, b in zip(src["steps"], rep["steps"]):
            for ra, rb in zip(a["batch"], b["batch"]):
                if ra.get(key) and (key == "spec" or ra[key]["hit"]):
                    fields = (("drafted", "accepted", "accepted_nodes", "emitted", "parents", "position_offsets") if key == "spec"
                              else ("hit", "prompt_len", "shared_blocks", "ref_cnt", "computed"))
                    assert {f: rb[key][f] for f in fields} == {f: ra[key][f] for f in fields}, (name, a["step"])
                    assert key == "spec" or ra[key]["ref_cnt"] == [2, 2, 2]


def test_replay_engine_is_an_engine_with_injected_parts(tiny, replays) -> None:
    from infertrace.runtimes.vllm.replay import PlanStops, ReplayScheduler, plan_from_manifest, replay_engine

    src, _ = replays["spec"]
    specs, opts = CASES["spec"]
    plan = plan_from_manifest(_as_vllm(src, opts))
    eng = replay_engine(tiny.model, tiny.tokenizer, EngineOptions(backend="paged", tokens_per_block=4, ctx_size=64),
                        _null(), plan)
    assert type(eng) is Engine and type(eng).step is Engine.step
    assert isinstance(eng.scheduler, ReplayScheduler) and isinstance(eng.sampler, ForcedSampler)
    assert isinstance(eng.stop_rule, PlanStops) and eng.opts.num_blocks == plan["num_blocks"]
    assert eng.sampler.verified  # the plan's verify outcomes, by (seq_id, step)
    with pytest.raises(InfertraceError, match="differs from the vLLM trace"):
        eng.add_request([1, 2, 3], _p(2))


def _null():
    from infertrace.model.taps import NULL_TRACER

    return NULL_TRACER


def test_replay_refuses_options_that_do_not_match(tiny, replays) -> None:
    from infertrace.runtimes.vllm.replay import plan_from_manifest, replay_engine

    src, _ = replays["chunked"]
    plan = plan_from_manifest(_as_vllm(src, CASES["chunked"][1]))
    for opts, msg in ((EngineOptions(backend="cells"), "add --backend paged"),
                      (EngineOptions(backend="paged", tokens_per_block=8), "pass --tokens-per-block 4"),
                      (EngineOptions(backend="paged", tokens_per_block=4, num_blocks=9), "pass --num-blocks 16"),
                      (EngineOptions(backend="paged", tokens_per_block=4, prefix_cache=True), "drop --prefix-cache")):
        with pytest.raises(InfertraceError, match=msg):
            replay_engine(tiny.model, tiny.tokenizer, opts, _null(), plan)


# ----------------------------------------------------------------------------- breaker: a hostile vLLM trace


def test_replay_refuses_block_tables_not_one_per_scheduled_request(replays) -> None:
    """A step with fewer block-table rows than scheduled requests gave 'internal error: IndexError' (exit 1)."""
    import copy

    from infertrace.runtimes.vllm.replay import plan_from_manifest

    src, _ = replays["chunked"]
    m = copy.deepcopy(_as_vllm(src, CASES["chunked"][1]))
    st = next(s for s in m["steps"] if len(s["batch"]) == 2)
    st["mask"]["metadata"]["block_tables"].pop()
    with pytest.raises(InfertraceError, match=f"step {st['step']} has 1 block tables for 2 scheduled requests"):
        plan_from_manifest(m)


def test_replay_refuses_a_plan_preempting_a_request_of_no_run(tiny, replays) -> None:
    """A plan preempting (or scheduling) a seq_id that never arrived gave 'internal error: KeyError: 7' (exit 1)."""
    from infertrace.runner import run_requests
    from infertrace.runtimes.vllm.replay import plan_from_manifest

    src, _ = replays["chunked"]
    specs, opts = CASES["chunked"]
    o = EngineOptions(backend="paged", tokens_per_block=4, ctx_size=64, max_batch_tokens=opts.max_batch_tokens,
                      prefill_chunk=opts.prefill_chunk)
    for key, what in (("preempted", "preempts"), ("chunk", "schedules")):
        plan = plan_from_manifest(_as_vllm(src, opts))
        if key == "preempted":
            plan["steps"][1]["preempted"] = [7]
        else:
            plan["steps"][1]["chunks"][0]["seq_id"] = 7
        with pytest.raises(InfertraceError, match=f"replay step 1: the vLLM trace {what} seq 7, which has not arrived"):
            run_requests(tiny, specs, o, replay=plan)


def _chunked_run_inputs(replays):
    from infertrace.runtimes.vllm.replay import plan_from_manifest

    src, _ = replays["chunked"]
    specs, opts = CASES["chunked"]
    o = EngineOptions(backend="paged", tokens_per_block=4, ctx_size=64, max_batch_tokens=opts.max_batch_tokens,
                      prefill_chunk=opts.prefill_chunk)
    return specs, o, plan_from_manifest(_as_vllm(src, opts))


def test_replay_refuses_a_plan_that_ends_before_its_requests_finish(tiny, replays) -> None:
    """A vLLM trace cut after step 1 (or with no steps) replayed to exit 0 with 'stop: None' outputs: a partial run
    passed off as the replay of the whole one. Expected: one line saying the trace ends before request N finished."""
    from infertrace.runner import run_requests

    specs, o, plan = _chunked_run_inputs(replays)
    plan["steps"] = {k: v for k, v in plan["steps"].items() if k <= 1}
    plan["last_step"] = 1
    with pytest.raises(InfertraceError, match="finish"):
        run_requests(tiny, specs, o, replay=plan)


def test_replay_refuses_one_block_in_two_tables_without_the_prefix_cache(tiny, replays) -> None:
    """Two requests' tables naming the same block with the prefix cache off (vLLM never shares a block then)
    replayed to exit 0: the second request's K/V overwrote the first's in the shared block."""
    from infertrace.runner import run_requests

    specs, o, plan = _chunked_run_inputs(replays)
    st = next(s for s in plan["steps"].values() if len(s["chunks"]) == 2 and all(c["table"] for c in s["chunks"]))
    st["chunks"][1]["table"][0] = st["chunks"][0]["table"][0]
    with pytest.raises(InfertraceError, match="block"):
        run_requests(tiny, specs, o, replay=plan)
