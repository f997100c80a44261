"""Continuous batching on a tiny random model (fast) and the real model: preemption with
recompute, late arrivals, budgets, and every cell/block free at the end."""

import pytest
import torch

from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.errors import InfertraceError
from infertrace.model.decoder import DecoderModel
from infertrace.loading.weights import load_checkpoint
from tests.helpers.tiny import make_weights, write_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    w, s = make_weights(seed=5)
    ck = load_checkpoint(write_gguf(tmp_path_factory.mktemp("tiny") / "m.gguf", w, s))
    return ck, DecoderModel(ck.config, ck.weights)


PROMPTS = [[72, 101, 108, 108, 111], [33, 34, 35], [100, 101, 102, 103, 104, 105, 106], [7]]


def _run(tiny, prompts, arrivals=None, params=None, **opts):
    ck, m = tiny
    e = Engine(m, ck.tokenizer, EngineOptions(**opts))
    for i, p in enumerate(prompts):
        e.add_request(p, params or SamplingParams(max_new_tokens=12, ignore_eos=True), (arrivals or [0] * len(prompts))[i])
    steps = []
    while (b := e.step()) is not None:
        steps.append(b)
    return e, steps


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_preemption_then_recompute_gives_same_tokens(tiny, backend):
    ref, _ = _run(tiny, PROMPTS, backend=backend, ctx_size=256, tokens_per_block=4)
    # paged: 8 blocks x 4 tokens = 32 slots for 4 requests that grow to 5+12, 3+12, 7+12, 1+12 tokens
    small = dict(num_blocks=8, tokens_per_block=4) if backend == "paged" else dict(ctx_size=30)
    e, steps = _run(tiny, PROMPTS, backend=backend, **small)
    assert sum(len(b.preempted) for b in steps) >= 1
    assert any(r.num_preemptions for r in e.requests.values())
    assert [r.output_ids for r in e.requests.values()] == [r.output_ids for r in ref.requests.values()]
    # everything freed at the end
    if backend == "paged":
        assert len(e.kv.free) == e.kv.num_blocks and not e.kv.tables
    else:
        assert e.kv.used == 0


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_late_arrivals_budget_and_release(tiny, backend):
    e, steps = _run(tiny, PROMPTS, arrivals=[0, 2, 2, 5], backend=backend, max_batch_tokens=4, prefill_chunk=2,
                    tokens_per_block=4)
    solo = [_run(tiny, [p], backend=backend)[0].requests[0].output_ids for p in PROMPTS]
    assert [r.output_ids for r in e.requests.values()] == solo
    assert all(b.N <= 4 for b in steps)
    first_step = {}
    for b in steps:
        for c in b.chunks:
            first_step.setdefault(c.req.seq_id, b.step)
    assert first_step[0] == 0 and first_step[1] >= 2 and first_step[2] >= 2 and first_step[3] >= 5
    assert any({c.phase for c in b.chunks} == {"prefill", "decode"} for b in steps)
    if backend == "paged":
        assert len(e.kv.free) == e.kv.num_blocks
    else:
        assert e.kv.used == 0


def test_finished_request_frees_while_others_continue(tiny):
    ck, m = tiny
    e = Engine(m, ck.tokenizer, EngineOptions(backend="paged", tokens_per_block=4))
    e.add_request(PROMPTS[0], SamplingParams(max_new_tokens=2, ignore_eos=True))
    e.add_request(PROMPTS[2], SamplingParams(max_new_tokens=10, ignore_eos=True))
    for _ in range(3):
        e.step()
    assert e.requests[0].status == "finished" and 0 not in e.kv.tables
    assert e.requests[1].status == "running" and e.kv.seq_len(1) == 9 and len(e.kv.tables[1]) == 3  # 7 prompt + 2 decode tokens cached -> 3 blocks of 4


def test_seeded_sampling_same_in_batch_and_solo(tiny):
    p = SamplingParams(temperature=0.9, top_k=20, seed=11, max_new_tokens=8, ignore_eos=True)
    solo = _run(tiny, [PROMPTS[1]], params=p)[0].requests[0].output_ids
    both = _run(tiny, [PROMPTS[0], PROMPTS[1]], params=p)[0]
    assert both.requests[1].output_ids == solo


def test_prompt_longer_than_context_is_refused(tiny):
    ck, m = tiny
    e = Engine(m, ck.tokenizer, EngineOptions(ctx_size=4))
    with pytest.raises(InfertraceError, match="prompt has 5 tokens but the context holds 4"):
        e.add_request(PROMPTS[0])


def test_request_larger_than_pool_stops_kv_full(tiny):
    """Case P5: the request stops with kv_full when the pool is full; the run is not aborted."""
    ck, m = tiny
    e = Engine(m, ck.tokenizer, EngineOptions(backend="paged", num_blocks=2, tokens_per_block=4, ctx_size=64))
    e.add_request(PROMPTS[2], SamplingParams(max_new_tokens=20, ignore_eos=True))
    e.run()
    r = e.requests[0]
    assert r.stop_reason == "kv_full" and len(r.output_ids) == 2  # 7 prompt + 1 decoded = 8 slots, the next needs a 3rd block
    assert len(e.kv.free) == 2
