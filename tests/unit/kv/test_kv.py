"""KV backends without a model: slot mapping (P4), cells mask layout, isolation, release."""

import torch

from infertrace.attention.reference import attention_with_kq_mask, paged_attention_torch, write_kv_paged_torch
from infertrace.kv.base import ChunkSpec, ranges_text
from infertrace.kv.cells import CellsKV
from infertrace.kv.paged import PagedKV


def test_p4_slot_mapping_at_block_boundaries():
    kv = PagedKV(1, 1, 4, num_blocks=16, tokens_per_block=4)
    kv.tables[0] = [10, 11]
    kv.lens[0] = 8
    assert kv.slot(0, 7) == 47  # never 43
    B = 4
    for p in (B - 1, B, 2 * B - 1):
        assert kv.slot(0, p) == kv.tables[0][p // B] * B + p % B
    assert [kv.slot(0, p) for p in range(8)] == [40, 41, 42, 43, 44, 45, 46, 47]


def test_p4_prepare_grows_tables_and_slot_mapping():
    kv = PagedKV(1, 1, 4, num_blocks=8, tokens_per_block=4)
    inp = kv.prepare([ChunkSpec(0, 0, 5), ChunkSpec(1, 0, 3)])
    assert kv.tables == {0: [0, 1], 1: [2]}
    assert inp.slot_mapping.tolist() == [0, 1, 2, 3, 4, 8, 9, 10]
    assert inp.cu_seqlens.tolist() == [0, 5, 8]
    assert inp.kv_lens.tolist() == [5, 3]
    inp = kv.prepare([ChunkSpec(1, 3, 1), ChunkSpec(0, 5, 1)])  # block boundary for seq 1 at p=3 -> still block 2; seq 0 p=5 -> block 1
    assert inp.slot_mapping.tolist() == [11, 5]
    inp = kv.prepare([ChunkSpec(1, 4, 1)])  # p=4 = B: new block 3
    assert kv.tables[1] == [2, 3] and inp.slot_mapping.tolist() == [12]
    kv.release(0)
    assert kv.free[:2] == [0, 1] and 0 not in kv.tables


def test_cells_kq_mask_worked_example():
    kv = CellsKV(1, 1, 4, size=64)
    inp = kv.prepare([ChunkSpec(0, 0, 3)])
    m = inp.kq_mask
    # as llama.cpp builds it (measured by --runtime llama.cpp): n_kv = min(size, pad(used, 256)) = 64,
    # rows = n_tokens (no GGML_KQ_MASK_PAD any more)
    assert list(m.shape) == [1, 1, 3, 64]  # ne = [n_kv=64, n_tokens=3, 1, 1]
    keep = (m[0, 0, :3, :3] == 0).int().tolist()
    assert keep == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert bool((m[0, 0, :3, 3:] == float("-inf")).all())  # empty cells dropped
    inp = kv.prepare([ChunkSpec(0, 3, 1)])
    assert (inp.kq_mask[0, 0, 0, :5] == 0).int().tolist() == [1, 1, 1, 1, 0]
    assert inp.cell_idx.tolist() == [3] and kv.head == 4


def test_cells_isolation_two_sequences_interleaved():
    kv = CellsKV(1, 1, 4, size=64)
    kv.prepare([ChunkSpec(0, 0, 2), ChunkSpec(1, 0, 3)])  # cells 0,1 -> seq0 ; 2,3,4 -> seq1
    inp = kv.prepare([ChunkSpec(0, 2, 1), ChunkSpec(1, 3, 1)])  # cells 5 (seq0 pos2), 6 (seq1 pos3)
    keep = (inp.kq_mask[0, 0, :2, :7] == 0).int().tolist()
    assert keep == [[1, 1, 0, 0, 0, 1, 0], [0, 0, 1, 1, 1, 0, 1]]
    lm = kv.logical_mask(inp)
    assert lm[0].int().tolist() == [[1, 1, 1]] and lm[1].int().tolist() == [[1, 1, 1, 1]]
    kv.release(0)
    assert kv.used == 4 and kv.cells_of(1) == [(2, 0), (3, 1), (4, 2), (6, 3)]
    assert ranges_text([c for c, _ in kv.cells_of(1)]) == "2..4,6"


def test_paged_and_masked_attention_agree_on_random_data():
    g = torch.Generator().manual_seed(0)
    nh, nkv, hd = 6, 2, 8
    cells = CellsKV(1, nkv, hd, size=64)
    paged = PagedKV(1, nkv, hd, num_blocks=16, tokens_per_block=4)
    plan = [[ChunkSpec(0, 0, 5), ChunkSpec(1, 0, 2)], [ChunkSpec(0, 5, 1), ChunkSpec(1, 2, 3), ChunkSpec(2, 0, 4)]]
    for chunks in plan:
        N = sum(c.T for c in chunks)
        q = torch.randn(N, nh, hd, generator=g)
        k = torch.randn(N, nkv, hd, generator=g)
        v = torch.randn(N, nkv, hd, generator=g)
        ic, ip = cells.prepare(chunks), paged.prepare(chunks)
        cells.write(0, k, v, ic)
        paged.write(0, k, v, ip)
        a = cells.attend(0, q, ic, hd ** -0.5)
        b = paged.attend(0, q, ip, hd ** -0.5)
        assert torch.allclose(a, b, atol=1e-5)
        for sid in {c.seq_id for c in chunks}:
            kc, vc = cells.read(0, sid)
            kp, vp = paged.read(0, sid)
            assert torch.equal(kc, kp) and torch.equal(vc, vp)
        # logical masks agree
        for x, y in zip(cells.logical_mask(ic), paged.logical_mask(ip)):
            assert torch.equal(x, y)


def test_reference_attention_single_query_hand_value():
    # one head, keys [1,0],[0,1], query [ln3, 0] with scale 1 -> weights 3/4, 1/4
    q = torch.tensor([[[float(torch.log(torch.tensor(3.0))), 0.0]]])
    k = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    v = torch.tensor([[[4.0, 0.0]], [[0.0, 8.0]]])
    out = attention_with_kq_mask(q, k, v, torch.zeros(1, 2), 1.0)
    assert torch.allclose(out, torch.tensor([[[3.0, 2.0]]]))
    pool = torch.zeros(2, 2, 1, 2, 2)
    write_kv_paged_torch(pool, k, v, torch.tensor([2, 3]))  # block 1
    out2 = paged_attention_torch(q, pool, torch.tensor([[1]], dtype=torch.int32), torch.tensor([1]), torch.tensor([2]),
                                 torch.tensor([0, 1]), 1.0)
    assert torch.allclose(out2, out)
