"""Planted truths for ``bisect``: a copy of a GGUF with one tensor perturbed (written with the ``gguf``
library: every metadata field and every other tensor copied byte for byte, the perturbed tensor
dequantised by ``gguf.quants`` and stored as F32, which llama.cpp, HF transformers' GGUF loader, vLLM
(through infertrace's converter) and infertrace all read)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def perturbed_gguf(src: Path, dst: Path, tensor: str, scale: float = 0.5, seed: int = 0) -> Path:
    """Write ``dst``: ``src`` with ``tensor += scale * std(tensor) * N(0, 1)`` (numpy generator ``seed``).

    Raises:
        KeyError: ``tensor`` is not in ``src``.
    """
    import gguf

    r = gguf.GGUFReader(str(src))
    arch = r.fields[gguf.Keys.General.ARCHITECTURE].contents()
    w = gguf.GGUFWriter(str(dst), arch=arch, endianess=r.endianess)
    for f in r.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        vt = f.types[0]
        w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    if tensor not in {t.name for t in r.tensors}:
        raise KeyError(tensor)
    data = {}
    for t in r.tensors:
        if t.name == tensor:
            x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)  # [ne1, ne0]
            x = x + np.float32(scale * x.std()) * np.random.default_rng(seed).standard_normal(x.shape, dtype=np.float32)
            data[t.name] = x
            w.add_tensor_info(t.name, x.shape, x.dtype, x.nbytes, gguf.GGMLQuantizationType.F32)
        else:
            data[t.name] = t.data
            w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(data[t.name], tensor_endianess=r.endianess)
    w.close()
    return dst
