"""Context shift (llama.cpp server n_keep / n_discard) on both backends: generation continues past the
context size, the trace shows the dropped range and the positions closing the gap, the shifted K
equals K computed fresh at the new positions in layer 0 (audit), and both backends agree."""

import pytest

from infertrace.engine.engine import EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.errors import InfertraceError
from infertrace.model.decoder import DecoderModel
from infertrace.loading.weights import load_checkpoint
from infertrace.runner import Loaded, PromptSpec, run_requests
from tests.helpers.tiny import make_weights, write_gguf

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
    with pytest.raises(InfertraceError, match="^serving.n_keep: 13 leaves nothing to shift in a context of 16 tokens"):  # llama.cpp keeps at most n_ctx - 4 = 12
        build_run_inputs(**kw, context_shift=True, n_keep=13)
    build_run_inputs(**kw, context_shift=True, n_keep=12)
    with pytest.raises(InfertraceError, match="^serving.n_keep: sets how a context shift works; it needs context_shift on$"):
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


# ----------------------------------------------------------------------------- case C1: the BOS stays


@pytest.fixture(scope="module")
def tiny_bos(tmp_path_factory):
    w, s = make_weights(seed=3)
    ck = load_checkpoint(write_gguf(tmp_path_factory.mktemp("bos") / "m.gguf", w, s, add_bos=True))
    return Loaded(ck, DecoderModel(ck.config, ck.weights))


@pytest.mark.parametrize("backend", ["cells", "paged"])
@pytest.mark.parametrize("n_keep, removed, moved, kept", [(0, "1..5", "6..10 -> 1..5", 1), (2, "3..6", "7..10 -> 3..6", 3)])
def test_context_shift_keeps_the_bos(tiny_bos, backend, n_keep, removed, moved, kept):
    """Case C1 (llama.cpp server: n_keep += add_bos, n_discard = (n_past - n_keep) / 2): prompt "abcde" ->
    [BOS, 97..101], ctx 12, 10 new tokens. The shift fires at n_past 11; --n-keep 0 keeps the BOS cell
    (n_keep 1, n_discard 5: drop 1..5), --n-keep 2 keeps 3 (n_discard 4: drop 3..6)."""
    spec = PromptSpec("abcde", SamplingParams(max_new_tokens=10, ignore_eos=True))
    tr = run_requests(tiny_bos, [spec], EngineOptions(backend=backend, ctx_size=12, tokens_per_block=4, context_shift=True,
                                                      n_keep=n_keep, audit_kv=True), show=("positions", "kv"))
    assert tr.requests[0]["prompt_ids"][1:] == [97, 98, 99, 100, 101]
    assert tr.requests[0]["prompt_ids"][0] == tiny_bos.tokenizer.bos_id == 257  # <|endoftext|>, VOCAB - 2
    shifts = [r.shift for st in tr.steps for r in st.batch if r.shift]
    s = shifts[0]
    assert (s["n_past"], s["n_keep"], s["removed"], s["moved"]) == (11, kept, removed, moved)
    assert s["k_shift_max_abs_layer0"] <= 1e-5
    if backend == "cells":  # the BOS cell is never freed
        rm = s["detail"]["steps"][1]
        assert rm["freed"] == removed
    last = tr.steps[-1].serving["audit"]
    assert last["max_abs_exact"] <= 1e-5
    assert any(g["provenance"] == "prefill" and g["entries"] == kept for g in last["by_provenance"])


# ----------------------------------------------------------------------------- cases C2 and C3: the model's own RoPE


def _shift_run(loaded, backend, **kw):
    spec = PromptSpec("", SamplingParams(max_new_tokens=14, ignore_eos=True), ids=PROMPT)
    return run_requests(loaded, [spec], EngineOptions(backend=backend, ctx_size=16, tokens_per_block=4, context_shift=True,
                                                      n_keep=2, **kw), show=("positions",))


