"""Tensor parallelism under ``run --runtime vllm``: which KV heads each rank holds, vLLM's refusals of a size,
and one step's record merged from every rank's capture (runtimes/vllm/capture.py records per worker)."""

from __future__ import annotations

from typing import Any

import numpy as np

from infertrace.errors import InfertraceError


def check_tensor_parallel(n_head: int, n_kv: int, tp: int) -> None:
    """Refuse a tensor-parallel size vLLM refuses for this model, with vLLM's own words.

    vLLM's rules: the query heads divide by ``tp`` (vllm/config/model.py:1546,
    ``ModelConfig.verify_with_parallel_config``); the KV heads divide by ``tp`` when ``tp <= n_kv``, else
    ``tp`` divides by them and each is replicated (vllm/model_executor/layers/linear.py:1053-1057,
    ``QKVParallelLinear``, through ``divide`` in vllm/distributed/utils.py:54).

    Raises:
        InfertraceError: a size vLLM refuses.
    """
    if tp <= 1:
        return
    if n_head % tp:
        raise InfertraceError(f"--tensor-parallel-size {tp}: vLLM refuses it: Total number of attention heads ({n_head}) must "
                              f"be divisible by tensor parallel size ({tp}). (vllm/config/model.py); use a size dividing {n_head}")
    num, den = (tp, n_kv) if tp >= n_kv else (n_kv, tp)
    if num % den:
        raise InfertraceError(f"--tensor-parallel-size {tp}: vLLM refuses it: {num} is not divisible by {den} (its "
                              f"QKVParallelLinear splits the model's {n_kv} KV heads over {tp} ranks, or replicates them when "
                              f"the ranks are a multiple of the heads: vllm/model_executor/layers/linear.py)")


#: per-rank tensors that hold a slice of the query heads: [T, heads/tp * hd] (Q before / after RoPE)
_Q_SHARDED = ("q_pre", "q_rot")
#: per-rank tensors that hold the rank's KV heads: [T, kv_heads_held, hd] (K/V) or [T, kv_heads_held * hd] (K rope)
_KV_SHARDED = ("k_written", "v_written", "k_cache", "v_cache", "k_pre", "k_rot")


def kv_heads_of_rank(rank: int, tp: int, n_kv: int) -> list[int]:
    """The KV heads tensor-parallel rank ``rank`` holds, as vLLM's ``QKVParallelLinear`` splits them
    (vllm/model_executor/layers/linear.py:1053-1058, 1303): ``n_kv >= tp``: heads
    ``[rank * n_kv / tp, (rank + 1) * n_kv / tp)``; ``tp > n_kv``: one head, ``rank // (tp / n_kv)``
    (each head replicated on ``tp / n_kv`` ranks)."""
    if tp >= n_kv:
        return [rank // (tp // n_kv)]
    per = n_kv // tp
    return list(range(rank * per, (rank + 1) * per))


def merge_ranks(per_rank: list[dict[str, Any]], n_kv: int | None = None) -> dict[str, Any]:
    """One step's record from every tensor-parallel rank -> one record: the metadata, ids, logits and
    samples every rank shares are rank 0's; the query-head tensors are concatenated in rank order; the
    KV tensors of the first rank holding each KV head, in head order (:func:`kv_heads_of_rank`: with
    ``tp > n_kv`` vLLM replicates a head on several ranks); ``ranks`` keeps per rank the heads it held,
    whether its K/V equal the first holder's and whether its metadata equalled rank 0's."""
    rec = dict(per_rank[0])
    if len(per_rank) == 1:
        return rec
    if rec.get("taps"):  # layer taps: the block outputs are all-reduced (rank 0's = every rank's); Q/K are head shards
        rec["taps"] = {k: v for k, v in rec["taps"].items() if not k.endswith(("_pre_rope", "_post_rope"))}
    tp = len(per_rank)
    n_kv = n_kv or tp
    heads = [kv_heads_of_rank(r, tp, n_kv) for r in range(tp)]
    first = [r for r in range(tp) if r == 0 or heads[r][0] != heads[r - 1][0]]  # the first holder of each head
    for k in _Q_SHARDED:
        if all(r.get(k) is not None for r in per_rank):
            rec[k] = np.concatenate([r[k] for r in per_rank], axis=1)
    for k in _KV_SHARDED:
        if all(r.get(k) is not None for r in per_rank):
            rec[k] = np.concatenate([per_rank[r][k] for r in first], axis=1)
    same = [all(np.array_equal(r[k], per_rank[0][k]) for k in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"))
            for r in per_rank]
    holder = {h: r for r in first for h in heads[r]}

    def replica_ok(i: int) -> bool:
        j = holder[heads[i][0]]
        return all(np.array_equal(per_rank[i][k], per_rank[j][k]) for k in ("k_written", "v_written")
                   if per_rank[i].get(k) is not None and per_rank[j].get(k) is not None)

    rec["ranks"] = [{"tp_rank": i, "kv_heads_held": int(r["k_written"].shape[1]) if r.get("k_written") is not None else None,
                     "kv_heads": heads[i], "kv_equals_first_holder": replica_ok(i),
                     "metadata_equals_rank0": bool(ok)} for i, (r, ok) in enumerate(zip(per_rank, same))]
    return rec
