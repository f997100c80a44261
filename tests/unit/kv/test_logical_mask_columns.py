"""CellsKV.logical_mask reads a kq_mask back into per-chunk keep matrices: column pos j of row i is set
iff some cell holding pos j is 0 in row i (an OR over cells sharing a pos). Checked against a hand-worked
case and against the per-cell definition written out as a loop, on random masks with shared positions."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from infertrace.kv.cells import CellsKV


class _Inp(SimpleNamespace):
    def mask(self, swa: bool = False) -> torch.Tensor:
        return self.kq_mask


def _inp(mask: torch.Tensor, pos: list[int], seq: torch.Tensor, chunks: list[tuple[int, int, int]]) -> _Inp:
    return _Inp(kq_mask=mask[None, None], n_kv=len(pos), cell_pos=torch.tensor(pos), cell_seq=seq,
                chunks=[SimpleNamespace(T=t, C=c, seq_id=s) for t, c, s in chunks])


def _by_definition(inp: _Inp) -> list[torch.Tensor]:
    mask, out, row = inp.kq_mask[0, 0], [], 0
    for c in inp.chunks:
        m = torch.zeros(c.T, c.C + c.T, dtype=torch.bool)
        for i in range(c.T):
            for cell in range(inp.n_kv):
                p = int(inp.cell_pos[cell])
                if 0 <= p < c.C + c.T and mask[row + i, cell] == 0 and inp.cell_seq[cell, c.seq_id]:
                    m[i, p] = True
        out.append(m)
        row += c.T
    return out


def test_hand_worked_two_cells_one_pos() -> None:
    inf = float("-inf")
    # 3 cells: cell 0 pos 0, cell 1 pos 1, cell 2 pos 1 (seq 0 holds all); one query at pos 2 (C=2, T=1)
    mask = torch.tensor([[0.0, 0.0, inf], [inf, inf, inf]])  # row 0 sees cells 0 and 1 (not 2); row 1 is padding
    seq = torch.tensor([[True], [True], [True]])
    got = CellsKV.logical_mask(None, _inp(mask, [0, 1, 1], seq, [(1, 2, 0)]))  # type: ignore[arg-type]
    assert got[0].tolist() == [[True, True, False]]


def test_random_masks_match_the_per_cell_definition() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        n_kv, chunks = 12, [(2, 3, 0), (1, 4, 1)]
        pos = torch.randint(-1, 6, (n_kv,), generator=g).tolist()
        seq = torch.zeros(n_kv, 2, dtype=torch.bool)
        for cell, p in enumerate(pos):
            if p >= 0:
                seq[cell, int(torch.randint(0, 2, (1,), generator=g))] = True
        keep = torch.rand(4, n_kv, generator=g) < 0.5
        keep &= torch.cat([seq[:, 0].expand(2, -1), seq[:, 1].expand(1, -1), torch.zeros(1, n_kv, dtype=torch.bool)])
        mask = torch.where(keep, 0.0, float("-inf"))
        inp = _inp(mask, pos, seq, chunks)
        got = CellsKV.logical_mask(None, inp)  # type: ignore[arg-type]
        assert [m.tolist() for m in got] == [m.tolist() for m in _by_definition(inp)]