@pytest.fixture(scope="module")
def yarn(tmp_path_factory):
    from tests.helpers.tiny import write_hf

    w, s = make_weights(seed=11)
    d = write_hf(tmp_path_factory.mktemp("yarn") / "hf", w, s,
                 rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    ck = load_checkpoint(d)
    return Loaded(ck, DecoderModel(ck.config, ck.weights))


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_k_shift_evidence_uses_yarns_cos_sin_factor(yarn, backend, monkeypatch):
    """Case C3: rope_scaling yarn x4 (original 64): K carries YaRN's cos/sin factor 0.1 ln 4 + 1 = 1.1386, so
    the trace's own K-shift check must too: <= 1e-5 on a correct shift (~0.33 without the factor), and a
    shift that forgets to rotate is still caught."""
    import math

    from infertrace.model.rope import layer_ropes

    assert layer_ropes(yarn.model.cfg)[0].mscale == pytest.approx(0.1 * math.log(4) + 1, abs=1e-12)
    shifts = [r.shift for st in _shift_run(yarn, backend, audit_kv=True).steps for r in st.batch if r.shift]
    assert shifts and all(s["k_shift_max_abs_layer0"] <= 1e-5 for s in shifts)
    import infertrace.kv.seq_ops as so

    monkeypatch.setattr(so, "rotate_k", lambda k, delta, inv_freq: k)
    shifts = [r.shift for st in _shift_run(yarn, backend).steps for r in st.batch if r.shift]
    assert shifts and all(s["k_shift_max_abs_layer0"] > 1e-2 for s in shifts)


@pytest.mark.parametrize("family", ["gemma3", "qwen2", "qwen3"])
@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_context_shift_on_families_with_their_own_k_path(tmp_path, family, backend):
    """Case C2 end to end: --context-shift runs on Gemma 3 (a RoPE base per layer, embedding scale, QK-norm)
    and on Qwen2 (K bias) / Qwen3 (QK-norm); the trace's K-shift evidence and the audit stay <= 1e-5."""
    w, s = make_weights(family=family, n_layer=6 if family == "gemma3" else 2, seed=5)
    kv = {"attention.sliding_window": 4, "final_logit_softcapping": 3.0} if family == "gemma3" else None
    ck = load_checkpoint(write_gguf(tmp_path / "m.gguf", w, s, kv=kv))
    loaded = Loaded(ck, DecoderModel(ck.config, ck.weights))
    tr = _shift_run(loaded, backend, audit_kv=True)
    shifts = [r.shift for st in tr.steps for r in st.batch if r.shift]
    assert len(tr.requests[0]["output_ids"]) == 14 and shifts
    assert all(s["k_shift_max_abs_layer0"] <= 1e-5 for s in shifts)
    assert all(st.serving["audit"]["max_abs_exact"] <= 1e-5 for st in tr.steps)
    if family == "gemma3":  # the positions record describes the traced layer 0's RoPE: windowed, base 10000
        p = tr.steps[0].positions
        assert p.theta == 10000.0 and p.inv_freq_first[1] == pytest.approx(10000.0 ** (-2 / 8), rel=1e-6)


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2", "qwen3"])
def test_layer0_k_equals_the_decoders_layer0(tmp_path, family):
    """The K-shift reference (layer0_k) is the decoder's own layer-0 K: same embedding scale, bias, K-norm
    and the layer's RoPE (Gemma 3 layer 0 is windowed: base 10000)."""
    from infertrace.kv.audit import layer0_k, recompute_kv

    w, s = make_weights(family=family, n_layer=6 if family == "gemma3" else 2, seed=9)
    kv = {"attention.sliding_window": 4} if family == "gemma3" else None
    ck = load_checkpoint(write_gguf(tmp_path / "m.gguf", w, s, kv=kv))
    m = DecoderModel(ck.config, ck.weights)
    fk, _ = recompute_kv(m, PROMPT)
    assert (layer0_k(m, PROMPT, range(len(PROMPT))) - fk[0]).abs().max() <= 1e-6
