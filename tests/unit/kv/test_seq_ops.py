"""KV sequence operations on both backends: K-shift against K computed fresh at the new positions,
seq_rm then re-decoding against a run that never had the removed tokens, seq_cp / seq_keep /
defrag on cells, fork with reference counts on paged."""

import pytest
import torch

from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.kv.audit import recompute_kv
from infertrace.kv.base import ChunkSpec
from infertrace.kv.cells import CellsKV
from infertrace.kv.prefix_cache import SharedPagedKV
from infertrace.kv.seq_ops import seq_cp, seq_rm, shift_out
from infertrace.model.decoder import DecoderModel
from infertrace.model.rope import layer_ropes
from infertrace.loading.weights import load_checkpoint
from tests.helpers.tiny import make_weights, write_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    w, s = make_weights(seed=7)
    ck = load_checkpoint(write_gguf(tmp_path_factory.mktemp("tiny") / "m.gguf", w, s))
    return ck, DecoderModel(ck.config, ck.weights)


TOKS = [72, 101, 108, 108, 111, 33, 34, 35, 100, 101, 102, 103]


def _prefill_cells(model, ids, start=0, size=64):
    cfg = model.cfg
    kv = CellsKV(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, size, 4)
    inp = kv.prepare([ChunkSpec(0, start, len(ids))])  # positions start .. start+len-1
    model.forward(torch.tensor(ids), inp, kv, torch.tensor([len(ids) - 1]))
    return kv


def test_k_shift_equals_fresh_k_at_new_positions_all_layers(tiny):
    """seq_add(+5) re-rotates cached K; the same tokens computed fresh at positions 5.. give the same K
    in every layer (RoPE attention depends on relative positions only), V untouched."""
    _, m = tiny
    kv = _prefill_cells(m, TOKS)
    before = [kv.k[i].clone() for i in range(m.cfg.n_layer)]
    op = kv.seq_add(0, -1, -1, 5, layer_ropes(m.cfg))
    assert op["from"] == "0..11" and op["to"] == "5..16"
    fresh = _prefill_cells(m, TOKS, start=5)
    n = len(TOKS)
    for layer in range(m.cfg.n_layer):
        k, v = kv.read(layer, 0)
        fk, fv = fresh.read(layer, 0)
        assert (k - fk).abs().max() <= 1e-5
        assert (v - fv).abs().max() <= 1e-5
        assert (before[layer][:n] - fk).abs().max() > 1e-2  # without the K-shift the cache would be wrong
    assert kv.pos[:n].tolist() == list(range(5, 5 + n))


def test_k_shift_real_model_layer0(smol):
    """Real SmolLM2: cache of a prompt shifted by -3 after dropping 3 positions equals layer-0 K/V computed
    fresh for the kept tokens (layer 0 sees only token and position)."""
    m = smol.model
    ids = smol.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    for backend in ("cells", "paged"):
        e = Engine(m, smol.tokenizer, EngineOptions(backend=backend, ctx_size=64, tokens_per_block=4))
        e.add_request(ids, SamplingParams(max_new_tokens=5, ignore_eos=True))
        e.step()
        shift_out(e.kv, 0, 2, 5, layer_ropes(m.cfg))
        kept = ids[:2] + ids[5:]
        fk, fv = recompute_kv(m, kept)
        k, v = e.kv.read(0, 0)
        assert k.shape[0] == len(kept)
        assert (k - fk[0]).abs().max() <= 1e-5, backend
        assert (v - fv[0]).abs().max() <= 1e-5, backend


