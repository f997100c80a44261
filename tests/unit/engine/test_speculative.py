"""Speculative decoding on a tiny random model (both backends): greedy speculative output equals
plain greedy token for token (chain K = 1, 3, 5 and trees; n-gram and layer-skip drafts; other
requests in the batch; chunked prefill); after a rejection the cache holds exactly the accepted
positions with the K/V a plain run computes for them; the verify mask in kq_mask rows and in the
TensorRT-LLM packed form equals the ancestor relation; bad options are one-line errors."""

import pytest
import torch

from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.engine.speculative import parse_tree
from infertrace.errors import ConfigError, InfertraceError
from infertrace.kv.base import ChunkSpec
from infertrace.kv.spec_meta import pack_mask, spec_metadata, unpack_mask
from infertrace.model.decoder import DecoderModel
from infertrace.loading.weights import load_checkpoint
from tests.helpers.tiny import make_weights, write_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    w, s = make_weights(seed=5, n_layer=3)
    ck = load_checkpoint(write_gguf(tmp_path_factory.mktemp("spec") / "m.gguf", w, s))
    return ck, DecoderModel(ck.config, ck.weights)


#: the first prompt repeats itself, so prompt lookup finds drafts; the others are plain
PROMPTS = [[72, 101, 108, 108, 111, 72, 101, 108], [33, 34, 35], [100, 101, 102, 103, 104, 105, 106], [7]]
TREE = (-1, -1, 0, 0, 1, 2)


def _run(tiny, prompts=PROMPTS, n=20, params=None, **kw):
    ck, m = tiny
    e = Engine(m, ck.tokenizer, EngineOptions(ctx_size=256, tokens_per_block=4, **kw))
    for p in prompts:
        e.add_request(p, params or SamplingParams(max_new_tokens=n, ignore_eos=True))
    return [r.output_ids for r in e.run()], e


@pytest.fixture(scope="module")
def plain(tiny):
    return {be: _run(tiny, backend=be)[0] for be in ("cells", "paged")}


