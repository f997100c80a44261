"""The tensors a run keeps (``--keep tensors``) on the torch side: serialised here for the torch-free
store (:func:`infertrace.trace.store.save_trace` writes the bytes as they are), and read back as
torch tensors (:func:`read_tensor`; the trace layer itself reads them through numpy).
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
from safetensors.torch import save as st_save

from infertrace.errors import InfertraceError
from infertrace.safe_text import visible
from infertrace.trace.store import TensorFile, TraceTensors


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


def read_tensor(tt: TraceTensors, name: str) -> torch.Tensor:
    """The saved tensor ``name`` as a CPU torch tensor of its saved dtype (bfloat16 included), bit
    for bit what :func:`encode_tensors` was given; the file's header was checked when ``tt`` was
    opened (:func:`infertrace.trace.store.load_tensors`).

    Raises:
        InfertraceError: no such tensor in the trace, or the file cannot be read.
    """
    if name not in tt.index:
        raise InfertraceError(f"{visible(str(tt.path))}: no tensor {visible(name)!r} in this trace")
    try:
        from safetensors import safe_open

        with safe_open(str(tt.path), framework="pt") as f:
            return f.get_tensor(name)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise InfertraceError(f"{visible(str(tt.path))}: cannot read tensor {visible(name)!r} "
                              f"({visible(' '.join(str(e).split())[:200] or type(e).__name__)})") from None
