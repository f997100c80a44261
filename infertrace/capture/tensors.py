"""The tensors a run keeps (``--keep tensors``), serialised on the engine side: the torch-free
store (:func:`infertrace.trace.store.save_trace`) writes the bytes as they are.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
from safetensors.torch import save as st_save

from infertrace.trace.store import TensorFile


def encode_tensors(tensors: Mapping[str, torch.Tensor], layers: Iterable[int]) -> TensorFile | None:
    """``tensors`` as one safetensors image (``safetensors.torch.save``, ``{"format": "pt"}``
    metadata, the layout ``transformers``/``safetensors.torch.load`` read back).

    Args:
        tensors: ``{name: tensor}`` from :func:`infertrace.runner.run_requests` (``tensors=``), names
            like ``step3/layer0/q_pre_rope``; any dtype safetensors stores (float32, float16,
            bfloat16, int64, ...), any shape; non-contiguous tensors are made contiguous.
        layers: the layers the tensors were taken from (recorded sorted and de-duplicated).

    Returns:
        a :class:`~infertrace.trace.store.TensorFile`, or None when ``tensors`` is empty
        (the trace is then saved as ``keep summary``).
    """
    if not tensors:
        return None
    index = {k: {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)} for k, t in sorted(tensors.items())}
    data = st_save({k: t.contiguous() for k, t in tensors.items()}, metadata={"format": "pt"})
    return TensorFile(data=data, index=index, layers=sorted(set(layers)))