class LogitsProbe:
    """Keeps each step's logits rows."""

    enabled = True
    layers: frozenset = frozenset()
    taps: frozenset = frozenset()

    def __init__(self):
        self.logits = []

    def tap(self, name, **t):
        return None

    def begin_step(self):
        return None

    def end_step(self, ctx):
        self.logits.append(None if ctx["logits"] is None else ctx["logits"].clone())


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_seq_rm_then_redecode_equals_never_having_it(tiny, backend):
    ck, m = tiny
    probe = LogitsProbe()
    e = Engine(m, ck.tokenizer, EngineOptions(backend=backend, ctx_size=64, tokens_per_block=4), probe)
    r = e.add_request(TOKS[:7], SamplingParams(max_new_tokens=8, ignore_eos=True))
    for _ in range(5):  # prefill + 4 decode steps: 7 + 4 positions cached
        e.step()
    assert r.num_computed == 11
    used_before = e.kv.used if backend == "cells" else e.kv.num_blocks - len(e.kv.free)
    op = e.serving.rewind(r, 8)  # keep prompt + first generated token, drop positions 8..10
    assert op["pos"] == "8..10"
    used_after = e.kv.used if backend == "cells" else e.kv.num_blocks - len(e.kv.free)
    assert used_after < used_before
    x = 200  # decode a different token at position 8
    r.output_ids[-1] = x
    e.step()
    got = probe.logits[-1][0]
    ref_probe = LogitsProbe()
    ref = Engine(m, ck.tokenizer, EngineOptions(backend=backend, ctx_size=64, tokens_per_block=4), ref_probe)
    ref.add_request(TOKS[:7] + [r.output_ids[0], x], SamplingParams(max_new_tokens=2, ignore_eos=True))
    ref.step()
    assert torch.allclose(got, ref_probe.logits[-1][0], atol=1e-5)
    for layer in range(m.cfg.n_layer):  # the cache now equals the one that never held the removed tokens
        k, v = e.kv.read(layer, 0)
        rk, rv = ref.kv.read(layer, 0)
        assert k.shape == rk.shape and (k - rk).abs().max() <= 1e-5 and (v - rv).abs().max() <= 1e-5


def test_cells_seq_cp_shares_cells_and_seq_keep_frees():
    kv = CellsKV(1, 1, 4, size=64, n_seq_max=4)
    kv.prepare([ChunkSpec(0, 0, 5)])
    op = kv.seq_cp(0, 1, 0, 3)
    assert op["cells"] == "0..2" and op["pos"] == "0..2"
    assert kv.seq_len(1) == 3 and kv.used == 5  # shared, no new cell
    inp = kv.prepare([ChunkSpec(1, 3, 1)])  # seq 1 continues at pos 3 in a new cell
    keep = (inp.kq_mask[0, 0, 0, :6] == 0).int().tolist()
    assert keep == [1, 1, 1, 0, 0, 1]  # sees the shared cells 0..2 and its own cell 5, not seq 0's 3..4
    seq_rm(kv, 0)
    assert kv.used == 4 and kv.cells_of(1) == [(0, 0), (1, 1), (2, 2), (5, 3)]  # shared cells survive
    kv.prepare([ChunkSpec(2, 0, 2)])
    kv.seq_keep(1)
    assert kv.used == 4 and kv.seq_len(2) == 0


def test_cells_defrag_moves_kv_and_keeps_attention():
    g = torch.Generator().manual_seed(1)
    kv = CellsKV(1, 2, 8, size=64, n_seq_max=4)
    for chunks in ([ChunkSpec(0, 0, 3), ChunkSpec(1, 0, 4)], [ChunkSpec(0, 3, 2)]):
        inp = kv.prepare(chunks)
        N = inp.n_tokens
        kv.write(0, torch.randn(N, 2, 8, generator=g), torch.randn(N, 2, 8, generator=g), inp)
    seq_rm(kv, 1)  # holes at cells 3..6
    k_before, v_before = kv.read(0, 0)
    op = kv.defrag()
    assert op["moves"] == [[7, 3], [8, 4]] and kv.head == 5
    k_after, v_after = kv.read(0, 0)
    assert torch.equal(k_before, k_after) and torch.equal(v_before, v_after)
    assert [c for c, _ in kv.cells_of(0)] == [0, 1, 2, 3, 4]


def test_paged_fork_ref_counts_and_tail_free():
    kv = SharedPagedKV(1, 1, 4, num_blocks=8, tokens_per_block=4)
    inp = kv.prepare([ChunkSpec(0, 0, 10)])  # blocks 0,1,2 (2 partial)
    kv.write(0, torch.arange(40.).view(10, 1, 4), -torch.arange(40.).view(10, 1, 4), inp)
    op = seq_cp(kv, 0, 1, -1, 10)
    assert op["shared_blocks"] == [0, 1] and op["copied"] == [2, 3, 2]
    assert kv.ref[0] == 2 and kv.ref[1] == 2 and kv.ref[3] == 1
    k0, _ = kv.read(0, 0)
    k1, _ = kv.read(0, 1)
    assert torch.equal(k0, k1)
    kv.release(0)
    assert 0 not in kv.free and 1 not in kv.free and 2 in kv.free  # shared blocks stay with seq 1
    seq_rm(kv, 1, 5, -1)  # tail: keep 0..4 -> blocks 0, 1 (block 1 shared? no longer: ref 1)
    assert kv.tables[1] == [0, 1] and kv.lens[1] == 5 and 3 in kv.free
    kv.release(1)
    assert sorted(kv.free) == list(range(8)) and not kv.ref
    with pytest.raises(Exception, match="only a tail"):
        kv.prepare([ChunkSpec(2, 0, 6)])
        seq_rm(kv, 2, 1, 3)


