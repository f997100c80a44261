"""Cases R1 (llama3 frequency scaling) and R2 (Q/K permutation under GQA), values worked by hand."""

import math

import pytest
import torch

from infertrace.model.config import ModelConfig, RopeScaling
from infertrace.model.rope import (
    apply_rope_neox, apply_rope_norm, base_inv_freq, cos_sin, inv_freq_table, llama3_freq_factors,
    llama3_inv_freq, permute_for_norm, unpermute_from_norm,
)


def _classify(theta, head_dim, s):
    base = base_inv_freq(theta, head_dim)
    scaled = llama3_inv_freq(base, s)
    keep = [i for i in range(head_dim // 2) if math.isclose(scaled[i], base[i], rel_tol=1e-12)]
    div = [i for i in range(head_dim // 2) if math.isclose(scaled[i], base[i] / s.factor, rel_tol=1e-12)]
    blend = [i for i in range(head_dim // 2) if i not in keep and i not in div]
    return keep, blend, div


def test_r1_llama3_bands_head_dim_64_factor_32():
    s = RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    keep, blend, div = _classify(500000.0, 64, s)
    assert keep == list(range(0, 15))
    assert blend == [15, 16, 17]
    assert div == list(range(18, 32))


def test_r1_llama3_bands_head_dim_128_factor_8():
    s = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    keep, blend, div = _classify(500000.0, 128, s)
    assert keep == list(range(0, 29))
    assert blend == list(range(29, 35))
    assert div == list(range(35, 64))


def _cfg(**kw):
    base = dict(arch="llama", source="gguf", n_layer=1, n_embd=64, n_ff=128, n_head=1, n_head_kv=1, head_dim=64,
                vocab_size=10, n_ctx_train=131072, rope_theta=500000.0, rope_theta_is_default=False, rope_dim=64,
                rms_eps=1e-5, tie_embeddings=True, rope_pairing_in_file="norm")
    base.update(kw)
    return ModelConfig(**base)


def test_r1_gguf_rope_freqs_table_equals_hf_config_table():
    s = RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    # what llama.cpp's converter writes to rope_freqs.weight (float32 in the file)
    factors = tuple(float(x) for x in llama3_freq_factors(500000.0, 64, s).float())
    gguf_cfg = _cfg(rope_freq_factors=factors)
    hf_cfg = _cfg(source="hf", rope_pairing_in_file="neox", rope_scaling=s)
    a, b = inv_freq_table(gguf_cfg), inv_freq_table(hf_cfg)
    assert torch.allclose(a, b, rtol=1e-6, atol=0)
    assert factors[0] == 1.0 and abs(factors[31] - 32.0) < 1e-4
    # and the plain table differs where the bug would hide
    assert not torch.allclose(inv_freq_table(_cfg()), b)


@pytest.mark.parametrize("n_head,n_kv", [(8, 2), (4, 2)])
def test_r2_permuted_gguf_weights_with_adjacent_rope_equal_hf(n_head, n_kv):
    g = torch.Generator().manual_seed(0)
    hd, H, N = 8, 16, 5
    wq = torch.randn(n_head * hd, H, generator=g, dtype=torch.float64)
    wk = torch.randn(n_kv * hd, H, generator=g, dtype=torch.float64)
    x = torch.randn(N, H, generator=g, dtype=torch.float64)
    cos, sin = cos_sin(torch.arange(3, 3 + N), base_inv_freq(10000.0, hd), torch.float64)

    def scores(wq_, wk_, rope):
        q = rope((x @ wq_.T).view(N, n_head, hd), cos, sin)
        k = rope((x @ wk_.T).view(N, n_kv, hd), cos, sin)
        k = k.repeat_interleave(n_head // n_kv, dim=1)
        return torch.einsum("qhd,khd->hqk", q, k)

    hf = scores(wq, wk, apply_rope_neox)
    gq, gk = permute_for_norm(wq, n_head), permute_for_norm(wk, n_kv)  # what a GGUF file stores
    assert torch.allclose(scores(gq, gk, apply_rope_norm), hf, atol=1e-10)
    # the loader's un-permutation gives back HF weights
    assert torch.equal(unpermute_from_norm(gq, n_head), wq)
    assert torch.equal(unpermute_from_norm(gk, n_kv), wk)
    # permuting K with the query head count is the bug: the check must fail
    bad_k = permute_for_norm(wk, n_head)
    assert not torch.allclose(scores(gq, bad_k, apply_rope_norm), hf, atol=1e-6)
    assert not torch.allclose(scores(wq, unpermute_from_norm(gk, n_head), apply_rope_neox), hf, atol=1e-6)


def test_rope_is_rotation_and_pos0_identity():
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    cos, sin = cos_sin(torch.tensor([0, 1, 2, 100]), base_inv_freq(10000.0, 8), torch.float64)
    y = apply_rope_neox(x, cos, sin)
    assert torch.allclose(y[0], x[0])
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))
    assert not torch.allclose(y[1:], x[1:])
