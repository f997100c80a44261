"""Cases S1 (repetition penalty on negative logits) and S2 (greedy ties)."""

import torch

from infertrace.engine.sampler import SamplingParams, apply_repetition_penalty, sample


def test_s1_repetition_penalty_divides_positive_multiplies_negative():
    out = apply_repetition_penalty(torch.tensor([2.0, -2.0, 0.5]), [0, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 0.5]


def test_s1_penalty_changes_greedy_choice():
    # token 0 seen: 2 -> 1, so token 2 (1.5) wins
    r = sample(torch.tensor([2.0, -2.0, 1.5]), SamplingParams(repetition_penalty=2.0), [0], torch.Generator())
    assert r.token == 2


def test_s2_greedy_and_top_k_1_take_first_of_tied_max_for_every_seed():
    logits = torch.tensor([1.0, 3.0, 3.0, 0.0])
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        assert sample(logits, SamplingParams(), [], g).token == 1
        assert sample(logits, SamplingParams(temperature=0.8, top_k=1, seed=seed), [], g).token == 1


def test_seeded_sampling_is_reproducible_and_top_p_min_p_restrict():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = SamplingParams(temperature=1.0, seed=7)
    a = [sample(logits, p, [], torch.Generator().manual_seed(7)).token for _ in range(5)]
    b = [sample(logits, p, [], torch.Generator().manual_seed(7)).token for _ in range(5)]
    assert a == b
    g = torch.Generator().manual_seed(1)
    toks = {sample(logits, SamplingParams(temperature=1.0, top_p=0.7), [], g).token for _ in range(200)}
    assert toks == {0, 1}  # 0.5 < 0.7, 0.5+0.3 >= 0.7: smallest prefix is {0, 1}
    toks = {sample(logits, SamplingParams(temperature=1.0, min_p=0.5), [], g).token for _ in range(200)}
    assert toks == {0, 1}  # 0.3 >= 0.5*0.5, 0.15 < 0.25
    r = sample(logits, SamplingParams(temperature=1.0, top_k=2), [], g)
    assert [t for t, _, _ in r.top] == [0, 1] and abs(sum(p for _, _, p in r.top) - 1) < 1e-6
