"""The decoder's linear-op point (:class:`infertrace.model.ops.Ops`) for weights that stay quantised.

:class:`QuantOps` changes only how projections are fused at load: Q/K/V and gate/up stored as
separate :class:`~infertrace.quant.source.QuantWeight` of one file are built as one kernel per
tensor type (``GGUFQuantSource.linear``: rows of one type concatenated before packing, parts of
different types stacked). Matmuls and embedding lookups are the weights' own (``w(x, b)``,
``w.rows(ids)``), as the default :class:`~infertrace.model.ops.Ops` already dispatches.
"""

from __future__ import annotations

from typing import Any, Sequence

from infertrace.model.ops import Ops
from infertrace.quant.source import QuantWeight


class QuantOps(Ops):
    """:class:`~infertrace.model.ops.Ops` that fuses quantised projections per tensor type at load."""

    def cat_rows(self, parts: Sequence[Any]) -> Any:
        """Row-stack projection weights: quantised parts of one source as one kernel per type, else
        :meth:`Ops.cat_rows` (``torch.cat`` of floats, ``RowStack`` otherwise)."""
        if parts and all(isinstance(p, QuantWeight) for p in parts) and len({id(p.source) for p in parts}) == 1:
            for p in parts:
                p.fused = True
            return parts[0].source.linear([p.name for p in parts])
        return super().cat_rows(parts)
