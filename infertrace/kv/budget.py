"""What a run will cost before it starts: KV cache bytes, decode steps, and the bounds on them.

``--ctx-size`` (and ``--num-blocks`` x ``--tokens-per-block``) decide how much memory the KV cache
takes; nothing else in a run grows as fast. :func:`check_kv_budget` refuses a cache larger than
half the memory of the device before it is allocated (instead of an out-of-memory kill);
:func:`run_cost_warnings` describes a run that goes past the model's trained context
(``n_ctx_train``): legal, but the positions were never trained and the cost grows with it.

Sizes follow llama.cpp ``llama_kv_cache`` (``n_ctx`` cells x ``n_embd_k_gqa`` + ``n_embd_v_gqa``
per layer) and the TensorRT-LLM / vLLM pool (``num_blocks x 2 x n_kv_heads x tokens_per_block x head_dim``).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from infertrace.errors import ConfigError, InfertraceError
from infertrace.fmt import human_bytes as _human_bytes
from infertrace.limits import LIMITS

#: largest --ctx-size / pool in tokens accepted before a model is loaded (2^24 = 16.7M positions): the
#: trace schema's ``MAX_CTX``, so a run never records a context a saved trace may not hold.
MAX_CTX_TOKENS = LIMITS["MAX_CTX"]
#: fraction of the device memory (physical RAM for cpu, total memory for a CUDA device) the KV cache may take.
KV_MEMORY_FRACTION = 0.5


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units; :func:`infertrace.fmt.human_bytes`)."""
    return _human_bytes(n, binary=True)


#: ``--kv-dtype`` name -> torch storage dtype (llama.cpp ``GGML_TYPE_F32`` / ``F16`` / ``BF16`` cache types)
KV_TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def kv_cache_dtype(opts: Any, model_dtype: torch.dtype) -> torch.dtype:
    """The K/V storage dtype of a run: ``opts.kv_dtype`` (``f32`` | ``f16`` | ``bf16``) or, when it is
    None (the default), the model's compute dtype. The recurrent (GDN) state stays in the model dtype.

    Raises:
        InfertraceError: an unknown ``kv_dtype``.
    """
    name = getattr(opts, "kv_dtype", None)
    if name is None:
        return model_dtype
    try:
        return KV_TORCH_DTYPES[name]
    except KeyError:
        raise ConfigError("cache.kv_dtype", f"must be one of {', '.join(KV_TORCH_DTYPES)} (got {name!r})") from None


