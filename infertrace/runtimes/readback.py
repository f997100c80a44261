"""What every read-back memory shares: a runtime's cache as infertrace reads it back (llama.cpp's cells,
llama.cpp's per-sequence streams, vLLM's paged pool), held as one of our memories by composition.

A read-back memory is not a memory our engine computes with: the runtime places and writes its own cache;
infertrace mirrors what it read (cell or block ids, positions, the captured layer's K/V) into
:attr:`ReadBack.mirror` (a :class:`~infertrace.kv.cells.CellsKV`, :class:`~infertrace.kv.streams.CellsStreamsKV`
or :class:`~infertrace.kv.paged.PagedKV` of one layer) and answers from it what the engine drives
(``can_fit``, ``seq_len``, ``capacity_tokens``) and what the recorder's probe reads
(:mod:`infertrace.capture.probe`). Each runtime's own class adds how a step is read back.
"""

from __future__ import annotations

from typing import Any

import torch

from infertrace.errors import ConfigError, InfertraceError


class ReadBack:
    """The read-only answers every read-back memory gives from its mirror.

    Subclasses set :attr:`mirror` (our memory of one layer: the captured ``layer``), :attr:`n_layer`
    (the model's layers: the runtime caches every one) and :attr:`layer` in their ``__init__``.
    """

    mirror: Any
    n_layer: int
    layer: int
    #: the runtime whose cache this is (named in the refusals)
    runtime: str = ""

    def check_layer(self, layer: int) -> None:
        """Refuse a layer whose K/V were not read back.

        Raises:
            ConfigError: ``run.layer``: ``layer`` is not the captured one (the CLI names ``--layer``).
        """
        if layer != self.layer:
            raise ConfigError("run.layer", f"{self.runtime} captured layer {self.layer} only; record layer {layer} "
                                           "by passing it as the recorded layer")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, inp: Any) -> None:  # pragma: no cover
        """Never called: the runtime writes its own cache.

        Raises:
            InfertraceError: always.
        """
        raise InfertraceError(f"{self.runtime} writes its own cache")

    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence can hold (llama.cpp ``n_ctx`` / ``n_ctx_seq``; vLLM the pool's slots)."""
        return self.mirror.capacity_tokens

    def can_fit(self, plan: list[tuple[int, int]]) -> bool:
        """Whether every ``(seq_id, n_new)`` of ``plan`` fits (the scheduler asks before packing)."""
        return self.mirror.can_fit(plan)

    def seq_len(self, seq_id: int) -> int:
        """Tokens cached for ``seq_id`` after the last step."""
        return self.mirror.seq_len(seq_id)

    def holds_values(self, il: int) -> bool:
        """Only the captured layer's K/V are read back (the runtime caches every layer)."""
        return il == self.layer

    def recurrent_state(self) -> None:
        """No recurrent state is read back (a hybrid model's recurrent cells, where read, are in the snapshot)."""
        return None

    def describe(self) -> dict[str, Any]:
        """As the mirror's ``describe``, with the model's layer count (every layer has a cache in the runtime)."""
        d = self.mirror.describe()
        d["n_layer"], d["kv_layers"] = self.n_layer, list(range(self.n_layer))
        return d

    def logical_mask(self, inp: Any, swa: bool = False) -> list[torch.Tensor]:
        """Per chunk ``[T, C+T]`` bool: the keys each query sees, from the read-back placement (as the mirror's)."""
        return self.mirror.logical_mask(inp, swa)
