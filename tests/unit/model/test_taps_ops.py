"""The decoder's tap vocabulary and its linear-op injection point (model/taps.py, model/ops.py).

Taps: the block taps fire in the declared order, only for the subscribed layers and names, never
for a stage the layer kind lacks, and not at all with a disabled tracer; their values are HF
transformers' own intermediate tensors (forward hooks on the same weights). Ops: every projection
and the embedding lookup go through ``model.ops``; weight objects that carry their own kernel give
the float path's logits; the llama.cpp emulation's op quantises the matmul input as ggml-cpu does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infertrace.engine.engine import EngineOptions, make_kv
from infertrace.compare.llamacpp import Q8ActivationOps
from infertrace.kv.base import ChunkSpec
from infertrace.model.decoder import DecoderModel
from infertrace.model.ops import Ops, RowStack
from infertrace.model.taps import (
    ATTN_OUT, BLOCK_TAPS, EMBED, MLP_OUT, Q_ROT, RESID_MID, RESID_POST, RESID_PRE, SSM_STATE, TAP_NAMES, Z,
)
from infertrace.loading.weights import load_checkpoint
from tests.helpers import tiny, tiny_qwen35

IDS = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]


class Spy:
    """Tracer keeping every tap call as ``(name, layer, fields)``."""

    enabled = True

    def __init__(self, layers, taps=frozenset(BLOCK_TAPS)):
        self.layers, self.taps, self.calls = frozenset(layers), frozenset(taps), []

    def tap(self, name, **f):
        self.calls.append((name, f.get("layer"), f))

    def value(self, name, layer):
        return next(f["value"] for n, il, f in self.calls if n == name and il == layer)


def _forward(m, ids=IDS, tracer=None, backend="cells"):
    kv = make_kv(m, EngineOptions(backend=backend, ctx_size=64, tokens_per_block=4), "torch")
    inp = kv.prepare([ChunkSpec(0, 0, len(ids))])
    args = (torch.tensor(ids), inp, kv, torch.arange(len(ids)))
    return m.forward(*args) if tracer is None else m.forward(*args, tracer)  # [T, V]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """Tiny Gemma 3 (post-norms, QK-norm, windows, GeGLU, soft-cap): the richest dense block."""
    w, s = tiny.make_weights(family="gemma3", n_layer=3, tie=True, seed=5)
    d = tiny.write_hf(tmp_path_factory.mktemp("g3") / "hf", w, s, sliding_window=4, final_logit_softcapping=3.0)
    ck = load_checkpoint(d)
    return d, ck, DecoderModel(ck.config, ck.weights)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    w, s = tiny_qwen35.make_weights(seed=3)
    ck = load_checkpoint(tiny_qwen35.write_hf_dir(tmp_path_factory.mktemp("q35") / "hf", w, s))
    return ck, DecoderModel(ck.config, ck.weights)


def test_vocabulary_is_declared_once_and_unique():
    assert TAP_NAMES[0] == EMBED and len(set(TAP_NAMES)) == len(TAP_NAMES) == 1 + len(BLOCK_TAPS)
    assert list(BLOCK_TAPS)[0] == RESID_PRE and list(BLOCK_TAPS)[-1] == RESID_POST


def test_dense_block_taps_are_hf_transformers_intermediates(gemma):
    """resid_pre / attn_out (after the post-attention norm) / mlp_out (after the post-FFN norm) /
    resid_post of every layer equal HF's Gemma3 decoder-layer tensors, captured by forward hooks."""
    transformers = pytest.importorskip("transformers")
    d, ck, m = gemma
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    got: dict = {}
    hooks = []
    for il, layer in enumerate(hf.model.layers):
        def hook(name, il=il):
            return lambda mod, args, out: got.__setitem__((name, il), (out[0] if isinstance(out, tuple) else out)[0])
        hooks.append(layer.post_attention_layernorm.register_forward_hook(hook(ATTN_OUT)))
        hooks.append(layer.post_feedforward_layernorm.register_forward_hook(hook(MLP_OUT)))
        hooks.append(layer.register_forward_pre_hook(
            lambda mod, args, kwargs, il=il: got.__setitem__((RESID_PRE, il), (args[0] if args else kwargs["hidden_states"])[0]),
            with_kwargs=True))
        hooks.append(layer.register_forward_hook(hook(RESID_POST)))
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    for h in hooks:
        h.remove()
    spy = Spy(range(ck.config.n_layer))
    ours = _forward(m, tracer=spy)
    assert (ours - ref).abs().max() < 1e-4
    for il in range(ck.config.n_layer):
        for name in (RESID_PRE, ATTN_OUT, MLP_OUT, RESID_POST):
            delta = (spy.value(name, il) - got[(name, il)]).abs().max()
            assert delta < 1e-4, (name, il, float(delta))
        # the residual adds between them, exactly as the skeleton does them
        assert torch.equal(spy.value(RESID_MID, il), spy.value(RESID_PRE, il) + spy.value(ATTN_OUT, il))
        assert torch.equal(spy.value(RESID_POST, il), spy.value(RESID_MID, il) + spy.value(MLP_OUT, il))


def test_taps_fire_in_declared_order_only_where_subscribed(gemma):
    _, ck, m = gemma
    spy = Spy({1}, {MLP_OUT, RESID_POST, Q_ROT})
    _forward(m, tracer=spy)
    assert [(n, il) for n, il, _ in spy.calls] == [(EMBED, None), (Q_ROT, 1), (MLP_OUT, 1), (RESID_POST, 1)]
    full = Spy({0})
    _forward(m, tracer=full)
    fired = [n for n, il, _ in full.calls if il == 0]
    assert fired == [n for n in BLOCK_TAPS if n in fired]  # declared order
    assert SSM_STATE not in fired and Z in fired  # attention has no recurrent state


