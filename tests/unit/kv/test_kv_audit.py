"""--audit-kv: provenance of every cached entry and a from-scratch recomputation (clean runs <= 1e-5 on both
backends, through chunked prefill, prefix hits and a rewind; a corrupted entry is caught and named), and
case P5 (a pool smaller than the context stops the request with kv_full, other requests finish)."""

import pytest
import torch

from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.errors import InfertraceError
from infertrace.model.decoder import DecoderModel
from infertrace.loading.weights import load_checkpoint
from infertrace.runner import Loaded, PromptSpec, run_requests
from tests.helpers.tiny import make_weights, write_gguf

BACKENDS = ["cells", "paged"]
A = list(range(40, 58))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    w, s = make_weights(seed=13)
    ck = load_checkpoint(write_gguf(tmp_path_factory.mktemp("tiny") / "m.gguf", w, s))
    return Loaded(ck, DecoderModel(ck.config, ck.weights))


def _engine(tiny, backend, **kw):
    return Engine(tiny.model, tiny.tokenizer, EngineOptions(backend=backend, tokens_per_block=4, audit_kv=True, **kw))


@pytest.mark.parametrize("backend", BACKENDS)
def test_clean_run_audits_below_1e5_with_every_provenance(tiny, backend):
    specs = [PromptSpec("", SamplingParams(max_new_tokens=4, ignore_eos=True), a, ids=ids)
             for ids, a in ((A, 0), (A[:13] + [1, 2], 2))]
    tr = run_requests(tiny, specs, EngineOptions(backend=backend, tokens_per_block=4, prefill_chunk=7,
                                                 prefix_cache=True, audit_kv=True), show=("kv",))
    labels = set()
    for st in tr.steps:
        a = st.serving["audit"]
        assert a["max_abs"] <= 1e-5, (st.step, a)
        labels |= {g["provenance"] for g in a["by_provenance"]}
    assert {"chunk 0", "chunk 1", "chunk 2", "decode", "prefix hit from request 0", "prefill"} <= labels


@pytest.mark.parametrize("backend", BACKENDS)
def test_rewind_provenance_and_clean_audit(tiny, backend):
    e = _engine(tiny, backend)
    r = e.add_request(A[:8], SamplingParams(max_new_tokens=8, ignore_eos=True))
    for _ in range(5):
        e.step()
    e.serving.rewind(r, 10)
    a = e.serving.run_audit()
    rows = {g["provenance"]: g for g in a["by_provenance"]}
    assert rows["prefill, kept after rewind"]["entries"] == 8 and rows["decode, kept after rewind"]["entries"] == 2
    assert a["max_abs"] <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_audit_catches_a_corrupted_entry(tiny, backend):
    e = _engine(tiny, backend, prefix_cache=True)
    e.add_request(A, SamplingParams(max_new_tokens=6, ignore_eos=True))
    e.add_request(A[:13] + [1, 2], SamplingParams(max_new_tokens=6, ignore_eos=True), arrival_step=2)
    for _ in range(4):
        e.step()
    assert e.serving.run_audit()["max_abs"] <= 1e-5
    # corrupt position 3 of seq 1 in layer 1 (an entry seq 1 got from a prefix hit on request 0)
    if backend == "cells":
        cell = e.kv.cells_of(1)[3][0]
        e.kv.k[1][cell, 0, 0] += 0.25
    else:
        slot = e.kv.slot(1, 3)
        e.kv.pool[1][slot // 4, 0, 0, slot % 4, 0] += 0.25
    a = e.serving.run_audit()
    assert a["worst"]["pos"] == 3 and a["worst"]["layer"] == 1
    assert abs(a["max_abs"] - 0.25) < 1e-3
    rows = {g["provenance"]: g for g in a["by_provenance"]}
    # the entry is shared: both owners see it (seq 0 computed it, seq 1 got it from the prefix hit)
    for label in ("prefill", "prefix hit from request 0"):
        assert rows[label]["max_abs_k"] >= 0.25 - 1e-3 and rows[label]["max_abs_layer0"] <= 1e-5
    assert rows["decode"]["max_abs_k"] <= 1e-5


def test_p5_pool_smaller_than_context(tiny):
    """Case P5: 2 blocks of 4 tokens, default context: the 4-token prompt stops with kv_full once the pool is
    full, with output; a request sharing the pool finishes normally; a prompt larger than the pool is refused
    up front with a message that names the pool."""
    p = SamplingParams(max_new_tokens=10, ignore_eos=True)
    opts = EngineOptions(backend="paged", num_blocks=2, tokens_per_block=4)
    tr = run_requests(tiny, [PromptSpec("", p, ids=A[:4])], opts, show=("kv",))
    r = tr.requests[0]
    assert r["stop_reason"] == "kv_full" and len(r["output_ids"]) == 5  # positions 0..7 cached, an 8th needs a 3rd block
    assert any(st.serving and st.serving.get("stopped") == {"0": "kv_full"} for st in tr.steps)
    both = run_requests(tiny, [PromptSpec("", p, ids=A[:4]), PromptSpec("", SamplingParams(max_new_tokens=2, ignore_eos=True), ids=A[4:7])],
                        opts, show=("kv",))
    assert both.requests[0]["stop_reason"] == "kv_full" and both.requests[1]["stop_reason"] == "max_new_tokens"
    e = Engine(tiny.model, tiny.tokenizer, opts)
    with pytest.raises(InfertraceError, match="KV pool holds 8"):
        e.add_request(A[:9])


def test_audit_cli_renders_table(tiny, tmp_path):
    from typer.testing import CliRunner

    from infertrace.cli.app import app
    from tests.helpers.tiny import make_weights, write_gguf

    w, s = make_weights(seed=13)
    path = write_gguf(tmp_path / "m.gguf", w, s)
    res = CliRunner().invoke(app, ["run", "-m", str(path), "-p", "hello hello", "-p", "hello help", "--arrival", "0",
                                   "--arrival", "3", "-n", "2", "--backend", "paged", "--tokens-per-block", "4",
                                   "--prefix-cache", "on", "--audit-kv", "--show", "kv"])
    assert res.exit_code == 0, res.output
    assert "prefix lookup: hit" in res.output and "KV audit" in res.output and "prefix hit from request 0" in res.output
    bad = CliRunner().invoke(app, ["run", "-m", str(path), "-p", "x", "--prefix-cache", "maybe"])
    assert bad.exit_code == 2 and "--prefix-cache must be one of on, off" in bad.output
