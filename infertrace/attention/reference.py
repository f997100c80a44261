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
        k: ``[n_kv, n_kv_heads, head_dim]`` keys of cells ``0..n_kv-1``, any float dtype (the cache's,
            ``--kv-dtype``): read back in q's dtype, as llama.cpp's CPU ``mul_mat`` converts an F16
            cache row to the activations' type.
        v: ``[n_kv, n_kv_heads, head_dim]`` values (likewise).
        kq_mask: ``[N, n_kv]`` float, 0 = keep, -inf = drop (the first N rows of
            llama.cpp's ``kq_mask``, i.e. ``ne = [n_kv, N]`` read row-major).
        scale: softmax scale, usually ``1/sqrt(head_dim)``.

    Returns:
        ``[N, n_head, head_dim]`` attention output, dtype of ``q``.

    Mirrors llama.cpp ``build_attn_mha`` (``kq = k*q; kq = soft_max_ext(kq, kq_mask, scale)``).
    Rows whose mask is all -inf are not allowed (every query sees at least itself).
    """
    N, n_head, hd = q.shape
    n_kv_heads = k.shape[1]
    group = n_head // n_kv_heads
    qg = q.view(N, n_kv_heads, group, hd).permute(1, 2, 0, 3).reshape(n_kv_heads, group * N, hd)  # [n_kv_heads, g*N, hd]
    kh = k.to(q.dtype).transpose(0, 1)  # [n_kv_heads, n_kv, hd] (no copy when the cache is in q's dtype)
    vh = v.to(q.dtype).transpose(0, 1)  # [n_kv_heads, n_kv, hd]
    scores = torch.matmul(qg, kh.transpose(1, 2)) * scale  # [n_kv_heads, g*N, n_kv]
    scores = scores.view(n_kv_heads, group, N, -1) + kq_mask.to(scores.dtype)  # [n_kv_heads, g, N, n_kv]
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # [n_kv_heads, g, N, n_kv]
    out = torch.matmul(probs.view(n_kv_heads, group * N, -1), vh)  # [n_kv_heads, g*N, hd]
    return out.view(n_kv_heads, group, N, hd).permute(2, 0, 1, 3).reshape(N, n_head, hd)  # [N, n_head, hd]


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
    window: int = 0,
    tree_mask: torch.Tensor | None = None,
    q_pos: torch.Tensor | None = None,
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
        window: sliding window W, 0 = none: the query at position p sees keys p-W+1..p
            (HF ``sliding_window``; TensorRT-LLM ``attention_window_size``; vLLM ``sliding_window``).
        tree_mask: optional ``[S, T_max, T_max]`` bool, speculative tree verification: query t
            of request i sees its past ``0..kv_len-T-1`` and, of the step's own keys, those set in
            row t (the unpacked TensorRT-LLM ``spec_decoding_packed_mask``).
        q_pos: ``[S, T_max]`` int64 query positions (``past + spec_decoding_position_offsets``)
            for the window rule when ``tree_mask`` is given.

    Returns:
        ``[N, n_head, head_dim]``, dtype of ``q``.

    Query j of request i has position ``kv_lens[i] - seq_lens[i] + j`` and sees keys
    ``0..that position`` of request i only (mask type ``causal``; TensorRT-LLM
    ``trtllm.py`` passes exactly these lengths and block offsets to the kernel).
    """
    N, n_head, hd = q.shape
    n_kv_heads = kv_pool.shape[2]
    group = n_head // n_kv_heads
    S = int(seq_lens.shape[0])
    T_list, L_list = seq_lens.tolist(), kv_lens.tolist()
    T_max, L_max = max(T_list), max(L_list)
    dev = q.device
    k, v = _gather_blocks(kv_pool, block_tables, L_max, q.dtype)  # [S, n_kv_heads, L, hd] each
    # pad the packed queries per request: row t of request i is packed row cu_seqlens[i] + t
    starts = cu_seqlens[:-1].long().to(dev)  # [S]
    t_idx = torch.arange(T_max, device=dev)  # [T_max]
    valid_q = t_idx.unsqueeze(0) < seq_lens.long().to(dev).unsqueeze(1)  # [S, T_max]
    rows = (starts.unsqueeze(1) + t_idx.unsqueeze(0)).clamp_max(N - 1)  # [S, T_max]
    qp = q[rows]  # [S, T_max, n_head, hd]
    qg = qp.view(S, T_max, n_kv_heads, group, hd).permute(0, 2, 3, 1, 4).reshape(S, n_kv_heads, group * T_max, hd)  # [S, kvh, g*T, hd]
    scores = torch.matmul(qg, k.transpose(2, 3)) * scale  # [S, kvh, g*T, L]
    keep = _visible_keys(seq_lens, kv_lens, t_idx, L_max, window, tree_mask, q_pos)  # [S, T_max, L]
    keep &= valid_q.unsqueeze(2)
    scores = scores.view(S, n_kv_heads, group, T_max, L_max).masked_fill(~keep.view(S, 1, 1, T_max, L_max), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(q.dtype)  # [S, kvh, g, T, L]
    o = torch.matmul(probs.view(S, n_kv_heads, group * T_max, L_max), v)  # [S, kvh, g*T, hd]
    o = o.view(S, n_kv_heads, group, T_max, hd).permute(0, 3, 1, 2, 4).reshape(S, T_max, n_head, hd)  # [S, T, n_head, hd]
    out = torch.empty_like(q)  # [N, n_head, hd]
    out[rows[valid_q]] = o[valid_q]
    return out


def _gather_blocks(kv_pool: torch.Tensor, block_tables: torch.Tensor, L_max: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's K and V read through its block-table row, as one contiguous sequence of keys.

    Args:
        kv_pool: ``[num_blocks, 2, n_kv_heads, B, head_dim]`` one layer's pool (0 = K, 1 = V).
        block_tables: ``[S, max_blocks]`` int32 physical block ids (-1 = unused: read as block 0; the
            caller masks those keys).
        L_max: the longest visible KV length (``max(kv_lens)``); keys past it are dropped.
        dtype: the queries' dtype, the K/V are read back in (any float cache dtype).

    Returns:
        ``(k, v)``, each ``[S, n_kv_heads, L_max, head_dim]`` in ``dtype``: key ``l`` of request ``i`` is
        slot ``l % B`` of block ``block_tables[i, l // B]``.
    """
    B, n_kv_heads, hd = kv_pool.shape[3], kv_pool.shape[2], kv_pool.shape[4]
    S = int(block_tables.shape[0])
    nb = (L_max + B - 1) // B
    blocks = block_tables[:, :nb].long().clamp_min(0)  # [S, nb] (-1 padding read as block 0, masked below)
    kv = kv_pool[blocks]  # [S, nb, 2, n_kv_heads, B, hd]
    k = kv[:, :, 0].permute(0, 2, 1, 3, 4).reshape(S, n_kv_heads, nb * B, hd)[:, :, :L_max].to(dtype)  # [S, n_kv_heads, L, hd]
    v = kv[:, :, 1].permute(0, 2, 1, 3, 4).reshape(S, n_kv_heads, nb * B, hd)[:, :, :L_max].to(dtype)  # [S, n_kv_heads, L, hd]
    return k, v


def _visible_keys(seq_lens: torch.Tensor, kv_lens: torch.Tensor, t_idx: torch.Tensor, L_max: int, window: int,
                  tree_mask: torch.Tensor | None, q_pos: torch.Tensor | None) -> torch.Tensor:
    """Which keys each padded query row sees, derived from the lengths (no dense mask is passed in).

    Args:
        seq_lens: ``[S]`` int32 current tokens T of each request; ``kv_lens``: ``[S]`` int32 visible KV
            length C + T.
        t_idx: ``[T_max]`` int64 ``arange(T_max)`` on the queries' device (query row index in a request).
        L_max: ``max(kv_lens)``, the keys' axis length.
        window: sliding window W, 0 = none (the query at position p sees keys p-W+1..p).
        tree_mask: optional ``[S, T_max, T_max]`` bool tree verification mask (see
            :func:`paged_attention_torch`); ``q_pos``: ``[S, T_max]`` int64 query positions for the window
            rule when ``tree_mask`` is given.

    Returns:
        ``[S, T_max, L_max]`` bool, True = visible; rows past a request's ``seq_lens`` are not masked here.
    """
    dev = t_idx.device
    S, T_max = int(seq_lens.shape[0]), int(t_idx.shape[0])
    # causal rule from the lengths: query t of request i sits at kv_len - T + t and sees keys 0..that
    qpos = (kv_lens.long().to(dev) - seq_lens.long().to(dev)).unsqueeze(1) + t_idx.unsqueeze(0)  # [S, T_max]
    keys = torch.arange(L_max, device=dev).view(1, 1, L_max)  # [1, 1, L]
    keep = keys <= qpos.unsqueeze(2)  # [S, T_max, L]
    if tree_mask is not None:
        past = (kv_lens.long() - seq_lens.long()).to(dev).view(S, 1, 1)  # [S, 1, 1]
        rel = (keys - past).expand(S, T_max, L_max)  # [S, T_max, L] index among the step's own keys
        inside = rel >= 0
        tm = tree_mask.to(dev)  # [S, T_max, T_max]
        own = torch.gather(tm, 2, rel.clamp(0, T_max - 1))  # [S, T_max, L]
        keep = torch.where(inside, own & (rel < T_max), keys < past)  # [S, T_max, L]
        if q_pos is not None:
            qpos = q_pos.long().to(dev)  # [S, T_max] tree positions for the window rule
    if window > 0:
        keep &= keys > qpos.unsqueeze(2) - window  # [S, T_max, L] sliding window
    return keep
