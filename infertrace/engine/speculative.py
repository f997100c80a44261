"""Speculative decoding: draft, verify K+1 candidates in one target forward, accept, rewind.

Each step, every running request in decode gets a draft (engine/drafters.py) shaped by the
static tree (a chain unless ``--spec-tree``); the scheduler packs the pending token and the drafts
as one verify chunk (``ChunkSpec.parents``), so hidden is ``[sum of (K+1), H]``, positions are
``past + depth(node)`` and the mask is the ancestor relation -- rows of ``kq_mask`` (cells) or
``spec_decoding_position_offsets`` + ``spec_decoding_packed_mask`` (paged, kv/spec_meta.py).
After the forward, :meth:`Speculator.verify` walks the tree:

* greedy: the target's token at the current node is compared with the node's children; a child
  holding it is accepted and the walk continues (the longest matching prefix); the target's token
  at the last accepted node is emitted as well (the correction / bonus token). The output equals
  plain greedy decoding token for token.
* sampling (chain): draft token x at depth i is accepted with probability ``min(1, p(x)/q(x))``
  (p: the target's final sampling distribution at the parent, q: the draft's; an n-gram draft is a
  point mass); on rejection one token is drawn from ``norm(max(p - q, 0))`` and the walk stops; if
  every draft is accepted, a bonus token is drawn from p at the last node (Leviathan et al. 2023;
  vLLM v1 ``rejection_sampler.py``). The emitted tokens follow the target distribution exactly.

The rejected candidates' K/V are then rewound (the memory's ``rewind``). Counters: per step drafted /
accepted / acceptance rate, per request acceptance by draft position, per run tokens per target
forward.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch

from infertrace.engine.drafters import DraftModelDrafter, NgramDrafter, layer_skip, target_probs
from infertrace.engine.mtp_drafter import MTPDrafter
from infertrace.engine.sampler import SampleResult, sample
from infertrace.engine.config import MAX_DRAFT as _MAX_DRAFT, SpeculativeConfig
from infertrace.errors import ConfigError, InfertraceError

#: largest draft (tree nodes) per request and step
MAX_DRAFT = _MAX_DRAFT


def parse_tree(text: str) -> tuple[int, ...]:
    """``"-1,0,0,1"`` -> parent index of each draft node (-1 = the pending token).

    Raises:
        InfertraceError: not integers, an empty item, a parent not before its node, or more than
            :data:`MAX_DRAFT` nodes.
    """
    text = str(text)
    shown = repr(text if len(text) <= 80 else text[:80] + "…")  # the error line stays short
    compact = text.replace(" ", "")
    fields = compact.split(",") if compact else []
    if "" in fields:  # "-1,,0" or a trailing comma: an item left out, not a smaller tree
        raise ConfigError("speculative.spec_tree", f"has an empty item (got {shown}); give one parent index per node, like -1,0,0,1")
    if len(fields) > MAX_DRAFT:
        raise ConfigError("speculative.spec_tree", f"must have 1..{MAX_DRAFT} nodes (got {len(fields)})")
    if not all(re.fullmatch(r"-?[0-9]{1,6}", x) for x in fields):
        raise ConfigError("speculative.spec_tree", f"must be comma-separated parent indices like -1,0,0,1 (got {shown})")
    parents = tuple(int(x) for x in fields)
    check_tree(parents)
    return parents


def check_tree(parents: tuple[int, ...]) -> None:
    """Raise :class:`ConfigError` (``speculative.spec_tree``) unless each parent is -1 or an earlier node and
    1 <= nodes <= MAX_DRAFT (:meth:`SpeculativeConfig.validate`'s rule)."""
    SpeculativeConfig("ngram", spec_tree=tuple(parents)).validate()


def prune(tokens: list[int | None], parents: list[int], max_depth: int) -> tuple[list[int], list[int], list[int]]:
    """Drop nodes without a token, deeper than ``max_depth`` or under a dropped node; renumber.
    Returns (tokens, parents as -1/kept index, kept static node ids)."""
    new_id: dict[int, int] = {}
    toks, pars, kept, depth = [], [], [], {}
    for i, (t, p) in enumerate(zip(tokens, parents)):
        if t is None or (p >= 0 and p not in new_id):
            continue
        depth[i] = 1 if p < 0 else depth[p] + 1
        if depth[i] > max_depth:
            continue
        new_id[i] = len(toks)
        toks.append(int(t))
        pars.append(-1 if p < 0 else new_id[p])
        kept.append(i)
    return toks, pars, kept


class Speculator:
    """Per-engine speculative decoding state (drafter, tree, counters)."""

    def __init__(self, engine: Any):
        o = engine.opts
        o.speculative_config.validate()  # ConfigError: speculative.<field>
        if o.prefix_cache or o.context_shift or o.audit_kv:
            raise ConfigError("speculative.method", "cannot be combined with prefix_cache, context_shift or audit_kv yet")
        if o.spec_tree is not None:
            self.parents = [p for p in o.spec_tree]
        else:
            self.parents = list(range(-1, o.num_spec_tokens - 1))
        self.chain = self.parents == list(range(-1, len(self.parents) - 1))
        #: the drafter reads the target's final-normed hidden states (the engine hands them over: keep_hidden)
        self.wants_hidden = o.speculative == "mtp"
        if o.speculative == "ngram":
            self.drafter: Any = NgramDrafter(o.ngram_min, o.ngram_max)
        elif o.speculative == "mtp":
            from infertrace.kv.budget import kv_cache_dtype

            size = engine.kv.capacity_tokens + o.n_seq_max * (len(self.parents) + 1)
            self.drafter = MTPDrafter(engine.model, size, o.n_seq_max, getattr(engine, "n_sample_rows", None),
                                      kv_cache_dtype(o, engine.model.dtype))
        else:
            if o.draft_layers:
                dm = layer_skip(engine.model, o.draft_layers)
            else:
                from infertrace.loading.model import load_model

                dm = load_model(o.draft_model, device=str(engine.model.device)).model
            size = engine.kv.capacity_tokens + o.n_seq_max * (len(self.parents) + 1)
            from infertrace.kv.budget import kv_cache_dtype

            self.drafter = DraftModelDrafter(dm, engine.model, size, o.n_seq_max, getattr(engine, "n_sample_rows", None),
                                             kv_cache_dtype(o, dm.dtype))  # --kv-dtype: the draft's cache too
        self.target_forwards = 0  # steps that ran the target on at least one decode / verify chunk
        self.decode_tokens = 0  # tokens emitted by those steps
        self.req_stats: dict[int, dict[str, Any]] = {}

    # --- before scheduling -------------------------------------------------------
    def propose(self, engine: Any) -> None:
        """Set ``req.draft`` / ``draft_parents`` / ``draft_q`` of every running request in decode."""
        sch = engine.scheduler
        running = {r.seq_id for r in sch.running}
        for sid in list(getattr(self.drafter, "cached", {})):
            if sid not in running:
                self.drafter.release(sid)
        reqs = []
        for r in sch.running:
            r.draft, r.draft_parents, r.draft_q = [], [], None
            if r.phase == "decode":
                reqs.append(r)
        if not reqs:
            return
        if any(not r.params.greedy for r in reqs) and not self.chain:
            raise ConfigError("speculative.spec_tree", "needs greedy requests (temperature 0): speculative sampling here verifies chains")
        drafts = self.drafter.draft(engine, reqs, self.parents)
        for r in reqs:
            toks, qs = drafts[r.seq_id]
            left = min(r.params.max_new_tokens - len(r.output_ids) - 1, engine.opts.ctx_size - len(r.cache_ids) - 1)
            t, p, kept = prune(toks, self.parents, left)
            r.draft, r.draft_parents = t, p
            r.draft_q = [qs[i] for i in kept] if any(q is not None for q in qs) else None

    def keep_hidden(self, batch: Any, hidden: torch.Tensor, spec_rec: dict[int, Any]) -> None:
        """Hand the drafter the target's final-normed hidden rows ``hidden`` ``[N, H]`` of the positions
        each chunk kept: every row of a prefill / plain decode chunk, the accepted nodes of a verify
        chunk (``spec_rec[seq_id]["accepted_nodes"]``, chunk-local, in path order)."""
        r0 = 0
        for c in batch.chunks:
            if c.parents is not None:
                keep = [r0 + a for a in spec_rec[c.req.seq_id]["accepted_nodes"]]
            else:
                keep = list(range(r0, r0 + c.T))
            self.drafter.keep_hidden(c.req.seq_id, c.C, hidden[keep])  # [k, H]
            r0 += c.T

    def draft_record(self, seq_id: int) -> dict[str, Any] | None:
        """What the drafter read for ``seq_id``'s current draft (the MTP's inputs), or None."""
        recs = getattr(self.drafter, "records", None)
        rec = recs.get(seq_id) if recs else None
        return copy.deepcopy(rec) if rec else None  # the drafter updates its record in place next step

    # --- after the verify forward -------------------------------------------------
    def verify(self, engine: Any, chunk: Any, logits: torch.Tensor) -> tuple[list[SampleResult], list[int]]:
        """Walk the verify chunk's tree over its logits ``[T, V]``; returns the emitted tokens'
        results and the accepted nodes (chunk-local, root 0 first)."""
        req, order = chunk.req, engine.sampler_order
        parents, toks = chunk.parents, chunk.token_ids
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            kids.setdefault(p, []).append(i)
        seen = list(req.all_ids)
        node, accepted, out = 0, [0], []
        if req.params.greedy:
            while True:
                res = sample(logits[node], req.params, seen, req.generator, order=order)
                out.append(res)
                nxt = [j for j in kids.get(node, []) if toks[j] == res.token]
                if not nxt:
                    return out, accepted
                node = nxt[0]
                accepted.append(node)
                seen.append(res.token)
        g = req.generator
        for i in range(1, chunk.T):  # a chain: node i's parent is i - 1
            p = target_probs(logits[i - 1], req.params, seen, order)  # [V]
            q = req.draft_q[i - 1] if req.draft_q is not None else None
            x = toks[i]
            qx = float(q[x]) if q is not None else 1.0
            u = float(torch.rand(1, generator=g))
            if u < min(1.0, float(p[x]) / qx):
                accepted.append(i)
                seen.append(x)
                out.append(SampleResult(x, [(x, float(logits[i - 1, x]), float(p[x]))]))
                continue
            resid = (p - (q if q is not None else torch.nn.functional.one_hot(torch.tensor(x), p.numel()).float())).clamp_min(0)
            if float(resid.sum()) <= 0:  # p == q: any draw from p is exact
                resid = p
            t = int(torch.multinomial(resid / resid.sum(), 1, generator=g))
            out.append(SampleResult(t, [(t, float(logits[i - 1, t]), float(p[t]))]))
            return out, accepted
        out.append(sample(logits[chunk.T - 1], req.params, seen, g, order=order))  # every draft accepted: bonus token
        return out, accepted

    def rewind(self, engine: Any, chunk: Any, accepted: list[int], inp: Any, row: int) -> dict[str, Any]:
        """:func:`rewind_chunk` on the engine's memory."""
        return rewind_chunk(engine.kv, chunk, accepted, inp, row)

    def note(self, seq_id: int, chunk: Any, accepted: list[int], emitted: int) -> dict[str, Any]:
        """Count drafted / accepted by draft position (depth) for ``seq_id``; returns the step's per-request counts."""
        st = self.req_stats.setdefault(seq_id, {"drafted_by_pos": [], "accepted_by_pos": [], "verify_forwards": 0,
                                               "tokens": 0})
        depths = chunk.depths() if chunk.parents is not None else [0]
        for d in depths[1:]:
            while len(st["drafted_by_pos"]) < d:
                st["drafted_by_pos"].append(0)
                st["accepted_by_pos"].append(0)
        for d in sorted({d for d in depths[1:]}):
            st["drafted_by_pos"][d - 1] += 1  # one chain position per depth (a tree: any node at that depth)
        for k in range(1, len(accepted)):
            st["accepted_by_pos"][k - 1] += 1
        st["verify_forwards"] += 1
        st["tokens"] += emitted
        return {"drafted": chunk.T - 1, "accepted": len(accepted) - 1}

    def summary(self) -> dict[str, Any]:
        """Per run: tokens per target forward; per request: acceptance rate by draft position."""
        reqs = {}
        for sid, st in sorted(self.req_stats.items()):
            rate = [round(a / d, 4) if d else None for a, d in zip(st["accepted_by_pos"], st["drafted_by_pos"])]
            reqs[str(sid)] = {**st, "acceptance_by_pos": rate,
                              "tokens_per_forward": round(st["tokens"] / st["verify_forwards"], 4) if st["verify_forwards"] else None}
        extra = {}
        if isinstance(self.drafter, MTPDrafter):  # the MTP head's own KV cache (counted in the budget: kv/budget.py)
            kv = self.drafter.kv
            extra["draft_kv"] = {"kind": "cells, 1 attention layer (the MTP block)", "cells": kv.capacity_tokens,
                                 "bytes": sum(t.numel() * t.element_size() for t in kv.k + kv.v),
                                 "mtp_forwards": self.drafter.forwards}
        return {"method": self.drafter.name, "tree": list(self.parents), "target_forwards": self.target_forwards, **extra,
                "decode_tokens": self.decode_tokens,
                "tokens_per_target_forward": round(self.decode_tokens / self.target_forwards, 4) if self.target_forwards else None,
                "requests": reqs}


def verify_chunk(engine: Any, chunk: Any, logits: torch.Tensor) -> tuple[list[SampleResult], list[int]]:
    """The outcome of verify chunk ``chunk`` over its logits ``[T, V]``: the emitted tokens' results and
    the accepted nodes (chunk-local, root 0 first).

    The sampler's forced outcome when it has one for this step (``engine.sampler.verify``, e.g.
    :class:`~infertrace.engine.parts.ForcedSampler` of a replayed vLLM trace: vLLM's accepted count
    and emitted tokens, our own candidates kept in ``top``); else :meth:`Speculator.verify`'s tree walk.

    Raises:
        InfertraceError: a verify chunk with neither a forced outcome nor speculative decoding on.
    """
    forced = getattr(engine.sampler, "verify", None)
    got = forced(logits, chunk, engine.sampler_order, engine.step_no) if forced is not None else None
    if got is not None:
        return got
    if engine.spec is None:
        raise InfertraceError(f"step {engine.step_no}: seq {chunk.req.seq_id} has a verify chunk but speculative "
                              "decoding is off and the sampler forces no outcome")
    return engine.spec.verify(engine, chunk, logits)


def rewind_chunk(kv: Any, chunk: Any, accepted: list[int], inp: Any, row: int) -> dict[str, Any]:
    """Free the rejected candidates' K/V (``kv.rewind``, the chunk's rows ``row..row+T-1`` of ``inp``);
    the request's ``num_computed`` becomes ``C + len(accepted)``. Returns the memory's record of it.

    Raises:
        InfertraceError: the memory cannot rewind (a recurrent state cannot drop tokens).
    """
    op = kv.rewind(chunk.req.seq_id, chunk.C, chunk.T, accepted, inp, row,
                   is_chain=chunk.parents == list(range(-1, chunk.T - 1)))
    if not op:
        raise InfertraceError(op["refused"])
    chunk.req.num_computed = chunk.C + len(accepted)
    return op