@pytest.mark.parametrize("backend", ["cells", "paged"])
@pytest.mark.parametrize("K", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_chain_equals_plain_greedy(tiny, plain, backend, K, method):
    extra = {"draft_layers": 1} if method == "draft" else {}
    out, e = _run(tiny, backend=backend, speculative=method, num_spec_tokens=K, **extra)
    assert out == plain[backend]
    s = e.spec.summary()
    assert s["target_forwards"] > 0 and sum(st["verify_forwards"] for st in s["requests"].values()) > 0
    assert any(st["accepted_by_pos"] and st["accepted_by_pos"][0] > 0 for st in s["requests"].values())  # drafts were accepted
    assert all(len(st["drafted_by_pos"]) <= K for st in s["requests"].values())
    # every cell / block is free at the end (rewinds freed what they should)
    assert (e.kv.used == 0) if backend == "cells" else (len(e.kv.free) == e.kv.num_blocks)


@pytest.mark.parametrize("backend", ["cells", "paged"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_tree_equals_plain_greedy(tiny, plain, backend, method):
    extra = {"draft_layers": 2} if method == "draft" else {}
    out, e = _run(tiny, backend=backend, speculative=method, spec_tree=TREE, **extra)
    assert out == plain[backend]
    assert e.spec.summary()["tokens_per_target_forward"] > len(PROMPTS)  # more than one token per request and forward


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_speculative_with_chunked_prefill_and_late_arrival(tiny, plain, backend):
    ck, m = tiny
    e = Engine(m, ck.tokenizer, EngineOptions(backend=backend, ctx_size=256, tokens_per_block=4, prefill_chunk=3,
                                              max_batch_tokens=7, speculative="ngram", num_spec_tokens=3))
    for i, p in enumerate(PROMPTS):
        e.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True), arrival_step=2 * i)
    assert [r.output_ids for r in e.run()] == plain[backend]


def _plain_kv(tiny, backend, ids, layer):
    """K/V of ``ids`` computed by a plain prefill (the reference for a rewound cache)."""
    ck, m = tiny
    e = Engine(m, ck.tokenizer, EngineOptions(backend=backend, ctx_size=256, tokens_per_block=4))
    e.add_request(ids, SamplingParams(max_new_tokens=2, ignore_eos=True))
    e.step()
    return e.kv.read(layer, 0)


@pytest.mark.parametrize("backend", ["cells", "paged"])
@pytest.mark.parametrize("tree", [None, TREE])
def test_cache_after_rejection_holds_exactly_the_accepted_positions(tiny, backend, tree):
    ck, m = tiny
    e = Engine(m, ck.tokenizer, EngineOptions(backend=backend, ctx_size=256, tokens_per_block=4, speculative="draft",
                                              draft_layers=1, num_spec_tokens=5, spec_tree=tree))
    e.add_request(PROMPTS[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    e.add_request(PROMPTS[2], SamplingParams(max_new_tokens=30, ignore_eos=True))
    seen_reject = 0
    while (b := e.step()) is not None:
        for c in b.chunks:
            req = c.req
            if c.parents is None or req.status == "finished":
                continue
            kept = req.num_computed
            if kept < c.C + c.T:
                seen_reject += 1
            # exactly positions 0..kept-1 are cached, once each
            if backend == "cells":
                assert [p for _, p in e.kv.cells_of(req.seq_id)] == list(range(kept))
            else:
                assert e.kv.lens[req.seq_id] == kept and len(e.kv.tables[req.seq_id]) == -(-kept // 4)
            # and they hold the K/V a plain run computes for those tokens (tree nodes moved into place)
            k, v = e.kv.read(2, req.seq_id)
            k_ref, v_ref = _plain_kv(tiny, backend, req.cache_ids[:kept], 2)
            torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5)
            assert req.num_pending == 1  # the next step's input is the correction / bonus token at position kept
        nxt = [c for c in (b.chunks or [])]
        del nxt
    assert seen_reject > 0


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_next_step_positions_continue_after_rewind(tiny, backend):
    ck, m = tiny
    e = Engine(m, ck.tokenizer, EngineOptions(backend=backend, ctx_size=256, tokens_per_block=4, speculative="ngram",
                                              num_spec_tokens=3, spec_tree=TREE))
    e.add_request(PROMPTS[0], SamplingParams(max_new_tokens=20, ignore_eos=True))
    kept = None
    steps = 0
    while (b := e.step()) is not None:
        c = b.chunks[0]
        if kept is not None:
            assert c.C == kept  # the step starts right after the accepted positions
        if c.parents is not None:
            steps += 1
            assert c.depths() == [_walk(c.parents, i) for i in range(c.T)]
        kept = c.req.num_computed
    assert steps > 0


def _walk(parents, i):
    """Depth of node i: steps up to the root."""
    n = 0
    while parents[i] >= 0:
        i, n = parents[i], n + 1
    return n


def test_verify_mask_is_the_ancestor_relation_in_both_conventions(tiny):
    ck, m = tiny
    parents = [-1] + [p + 1 for p in TREE]  # root + static tree, chunk-local
    want = torch.zeros(7, 7, dtype=torch.bool)
    for i in range(7):  # ancestor relation by walking up, computed independently of ChunkSpec.ancestors
        j = i
        while j >= 0:
            want[i, j] = True
            j = parents[j]
    other = ChunkSpec(1, 0, 4)  # a prefill of another request in the same step
    for backend in ("cells", "paged"):
        e = Engine(m, ck.tokenizer, EngineOptions(backend=backend, ctx_size=64, tokens_per_block=4))
        e.kv.prepare([ChunkSpec(0, 0, 5)])  # request 0 has 5 cached tokens
        chunk = ChunkSpec(0, 5, 7, parents)
        inp = e.kv.prepare([other, chunk])
        assert inp.positions[4:].tolist() == [5, 6, 6, 7, 7, 7, 8]  # past + depth(node)
        if backend == "cells":
            mask = inp.kq_mask[0, 0]  # [n_tokens, n_kv]
            cells = inp.cell_idx[4:]
            got = mask[4:][:, cells] == 0  # [7, 7] the verify block of kq_mask
            assert torch.equal(got, want)
            past = [c for c, _ in e.kv.cells_of(0) if int(e.kv.pos[c]) < 5]
            assert bool((mask[4:][:, past] == 0).all())  # every candidate sees the whole past
            foreign = inp.cell_idx[:4]
            assert bool((mask[4:][:, foreign] == float("-inf")).all())  # and nothing of request 1
        else:
            packed = inp.spec_decoding_packed_mask[1]  # [7, 1]
            assert torch.equal(unpack_mask(packed, 7)[:, :7], want)
            assert inp.spec_decoding_position_offsets[1].tolist() == [0, 1, 1, 2, 2, 2, 3]
            assert inp.spec_decoding_generation_lengths.tolist() == [0, 7]
            assert packed[:, 0].tolist() == [sum(1 << j for j in range(7) if want[i, j]) for i in range(7)]


def test_packed_mask_words_past_32_candidates():
    rows = torch.rand(40, 40, generator=torch.Generator().manual_seed(0)) > 0.5
    p = pack_mask(rows)
    assert p.shape == (40, 2) and p.dtype == torch.int32
    assert torch.equal(unpack_mask(p, 40), rows)
    assert spec_metadata([ChunkSpec(0, 3, 4)]) == {}  # no verify chunk: no spec metadata


def test_bad_speculative_options_are_one_line_errors(tiny):
    ck, m = tiny
    for kw, field, msg in [
            (dict(speculative="medusa"), "speculative.method", "must be one of ngram, draft, mtp (got 'medusa')"),
            (dict(speculative="draft"), "speculative.method", "draft needs exactly one of draft_model (a path) or draft_layers (k)"),
            (dict(speculative="draft", draft_layers=3), "speculative.draft_layers", "must be in 1..2 for this 3-layer model (got 3)"),
            (dict(speculative="ngram", num_spec_tokens=0), "speculative.num_spec_tokens", "must be >= 1 (got 0)"),
            (dict(speculative="ngram", prefix_cache=True), "speculative.method",
             "cannot be combined with prefix_cache, context_shift or audit_kv yet")]:
        with pytest.raises(ConfigError) as e:
            Engine(m, ck.tokenizer, EngineOptions(**kw))
        assert (e.value.field, e.value.reason) == (field, msg)
    for bad in ("0,-1", "-1,x", "-1,5"):
        with pytest.raises(InfertraceError, match="^speculative.spec_tree: "):
            parse_tree(bad)
    assert parse_tree("-1, 0,0") == (-1, 0, 0)
    for huge in ("-1," + "9" * 5000, "-1,x" * 20000, "-1," * 30000):  # the error line stays short (no 5000-digit int)
        with pytest.raises(InfertraceError, match="^speculative.spec_tree: ") as ei:
            parse_tree(huge)
        assert len(str(ei.value)) < 200
    e = Engine(m, ck.tokenizer, EngineOptions(speculative="ngram", spec_tree=(-1, 0, 0)))
    e.add_request(PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=4))
    with pytest.raises(InfertraceError, match="needs greedy"):
        e.run()


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_real_model_layer_skip_draft_equals_plain_greedy(smol, backend):
    """SmolLM2-135M as target and, through its first 10 of 30 layers, as its own draft model."""
    tok = smol.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("1, 2, 3, 4, 5,")]

    def run(**kw):
        e = Engine(smol.model, tok, EngineOptions(backend=backend, ctx_size=128, tokens_per_block=8, **kw))
        for p in prompts:
            e.add_request(p, SamplingParams(max_new_tokens=10, ignore_eos=True))
        return [r.output_ids for r in e.run()], e

    ref, _ = run()
    out, e = run(speculative="draft", draft_layers=10, num_spec_tokens=3)
    assert out == ref
    assert e.spec.summary()["requests"]["1"]["accepted_by_pos"][0] > 0  # the counting prompt is easy to draft


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_separate_draft_model_file(tiny, plain, backend, tmp_path):
    """--draft-model PATH: another (1-layer, differently seeded) checkpoint with the same vocabulary."""
    w, s = make_weights(seed=9, n_layer=1)
    path = write_gguf(tmp_path / "draft.gguf", w, s)
    out, e = _run(tiny, backend=backend, speculative="draft", draft_model=str(path), num_spec_tokens=3)
    assert out == plain[backend]
    assert e.spec.drafter.model is not tiny[1] and len(e.spec.drafter.model.layers) == 1


def test_draft_model_with_another_vocabulary_is_refused(tiny):
    import dataclasses
    from types import SimpleNamespace

    from infertrace.engine.drafters import DraftModelDrafter

    _, m = tiny
    other = SimpleNamespace(cfg=dataclasses.replace(m.cfg, vocab_size=m.cfg.vocab_size - 1))
    with pytest.raises(InfertraceError, match="vocabulary"):
        DraftModelDrafter(other, m, 64, 4)


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_tree_near_a_full_cache_drops_drafts_instead_of_stopping(tiny, backend):
    """A tree has more nodes than depth: near --ctx-size the verify chunk must shrink to what the
    pool holds (a prefix of the tree), not stop the request with kv_full before plain greedy would."""
    ck, m = tiny

    def run(**kw):
        e = Engine(m, ck.tokenizer, EngineOptions(backend=backend, ctx_size=24, tokens_per_block=4, **kw))
        e.add_request(PROMPTS[0] * 2, SamplingParams(max_new_tokens=30, ignore_eos=True))
        return [(r.output_ids, r.stop_reason) for r in e.run()]

    ref = run()
    assert ref[0][1] == "ctx_full" and len(ref[0][0]) == 24 - 16
    assert run(speculative="draft", draft_layers=1, spec_tree=(-1, -1, 0, 1, 1, 2)) == ref
    assert run(speculative="ngram", spec_tree=(-1, -1, 0, 0, 1, 2, 3)) == ref


def test_branching_tree_never_runs_on_the_triton_kernel(tiny, monkeypatch):
    """The Triton paged kernel reads causal lengths only: a branching tree is refused with
    --attention triton before any step, and --attention auto (triton on CUDA) picks torch for it;
    a chain (causal) keeps auto's choice."""
    ck, m = tiny
    monkeypatch.setattr("infertrace.attention.select.resolve_attention", lambda req, dev: "triton")  # as on a CUDA device
    with pytest.raises(InfertraceError, match="^speculative.spec_tree: with branches needs the torch attention"):
        Engine(m, ck.tokenizer, EngineOptions(backend="paged", attention="triton", speculative="ngram", spec_tree=TREE))
    e = Engine(m, ck.tokenizer, EngineOptions(backend="paged", attention="auto", speculative="ngram", spec_tree=TREE))
    assert e.attn_impl == "torch"
    e = Engine(m, ck.tokenizer, EngineOptions(backend="paged", attention="auto", speculative="ngram", spec_tree=(-1, 0, 1)))
    assert e.attn_impl == "triton"


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_sliding_window_model_equals_plain_greedy(tmp_path, backend):
    """Gemma 3 tiny with a 4-token sliding window on layer 0 (kq_mask_swa / windowed paged
    attention): chain and tree verify rows see only their window, output equals plain greedy, also
    at the context limit."""
    from infertrace.runner import load_model
    from tests.helpers.tiny import write_hf

    w, s = make_weights(seed=3, n_layer=2, family="gemma3")
    lm = load_model(str(write_hf(tmp_path / "g", w, s, sliding_window=4,
                                 layer_types=["sliding_attention", "full_attention"])))
    assert lm.config.sliding_window == 4

    def run(ctx, **kw):
        e = Engine(lm.model, lm.tokenizer, EngineOptions(backend=backend, ctx_size=ctx, tokens_per_block=4, **kw))
        for p in PROMPTS[:3]:
            e.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True))
        return [(r.output_ids, r.stop_reason) for r in e.run()]

    for ctx in (256, 24):
        ref = run(ctx)
        assert run(ctx, speculative="draft", draft_layers=1, num_spec_tokens=5) == ref
        assert run(ctx, speculative="draft", draft_layers=1, spec_tree=(-1, -1, 0, 1, 1, 2)) == ref
