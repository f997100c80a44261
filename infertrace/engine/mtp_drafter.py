"""The MTP drafter: Qwen3.5's own multi-token-prediction head (:class:`~infertrace.model.mtp.MTPHead`)
proposing drafts from the target's final-normed hidden states, with its own one-layer KV cache.

vLLM ``vllm/v1/spec_decode/llm_base_proposer.py`` (``set_inputs_first_pass``: input ids shifted by one,
positions and hidden states unchanged; later draft steps feed the drafted token and the MTP's own
hidden state at the next position), llama.cpp ``common/speculative.cpp``
``common_speculative_impl_draft_mtp`` (``process``: catch-up rows pairing each token with the target's
hidden state one row earlier; ``draft``: the chain), TensorRT-LLM MTP-Eagle (``Qwen3NextMTP``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from infertrace.engine.drafters import Draft, DraftModelDrafter, _path, ranks
from infertrace.engine.sampler import mask_padded_rows
from infertrace.errors import ConfigError, InfertraceError
from infertrace.kv.base import ChunkSpec
from infertrace.kv.cells import CellsKV


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
            raise ConfigError("speculative.method", "mtp needs a model with an MTP head (Qwen3.5 mtp.* tensors / GGUF "
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
