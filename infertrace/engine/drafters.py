"""Drafters for speculative decoding: prompt lookup (n-gram) and a draft model.

Both fill a static draft tree given as parent indices (``-1`` = the root, the request's pending
token; a chain of K drafts is ``[-1, 0, 1, .., K-2]``): node i's token is the ``rank(i)``-th
proposal after the path root -> parent(i), where ``rank`` is i's index among its siblings. A
node that gets no proposal is dropped with its subtree.

* :class:`NgramDrafter` -- llama.cpp ``examples/lookup`` / ``common_ngram_cache`` and vLLM v1
  ``NgramProposer``: take the longest suffix of the context (``n = ngram_max .. ngram_min``) that
  occurred earlier and propose the token that followed it (rank r: the r-th distinct follower,
  most recent occurrence first, then the followers of shorter suffixes). The draft is a point mass (q = one-hot).
* :class:`DraftModelDrafter` -- llama.cpp ``common/speculative.cpp`` / vLLM ``draft_model``: a
  smaller model with its own KV cache (cells), kept in step with the target's accepted tokens by
  ``seq_rm`` of whatever diverged; rank r = the r-th best token of the draft's logits (greedy),
  or one draw from the draft's sampling distribution q (chain, temperature > 0).
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch

from infertrace.engine.sampler import apply_penalties, kept_set, mask_padded_rows
from infertrace.engine.config import SpeculativeConfig
from infertrace.errors import ConfigError, InfertraceError
from infertrace.kv.base import ChunkSpec
from infertrace.kv.cells import CellsKV

#: one drafted tree: per node (static numbering) a token or None, and per node q ``[V]`` or None
Draft = tuple[list[int | None], list[torch.Tensor | None]]


def ranks(parents: Sequence[int]) -> list[int]:
    """Index of each node among its siblings (0 = the parent's best proposal)."""
    seen: dict[int, int] = {}
    out = []
    for p in parents:
        out.append(seen.get(p, 0))
        seen[p] = out[-1] + 1
    return out


def target_probs(logits: torch.Tensor, params: Any, seen: Sequence[int], order: str) -> torch.Tensor:
    """The sampler's final distribution over the whole vocabulary: ``[V]`` float32 (zeros outside
    the kept set; case S3 decides top-p membership). Greedy: one-hot at the first max."""
    x = apply_penalties(logits.float(), seen, params, order)  # [V]
    out = torch.zeros(x.numel(), dtype=torch.float32)  # [V]
    if params.greedy:
        out[int(torch.argmax(x))] = 1.0
        return out
    ids, p = kept_set(x, params, order)  # [K] each
    out[ids] = p.float()
    return out


class NgramDrafter:
    """Prompt lookup over the request's own tokens (prompt + generated). Args: ``nmin``, ``nmax``."""

    name = "ngram"

    def __init__(self, nmin: int = 1, nmax: int = 3):
        SpeculativeConfig("ngram", ngram_min=nmin, ngram_max=nmax).validate()  # ConfigError: speculative.ngram_min
        self.nmin, self.nmax = nmin, nmax

    def followers(self, ctx: Sequence[int], want: int) -> list[int]:
        """Up to ``want`` distinct tokens that followed the longest earlier match of a suffix of ``ctx``."""
        out: list[int] = []
        L = len(ctx)
        for n in range(min(self.nmax, L - 1), self.nmin - 1, -1):
            suf = list(ctx[L - n :])
            for i in range(L - n - 1, -1, -1):  # most recent earlier occurrence first
                if list(ctx[i : i + n]) == suf and ctx[i + n] not in out:
                    out.append(ctx[i + n])
                    if len(out) >= want:
                        return out
        return out  # the longest match's followers first, then shorter suffixes' (a tree's other branches)

    def draft(self, engine: Any, reqs: list[Any], parents: Sequence[int]) -> dict[int, Draft]:
        """Prompt-lookup drafts for every request (llama.cpp ``common_ngram`` lookup, vLLM ``NgramProposer``).

        Args:
            engine: the target engine (unused: n-gram drafting reads only the token history).
            reqs: running requests; their ``cache_ids`` are the context searched.
            parents: the static tree, parent index per draft node (-1 = the pending token).

        Returns:
            ``{seq_id: (tokens, probs)}``: one token id per node (None where no earlier match
            proposes one; its subtree is dropped) and ``probs`` all None (a point-mass draft, q = 1).
        """
        rk = ranks(parents)
        nsib = [sum(1 for q in parents if q == p) for p in parents]
        res: dict[int, Draft] = {}
        for r in reqs:
            base = list(r.cache_ids)
            toks: list[int | None] = []
            for i, p in enumerate(parents):
                if p >= 0 and toks[p] is None:
                    toks.append(None)
                    continue
                path, j = [], p
                while j >= 0:
                    path.append(toks[j])
                    j = parents[j]
                f = self.followers(base + path[::-1], nsib[i])
                toks.append(f[rk[i]] if rk[i] < len(f) else None)
            res[r.seq_id] = (toks, [None] * len(toks))
        return res

    def release(self, seq_id: int) -> None:
        """Nothing to free: n-gram drafting keeps no per-sequence state."""


def layer_skip(model: Any, k: int) -> Any:
    """The target's first ``k`` layers with its embeddings and head, as a draft model (weights shared).

    Raises:
        ConfigError: ``k`` not in ``1..n_layer-1`` (``speculative.draft_layers``).
    """
    n = len(model.layers)
    if not 1 <= k < n:
        raise ConfigError("speculative.draft_layers", f"must be in 1..{n - 1} for this {n}-layer model (got {k})")
    d = copy.copy(model)
    d.layers = model.layers[:k]
    return d


class DraftModelDrafter:
    """A draft model with its own cells KV cache.

    Args:
        draft: a :class:`~infertrace.model.decoder.DecoderModel` sharing the target's vocabulary.
        target: the target model (vocabulary check).
        size: cells of the draft cache; n_seq_max: sequences.
        n_sample_rows: the tokenizer's size when the vocabulary is padded (the draft's logits past it
            are masked as the target's: :func:`~infertrace.engine.sampler.mask_padded_rows`), else None.
        kv_dtype: storage dtype of the draft's cache (``--kv-dtype``, as the target's); None = the draft's dtype.

    Raises:
        InfertraceError: a vocabulary that differs from the target's. A hybrid draft (Gated DeltaNet
            layers) keeps a hybrid memory (:func:`draft_memory`) and rolls back to a state checkpoint.
    """

    name = "draft"

    def __init__(self, draft: Any, target: Any, size: int, n_seq_max: int, n_sample_rows: int | None = None,
                 kv_dtype: torch.dtype | None = None):
        if draft.cfg.vocab_size != target.cfg.vocab_size:
            raise InfertraceError(f"the draft model's vocabulary ({draft.cfg.vocab_size}) differs from the target's "
                                  f"({target.cfg.vocab_size}); use a draft model with the target's tokenizer")
        self.model = draft
        self.n_sample_rows = n_sample_rows
        self.kv = draft_memory(draft, size, n_seq_max, kv_dtype)
        self.cached: dict[int, list[int]] = {}  # token ids in the draft cache, by seq_id
        self.gens: dict[int, torch.Generator] = {}
        self.forwards = 0
        self.recomputed = 0  # a hybrid draft: sequences re-evaluated from position 0
        self.restored = 0  # a hybrid draft: rollbacks to the state checkpoint of the last sync
        #: a hybrid draft: per seq_id the state after the last sync (HybridKV.checkpoint), for rollbacks
        self.ckpt: dict[int, dict[str, Any]] = {}

    def release(self, seq_id: int) -> None:
        """Free ``seq_id``'s cells in the draft model's own cache (llama.cpp ``seq_rm(seq, -1, -1)``)."""
        if seq_id in self.cached:
            self.kv.release(seq_id)
            del self.cached[seq_id]
        self.ckpt.pop(seq_id, None)

    def _truncate(self, seq_id: int, n: int, have: Sequence[int]) -> int:
        """Drop the draft cache's positions ``n..`` of ``seq_id`` (llama.cpp ``seq_rm(seq, n, -1)``);
        returns how many positions it still holds. A hybrid draft's recurrent state cannot drop a tail
        (``seq_rm`` answers False): it goes back to the checkpoint taken after the last sync when that
        is at or before ``n`` (llama.cpp server's speculative checkpointing: restore, then re-decode the
        accepted tokens), else the whole sequence is freed and re-evaluated (0)."""
        if self.kv.seq_rm(seq_id, n, -1):
            return n
        ck = self.ckpt.get(seq_id)
        if ck is not None and ck["n"] <= n and self.kv.restore(seq_id, ck):
            self.restored += 1
            return int(ck["n"])
        self.kv.release(seq_id)
        self.ckpt.pop(seq_id, None)
        self.recomputed += 1
        return 0

    def _forward(self, chunks: list[ChunkSpec], ids: list[int]) -> torch.Tensor:
        inp = self.kv.prepare(chunks)
        rows, r = [], 0
        for c in chunks:
            r += c.T
            rows.append(r - 1)
        self.forwards += 1

        logits = self.model.forward(torch.tensor(ids, dtype=torch.int64), inp, self.kv,
                                    torch.tensor(rows, dtype=torch.int64))  # [len(chunks), V]
        return mask_padded_rows(logits, self.n_sample_rows)  # padded rows never drafted

    def _sync(self, reqs: list[Any]) -> torch.Tensor:
        """Bring each request's draft cache to its ``cache_ids`` (``seq_rm`` of what diverged, then one
        batched forward of the rest); returns the draft logits at each pending token ``[R, V]``."""
        chunks, ids = [], []
        for r in reqs:
            want = list(r.cache_ids)
            have = self.cached.get(r.seq_id, [])
            n = 0
            while n < min(len(have), len(want) - 1) and have[n] == want[n]:
                n += 1
            if n < len(have):
                n = self._truncate(r.seq_id, n, have)
            chunks.append(ChunkSpec(r.seq_id, n, len(want) - n))
            ids += want[n:]
            self.cached[r.seq_id] = want
        logits = self._forward(chunks, ids)
        for r in reqs:  # a hybrid draft: the state at the accepted tokens, before drafting (None: nothing to save)
            ck = self.kv.checkpoint(r.seq_id)
            if ck is not None:
                self.ckpt[r.seq_id] = ck
        return logits

    def _pick(self, logits: torch.Tensor, r: Any, seen: list[int], rank: int, order: str) -> tuple[int, torch.Tensor | None]:
        if r.params.greedy:
            x = apply_penalties(logits.float(), seen, r.params, order)  # [V]
            return int(torch.sort(x, descending=True, stable=True).indices[rank]), None
        q = target_probs(logits, r.params, seen, order)  # [V] the draft's sampling distribution
        g = self.gens.setdefault(r.seq_id, torch.Generator().manual_seed((r.params.seed + 0x5EED) % 2**63))
        return int(torch.multinomial(q, 1, generator=g)), q

    def draft(self, engine: Any, reqs: list[Any], parents: Sequence[int]) -> dict[int, Draft]:
        """Draft-model proposals (llama.cpp ``common_speculative_gen_draft``, vLLM ``DraftModelProposer``).

        The draft's cache is first brought in step with each request's accepted tokens
        (``seq_rm`` of its stale tail, then the missing tokens evaluated); a chain then runs one
        batched draft forward per depth, a tree walks its nodes.

        Args:
            engine: the target engine (its sampler order and sampling parameters are used).
            reqs: running requests.
            parents: parent index per draft node (-1 = the pending token).

        Returns:
            ``{seq_id: (tokens, probs)}``: a token id per node and, when sampling, the draft's
            distribution ``q`` (float32 ``[V]``) it was drawn from (None for greedy: rank-th argmax).
        """
        order = engine.sampler_order
        rk = ranks(parents)
        chain = list(parents) == list(range(-1, len(parents) - 1))
        root_logits = self._sync(reqs)  # [R, V]
        res: dict[int, Draft] = {}
        if chain:  # batched: one draft forward per depth for every request
            live = list(range(len(reqs)))
            toks = {r.seq_id: [] for r in reqs}
            qs = {r.seq_id: [] for r in reqs}
            logits = root_logits
            for depth in range(len(parents)):
                for i, li in enumerate(live):
                    r = reqs[li]
                    t, q = self._pick(logits[i], r, list(r.all_ids) + toks[r.seq_id], 0, order)
                    toks[r.seq_id].append(t)
                    qs[r.seq_id].append(q)
                if depth == len(parents) - 1:
                    break
                chunks, ids = [], []
                for li in live:
                    r = reqs[li]
                    chunks.append(ChunkSpec(r.seq_id, len(self.cached[r.seq_id]), 1))
                    ids.append(toks[r.seq_id][-1])
                    self.cached[r.seq_id].append(toks[r.seq_id][-1])
                logits = self._forward(chunks, ids)
            for r in reqs:
                res[r.seq_id] = (list(toks[r.seq_id]), qs[r.seq_id])
            return res
        for i, r in enumerate(reqs):  # a tree: one draft forward per internal node, rewound after
            if not r.params.greedy:
                raise InfertraceError("tree drafting needs greedy requests (--temperature 0); use a chain for sampling")
            base = len(self.cached[r.seq_id])
            node_logits: dict[int, torch.Tensor] = {-1: root_logits[i]}
            toks: list[int | None] = []
            for j, p in enumerate(parents):
                if p not in node_logits:
                    if toks[p] is None:
                        toks.append(None)
                        continue
                    path, a = [], p
                    while a >= 0:
                        path.append(toks[a])
                        a = parents[a]
                    path = path[::-1]
                    node_logits[p] = self._forward([ChunkSpec(r.seq_id, base, len(path))], path)[0]
                    if self._truncate(r.seq_id, base, self.cached[r.seq_id]) < base:  # a recurrent draft: re-evaluate
                        self._forward([ChunkSpec(r.seq_id, 0, base)], self.cached[r.seq_id][:base])
                seen = list(r.all_ids) + [toks[a] for a in _path(parents, p)]
                toks.append(self._pick(node_logits[p], r, seen, rk[j], order)[0])
            res[r.seq_id] = (toks, [None] * len(toks))
        return res


def draft_memory(draft: Any, size: int, n_seq_max: int, kv_dtype: torch.dtype | None = None) -> Any:
    """The draft model's own memory: a cells KV cache of ``size`` cells over its layers, or for a hybrid
    draft (a Qwen3.5-type model, or ``--draft-layers`` of one) a :class:`~infertrace.kv.recurrent.HybridKV`
    (K/V for its attention layers, one GDN state slot per sequence, llama.cpp cells convention).

    A hybrid draft cannot drop a rejected tail from its recurrent state (``seq_rm`` answers False,
    as llama.cpp's ``memory_recurrent`` without ``n_rs_seq``): :class:`DraftModelDrafter` then goes
    back to the checkpoint it took after the last sync (:meth:`~infertrace.kv.recurrent.HybridKV.checkpoint`,
    llama.cpp server's speculative checkpointing, ggml-org/llama.cpp PR 19493) and re-evaluates the
    tokens accepted since."""
    cfg = draft.cfg
    n_layer = len(draft.layers)
    dt = kv_dtype or draft.dtype
    if not getattr(cfg, "is_hybrid", False):
        return CellsKV(n_layer, cfg.n_head_kv, cfg.head_dim, size, n_seq_max, dt, draft.device,
                       windows=[cfg.layer_window(i) for i in range(n_layer)])
    from infertrace.kv.recurrent import HybridKV, RecurrentState

    attn = [i for i in range(n_layer) if not cfg.is_linear(i)]
    lin = [i for i in range(n_layer) if cfg.is_linear(i)]
    state = RecurrentState(lin, cfg.conv_dim, cfg.ssm_conv_kernel, cfg.ssm_n_v_heads, cfg.ssm_k_head_dim,
                           cfg.ssm_v_head_dim, n_seq_max, "cells", draft.dtype, draft.device)
    return HybridKV(CellsKV(len(attn), cfg.n_head_kv, cfg.head_dim, size, n_seq_max, dt, draft.device,
                            windows=[0] * len(attn)), state, attn)


def _path(parents: Sequence[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]

