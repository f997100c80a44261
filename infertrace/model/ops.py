"""The decoder's replaceable numerics: every linear layer of the forward pass goes through one object.

:class:`Ops` is what a :class:`~infertrace.model.decoder.DecoderModel` calls for each projection
(Q/K/V, output, gate/up, down, the GDN projections, the lm head) and for the embedding lookup. Replace it to change numerics
without patching modules: the llama.cpp CPU-numerics emulation quantises each matmul's activations
(:mod:`infertrace.compare.llamacpp`); weights that stay quantised bring their own kernel.

The weight of a linear layer is either a ``torch.Tensor`` ``[out, in]`` (``F.linear``, as HF's
``nn.Linear``) or any object implementing :class:`LinearWeight`: called as ``w(x, bias)`` it computes
``x @ W^T (+ bias)`` with whatever kernel it carries (llama.cpp: ``ggml_mul_mat`` dispatches on the
weight's ``ggml_type`` in the same way). Such an object is used where it is: the decoder moves only
float tensors to its device.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F


@runtime_checkable
class LinearWeight(Protocol):
    """A weight that computes its own matmul (e.g. the blocks of a quantised GGUF tensor).

    Attributes:
        shape: ``(out, in)``, as the float tensor it stands for.
    """

    shape: tuple[int, ...]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[..., in]`` -> ``[..., out]`` in ``x``'s dtype (``+ bias [out]`` when given)."""
        ...

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` ``[N]`` as float ``[N, in]`` in the compute dtype (needed only for an embedding
        table, llama.cpp ``ggml_get_rows``)."""
        ...


#: a linear layer's weight: a float tensor ``[out, in]`` or a :class:`LinearWeight`
Weight = Any


class RowStack:
    """Weights stacked along the output dimension without copying them into one tensor: the
    fused Q/K/V or gate/up of weights that are not all plain tensors (each part keeps its kernel).

    Called as ``w(x, bias)``: runs each part and concatenates the outputs, ``[..., sum(out_i)]``.
    """

    def __init__(self, parts: Sequence[Weight]):
        self.parts = tuple(parts)
        self.rows = tuple(int(p.shape[0]) for p in self.parts)
        self.shape = (sum(self.rows), int(self.parts[0].shape[1]))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        bs = bias.split(self.rows) if bias is not None else (None,) * len(self.parts)
        outs = [F.linear(x, p, b) if isinstance(p, torch.Tensor) else p(x, b) for p, b in zip(self.parts, bs)]
        return torch.cat(outs, dim=-1)  # [..., sum(out_i)]


class Ops:
    """The default numerics: ``F.linear`` for float tensors, the weight's own kernel otherwise.

    Subclass and override :meth:`linear` to change every projection of the forward pass (the
    llama.cpp emulation quantises ``x`` then calls ``super().linear``, so it composes with
    quantised weights). :meth:`cat_rows` decides how separately stored projections are fused at
    load (Q/K/V, gate/up).
    """

    def linear(self, x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[..., in]`` @ ``w`` ``[out, in]``^T (+ ``b`` ``[out]``) -> ``[..., out]``.

        Mirrors ``torch.nn.functional.linear`` / llama.cpp ``build_lora_mm`` (``ggml_mul_mat``).
        """
        if isinstance(w, torch.Tensor):
            return F.linear(x, w, b)
        return w(x, b)

    def embed(self, table: Weight, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` ``[N]`` of the embedding table ``[V, H]`` -> ``[N, H]`` (llama.cpp ``ggml_get_rows``)."""
        if isinstance(table, torch.Tensor):
            return table[ids]
        return table.rows(ids)

    def cat_rows(self, parts: Sequence[Weight]) -> Weight:
        """Stack projection weights along ``out`` at load (one matmul for Q/K/V, one for gate/up, the
        GDN beta/alpha): ``torch.cat`` for float tensors, a :class:`RowStack` for anything else (override
        to fuse a weight type's own blocks instead)."""
        if all(isinstance(p, torch.Tensor) for p in parts):
            return torch.cat(list(parts))  # [sum(out_i), in]
        return RowStack(parts)


#: the default :class:`Ops` (stateless; shared)
TORCH_OPS = Ops()