def kv_tokens(opts: Any) -> int:
    """Token slots the backend of ``opts`` allocates (cells: ``ctx_size``; paged: ``num_blocks x tokens_per_block``)."""
    if getattr(opts, "backend", "cells") == "paged":
        nb = opts.num_blocks if opts.num_blocks is not None else -(-opts.ctx_size // opts.tokens_per_block)
        return nb * opts.tokens_per_block
    return opts.ctx_size


def kv_bytes_per_layer(cfg: Any, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one layer: ``2 x tokens x n_head_kv x head_dim x itemsize``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * tokens * cfg.n_head_kv * cfg.head_dim * itemsize


def spec_snapshots(opts: Any) -> int:
    """GDN state snapshots per slot a speculative run keeps (0 without ``--speculative``): the largest
    verify chunk, the pending token plus every draft node (``len(spec_tree)`` or ``num_spec_tokens``)
    -- TensorRT-LLM's ``draft_len + 1`` intermediate states per slot."""
    if not getattr(opts, "speculative", None):
        return 0
    tree = getattr(opts, "spec_tree", None)
    return (len(tree) if tree is not None else int(getattr(opts, "num_spec_tokens", 0))) + 1


def recurrent_state_bytes(cfg: Any, opts: Any, dtype: torch.dtype) -> int:
    """Bytes of the GDN state of a hybrid model (0 for others): ``n_seq_max`` slots x GDN layers x
    (conv state ``conv_dim x (K-1)`` + recurrent state ``Hv x dk x dv``) x itemsize x (1 +
    :func:`spec_snapshots`), as :class:`~infertrace.kv.recurrent.RecurrentState` allocates (llama.cpp
    ``memory_recurrent``: ``n_seq_max`` cells, ``mem_size * (1 + n_rs_seq)`` rows with rollback
    snapshots; TensorRT-LLM ``MambaCacheManager``: ``max_batch_size`` slots plus ``draft_len + 1``
    intermediate conv / SSM states per slot when speculative)."""
    if not getattr(cfg, "is_hybrid", False):
        return 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    n_lin = sum(1 for i in range(cfg.n_layer) if cfg.is_linear(i))
    per_slot = cfg.conv_dim * (cfg.ssm_conv_kernel - 1) + cfg.ssm_n_v_heads * cfg.ssm_k_head_dim * cfg.ssm_v_head_dim
    return int(getattr(opts, "n_seq_max", 1)) * n_lin * per_slot * itemsize * (1 + spec_snapshots(opts))


def mtp_kv_bytes(cfg: Any, opts: Any, dtype: torch.dtype) -> int:
    """Bytes of the MTP draft head's own KV cache under ``--speculative mtp`` (0 otherwise): one
    attention layer over ``kv_tokens + n_seq_max x (drafts + 1)`` cells (the target's capacity plus
    each sequence's speculative rows, as :class:`~infertrace.engine.drafters.MTPDrafter` allocates),
    K and V at ``dtype``, plus the cells' ``pos`` / ``seq_id`` bookkeeping (vLLM allocates the MTP
    layer's KV in the same pool as the target's layers; llama.cpp's MTP context has its own cache)."""
    if getattr(opts, "speculative", None) != "mtp" or not getattr(cfg, "mtp_layers", 0):
        return 0
    drafts = len(opts.spec_tree) if opts.spec_tree is not None else opts.num_spec_tokens
    n_seq = getattr(opts, "n_seq_max", 1)
    cells = kv_tokens(opts) + n_seq * (drafts + 1)
    return kv_bytes_per_layer(cfg, cells, dtype) + cells * (8 + n_seq)


def memory_limit_bytes(device: str | torch.device = "cpu") -> int | None:
    """``KV_MEMORY_FRACTION`` of the device's memory, or None when it cannot be told."""
    dev = torch.device(device)
    try:
        if dev.type == "cuda":
            total = torch.cuda.get_device_properties(dev.index or 0).total_memory
        else:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, RuntimeError, AttributeError, AssertionError):
        return None
    return int(total * KV_MEMORY_FRACTION)


def check_kv_budget(cfg: Any, opts: Any, dtype: torch.dtype, device: str | torch.device = "cpu") -> int:
    """Refuse a KV cache larger than :func:`memory_limit_bytes`, before it is allocated.

    Args:
        cfg: the :class:`~infertrace.model.config.ModelConfig` (``n_layer``, ``n_head_kv``, ``head_dim``).
        opts: :class:`~infertrace.engine.engine.EngineOptions`.
        dtype, device: the model's compute dtype and the device; K/V bytes are counted at
            :func:`kv_cache_dtype` (``opts.kv_dtype``, default ``dtype``), the GDN state at ``dtype``.

    Returns:
        The cache size in bytes (all attention layers, K and V, the cells' ``pos`` / ``seq_id`` bookkeeping,
        for hybrid models the GDN state of ``n_seq_max`` sequences, and under ``--speculative mtp`` the
        MTP head's own KV cache, :func:`mtp_kv_bytes`).

    Raises:
        InfertraceError: the cache would exceed the limit; the message gives its size and the limit.
    """
    tokens = kv_tokens(opts)
    kv_dtype = kv_cache_dtype(opts, dtype)
    per_layer = kv_bytes_per_layer(cfg, tokens, kv_dtype)
    n_kv_layers = sum(1 for i in range(cfg.n_layer) if not (hasattr(cfg, "is_linear") and cfg.is_linear(i)))
    total = per_layer * n_kv_layers  # hybrid models: K/V only for the attention layers
    state = recurrent_state_bytes(cfg, opts, dtype)  # hybrid models: n_seq_max fixed-size GDN state slots per layer
    total += state
    book = 0
    if getattr(opts, "backend", "cells") == "cells":  # cell bookkeeping: pos (int64) + seq_id set (n_seq_max bools)
        book = tokens * (8 + getattr(opts, "n_seq_max", 64))
    total += book
    mtp = mtp_kv_bytes(cfg, opts, kv_dtype)  # --speculative mtp: the MTP layer's own cache
    total += mtp
    limit = memory_limit_bytes(device)
    if limit is not None and total > limit:
        what = "--ctx-size" if getattr(opts, "backend", "cells") == "cells" else "--num-blocks x --tokens-per-block"
        raise InfertraceError(
            f"the KV cache for {tokens} tokens would take {human_bytes(total)} ({human_bytes(per_layer)} per layer x "
            f"{n_kv_layers} layers at {str(kv_dtype).replace('torch.', '')}{f' + {human_bytes(book)} of cell bookkeeping' if book else ''}"
            f"{f' + {human_bytes(state)} of GDN state for {opts.n_seq_max} sequences' if state else ''}"
            f"{f' (with {spec_snapshots(opts)} verify snapshots each)' if state and spec_snapshots(opts) else ''}"
            f"{f' + {human_bytes(mtp)} of MTP draft-head KV' if mtp else ''}), "
            f"over the limit of {human_bytes(limit)} "
            f"(half of this machine's memory); lower {what}")
    return total


def run_cost_warnings(cfg: Any, opts: Any, max_new_tokens: Sequence[int], dtype: torch.dtype,
                      default_ctx_size: int | None = None) -> list[str]:
    """One-line warnings for a run that goes past the model's trained context, with its cost.

    Args:
        cfg: model config (``n_ctx_train``, ``n_layer``, ``n_head_kv``, ``head_dim``).
        opts: engine options (``ctx_size``, backend, pool).
        max_new_tokens: ``--max-new-tokens`` of each request.
        dtype: the model's compute dtype (the cache is counted at :func:`kv_cache_dtype`).
        default_ctx_size: the CLI's default ``--ctx-size``; a default larger than a small model's
            trained context is only mentioned when the generation length can actually pass it.

    Returns:
        Zero, one or two messages (no ``warning:`` prefix).
    """
    out: list[str] = []
    n_train = cfg.n_ctx_train
    tokens = kv_tokens(opts)
    dtype = kv_cache_dtype(opts, dtype)
    per_layer = kv_bytes_per_layer(cfg, tokens, dtype)
    dt = str(dtype).replace("torch.", "")
    biggest = max(max_new_tokens, default=0)
    if opts.ctx_size > n_train and (opts.ctx_size != default_ctx_size or biggest > n_train):
        out.append(f"--ctx-size {opts.ctx_size} is beyond the model's trained context ({n_train} tokens): positions past "
                   f"{n_train} were never trained; the KV cache takes {human_bytes(per_layer)} per layer x {cfg.n_layer} "
                   f"layers = {human_bytes(per_layer * cfg.n_layer)} at {dt}")
    if biggest > n_train:
        shift = bool(getattr(opts, "context_shift", False))
        steps = biggest if shift else min(biggest, opts.ctx_size - 1)  # a context shift keeps generating past ctx_size
        how = " (with --context-shift: the cache is shifted each time it fills)" if shift else ""
        out.append(f"--max-new-tokens {biggest} is beyond the model's trained context ({n_train} tokens): up to "
                   f"{steps} decode steps per request{how} ({len(max_new_tokens)} request(s)), each reading a KV cache that grows "
                   f"to {human_bytes(kv_bytes_per_layer(cfg, min(opts.ctx_size, tokens), dtype) * cfg.n_layer)} at {dt}")
    return out
