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
from infertrace.errors import InfertraceError
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
        if not 1 <= nmin <= nmax <= 16:
            raise InfertraceError(f"--ngram-min/--ngram-max must satisfy 1 <= min <= max <= 16 (got {nmin}, {nmax})")
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
        InfertraceError: ``k`` not in ``1..n_layer-1``.
    """
    n = len(model.layers)
    if not 1 <= k < n:
        raise InfertraceError(f"--draft-layers must be in 1..{n - 1} for this {n}-layer model (got {k})")
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
        if hasattr(self.kv, "checkpoint"):  # a hybrid draft: the state at the accepted tokens, before drafting
            for r in reqs:
                self.ckpt[r.seq_id] = self.kv.checkpoint(r.seq_id)
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


class MTPDrafter(DraftModelDrafter):
    """The target's own MTP head (Qwen3.5 ``mtp.*``; :class:`~infertrace.model.mtp.MTPHead`) with its own
    one-layer cells KV cache (vLLM ``EagleProposer`` with ``method="mtp"``, TensorRT-LLM MTP-Eagle,
    llama.cpp ``LLM_GRAPH_TYPE_DECODER_MTP``).

    After every target forward the engine hands over each request's final-normed hidden rows of the
    positions it kept (:meth:`keep_hidden`). At draft time the MTP first catches up: one row per new
    position ``p`` pairing the target's hidden at ``p`` with the token at ``p + 1`` (positions
    unchanged: vLLM ``set_inputs_first_pass``), written to the MTP cache at ``p``; the last row (the
    pending token) gives draft 1. A chain then feeds the MTP's own output hidden back with each drafted
    token at the next position; those speculative rows are removed from the MTP cache after drafting
    (the target's true hidden states replace them next step). A tree recomputes each internal node's path.

    Args:
        target: the target :class:`~infertrace.model.decoder.DecoderModel` (its ``mtp`` head is used).
        size: cells of the MTP cache; n_seq_max: sequences; n_sample_rows: see :class:`DraftModelDrafter`;
        kv_dtype: storage dtype of the MTP cache (``--kv-dtype``).

    Raises:
        InfertraceError: the target has no MTP head.
    """

    name = "mtp"

    def __init__(self, target: Any, size: int, n_seq_max: int, n_sample_rows: int | None = None,
                 kv_dtype: torch.dtype | None = None):
        if getattr(target, "mtp", None) is None:
            raise InfertraceError("--speculative mtp needs a model with an MTP head (Qwen3.5 mtp.* tensors / GGUF "
                                  "blk.N.nextn.*); this model has none (`infertrace inspect` shows mtp_num_hidden_layers)")
        self.head = target.mtp
        self.model = target
        self.n_sample_rows = n_sample_rows
        cfg = target.cfg
        self.kv = CellsKV(1, cfg.n_head_kv, cfg.head_dim, size, n_seq_max, kv_dtype or target.dtype, target.device)
        self.cached: dict[int, int] = {}  # positions 0..n-1 of each seq_id in the MTP cache (target hidden states)
        self.pending: dict[int, list[torch.Tensor]] = {}  # target hidden [H] of positions cached.. not yet fed
        #: seq -> (n, logits [V], MTP hidden out [H], target hidden in [H]) of its MTP row at position n - 1
        self.root: dict[int, tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.gens: dict[int, torch.Generator] = {}
        self.records: dict[int, dict[str, Any]] = {}  # seq -> what the last draft read (for the trace)
        self.forwards = 0

    def release(self, seq_id: int) -> None:
        """Free ``seq_id``'s MTP cells and its buffered hidden states."""
        if seq_id in self.cached:
            self.kv.release(seq_id)
        for d in (self.cached, self.pending, self.root, self.records):
            d.pop(seq_id, None)

    def keep_hidden(self, seq_id: int, C: int, hidden: torch.Tensor) -> None:
        """Buffer the target's final-normed hidden states ``[k, H]`` of positions ``C..C+k-1`` of
        ``seq_id`` (the rows its forward kept: a prefill chunk's rows, a verify chunk's accepted nodes).
        A ``C`` below what is buffered (recompute after preemption) drops the MTP cache from ``C`` first."""
        done = self.cached.setdefault(seq_id, 0)  # listed in cached: the speculator releases it when it finishes
        buf = self.pending.setdefault(seq_id, [])
        if C < done:  # recomputed positions: the MTP cache from C on is stale
            self.kv.seq_rm(seq_id, C, -1)
            self.cached[seq_id] = done = C
            buf.clear()
            self.root.pop(seq_id, None)
        del buf[max(0, C - done):]
        if C != done + len(buf):
            raise InfertraceError(f"internal: MTP hidden rows for seq {seq_id} jump from {done + len(buf)} to {C}")
        buf.extend(hidden.detach().unbind(0))

    def _run(self, chunks: list[ChunkSpec], ids: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP forward; returns (logits at each chunk's last row ``[R, V]``, hidden of every row ``[N, H]``)."""
        inp = self.kv.prepare(chunks)
        rows, r = [], 0
        for c in chunks:
            r += c.T
            rows.append(r - 1)
        self.forwards += 1
        logits, h = self.head.forward(torch.tensor(ids, dtype=torch.int64), hidden, inp, self.kv,
                                      torch.tensor(rows, dtype=torch.int64))  # [R, V], [N, H]
        return mask_padded_rows(logits, self.n_sample_rows), h

    def _catch_up(self, reqs: list[Any]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Feed every request's buffered target rows (one batched MTP forward); returns per seq_id the
        MTP (logits ``[V]``, output hidden ``[H]``, input target hidden ``[H]``) of its row at position
        ``n - 1`` (the pending token's row)."""
        from infertrace.model.mtp import TARGET_HIDDEN

        chunks, ids, hs, who = [], [], [], []
        out: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for r in reqs:
            sid, n = r.seq_id, r.num_computed
            done, buf = self.cached.get(sid, 0), self.pending.get(sid, [])
            if done + len(buf) != n:
                raise InfertraceError(f"internal: the MTP holds hidden states of {done + len(buf)} positions of seq {sid}, "
                                      f"the target computed {n}")
            toks = list(r.cache_ids)
            if not buf:  # nothing new since the last draft (the request was not scheduled): reuse its root
                if self.root.get(sid, (None,))[0] != n:
                    raise InfertraceError(f"internal: no MTP state for seq {sid} at position {n - 1}")
                out[sid] = self.root[sid][1:]
                continue
            chunks.append(ChunkSpec(sid, done, len(buf)))
            ids += toks[done + 1: n + 1]  # row p: the token at p + 1 (the last: the pending token)
            hs += buf
            who.append(r)
            self.records[sid] = {"catch_up": {"positions": [done, n - 1], "tokens": toks[done + 1: n + 1][-8:],
                                              "hidden": TARGET_HIDDEN}}
        if chunks:
            hs_in = torch.stack(hs)  # [N, H] the target's hidden rows
            logits, h = self._run(chunks, ids, hs_in)  # [R, V], [N, H]
            r0 = 0
            for i, (c, r) in enumerate(zip(chunks, who)):
                r0 += c.T
                out[r.seq_id] = (logits[i], h[r0 - 1], hs_in[r0 - 1])
                self.root[r.seq_id] = (r.num_computed, logits[i], h[r0 - 1], hs_in[r0 - 1])
                self.cached[r.seq_id] = r.num_computed
                self.pending[r.seq_id] = []
        return out

    def draft(self, engine: Any, reqs: list[Any], parents: Sequence[int]) -> dict[int, Draft]:
        """MTP proposals (vLLM ``EagleProposer.propose`` for ``mtp``; llama.cpp ``graph_mtp`` drafting).

        Args:
            engine: the target engine (sampler order, sampling parameters).
            reqs: running requests in decode (``num_computed`` = position of the pending token).
            parents: parent index per draft node (-1 = the pending token).

        Returns:
            ``{seq_id: (tokens, probs)}`` as :meth:`DraftModelDrafter.draft`. The inputs each MTP row read
            (position, token, which hidden state, its L2 norm, the draft it gave) are kept in
            :attr:`records` for the trace.
        """
        from infertrace.model.mtp import MTP_HIDDEN, TARGET_HIDDEN

        order = engine.sampler_order
        rk = ranks(parents)
        root = self._catch_up(reqs)
        res: dict[int, Draft] = {}
        for r in reqs:
            sid, n = r.seq_id, r.num_computed
            lg0, h0, hin = root[sid]
            rec = self.records.setdefault(sid, {})
            rec["rows"] = [self._row(-1, n - 1, int(r.cache_ids[n]), "target", n - 1, TARGET_HIDDEN, lg0, hin)]
            state: dict[int, tuple[torch.Tensor, torch.Tensor]] = {-1: (lg0, h0)}  # node -> MTP (logits [V], hidden [H])
            in_cache: list[int] = []  # draft nodes whose MTP rows sit at positions n, n+1, .. of the MTP cache
            toks: list[int | None] = []
            qs: list[torch.Tensor | None] = []
            for j, p in enumerate(parents):
                if p >= 0 and toks[p] is None:
                    toks.append(None)
                    qs.append(None)
                    continue
                if p not in state:  # run the MTP down the path root -> p, reusing the rows already cached
                    path = _path(parents, p)
                    k = 0
                    while k < min(len(path), len(in_cache)) and path[k] == in_cache[k]:
                        k += 1
                    self.kv.seq_rm(sid, n + k, -1)  # a sibling branch's rows: not visible to this path
                    in_cache = in_cache[:k]
                    for d in range(k, len(path)):
                        a, h_in = path[d], state[parents[path[d]]][1]  # the parent's MTP output is this row's hidden
                        lg, hs = self._run([ChunkSpec(sid, n + d, 1)], [int(toks[a])], h_in.unsqueeze(0))  # [1, V], [1, H]
                        state[a] = (lg[0], hs[0])
                        in_cache.append(a)
                        rec["rows"].append(self._row(a, n + d, int(toks[a]), "mtp", n + d - 1, MTP_HIDDEN, lg[0], h_in))
                seen = list(r.all_ids) + [int(toks[a]) for a in _path(parents, p)]
                t, q = self._pick(state[p][0], r, seen, rk[j], order)
                toks.append(t)
                qs.append(q)
            self.kv.seq_rm(sid, n, -1)  # drop the speculative rows: next step's catch-up writes the target's
            rec["drafts"] = list(toks)
            res[sid] = (toks, qs)
        return res

    @staticmethod
    def _row(node: int, pos: int, token: int, src: str, hpos: int, what: str, logits: torch.Tensor,
             hidden: torch.Tensor) -> dict[str, Any]:
        """One MTP row of the trace: where it ran, what it read, and its top logit."""
        return {"node": node, "position": pos, "token": token, "hidden_from": src, "hidden_position": hpos,
                "hidden_norm": "output_norm" if src == "target" else "nextn.shared_head_norm", "hidden": what,
                "hidden_l2": round(float(hidden.float().norm()), 6), "argmax": int(torch.argmax(logits)),
                "logit_max": round(float(logits.max()), 6)}
