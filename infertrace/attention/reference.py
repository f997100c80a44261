"""Torch reference attention: the twins every Triton kernel is checked against.

Two entry points, one per runtime convention:

* :func:`attention_with_kq_mask` -- llama.cpp style: the query rows attend over *all*
  ``n_kv`` cache cells, and an explicit host-filled ``kq_mask`` (0 keep / -inf drop)
  decides visibility (llama.cpp ``src/llama-graph.cpp`` ``build_attn_mha``).
* :func:`paged_attention_torch` -- TensorRT-LLM / vLLM style: no dense mask; each
  request reads its own blocks through its block-table row and causality is derived
  from ``seq_lens`` / ``kv_lens`` / ``cu_seqlens`` (TensorRT-LLM
  ``_torch/attention_backend/trtllm.py``, vLLM ``PagedAttention``).
"""

from __future__ import annotations

import torch


def attention_with_kq_mask(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kq_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked multi-head attention over cache cells with GQA.

    Args:
        q: ``[N, n_head, head_dim]`` queries (float), already RoPE-rotated.
        k: ``[n_kv, n_kv_heads, head_dim]`` keys of cells ``0..n_kv-1`` (same dtype as q).
        v: ``[n_kv, n_kv_heads, head_dim]`` values.
        kq_mask: ``[N, n_kv]`` float, 0 = keep, -inf = drop (the first N rows of
            llama.cpp's ``kq_mask``, i.e. ``ne = [n_kv, N]`` read row-major).
        scale: softmax scale, usually ``1/sqrt(head_dim)``.

    Returns:
        ``[N, n_head, head_dim]`` attention output, dtype of ``q``.

    Mirrors llama.cpp ``build_attn_mha`` (``kq = k*q; kq = soft_max_ext(kq, kq_mask, scale)``).
    Rows whose mask is all -inf are not allowed (every query sees at least itself).
    """
    n_head, n_kv_heads = q.shape[1], k.shape[1]
    group = n_head // n_kv_heads
    qh = q.transpose(0, 1)  # [n_head, N, hd]
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)  # [n_head, n_kv, hd]
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0)  # [n_head, n_kv, hd]
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale  # [n_head, N, n_kv]
    scores = scores + kq_mask.to(scores.dtype).unsqueeze(0)  # [n_head, N, n_kv]
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # [n_head, N, n_kv]
    out = torch.matmul(probs, vh)  # [n_head, N, hd]
    return out.transpose(0, 1).contiguous()  # [N, n_head, hd]


def write_kv_paged_torch(
    kv_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter the current tokens' K/V into the paged pool by slot mapping (in place).

    Args:
        kv_pool: ``[num_blocks, 2, n_kv_heads, tokens_per_block, head_dim]`` one layer's pool.
        k, v: ``[N, n_kv_heads, head_dim]`` current tokens' keys / values.
        slot_mapping: ``[N]`` int64, physical slot of each token,
            ``block_table[p // B] * B + p % B`` (vLLM ``slot_mapping``).

    Mirrors vLLM ``reshape_and_cache`` / TensorRT-LLM ``update_kv_cache``.
    """
    B = kv_pool.shape[3]
    blk = slot_mapping // B  # [N]
    off = slot_mapping % B  # [N]
    kv_pool[blk, 0, :, off, :] = k.to(kv_pool.dtype)
    kv_pool[blk, 1, :, off, :] = v.to(kv_pool.dtype)


def paged_attention_torch(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Varlen causal attention read from a paged KV pool through block tables.

    Args:
        q: ``[N, n_head, head_dim]`` packed queries of all requests (N = sum(seq_lens)).
        kv_pool: ``[num_blocks, 2, n_kv_heads, B, head_dim]`` (index 0 = K, 1 = V); the
            current tokens' K/V must already be written (see :func:`write_kv_paged_torch`).
        block_tables: ``[num_seqs, max_blocks]`` int32, physical block ids (-1 = unused).
        seq_lens: ``[num_seqs]`` int32, current tokens T of each request.
        kv_lens: ``[num_seqs]`` int32, visible KV length C + T of each request.
        cu_seqlens: ``[num_seqs + 1]`` int32, prefix sums of ``seq_lens``.
        scale: softmax scale.

    Returns:
        ``[N, n_head, head_dim]``, dtype of ``q``.

    Query j of request i has position ``kv_lens[i] - seq_lens[i] + j`` and sees keys
    ``0..that position`` of request i only (mask type ``causal``; TensorRT-LLM
    ``trtllm.py`` passes exactly these lengths and block offsets to the kernel).
    """
    B = kv_pool.shape[3]
    n_head, n_kv_heads = q.shape[1], kv_pool.shape[2]
    group = n_head // n_kv_heads
    out = torch.empty_like(q)  # [N, n_head, hd]
    for i in range(int(seq_lens.shape[0])):
        T, L = int(seq_lens[i]), int(kv_lens[i])
        s = int(cu_seqlens[i])
        nb = (L + B - 1) // B
        blocks = block_tables[i, :nb].long()  # [nb]
        kv = kv_pool[blocks]  # [nb, 2, n_kv_heads, B, hd]
        k = kv[:, 0].permute(1, 0, 2, 3).reshape(n_kv_heads, nb * B, -1)[:, :L]  # [n_kv_heads, L, hd]
        v = kv[:, 1].permute(1, 0, 2, 3).reshape(n_kv_heads, nb * B, -1)[:, :L]  # [n_kv_heads, L, hd]
        k = k.repeat_interleave(group, dim=0).to(q.dtype)  # [n_head, L, hd]
        v = v.repeat_interleave(group, dim=0).to(q.dtype)  # [n_head, L, hd]
        qi = q[s : s + T].transpose(0, 1)  # [n_head, T, hd]
        scores = torch.matmul(qi, k.transpose(1, 2)) * scale  # [n_head, T, L]
        qpos = torch.arange(L - T, L).unsqueeze(1)  # [T, 1]
        kpos = torch.arange(L).unsqueeze(0)  # [1, L]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))  # [n_head, T, L]
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # [n_head, T, L]
        out[s : s + T] = torch.matmul(probs, v).transpose(0, 1)  # [T, n_head, hd]
    return out
