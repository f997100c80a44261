"""Prefix caching on both backends (tiny random model, and SmolLM2 for the full hit): a repeated prompt
evaluates one token with the cold run's logits, a partial hit evaluates exactly the unmatched suffix,
shared blocks/cells outlive their first owner, eviction under a small pool changes no output, and
diff-backends still agrees."""

import pytest
import torch

from infertrace.compare.backends import diff_backends
from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.kv.prefix_cache import block_hash
from infertrace.model.decoder import DecoderModel
from infertrace.loading.weights import load_checkpoint
from infertrace.runner import Loaded, PromptSpec
from tests.helpers.tiny import make_weights, write_gguf

BACKENDS = ["cells", "paged"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    w, s = make_weights(seed=11)
    ck = load_checkpoint(write_gguf(tmp_path_factory.mktemp("tiny") / "m.gguf", w, s))
    return ck, DecoderModel(ck.config, ck.weights)


class Probe:
    """Keeps per step: chunks (seq_id, C, T), logits rows by seq_id, and the serving record."""

    enabled = True
    layers: frozenset = frozenset()
    taps: frozenset = frozenset()

    def __init__(self):
        self.steps = []

    def tap(self, name, **t):
        return None

    def begin_step(self):
        return None

    def end_step(self, ctx):
        chunks = [(c.req.seq_id, c.C, c.T) for c in ctx["batch"].chunks]
        logits, j = {}, 0
        for c in ctx["batch"].chunks:
            if c.need_logits:
                logits[c.req.seq_id] = ctx["logits"][j].clone()
                j += 1
        self.steps.append({"chunks": chunks, "logits": logits, "serving": ctx.get("serving")})

    def first(self, sid):
        """(C, T, logits) of the first step that computed ``sid``."""
        for s in self.steps:
            for c in s["chunks"]:
                if c[0] == sid:
                    return c[1], c[2], s["logits"].get(sid)
        raise AssertionError(sid)

    def prefix(self, sid):
        for s in self.steps:
            if s["serving"] and str(sid) in s["serving"]["prefix"]:
                return s["serving"]["prefix"][str(sid)]
        return None


def run(model, tok, prompts, arrivals=None, n=4, **opts):
    p = Probe()
    e = Engine(model, tok, EngineOptions(**opts), p)
    for i, ids in enumerate(prompts):
        e.add_request(ids, SamplingParams(max_new_tokens=n if isinstance(n, int) else n[i], ignore_eos=True),
                      (arrivals or [0] * len(prompts))[i])
    e.run()
    return e, p


A = list(range(40, 56))  # 16 tokens: 4 full blocks of 4
A2 = list(range(40, 58))  # 18 tokens: partial last block


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prompt", [A, A2], ids=["full-blocks", "partial-block"])
def test_repeated_prompt_evaluates_one_token_with_cold_logits(tiny, backend, prompt):
    ck, m = tiny
    cold, pc = run(m, ck.tokenizer, [prompt], backend=backend, tokens_per_block=4)
    e, p = run(m, ck.tokenizer, [prompt, prompt], arrivals=[0, 6], backend=backend, tokens_per_block=4, prefix_cache=True)
    C, T, logits = p.first(1)
    assert (C, T) == (len(prompt) - 1, 1)  # only the last prompt token is evaluated
    _, _, cold_logits = pc.first(0)
    assert torch.allclose(logits, cold_logits, atol=1e-5)
    assert e.requests[1].output_ids == cold.requests[0].output_ids
    info = p.prefix(1)
    assert info["hit"] == len(prompt) - 1 and info["src"] == 0
    assert info["stop"].startswith("last prompt token")
    if backend == "paged":  # full blocks shared, the block holding the last prompt token copied (never written shared)
        assert len(info["shared_blocks"]) == (len(prompt) - 1) // 4
        assert info["copied"]["tokens"] == (len(prompt) - 1) % 4 or info["copied"]["tokens"] == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_hit_evaluates_exactly_the_unmatched_suffix(tiny, backend):
    ck, m = tiny
    b = A[:10] + [7, 8, 9, 10, 11]  # shares 10 tokens with A (2 full blocks of 4 + 2)
    cold, pc = run(m, ck.tokenizer, [b], backend=backend, tokens_per_block=4)
    e, p = run(m, ck.tokenizer, [A, b], arrivals=[0, 6], backend=backend, tokens_per_block=4, prefix_cache=True)
    C, T, logits = p.first(1)
    assert (C, T) == (10, 5)
    assert torch.allclose(logits, pc.first(0)[2], atol=1e-5)
    assert e.requests[1].output_ids == cold.requests[0].output_ids
    info = p.prefix(1)
    assert info["hit"] == 10 and info["computed"] == "10..14" and "position 10" in info["stop"]
    if backend == "paged":
        assert info["copied"]["tokens"] == 2 and len(info["shared_blocks"]) == 2
        # blocks 0, 1 matched by hash(parent, tokens); block 2's hash was unknown when request 1 arrived
        assert info["hashes"] == [block_hash(None, b[:4]), block_hash(block_hash(None, b[:4]), b[4:8])]
        assert "partial block copied" in info["stop"]


def test_paged_shared_blocks_freed_only_when_last_owner_finishes(tiny):
    ck, m = tiny
    e = Engine(m, ck.tokenizer, EngineOptions(backend="paged", tokens_per_block=4, prefix_cache=True))
    e.add_request(A, SamplingParams(max_new_tokens=10, ignore_eos=True))
    e.add_request(A[:12] + [1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True), arrival_step=2)
    for _ in range(3):
        e.step()
    shared = e.kv.tables[1][:3]
    assert shared == e.kv.tables[0][:3] and all(e.kv.ref[b] == 2 for b in shared)
    while e.requests[1].status != "finished":
        e.step()
    assert all(e.kv.ref[b] == 1 for b in shared) and not set(shared) & set(e.kv.free)
    e.run()
    assert not e.kv.ref and set(shared) <= set(e.kv.free)  # freed, still hashed: a later request can hit them
    assert all(b in e.kv.hash_of for b in shared)


def test_cells_shared_cells_outlive_evicted_owner(tiny):
    ck, m = tiny
    cold, _ = run(m, ck.tokenizer, [A], n=12, backend="cells", ctx_size=64)
    # seq 1 shares A's first 12 cells and finishes (retained); seq 2 needs room: seq 1 is evicted
    e, p = run(m, ck.tokenizer, [A, A[:12] + [1, 2, 3], list(range(100, 120))], arrivals=[0, 2, 6], n=[12, 2, 1],
               backend="cells", ctx_size=44, prefix_cache=True)
    assert p.prefix(1)["hit"] == 12 and p.prefix(1)["cells"] == "0..11"
    evictions = [ev for s in p.steps if s["serving"] for ev in s["serving"]["evictions"]]
    assert evictions[0]["seq_id"] == 1
    assert evictions[0]["still_shared"] == "0..11" and evictions[0]["freed"] == evictions[0]["cells"][len("0..11,"):]
    assert e.requests[0].output_ids == cold.requests[0].output_ids  # the shared cells survived seq 1's eviction
    assert all(r.num_preemptions == 0 for r in e.requests.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_eviction_under_small_pool_keeps_outputs(tiny, backend):
    ck, m = tiny
    sys_p = list(range(60, 72))
    prompts = [sys_p + [i, i + 1, i + 2] for i in (1, 5, 9, 13)] + [list(range(150, 170)), sys_p + [1, 2, 3]]
    arrivals = [0, 3, 6, 9, 12, 20]
    small = dict(num_blocks=10, tokens_per_block=4) if backend == "paged" else dict(ctx_size=40)
    ref, _ = run(m, ck.tokenizer, prompts, arrivals, n=5, backend=backend, **small)
    e, p = run(m, ck.tokenizer, prompts, arrivals, n=5, backend=backend, prefix_cache=True, **small)
    assert [r.output_ids for r in e.requests.values()] == [r.output_ids for r in ref.requests.values()]
    evictions = [ev for s in p.steps if s["serving"] for ev in s["serving"]["evictions"]]
    assert evictions, "the small pool must have evicted cached prefixes"
    assert sum(s["chunks"][0][2] for s in p.steps if s["chunks"]) < sum(len(x) + 4 for x in prompts)  # hits happened


def test_diff_backends_agree_with_prefix_cache(tiny):
    ck, m = tiny
    specs = [PromptSpec("", SamplingParams(max_new_tokens=3, ignore_eos=True), a, ids=ids)
             for ids, a in ((A, 0), (A2, 2), (A[:10] + [5, 6], 4))]
    rep = diff_backends(Loaded(ck, m), specs, EngineOptions(tokens_per_block=4, prefix_cache=True))
    assert rep["identical"], rep.get("first_mismatch")


def test_real_model_repeated_prompt_one_token(smol):
    ids = smol.tokenizer.encode("In a small village by the sea, an old fisherman told stories")
    for backend in BACKENDS:
        cold, pc = run(smol.model, smol.tokenizer, [ids], n=2, backend=backend, ctx_size=128, tokens_per_block=8)
        e, p = run(smol.model, smol.tokenizer, [ids, ids], arrivals=[0, 3], n=2, backend=backend, ctx_size=128,
                   tokens_per_block=8, prefix_cache=True)
        assert p.first(1)[:2] == (len(ids) - 1, 1)
        assert torch.allclose(p.first(1)[2], pc.first(0)[2], atol=1e-4)
        assert e.requests[1].output_ids == cold.requests[0].output_ids


def test_serving_record_render_survives_malformed_trace():
    """A loaded trace is untrusted: malformed serving fields render as text, never crash or inject markup."""
    from rich.console import Console

    from infertrace.trace.records import ReqStep, StepTrace
    from infertrace.present.render import render_step
    from infertrace.present.render_serving import serving_mark

    r = ReqStep(0, "prefill", 0, 1, [1], ["a"], [0], ["0"], "-", "0", [0], prefix={"hit": "x[red]"}, shift={"n_discard": "[b]9"})
    st = StepTrace(step=0, backend="cells", attention="torch", N=1, batch=[r],
                   serving={"prefix": {"0": {"hit": "nan", "stop": "[bold]x" * 100, "copied": 3, "src": "[u]s"}, "1": 5}, "evictions": [3, {"block": 1}],
                            "ops_before_step": ["junk", {"op": "context_shift"}], "audit": {"by_provenance": [{"provenance": "[i]p\x1b[2J"}, 7]},
                            "stopped": [1]})
    c = Console(record=True, width=120)
    render_step(c, st, show=())
    out = c.export_text()
    assert "[bold]x" in out and "[i]p" in out and "\x1b" not in out  # shown literally, no terminal escape
    assert "[b]9" in str(serving_mark("[0]", r)) and "hit" not in str(serving_mark("[0]", r))
