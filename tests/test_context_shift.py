"""Context shift (llama.cpp server n_keep / n_discard) on both backends: generation continues past the
context size, the trace shows the dropped range and the positions closing the gap, the shifted K
equals K computed fresh at the new positions in layer 0 (audit), and both backends agree."""

import pytest

from infertrace.engine.engine import EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.errors import InfertraceError
from infertrace.model.decoder import DecoderModel
from infertrace.model.weights import load_checkpoint
from infertrace.runner import Loaded, PromptSpec, run_requests
from tests.tiny import make_weights, write_gguf

PROMPT = [72, 101, 108, 108, 111, 33, 34, 35, 100, 101]  # 10 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    w, s = make_weights(seed=3)
    ck = load_checkpoint(write_gguf(tmp_path_factory.mktemp("tiny") / "m.gguf", w, s))
    return Loaded(ck, DecoderModel(ck.config, ck.weights))


def _run(tiny, backend, **opts):
    spec = PromptSpec("", SamplingParams(max_new_tokens=20, ignore_eos=True), ids=PROMPT)
    return run_requests(tiny, [spec], EngineOptions(backend=backend, ctx_size=16, tokens_per_block=4, **opts),
                        show=("positions", "mask", "kv"))


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_generation_continues_past_ctx_size_with_traced_positions(tiny, backend):
    tr = _run(tiny, backend, context_shift=True, n_keep=2, audit_kv=True)
    req = tr.requests[0]
    assert len(req["output_ids"]) == 20 and req["stop_reason"] == "max_new_tokens"  # 30 tokens through a 16-token context
    rows = [r for st in tr.steps for r in st.batch]
    shifted = [(st, r) for st in tr.steps for r in st.batch if r.shift]
    assert len(shifted) >= 2
    st, r = shifted[0]
    # n_past = 15 (15 cached + 1 pending = ctx 16): keep 0..1, drop n_discard = (15 - 2) // 2 = 6 -> 2..7, move 8..14 -> 2..8
    assert r.shift["n_past"] == 15 and r.shift["n_discard"] == 6 and r.shift["removed"] == "2..7"
    assert r.shift["moved"] == "8..14 -> 2..8"
    assert all(s.shift["k_shift_max_abs_layer0"] <= 1e-5 for _, s in shifted)  # the trace's own K-shift evidence
    prev = rows[rows.index(r) - 1]
    assert prev.positions == [14] and r.positions == [9]  # the gap closed: next token at position 9, not 15
    assert r.visible == ["0..9"] and r.C == 9
    assert st.mask.logical[0] == [[1] * 10]
    assert max(p for row in rows for p in row.positions) <= 15
    for st in tr.steps:  # the audit: unshifted entries exact everywhere, shifted entries exact in layer 0
        a = st.serving["audit"]
        assert a["max_abs_exact"] <= 1e-5
    last = tr.steps[-1].serving["audit"]
    assert any("shifted by -6" in g["provenance"] for g in last["by_provenance"])


def test_both_backends_shift_alike(tiny):
    a = _run(tiny, "cells", context_shift=True, n_keep=3, n_discard=4)
    b = _run(tiny, "paged", context_shift=True, n_keep=3, n_discard=4)
    assert a.requests[0]["output_ids"] == b.requests[0]["output_ids"]
    sa = [r.shift for st in a.steps for r in st.batch if r.shift]
    # 10 prompt + 5 decoded = 15 cached -> shift to 11; every 4 decodes again: after outputs 6, 10, 14, 18
    assert [s["removed"] for s in sa] == ["3..6"] * 4 and [s["n_past_after"] for s in sa] == [11] * 4


def test_without_context_shift_the_request_stops_ctx_full(tiny):
    tr = _run(tiny, "cells")
    assert tr.requests[0]["stop_reason"] == "ctx_full" and len(tr.requests[0]["output_ids"]) == 6


def test_n_keep_must_leave_room():
    from infertrace.cli.run_options import build_run_inputs

    kw = dict(prompt=["x"], prompts=None, arrival=None, max_new_tokens=4, chat=False, temperature=0.0, top_k=0,
              top_p=1.0, min_p=0.0, repetition_penalty=1.0, seed=0, ignore_eos=False, backend="cells", ctx_size=16,
              num_blocks=None, tokens_per_block=4, max_batch_tokens=64, prefill_chunk=None, attention="auto",
              dtype="float32", device="cpu")
    with pytest.raises(InfertraceError, match="--n-keep 15 leaves nothing"):
        build_run_inputs(**kw, context_shift=True, n_keep=15)
    with pytest.raises(InfertraceError, match="add --context-shift"):
        build_run_inputs(**kw, n_keep=2)
    with pytest.raises(InfertraceError, match="--prefix-cache must be one of"):
        build_run_inputs(**kw, prefix_cache="yes")


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_k_shift_evidence_catches_a_missing_rerotation(tiny, backend, monkeypatch):
    import infertrace.kv.seq_ops as so

    monkeypatch.setattr(so, "rotate_k", lambda k, delta, inv_freq: k)  # a K-shift that forgets to rotate
    tr = _run(tiny, backend, context_shift=True, n_keep=2)
    shifts = [r.shift for st in tr.steps for r in st.batch if r.shift]
    assert shifts and all(s["k_shift_max_abs_layer0"] > 1e-2 for s in shifts)
