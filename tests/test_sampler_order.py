"""--sampler-order: HF order (temperature, then filters) vs llama.cpp's common_sampler order (filters on
unscaled logits, temperature last). The hand example of issue 12, then llama.cpp's own sampler chain
(llama_sampler_init_top_k / top_p / min_p / temp through llama-cpp-python) keeps the same sets."""

from __future__ import annotations

import ctypes

import pytest
import torch

from infertrace.engine.sampler import SamplingParams, default_order, kept_set, sample


def test_hand_example_kept_sets() -> None:
    # logits [3, 2, 1], top-p 0.8, temperature 0.5.
    # hf: softmax([6, 4, 2]) = [0.867, 0.117, 0.016]; 0.867 >= 0.8 already -> keeps {0}.
    # llama.cpp: softmax([3, 2, 1]) = [0.665, 0.245, 0.090]; 0.665 < 0.8, 0.910 >= 0.8 -> keeps {0, 1},
    #            then temperature: softmax([3, 2] / 0.5) = [0.8808, 0.1192].
    x = torch.tensor([3.0, 2.0, 1.0])
    p = SamplingParams(temperature=0.5, top_p=0.8)
    ids, probs = kept_set(x, p, "hf")
    assert ids.tolist() == [0] and probs.tolist() == [1.0]
    ids, probs = kept_set(x, p, "llama.cpp")
    assert ids.tolist() == [0, 1]
    assert probs.tolist() == pytest.approx([0.880797, 0.119203], abs=1e-6)


def test_draws_follow_the_order() -> None:
    x = torch.tensor([3.0, 2.0, 1.0])
    p = SamplingParams(temperature=0.5, top_p=0.8)
    g = torch.Generator().manual_seed(0)
    assert {sample(x, p, [], g, order="hf").token for _ in range(200)} == {0}
    g = torch.Generator().manual_seed(0)
    assert {sample(x, p, [], g, order="llama.cpp").token for _ in range(200)} == {0, 1}


def test_default_order_follows_the_runtime() -> None:
    assert default_order("llama.cpp", "cells") == "llama.cpp"
    assert default_order("infertrace", "cells") == "llama.cpp"
    assert default_order("infertrace", "paged") == "hf"


def _llamacpp_kept(llama_cpp, logits: list[float], p: SamplingParams) -> list[int]:
    """The candidates left by llama.cpp's chain top-k -> top-p -> min-p -> temp (common_sampler order)."""
    L = llama_cpp
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    if p.top_k > 0:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(p.top_k))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(p.top_p, 1))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(p.min_p, 1))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(p.temperature))
    n = len(logits)
    data = (L.llama_token_data * n)(*[L.llama_token_data(i, v, 0.0) for i, v in enumerate(logits)])
    arr = L.llama_token_data_array(data=ctypes.cast(data, L.llama_token_data_p), size=n, selected=-1, sorted=False)
    L.llama_sampler_apply(chain, ctypes.byref(arr))
    kept = [arr.data[i].id for i in range(arr.size)]
    L.llama_sampler_free(chain)
    return kept


def test_llamacpp_sampler_keeps_the_same_sets(llama_cpp) -> None:
    assert _llamacpp_kept(llama_cpp, [3.0, 2.0, 1.0], SamplingParams(temperature=0.5, top_p=0.8)) == [0, 1]
    gen = torch.Generator().manual_seed(1)
    settings = [SamplingParams(temperature=t, top_k=k, top_p=tp, min_p=mp)
                for t in (0.3, 0.7, 1.5) for k in (0, 40) for tp in (1.0, 0.9, 0.5) for mp in (0.0, 0.05)]
    differs = 0
    for p in settings:
        x = torch.randn(300, generator=gen) * 3  # [V]
        ours, _ = kept_set(x, p, "llama.cpp")
        theirs = _llamacpp_kept(llama_cpp, x.tolist(), p)
        assert sorted(ours.tolist()) == sorted(theirs), p
        differs += sorted(kept_set(x, p, "hf")[0].tolist()) != sorted(theirs)
    assert differs > 0  # the two orders really keep different sets on these settings
