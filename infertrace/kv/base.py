"""What both KV-cache backends share: the per-step attention inputs and the protocol.

A backend owns the physical K/V storage of every layer. Each step the engine calls
``prepare(chunks)`` (choose where the current tokens' K/V go and build the attention
inputs), then per layer ``write`` and ``attend``, then ``release`` for finished requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from infertrace.ranges import ranges_text  # noqa: F401 - torch-free home; re-exported for old imports


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


@dataclass
class AttnInputs:
    """Per-step attention inputs (a batch of one is still a batch).

    Common: ``chunks`` (packed order), ``positions`` ``[N]`` int64, ``seq_ids`` ``[N]`` int64.
    ``cells`` backend: ``cell_idx`` ``[N]`` (where each token's K/V goes), ``n_kv`` and
    ``kq_mask`` ``[n_stream, 1, n_tokens_padded, n_kv]`` (ggml ``ne = [n_kv, n_tokens_padded, 1, n_stream]``).
    ``paged`` backend: ``slot_mapping`` ``[N]``, ``block_tables`` ``[num_seqs, max_blocks]``,
    ``seq_lens``/``kv_lens`` ``[num_seqs]``, ``cu_seqlens`` ``[num_seqs+1]``, ``num_contexts``,
    ``request_types``.
    """

    chunks: list[ChunkSpec]
    positions: torch.Tensor
    seq_ids: torch.Tensor
    backend: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return int(self.positions.shape[0])


class KVBackend(Protocol):
    """The contract both ``cells`` and ``paged`` implement."""

    kind: str
    capacity_tokens: int

    def can_fit(self, plan: list[tuple[int, int]]) -> bool:
        """Whether all ``(seq_id, n_new)`` of ``plan`` fit at once."""

    def prepare(self, chunks: Sequence[ChunkSpec]) -> AttnInputs:
        """Reserve storage for the current tokens and build attention inputs."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, inp: AttnInputs) -> None:
        """Store current K/V ``[N, n_kv_heads, head_dim]`` of ``layer``."""

    def attend(self, layer: int, q: torch.Tensor, inp: AttnInputs, scale: float) -> torch.Tensor:
        """Attention output ``[N, n_head, head_dim]`` for queries ``q``."""

    def release(self, seq_id: int) -> None:
        """Free everything ``seq_id`` owns."""

    def seq_len(self, seq_id: int) -> int:
        """Tokens of ``seq_id`` currently cached."""

    def read(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical K, V of ``seq_id`` ordered by position: ``[L, n_kv_heads, head_dim]`` each."""

    def logical_mask(self, inp: AttnInputs) -> list[torch.Tensor]:
        """Per chunk, bool ``[T, C+T]``: query i may see key position j."""

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready description of the physical state (for traces and ``dump-kv``)."""
