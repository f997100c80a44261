"""One request's share of a step (:class:`ChunkSpec`): the unit the scheduler hands the memory. Below
``kv/base.py`` and ``kv/spec_meta.py``, which both read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ChunkSpec:
    """One request's share of a step: tokens ``C .. C+T-1`` of ``seq_id``."""

    seq_id: int
    C: int  # tokens already cached before the step
    T: int  # tokens computed this step
    #: speculative verify chunk: chunk-local parent index per token (``parents[0] == -1``: the
    #: last accepted token; a chain is ``[-1, 0, 1, ..]``). Token i then sits at position
    #: ``C + depth(i)`` and sees the past plus its ancestors (engine/speculative.py). None = causal.
    parents: list[int] | None = None

    def depths(self) -> list[int]:
        """Depth of each token in its draft tree (``0..T-1`` for a plain chunk)."""
        if self.parents is None:
            return list(range(self.T))
        d: list[int] = []
        for p in self.parents:
            d.append(0 if p < 0 else d[p] + 1)
        return d

    def ancestors(self) -> torch.Tensor:
        """``[T, T]`` bool: (i, j) iff token j is token i or one of its ancestors (the verify mask)."""
        if self.parents is None:
            return torch.ones(self.T, self.T, dtype=torch.bool).tril()  # [T, T] causal block
        a = torch.zeros(self.T, self.T, dtype=torch.bool)  # [T, T]
        for i, p in enumerate(self.parents):
            a[i, i] = True
            if p >= 0:
                a[i] |= a[p]
        return a
