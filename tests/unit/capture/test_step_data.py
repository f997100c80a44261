"""The recorder's two halves: the probe's :class:`StepData` crosses a process boundary and gives the same record.

Every step of real runs on the default model (SmolLM2 GGUF; both conventions, chunked prefill with late
arrivals, n-gram speculative decoding, the prefix cache, llama.cpp's non-unified streams, idle steps,
sampling, ``--keep tensors`` on two layers) and on a tiny hybrid (Qwen3.5-type) model is recorded twice:
once from the live step (``Recorder.end_step``), once from its :class:`StepData` sent through JSON text and
safetensors bytes (``to_wire`` -> ``json.dumps`` / ``safetensors.torch.save`` -> ``load`` -> ``from_wire``).
The two StepTraces are equal (``to_dict``) and so are the tensors they keep. ``from_wire`` refuses malformed
data in one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from infertrace.capture.recorder import VARIABLES, Recorder
from infertrace.capture.step_data import StepData
from infertrace.engine.drive import PromptSpec, drive, encode_requests
from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.errors import InfertraceError
from tests.helpers.step_wire import TwinRecorder, same_steps


def _run(loaded, prompts, n, layer=1, tensors=True, **opts):
    rec = TwinRecorder(loaded.tokenizer, loaded.config, layer=layer, show=VARIABLES, layers=[0, 1],
                       tensors={} if tensors else None)
    eng = Engine(loaded.model, loaded.tokenizer, EngineOptions(attention="torch", **opts), rec)
    specs = [p if isinstance(p, PromptSpec) else PromptSpec(p[0], SamplingParams(max_new_tokens=n).validate(), p[1])
             for p in prompts]
    drive(eng, encode_requests(loaded.tokenizer, specs))
    return rec


REP = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3,"
PREFIX = "The capital of France is Paris. The capital of"
SCENARIOS = {
    "cells-batching": ([("The capital of", 0), ("Hello, my name is", 1), ("1, 2, 3,", 3)], 2,
                       dict(backend="cells", prefill_chunk=2)),
    "paged-batching": ([("The capital of", 0), ("Hello, my name is", 1), ("1, 2, 3,", 3)], 2,
                       dict(backend="paged", prefill_chunk=2, tokens_per_block=4)),
    "cells-ngram": ([(REP, 0)], 6, dict(backend="cells", speculative="ngram")),
    "paged-ngram": ([(REP, 0), ("Hello, my name is", 0)], 6, dict(backend="paged", speculative="ngram", tokens_per_block=4)),
    "cells-prefix": ([(PREFIX, 0), (PREFIX + " Spain", 3)], 3, dict(backend="cells", prefix_cache=True)),
    "paged-prefix": ([(PREFIX, 0), (PREFIX + " Spain", 3)], 3, dict(backend="paged", prefix_cache=True, tokens_per_block=4)),
    "cells-streams": ([("The capital of", 0), ("Hello", 0)], 2, dict(backend="cells", kv_unified=False, ctx_size=512, n_seq_max=2)),
    "idle-steps": ([("Hi", 2)], 2, dict(backend="paged")),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_step_data_through_the_wire_records_the_same_step(smol, name):
    prompts, n, opts = SCENARIOS[name]
    rec = _run(smol, prompts, n, **opts)
    same_steps(rec)
    if "ngram" in name:
        assert any(d.spec for d in rec.data) and any(c.verify for d in rec.data for c in d.chunks)
    if "prefix" in name:
        assert any((d.serving or {}).get("prefix") for d in rec.data)
    if name == "idle-steps":
        assert rec.data[0].idle and rec.steps[0].N == 0 and rec.steps[0].kv is not None


def test_sampled_run_keeps_the_sampler_through_the_wire(smol):
    spec = PromptSpec("Once upon a time", SamplingParams(max_new_tokens=3, temperature=0.8, top_k=20, seed=3).validate())
    rec = _run(smol, [spec], 3, backend="cells", sampler_order="llama.cpp")
    same_steps(rec)
    assert rec.steps[-1].decode.per_request[0]["sampler"]["order"] == "llama.cpp"


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from infertrace.runner import load_model
    from tests.helpers.tiny_qwen35 import make_weights, write_hf_dir

    w, s = make_weights(seed=3)
    return load_model(str(write_hf_dir(tmp_path_factory.mktemp("q35") / "hf", w, s)))


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_hybrid_step_data_through_the_wire(hybrid, backend):
    ids = [[72, 101, 108, 108, 111, 72, 101, 108], [33, 34, 35]]
    prompts = [PromptSpec("", SamplingParams(max_new_tokens=4).validate(), 0, False, x) for x in ids]
    rec = _run(hybrid, prompts, 4, backend=backend, speculative="ngram" if backend == "cells" else None)
    same_steps(rec)
    assert all(st.hybrid and "state" in st.hybrid for st in rec.steps) and rec.data[0].recurrent is not None


# ----------------------------------------------------------------------------- untrusted input


@pytest.fixture(scope="module")
def one_step(smol):
    rec = _run(smol, [("The capital of", 0)], 2, backend="cells")
    return rec.data[1].to_wire()


def _mutated(pair, fn):
    d, t = json.loads(json.dumps(pair[0])), dict(pair[1])
    fn(d, t)
    return d, t


@pytest.mark.parametrize("fn, message", [
    (lambda d, t: d.update(version=2), "version is 2"),
    (lambda d, t: d.update(step=-1), "step is -1, not an integer"),
    (lambda d, t: d.update(step=True), "step is True, not an integer"),
    (lambda d, t: d.update(extra=1), "unknown field 'extra'"),
    (lambda d, t: d["chunks"][0].update(T=5), "chunks[0].token_ids has 1 items, not 5..5"),
    (lambda d, t: d.update(N=7), "positions has 1 entries for N = 7"),
    (lambda d, t: t.pop("positions"), "positions names tensor 'positions', which the tensors do not hold"),
    (lambda d, t: t.update(positions=torch.zeros(4)), "positions tensor 'positions' is torch.float32"),
    (lambda d, t: t.update(stray=torch.zeros(1)), "tensors 1 not named by the step data (first: 'stray')"),
    (lambda d, t: t.update({"chunk0/logical": torch.ones(3, 3, dtype=torch.bool)}), "chunks[0].logical has 3 rows for T = 1"),
    (lambda d, t: d["chunks"][0].update(logical_swa="chunk0/logical"), "names tensor 'chunk0/logical' a second time"),
    (lambda d, t: d.update(serving={"a": {1, 2}}), "serving holds a set, not a JSON value"),
    (lambda d, t: d.update(serving=[1]), "serving is a list, not a dict"),
    (lambda d, t: d.update(vllm=[1]), "vllm is a list, not a dict"),  # a runtime's native section: bounded JSON
    (lambda d, t: d.update(vllm={"scheduler": {"free_blocks": {3}}}), "vllm holds a set, not a JSON value"),
    (lambda d, t: d.update(vllm={"slot_mapping": [0] * ((1 << 22) + 1)}), "vllm has a list of 4194305 items"),
    (lambda d, t: d.update(serving={"a": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}),
     "deeper than 32"),
    (lambda d, t: d.update(samples=[[0, 1]]), "samples[0] has 2 items, not 4..4"),
    (lambda d, t: (d.update(logits="logits"), t.update(logits=torch.zeros(2, 3))),
     "logits tensor has shape [2, 3], logits_shape says"),
    (lambda d, t: d["kv"].update(snapshot={1: 2}), "kv.snapshot has a key 1 that is not a string"),
    (lambda d, t: t.update({"chunk0/logical": torch.zeros(1, 1, dtype=torch.bool).expand(1, 1 << 29)}),
     "has shape [1, 536870912], at most 268435456 elements"),
])
def test_from_wire_refuses_malformed_data_in_one_line(one_step, fn, message):
    d, t = _mutated(one_step, fn)
    with pytest.raises(InfertraceError) as e:
        StepData.from_wire(d, t)
    assert message in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("step data: ")


@pytest.mark.parametrize("fn, message", [
    (lambda d, t: d.update(kv=None), "step data: kv is missing (the recorder records kv)"),
    (lambda d, t: d.update(mask=None), "step data: mask is missing (the recorder records mask)"),
    (lambda d, t: d["mask"].pop("rule"), "step data: mask has no 'rule'"),
    (lambda d, t: d["kv"]["describe"].pop("kind"), "step data: kv.describe has no 'kind'"),
    (lambda d, t: (d["chunks"][0].update(k_rows=None, v_rows=None), t.pop("chunk0/k_rows"), t.pop("chunk0/v_rows")),
     "step data: chunks[0].k_rows are missing"),
    (lambda d, t: d.update(spec={"requests": {"0": {"accepted_nodes": ["x"], "emitted": [], "parents": [],
                                                    "drafted": 0, "accepted": 0}}}),
     "step data: spec.requests['0'].accepted_nodes is not a list of integers"),
])
def test_record_refuses_data_lacking_what_it_reads(smol, one_step, fn, message):
    """Data read back may be well-formed yet lack what the recorder reads: one line, not a TypeError."""
    data = StepData.from_wire(*_mutated(one_step, fn))
    rec = Recorder(smol.tokenizer, smol.config, layer=1, show=VARIABLES)
    with pytest.raises(InfertraceError) as e:
        rec.record(data)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_from_wire_refuses_what_is_not_a_mapping(one_step):
    with pytest.raises(InfertraceError, match="step data: step data is a list"):
        StepData.from_wire([], {})
    with pytest.raises(InfertraceError, match="tensors are a list"):
        StepData.from_wire(one_step[0], [])
    StepData.from_wire(*_mutated(one_step, lambda d, t: None))  # the untouched pair reads


def test_native_section_travels_and_is_recorded(smol, one_step):
    """A runtime's native section (``vllm``) is step data: read back from the wire as given, and the recorder writes
    it into the step record (nothing sets it on the record afterwards)."""
    sec = {"scheduler": {"free_blocks": 3, "new_block_ids": {"0": [1, 2]}}, "logits_indices": [0], "kv_readback": None}
    data = StepData.from_wire(*_mutated(one_step, lambda d, t: d.update(vllm=sec)))
    assert data.vllm == sec
    st = Recorder(smol.tokenizer, smol.config, layer=1, show=VARIABLES).record(data)
    assert st.vllm == sec and st.to_dict()["vllm"] == sec
    plain = Recorder(smol.tokenizer, smol.config, layer=1, show=VARIABLES).record(StepData.from_wire(*one_step))
    assert plain.vllm is None and "vllm" not in plain.to_dict()


def test_on_record_sees_each_step_and_its_full_logits(smol):
    """``keep_logits`` asks the probe for the full logits ``[M, V]``; ``on_record`` gets each step's data and record
    (``diff-runtimes vllm`` keeps its float tensors this way), through the wire as well."""
    seen = []
    rec = Recorder(smol.tokenizer, smol.config, layer=1, show=VARIABLES, keep_logits=True,
                   on_record=lambda data, st: seen.append((data, st)))
    eng = Engine(smol.model, smol.tokenizer, EngineOptions(attention="torch", backend="paged"), rec)
    drive(eng, encode_requests(smol.tokenizer, [PromptSpec("Hi", SamplingParams(max_new_tokens=2).validate(), 1)]))
    assert [st for _, st in seen] == rec.steps and seen[0][0].idle and seen[0][0].logits is None
    for data, st in seen[1:]:
        assert data.logits is not None and tuple(data.logits.shape) == data.logits_shape == (1, smol.config.vocab_size)
        from tests.helpers.step_wire import wire

        assert torch.equal(wire(data).logits, data.logits)
    plain = _run(smol, [("Hi", 0)], 1, tensors=False, backend="paged")
    assert all(d.logits is None for d in plain.data)  # not asked: not copied


# ----------------------------------------------------------------------------- breaker: hostile wire data


@pytest.mark.parametrize("fn, message", [
    (lambda d, t: d.update(time_ms=10 ** 400), "step data: time_ms is 1000"),
    (lambda d, t: d.update(time_ms=float("nan")), "step data: time_ms is nan, not a finite number"),
    (lambda d, t: d["samples"][0][2][0].__setitem__(1, 10 ** 400), "step data: samples[0].top logit is 1000"),
    (lambda d, t: t.update({"tap/q/0": torch.empty(1, 9, 64, device="meta")}), "not a dense one with data"),
    (lambda d, t: t.update({"chunk0/logical": torch.ones(1, 4, dtype=torch.bool).to_sparse_csr()}), "not a dense one with data"),
])
def test_from_wire_refuses_numbers_and_tensors_it_cannot_read(one_step, fn, message):
    """An int past float's range gave an OverflowError, a NaN wall time a trace json.dumps refuses later,
    a meta / sparse-CSR tensor a RuntimeError in the recorder."""
    d, t = _mutated(one_step, fn)
    with pytest.raises(InfertraceError) as e:
        StepData.from_wire(d, t)
    assert message in str(e.value) and str(e.value).startswith("step data: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("fn, message", [
    (lambda d, t: d.update(serving={"prefix": "x"}), "step data: serving.prefix is not an object"),
    (lambda d, t: d.update(serving={"ops_before_step": [1]}), "step data: serving.ops_before_step is not a list of objects"),
    (lambda d, t: d.update(spec={"requests": 5}), "step data: spec.requests is a int, not an object"),
    # the recorded layer's cache rows against its K/V taps (the RoPE evidence): RuntimeError today
    (lambda d, t: t.update({"chunk0/k_rows": torch.zeros(1, 7, 5), "chunk0/v_rows": torch.zeros(1, 7, 5)}), "step data: chunks[0].k_rows"),
    (lambda d, t: t.update({"chunk0/k_rows": torch.zeros(0, 3, 64), "chunk0/v_rows": torch.zeros(0, 3, 64)}), "step data: chunks[0].k_rows"),
])
def test_record_refuses_wire_sections_of_the_wrong_shape(smol, one_step, fn, message):
    """Well-formed JSON of the wrong shape reached the recorder: AttributeError ('str' object has no attribute
    'get') on serving / spec, RuntimeError on cache rows whose [n, n_kv, head_dim] do not match the taps."""
    data = StepData.from_wire(*_mutated(one_step, fn))
    rec = Recorder(smol.tokenizer, smol.config, layer=1, show=VARIABLES, layers=[0, 1], tensors={})
    with pytest.raises(InfertraceError) as e:
        rec.record(data)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
