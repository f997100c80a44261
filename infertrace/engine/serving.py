"""Serving mechanisms around the engine loop: prefix-cache lookups at admission, context shift when
a sequence fills the context, KV provenance and the ``--audit-kv`` check.

The engine calls four hooks (nothing here runs when all three options are off):

* :meth:`Serving.on_admit` -- the scheduler is admitting a request with nothing cached: look up its
  prefix (``kv.lookup``), attach the cached K/V and set ``num_computed`` to the hit length;
* :meth:`Serving.after_forward` -- the step's K/V are written: record their token ids (hashes of
  full blocks / the tokens of each cells sequence) and their provenance; run the audit;
* :meth:`Serving.take_record` -- what the step's trace shows (hits, evictions, audit, ops);
* :meth:`Serving.after_finish` -- context shift of requests whose cache is full (llama.cpp server
  ``update_slots``: ``n_past + 1 >= n_ctx`` -> ``seq_rm(n_keep, n_keep + n_discard)`` +
  ``seq_add(n_keep + n_discard, n_past, -n_discard)``).
"""

from __future__ import annotations

from typing import Any

from infertrace.errors import ConfigError, InfertraceError
from infertrace.kv.audit import Provenance, audit_kv, layer0_k
from infertrace.kv.seq_ops import seq_rm, shift_out
from infertrace.model.rope import layer_ropes