def test_disabled_tracer_gets_no_call(gemma):
    _, ck, m = gemma

    class Off(Spy):
        enabled = False

        def tap(self, name, **f):
            raise AssertionError(f"tap {name} called on a disabled tracer")

    off = Off(range(ck.config.n_layer))
    assert torch.equal(_forward(m, tracer=off), _forward(m))


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_hybrid_layer_kinds_fire_their_own_stages(hybrid, backend):
    ck, m = hybrid
    cfg = ck.config
    spy = Spy(range(cfg.n_layer))
    _forward(m, tracer=spy, backend=backend)
    for il in range(cfg.n_layer):
        fired = [n for n, l, _ in spy.calls if l == il]
        assert fired == [n for n in BLOCK_TAPS if n in fired]
        if cfg.is_linear(il):
            assert SSM_STATE in fired and Q_ROT not in fired
            st = next(f for n, l, f in spy.calls if n == SSM_STATE and l == il)
            assert st["slots"] and st["rec"][0].shape == (cfg.ssm_n_v_heads, cfg.ssm_k_head_dim, cfg.ssm_v_head_dim)
        else:
            assert Q_ROT in fired and SSM_STATE not in fired
        assert torch.equal(spy.value(RESID_POST, il), spy.value(RESID_MID, il) + spy.value(MLP_OUT, il))
        if il + 1 < cfg.n_layer:
            assert torch.equal(spy.value(RESID_PRE, il + 1), spy.value(RESID_POST, il))


class CountingOps(Ops):
    def __init__(self):
        self.linear_calls, self.embed_calls = 0, 0

    def linear(self, x, w, b=None):
        self.linear_calls += 1
        return super().linear(x, w, b)

    def embed(self, table, ids):
        self.embed_calls += 1
        return super().embed(table, ids)


def test_every_projection_goes_through_ops(gemma, hybrid):
    _, ck, m = gemma
    ops = CountingOps()
    ref = _forward(m)
    assert torch.equal(_forward(m.with_ops(ops)), ref)  # same numbers, and the original keeps its ops
    assert m.ops is not ops
    # per attention block: fused QKV, output, gate/up, down; then the lm head
    assert (ops.linear_calls, ops.embed_calls) == (4 * ck.config.n_layer + 1, 1)
    ck, m = hybrid
    ops = CountingOps()
    _forward(m.with_ops(ops))
    n_gdn = sum(ck.config.is_linear(i) for i in range(ck.config.n_layer))
    # GDN: in_proj_qkv, z, beta|alpha, out; attention: QKV(+gate), output; every block: gate/up, down
    assert ops.linear_calls == 6 * n_gdn + 4 * (ck.config.n_layer - n_gdn) + 1


class Held:
    """A weight object with its own kernel (here float, as a stand-in for quantised blocks)."""

    def __init__(self, t):
        self.t, self.shape, self.calls = t, tuple(t.shape), 0

    def __call__(self, x, bias=None):
        self.calls += 1
        return F.linear(x, self.t, bias)

    def rows(self, ids):
        return self.t[ids]


def test_weight_objects_carry_their_own_kernel(gemma, tmp_path):
    """Every 2-D weight replaced by an object: fused projections become RowStacks of the parts, the
    embedding and the tied head use the object; logits agree with the float path."""
    w, s = tiny.make_weights(family="llama", attn_bias=True, mlp_bias=True, tie=True, n_layer=2, seed=7)
    ck = load_checkpoint(tiny.write_gguf(tmp_path / "m.gguf", w, s))
    held = {k: (Held(v) if v.dim() == 2 else v) for k, v in ck.weights.items()}
    m_obj = DecoderModel(ck.config, held)
    assert isinstance(m_obj.layers[0].mixer.wqkv, RowStack) and m_obj.layers[0].mixer.wqkv.shape == (32 + 2 * 16, 32)
    ref = _forward(DecoderModel(ck.config, ck.weights))
    got = _forward(m_obj)
    assert (got - ref).abs().max() < 1e-5
    assert all(h.calls > 0 for h in held.values() if isinstance(h, Held))


def test_q8_activation_op_quantises_the_matmul_input_in_blocks_of_32():
    """ggml-cpu quantize_row_q8_0 on a hand-worked block: d = max|x| / 127, q = round(x / d)."""
    x = torch.tensor([[0.5] + [0.0] * 30 + [-1.27]] * 1)  # [1, 32]: d = 0.01, q = 50 / 0 / -127
    w = torch.eye(32)
    y = Q8ActivationOps().linear(x, w)
    want = torch.zeros(1, 32)
    want[0, 0], want[0, 31] = 50 * (1.27 / 127), -127 * (1.27 / 127)
    assert torch.allclose(y, want, atol=1e-7)
    x2 = torch.tensor([[0.013] + [0.0] * 30 + [-1.27]])  # 0.013 / 0.01 = 1.3 -> 1
    assert torch.allclose(Q8ActivationOps().linear(x2, w)[0, 0], torch.tensor(0.01), atol=1e-7)
    assert torch.equal(Ops().linear(x2, w), F.linear(x2, w))  # the default op leaves the input alone