def test_cells_shift_of_shared_cells_copies_first():
    """A context shift of seq 1 must not move cells it shares with seq 0 (copy-on-write)."""
    from infertrace.model.rope import LayerRope

    inv = [LayerRope(torch.tensor([1.0, 0.1], dtype=torch.float64), 1.0, 100.0, True)]  # one layer, rope_dim 4
    kv = CellsKV(1, 1, 4, size=64, n_seq_max=4)
    inp = kv.prepare([ChunkSpec(0, 0, 8)])
    kv.write(0, torch.randn(8, 1, 4), torch.randn(8, 1, 4), inp)
    kv.seq_cp(0, 1, 0, 8)
    k0 = kv.read(0, 0)[0].clone()
    shift_out(kv, 1, 2, 4, inv)
    assert kv.cells_of(0) == [(c, c) for c in range(8)] and torch.equal(kv.read(0, 0)[0], k0)  # seq 0 untouched
    assert [p for _, p in kv.cells_of(1)] == list(range(6)) and kv.cells_of(1)[:2] == [(0, 0), (1, 1)]


# ----------------------------------------------------------------------------- case C2: a RoPE base per layer


def _rot64(k: torch.Tensor, delta: int, base: float) -> torch.Tensor:
    """Half-split rotation of ``k`` ``[M, h, d]`` by ``delta`` positions with base ``base``, in float64
    (the reference: written here, not taken from infertrace.model.rope)."""
    d = k.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    c, s = (delta * inv).cos(), (delta * inv).sin()  # [d/2] each
    x1, x2 = k.double()[..., : d // 2], k.double()[..., d // 2 :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)  # [M, h, d]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    w, s = make_weights(family="gemma3", n_layer=6, seed=11)
    path = write_gguf(tmp_path_factory.mktemp("gemma") / "g.gguf", w, s,
                      kv={"attention.sliding_window": 4, "final_logit_softcapping": 3.0})
    ck = load_checkpoint(path)
    return ck, DecoderModel(ck.config, ck.weights)


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_k_shift_rotates_each_layer_with_its_own_base(gemma, backend):
    """Case C2: Gemma 3, windowed layers 0..4 base 10000, global layer 5 base 1e6. After seq_rm [2, 4) and a
    shift of [4, 10) by -2, each layer's K equals R(-2 theta_layer) K (float64 reference) within 1e-5, and
    layer 0 equals K computed fresh for the kept tokens at their new positions."""
    ck, m = gemma
    assert m.cfg.windowed_layers == [0, 1, 2, 3, 4] and (m.cfg.rope_theta_swa, m.cfg.rope_theta) == (10000.0, 1e6)
    ids = TOKS[:10]
    e = Engine(m, ck.tokenizer, EngineOptions(backend=backend, ctx_size=32, tokens_per_block=4))
    e.add_request(ids, SamplingParams(max_new_tokens=5, ignore_eos=True))
    e.step()  # the 10-token prefill
    before = [e.kv.read(il, 0)[0].clone() for il in range(6)]  # [10, nkv, hd] each
    shift_out(e.kv, 0, 2, 4, layer_ropes(m.cfg))  # seq_rm(0, 2, 4) + seq_add(0, 4, 10, -2)
    for il in range(6):
        base = 10000.0 if il < 5 else 1e6
        k = e.kv.read(il, 0)[0]  # [8, nkv, hd]
        assert k.shape[0] == 8 and torch.equal(k[:2], before[il][:2])
        ref = _rot64(before[il][4:10], -2, base)  # [6, nkv, hd]
        assert (k[2:].double() - ref).abs().max() <= 1e-5, (backend, il)
        if il < 5:  # one table for all layers (the global base) is far off on windowed layers
            assert (_rot64(before[il][4:10], -2, 1e6) - ref).abs().max() > 1e-2
    fk, _ = recompute_kv(m, ids[:2] + ids[4:])
    assert (e.kv.read(0, 0)[0] - fk[0]).abs().max() <= 1e-5


def test_k_shift_refuses_one_table_for_every_layer(gemma):
    from infertrace.errors import InfertraceError

    ck, m = gemma
    kv = _prefill_cells(m, TOKS[:6])
    with pytest.raises(InfertraceError, match="one RoPE per layer"):
        kv.seq_add(0, 2, -1, -1, m.inv_freq)
