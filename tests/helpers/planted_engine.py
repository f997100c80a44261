"""Planted defects in a test build of infertrace's engine (the production code is untouched: each is a context
manager patching one layer for the duration of a run).

* :func:`rope_base` — layer ``layer`` rotates Q and K with RoPE base ``theta`` instead of the model's;
* :func:`drop_first_key` — layer ``layer``'s attention cannot see position 0 from any later query (the cells
  convention's kq_mask gets ``-inf`` at the cells holding position 0, for rows at positions > 0).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Iterator

import torch


@contextlib.contextmanager
def rope_base(layer: int, theta: float, head_dim_rot: int) -> Iterator[None]:
    """Layer ``layer`` of every model run inside rotates with base ``theta`` (``head_dim_rot`` rotated dims)."""
    from infertrace.model import layers
    from infertrace.model.rope import cos_sin

    inv = 1.0 / (theta ** (torch.arange(0, head_dim_rot, 2, dtype=torch.float32) / head_dim_rot))  # [d/2]
    orig = layers.Attention.forward

    def forward(self: Any, h: torch.Tensor, s: Any, il: int, tp: Any) -> torch.Tensor:
        if il == layer:
            cos, _ = s.rope
            s = replace(s, rope=cos_sin(s.attn.positions.to(cos.device), inv.to(cos.device), cos.dtype))
        return orig(self, h, s, il, tp)

    layers.Attention.forward = forward
    try:
        yield
    finally:
        layers.Attention.forward = orig


@contextlib.contextmanager
def drop_first_key(layer: int) -> Iterator[None]:
    """Layer ``layer`` of every cells-backend run inside hides position 0 from queries at positions > 0."""
    from infertrace.attention.reference import attention_with_kq_mask
    from infertrace.kv.cells import CellsKV

    orig = CellsKV.attend

    def attend(self: Any, il: int, q: torch.Tensor, inp: Any, scale: float) -> torch.Tensor:
        if il != layer:
            return orig(self, il, q, inp, scale)
        n_kv, N = inp.n_kv, q.shape[0]
        mask = inp.kq_mask[0, 0, :N].clone().to(q.device)  # [N, n_kv]
        first = (self.pos[:n_kv] == 0).to(q.device)  # [n_kv] cells holding position 0
        later = (inp.positions[:N] > 0).to(q.device)  # [N] queries past position 0
        mask[later[:, None] & first[None, :]] = float("-inf")
        return attention_with_kq_mask(q, self.k[il][:n_kv], self.v[il][:n_kv], mask, scale)

    CellsKV.attend = attend
    try:
        yield
    finally:
        CellsKV.attend = orig