class Serving:
    """Per-engine state of the serving mechanisms (see the module docstring)."""

    def __init__(self, engine: Any):
        self.eng = engine
        o = engine.opts
        self.prefix_on = bool(o.prefix_cache)
        self.shift_on = bool(o.context_shift)
        self.audit_on = bool(o.audit_kv)
        self.active = self.prefix_on or self.shift_on or self.audit_on
        # each layer's own RoPE (Gemma 3: windowed layers base 10000, global 1e6; YaRN's cos/sin factor)
        self.ropes = layer_ropes(engine.model.cfg)
        # llama.cpp server: ``n_keep += add_bos_token`` (the BOS cell is never shifted out)
        self.add_bos = bool(getattr(engine.tok, "add_bos", False))
        self.prov = Provenance()
        self.hits: dict[int, dict[str, Any]] = {}
        self.pending_ops: list[dict[str, Any]] = []  # done after the previous step (context shifts)
        self.audit: dict[str, Any] | None = None

    # --- prefix cache -------------------------------------------------------------
    def on_admit(self, req: Any) -> int:
        """Look up and attach ``req``'s cached prefix; returns the hit length (0 when caching is off)."""
        if not self.prefix_on:
            return 0
        ids = req.cache_ids
        info = self.eng.kv.lookup(req.seq_id, ids)
        src = info.get("src")
        if src is None and info.get("shared_blocks"):
            src = self.prov.block_writer.get(info["shared_blocks"][0])
        elif src is None and info.get("copied"):
            src = self.prov.block_writer.get(info["copied"]["from_block"])
        info["src"] = src
        info["prompt_len"] = len(ids)
        info["computed"] = f"{info['hit']}..{len(ids) - 1}"
        req.num_computed = info["hit"]
        self.hits[req.seq_id] = info
        self.prov.on_hit(req.seq_id, info["hit"], src)
        return info["hit"]

    # --- after the forward ----------------------------------------------------------
    def after_forward(self, batch: Any, inp: Any) -> None:
        """Record the step's token ids and provenance; run the audit when asked."""
        kv = self.eng.kv
        row = 0
        for c in batch.chunks:
            req = c.req
            if self.prefix_on and not req.shifts:
                kv.note_tokens(req.seq_id, c.C, c.token_ids, req.cache_ids[: c.C + c.T])
            blocks = kv.written_blocks(inp, row, c.T) if inp is not None else ()
            self.prov.on_write(req.seq_id, c.C, c.T, c.phase, c.need_logits, blocks)
            row += c.T
        if self.audit_on:
            self.audit = self.run_audit()

    def run_audit(self) -> dict[str, Any]:
        """:func:`~infertrace.kv.audit.audit_kv` over every running request's cache."""
        seqs = {r.seq_id: r.cache_ids[: r.num_computed] for r in self.eng.requests.values()
                if r.status == "running" and r.num_computed}
        return audit_kv(self.eng.model, self.eng.kv, seqs, self.prov)

    def take_record(self, batch: Any = None) -> dict[str, Any] | None:
        """The step's serving record (None when nothing happened): prefix lookups of requests admitted
        this step (of ``batch``: a lookup undone because the request did not fit is not shown), cache
        evictions, operations done before the step (context shifts), the audit."""
        if not self.active:
            return None
        if batch is not None:
            scheduled = {c.req.seq_id for c in batch.chunks}
            self.hits = {k: v for k, v in self.hits.items() if k in scheduled}
        events = self.eng.kv.take_events()
        rec = {"prefix": {str(k): v for k, v in self.hits.items()}, "evictions": events,
               "ops_before_step": self.pending_ops, "audit": self.audit}
        self.hits, self.pending_ops, self.audit = {}, [], None
        return rec

    # --- after finished requests are freed ------------------------------------------------
    def after_finish(self, batch: Any, finished: dict[int, str]) -> None:
        """Forget finished requests' provenance; context-shift requests whose cache is full."""
        for sid in finished:
            self.prov.on_release(sid)
        if not self.shift_on:
            return
        for c in batch.chunks:
            req = c.req
            if req.seq_id in finished or req.status != "running" or len(req.cache_ids) < self.eng.ctx_limit:
                continue
            self.pending_ops.append(self.context_shift(req))

    def context_shift(self, req: Any) -> dict[str, Any]:
        """Keep the first ``n_keep`` cached tokens, drop the next ``n_discard`` (default half of the
        rest), move the others down (K re-rotated with each layer's RoPE). Returns the op record.

        As llama.cpp's server (``tools/server/server-context.cpp``, context shift in ``update_slots``):
        ``n_keep = min(n_ctx - 4, --n-keep + add_bos_token)`` (the BOS stays in its cell; ``--n-keep -1``
        is the prompt's token count, BOS included, before that ``+ add_bos_token``, as llama.cpp's),
        ``n_left = n_past - n_keep``, ``n_discard = --n-discard ?: n_left / 2`` (the default clamped to
        ``0..n_left - 1``, an explicit ``--n-discard`` over ``n_left - 1`` refused); then ``seq_rm(n_keep, n_keep + n_discard)`` and
        ``seq_add(n_keep + n_discard, n_past, -n_discard)``. The record's ``n_keep`` is the effective one.

        Raises:
            InfertraceError: ``n_keep`` leaves nothing to discard; ``--n-discard`` more than ``n_left - 1``.
        """
        o = self.eng.opts
        n_past = req.num_computed
        keep = len(req.prompt_ids) if o.n_keep < 0 else o.n_keep  # llama.cpp: n_keep < 0 keeps the whole prompt
        n_keep = max(0, min(self.eng.ctx_limit - 4, keep + int(self.add_bos)))  # the slot's n_ctx (non-unified: n_ctx_seq)
        n_left = n_past - n_keep
        if o.n_discard and o.n_discard > n_left - 1:  # never clamped silently (llama.cpp's server does not clamp it)
            raise ConfigError("serving.n_discard", f"{o.n_discard} is more than the {max(n_left - 1, 0)} tokens a context shift of "
                                                   f"request {req.seq_id} can drop (n_past {n_past}, n_keep {n_keep} with BOS); lower it")
        n_discard = o.n_discard if o.n_discard else n_left // 2
        n_discard = min(max(n_discard, 0), max(0, n_left - 1))
        if n_discard < 1:
            raise ConfigError("serving.n_keep", f"{o.n_keep} keeps the whole context of {n_past} tokens: a context shift of "
                                                f"request {req.seq_id} is impossible; lower it")
        kv = self.eng.kv
        op = shift_out(kv, req.seq_id, n_keep, n_keep + n_discard, self.ropes)  # raises where the memory cannot
        req.shifts.append((n_keep, n_discard))
        req.num_computed -= n_discard
        self.prov.on_shift(req.seq_id, n_keep, n_discard)
        # evidence: layer-0 K of the moved entries vs K computed fresh for their tokens at the new positions
        moved = range(n_keep, req.num_computed)
        k_now = kv.read(0, req.seq_id)[0][n_keep : req.num_computed].float()  # [M, n_kv_heads, hd]
        k_fresh = layer0_k(self.eng.model, req.cache_ids[n_keep : req.num_computed], moved).float()
        k_check = float((k_now - k_fresh).abs().max()) if len(moved) else 0.0
        return {"op": "context_shift", "seq_id": req.seq_id, "n_past": n_past, "n_keep": n_keep, "n_discard": n_discard,
                "removed": f"{n_keep}..{n_keep + n_discard - 1}",
                "moved": f"{n_keep + n_discard}..{n_past - 1} -> {n_keep}..{n_past - n_discard - 1}",
                "n_past_after": req.num_computed, "k_shift_max_abs_layer0": float(f"{k_check:.3g}"), "detail": op}

    def rewind(self, req: Any, keep: int) -> dict[str, Any]:
        """Remove ``req``'s cached positions ``keep..`` (``seq_rm(seq, keep, -1)``) and its generated
        tokens past them, so decoding continues at position ``keep`` (speculative-decoding rollback)."""
        n_prompt = len(req.prompt_ids)
        if req.shifts or keep < n_prompt or keep > req.num_computed:
            raise InfertraceError(f"rewind of request {req.seq_id} to {keep}: only generated positions "
                                  f"{n_prompt}..{req.num_computed} of an unshifted request can be removed")
        op = seq_rm(self.eng.kv, req.seq_id, keep, -1)
        del req.output_ids[keep - n_prompt + 1 :]
        req.num_computed = keep
        self.prov.on_rewind(req.seq_id, keep)
        self.eng.kv.note_rewind(req.seq_id, req.cache_ids[:keep])
        return op
