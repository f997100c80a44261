"""Pick the paged-attention implementation for ``--attention torch|triton|auto`` and dispatch to it.

* ``torch``: the reference twins in :mod:`infertrace.attention.reference` (any device).
* ``triton``: the kernels in :mod:`infertrace.attention.triton_paged`; on CUDA, or on CPU
  through Triton's interpreter when ``TRITON_INTERPRET=1`` is set.
* ``auto``: ``triton`` on a CUDA device when triton is importable, ``torch`` otherwise
  (never the interpreter: it is a verification tool, far slower than torch on CPU).
"""

from __future__ import annotations

import torch

from infertrace.attention.reference import paged_attention_torch, write_kv_paged_torch
from infertrace.attention.triton_paged import (
    interpreter_requested,
    paged_attention_triton,
    triton_available,
    write_kv_paged_triton,
)
from infertrace.errors import ConfigError, InfertraceError

CHOICES = ("torch", "triton", "auto")


def resolve_attention(requested: str, device: torch.device) -> str:
    """Resolve an ``--attention`` choice to the implementation that will run.

    Args:
        requested: ``"torch"``, ``"triton"`` or ``"auto"`` (case-insensitive).
        device: device the model runs on.

    Returns:
        ``"torch"`` or ``"triton"``. ``auto`` picks ``triton`` only on a CUDA device with
        triton importable and ``TRITON_INTERPRET`` unset (the interpreter is for checks).

    Raises:
        ConfigError: ``attention``: unknown choice; ``triton`` asked for but triton is not installed;
            ``triton`` asked for on a non-CUDA device without ``TRITON_INTERPRET=1``.
    """
    choice = str(requested).strip().lower()
    if choice not in CHOICES:
        raise ConfigError("attention", f"must be one of {', '.join(CHOICES)}, got {requested!r}")
    device = torch.device(device)
    if choice == "torch":
        return "torch"
    ok, reason = triton_available()
    if choice == "auto":
        return "triton" if (ok and device.type == "cuda" and not interpreter_requested()) else "torch"
    # choice == "triton"
    if device.type == "cuda":
        if not ok:
            raise ConfigError("attention", f"triton: {reason}")
        return "triton"
    if not interpreter_requested():
        raise ConfigError("attention", f"triton on {device.type} needs TRITON_INTERPRET=1 (Triton's CPU interpreter, "
                                       "slow) or a GPU; or use torch")
    if not ok:
        raise ConfigError("attention", f"triton: {reason}")
    return "triton"


def _check_impl(impl: str) -> str:
    if impl not in ("torch", "triton"):
        raise InfertraceError(f"attention implementation must be 'torch' or 'triton' (resolve 'auto' first), got {impl!r}")
    return impl


def paged_attention(
    impl: str,
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Paged attention by the resolved implementation; arguments (``window``: sliding window W,
    0 = none) and result as :func:`~infertrace.attention.reference.paged_attention_torch`
    (``[N, n_head, head_dim]``)."""
    if _check_impl(impl) == "triton":
        return paged_attention_triton(q, kv_pool, block_tables, seq_lens, kv_lens, cu_seqlens, scale, window=window)
    return paged_attention_torch(q, kv_pool, block_tables, seq_lens, kv_lens, cu_seqlens, scale, window)


def write_kv_paged(
    impl: str, kv_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Slot-mapping K/V write by the resolved implementation, in place; arguments as
    :func:`~infertrace.attention.reference.write_kv_paged_torch`."""
    if _check_impl(impl) == "triton":
        write_kv_paged_triton(kv_pool, k, v, slot_mapping)
    else:
        write_kv_paged_torch(kv_pool, k, v, slot_mapping)


__all__ = ["CHOICES", "paged_attention", "resolve_attention", "write_kv_paged"]
