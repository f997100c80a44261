"""The speculative-sampling rule preserves the target distribution (chi-square over many seeded
draws on a tiny model, draft model and n-gram drafts), and case S3: a token outside the top-p set
(decided by the mass before it) is never accepted nor resampled."""

import math
from types import SimpleNamespace

import pytest
import torch

from infertrace.engine.drafters import target_probs
from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.request import Request
from infertrace.engine.sampler import SamplingParams
from infertrace.engine.speculative import Speculator
from infertrace.kv.base import ChunkSpec
from infertrace.kv.cells import CellsKV
from infertrace.model.decoder import DecoderModel
from infertrace.loading.weights import load_checkpoint
from tests.helpers.tiny import make_weights, write_gguf

TOPK = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    w, s = make_weights(seed=5, n_layer=3)
    ck = load_checkpoint(write_gguf(tmp_path_factory.mktemp("specs") / "m.gguf", w, s))
    return ck, DecoderModel(ck.config, ck.weights)


def _next_dist(m, ids):
    """Target distribution after ``ids`` at temperature 1, top-k 3, computed by hand:
    a plain forward, the 3 largest logits, their softmax. ``{token: prob}``."""
    cfg = m.cfg
    kv = CellsKV(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, 64)
    inp = kv.prepare([ChunkSpec(0, 0, len(ids))])
    logits = m.forward(torch.tensor(ids), inp, kv, torch.tensor([len(ids) - 1]))[0]  # [V]
    top = torch.topk(logits.double(), TOPK)
    p = torch.softmax(top.values, 0)
    return {int(t): float(q) for t, q in zip(top.indices, p)}


def _chi2_pvalue(obs: dict, exp: dict, n: int) -> float:
    """Pearson chi-square p-value; bins with expected count < 5 pooled into one."""
    small_o = small_e = 0.0
    stat, bins = 0.0, 0
    for k, pe in exp.items():
        e, o = pe * n, obs.get(k, 0)
        if e < 5:
            small_o, small_e = small_o + o, small_e + e
            continue
        stat += (o - e) ** 2 / e
        bins += 1
    if small_e > 0:
        stat += (small_o - small_e) ** 2 / small_e
        bins += 1
    assert sum(obs.values()) == n and all(k in exp for k in obs), "a sequence outside the target support was emitted"
    return float(torch.special.gammaincc(torch.tensor((bins - 1) / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def test_speculative_sampling_preserves_the_target_distribution(tiny):
    """Draft = the target's first layer (q != p): the emitted (t1, t2, t3) follow the target's joint."""
    ck, m = tiny
    method, prompt = "draft", [100, 101, 102, 103, 104, 105, 106]
    # exact joint distribution of the 3 generated tokens
    exp = {}
    for t1, p1 in _next_dist(m, prompt).items():
        for t2, p2 in _next_dist(m, prompt + [t1]).items():
            for t3, p3 in _next_dist(m, prompt + [t1, t2]).items():
                exp[(t1, t2, t3)] = p1 * p2 * p3
    obs: dict = {}
    n, per = 1200, 150
    drafted = accepted = 0
    for b in range(n // per):
        extra = {"draft_layers": 1}
        e = Engine(m, ck.tokenizer, EngineOptions(backend="paged", ctx_size=4096, tokens_per_block=4, n_seq_max=per,
                                                  speculative=method, num_spec_tokens=2, **extra))
        for i in range(per):
            e.add_request(prompt, SamplingParams(temperature=1.0, top_k=TOPK, max_new_tokens=3, ignore_eos=True,
                                                 seed=1000 * b + i))
        for r in e.run():
            key = tuple(r.output_ids)
            obs[key] = obs.get(key, 0) + 1
        for st in e.spec.summary()["requests"].values():
            drafted += sum(st["drafted_by_pos"])
            accepted += sum(st["accepted_by_pos"])
    assert 0 < accepted < drafted  # both branches of the rule ran (accept, and reject + resample)
    assert _chi2_pvalue(obs, exp, n) > 1e-3


def test_s3_top_p_membership_decides_acceptance():
    """Case S3: probabilities [.5, .3, .1, .1], top-p 0.8 keeps {0, 1} (.625/.375); a draft of
    token 2 (a point mass, as an n-gram draft) is accepted with min(1, p/q) = 0 and the residual
    draw never yields token 2 either."""
    params = SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=8, seed=3)
    logits = torch.tensor([0.5, 0.3, 0.1, 0.1]).log()
    p = target_probs(logits, params, [], "hf")
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(target_probs(logits, params, [], "llama.cpp"), p)
    req = Request(0, [1], params)
    spec = Speculator.__new__(Speculator)  # only verify() is exercised: no drafter
    counts = [0, 0, 0, 0]
    for _ in range(2000):
        req.draft_q = None
        chunk = SimpleNamespace(req=req, parents=[-1, 0], token_ids=[1, 2], T=2)
        out, accepted = spec.verify(SimpleNamespace(sampler_order="hf"), chunk, torch.stack([logits, logits]))
        assert accepted == [0] and len(out) == 1
        counts[out[0].token] += 1
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / 2000 - 0.625) < 0.04  # the residual of a point mass on 2 is p itself


def test_point_mass_draft_rule_preserves_the_distribution():
    """An n-gram draft is a point mass q = one-hot(x): accepted with probability p(x), otherwise the
    token is drawn from p without x renormalised. Over a 2-token chain, the emitted pair follows
    p(t1) p(t2 | t1) (here the rows do not depend on the path, so the joint is a product)."""
    params = SamplingParams(temperature=1.0, seed=11, max_new_tokens=8)
    l0 = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    l1 = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    p0, p1 = torch.softmax(l0, 0), torch.softmax(l1, 0)
    exp = {(a, b): float(p0[a] * p1[b]) for a in range(4) for b in range(4)}
    exp1 = {(a,): float(p0[a]) for a in range(4)}
    req = Request(0, [1], params)
    spec = Speculator.__new__(Speculator)
    obs, obs1, n, acc = {}, {}, 6000, 0
    for _ in range(n):
        chunk = SimpleNamespace(req=req, parents=[-1, 0, 1], token_ids=[1, 1, 2], T=3)
        out, accepted = spec.verify(SimpleNamespace(sampler_order="hf"), chunk, torch.stack([l0, l1, l1]))
        acc += len(accepted) - 1
        first = (out[0].token,)
        obs1[first] = obs1.get(first, 0) + 1
        if len(out) >= 2:  # t2 exists when draft 1 was accepted; its law given t1 = 1 is p1
            key = (out[0].token, out[1].token)
            obs[key] = obs.get(key, 0) + 1
    assert 0 < acc
    assert _chi2_pvalue(obs1, exp1, n) > 1e-3
    m = sum(obs.values())
    cond = {k: v for k, v in exp.items() if k[0] == 1}
    z = sum(cond.values())
    assert _chi2_pvalue(obs, {k: v / z for k, v in cond.items()}, m) > 1e-3
