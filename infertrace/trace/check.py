"""``infertrace check``: invariants every trace must satisfy, whoever produced it (our engine on
either backend, or llama.cpp through ``run --engine llama.cpp``).

Checked per step, in this order (the first violation is reported with its step, seq_id and
variable):

1. **positions** -- each request's positions are ``C .. C+T-1``, continuing where its previous
   chunk stopped (restarting at 0 only after a preemption); ``inp_pos`` is the packed
   concatenation of them. Serving events move the start: a prefix-cache hit at admission
   (``ReqStep.prefix``: the chunk starts where the hit ends, ``0 <= hit < prompt_len``, vLLM /
   llama.cpp server recompute at least the last prompt token) and a context shift before the step
   (``serving.ops_before_step``: it shifts the ``n_past`` positions the sequence held, drops
   ``n_discard >= 1`` after ``n_keep``, and positions continue at ``n_past_after = n_past - n_discard``;
   its ``removed`` / ``moved`` ranges are the ones ``n_keep`` / ``n_discard`` imply, and a request's
   copy of the shift equals the step's op).
2. **positions (RoPE)** -- every recorded ``cos``/``sin`` is ``cos(pos * inv_freq[i])`` /
   ``sin(...)`` for its position (1e-5: values are stored rounded to 6 digits).
3. **mask (causality)** -- no query sees a later position, and each query sees its own.
4. **mask (isolation)** -- in the kq_mask slice (cells), a kept entry (0) lies on a cell that
   holds the query's seq_id at a position <= the query's; the materialised logical mask has
   no leak column.
5. **kv (ownership)** -- cells: no two cells hold the same (seq, pos); the cells written this
   step were free or released before (finished, preempted, past the sequence's cached length, or
   dropped by a context shift); a sequence joins a cell only by writing it or through its prefix
   hit (``seq_cp`` of a cell the hit's source held at that position); a cell a sequence keeps
   without writing it keeps its position (or moves by ``-n_discard`` in the step's context shift);
   a finished sequence is in no cell unless the cache lists it as retained (prefix cache: llama.cpp
   server keeps a finished slot's cells for reuse; a retained id is a sequence already computed, not
   one running); after the step each computed request owns exactly
   positions ``0 .. C+T-1`` (after a speculative verify: ``0 .. C + accepted path - 1``, and the
   verify row's positions are ``C + depth(node)`` of its draft tree); a finished request owns nothing later. paged: a block belongs to
   one request, unless it is a shared prefix block (vLLM automatic prefix caching: in every
   table at the same index, with ``ref`` = the number of tables, joined only through a prefix hit's
   ``shared_blocks``); the slot mapping is ``table[p // B] * B + p % B``; a finished request has no
   table later. llama.cpp traces: ``llama_memory_seq_pos_min/max`` agree with the cells.
6. **spec** -- a speculative verify row agrees with its tree (:func:`verify_row_problem`: counts,
   emitted tokens, every recorded verify-mask form); the run's summary is consistent
   (:func:`run_spec_problem`).

Every field is validated before use: a malformed trace is a violation of "schema", not a crash.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

from infertrace.ranges import parse_ranges  # the range grammar lives in ranges.py (still importable from here)
from infertrace.trace.schema import Bad, spec_positions


@dataclass
class Violation:
    """The first broken invariant: where (step, seq_id, variable) and what."""

    step: int | None
    seq_id: int | None
    variable: str
    rule: str
    detail: str

    def line(self) -> str:
        where = f"step {self.step}" + (f" seq {self.seq_id}" if self.seq_id is not None else "")
        return f"violation: {where} {self.variable}: {self.rule}: {self.detail}"


class _Bad(Exception):
    def __init__(self, v: Violation):
        self.v = v


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _Checker:
    def __init__(self, m: dict[str, Any]):
        self.m = m
        self.next_pos: dict[int, int] = {}
        self.finished: set[int] = set()
        self.prev_cells: dict[int, tuple[int, list[int]]] = {}
        self.prev_blocks: dict[int, set[int]] = {}  # paged: block -> seqs whose table held it after the previous step
        self.prev_kv_step: int | None = None  # the step prev_cells / prev_blocks come from
        self.n_checks = 0
        # per step: prefix hits (seq -> hit record), shifts done before it (seq -> op), where each
        # sequence's valid cache ended when the step began (cells past it are released)
        self.hits: dict[int, dict[str, Any]] = {}
        self.shifts: dict[int, dict[str, Any]] = {}
        self.start: dict[int, int] = {}
        self.preempted: set[int] = set()

    def fail(self, step: Any, sid: Any, var: str, rule: str, detail: str) -> None:
        raise _Bad(Violation(step if _int(step) else None, sid if _int(sid) else None, var, rule, detail))

    def need(self, ok: bool, step: Any, sid: Any, var: str, detail: str) -> None:
        self.n_checks += 1
        if not ok:
            self.fail(step, sid, var, "schema", detail)

    # ------------------------------------------------------------------ per step
    def step(self, st: Any) -> None:
        self.need(isinstance(st, dict), None, None, "schema", "a step is not an object")
        s = st.get("step")
        self.need(_int(s), None, None, "schema", "step number missing")
        batch = st.get("batch")
        self.need(isinstance(batch, list), s, None, "schema", "batch is not a list")
        preempted = st.get("preempted") or []
        self.need(isinstance(preempted, list) and all(_int(x) for x in preempted), s, None, "schema", "preempted is not a list of ints")
        for sid in preempted:
            self.next_pos[sid] = 0
        self.preempted = set(preempted)
        reqs = []
        for r in batch:
            self.need(isinstance(r, dict) and _int(r.get("seq_id")) and _int(r.get("C")) and _int(r.get("T")), s, None,
                      "schema", "batch row without int seq_id/C/T")
            self.need(isinstance(r.get("positions"), list) and all(_int(p) for p in r["positions"]), s, r["seq_id"],
                      "schema", "positions is not a list of ints")
            reqs.append(r)
        self._serving(s, st, reqs)
        self._positions(s, st, reqs)
        self._rope(s, st)
        self._causal(s, st, reqs)
        self._isolation(s, st, reqs)
        self._kv(s, st, reqs)
        for r in reqs:
            if r.get("finished"):
                self.finished.add(r["seq_id"])

    def _serving(self, s: int, st: dict, reqs: list[dict]) -> None:
        """Serving events of the step: context shifts done before it (``serving.ops_before_step``, or
        a request's ``shift``) move the sequence's next position to ``n_past_after``; prefix hits
        (a request's ``prefix``, or ``serving.prefix``) are kept for the position and ownership
        checks. Each record must be consistent with the sequence the checker has followed."""
        sv = st.get("serving") if isinstance(st.get("serving"), dict) else {}
        ops = sv.get("ops_before_step") if isinstance(sv.get("ops_before_step"), list) else []
        shifts: dict[int, dict[str, Any]] = {}
        for op in ops:
            self.need(isinstance(op, dict), s, None, "serving", "an op before the step is not an object")
            if op.get("op") == "context_shift":
                self.need(_int(op.get("seq_id")), s, None, "serving", "context_shift without an int seq_id")
                shifts[op["seq_id"]] = op
        for r in reqs:
            if isinstance(r.get("shift"), dict) and r["seq_id"] not in shifts:
                shifts[r["seq_id"]] = r["shift"]
            elif isinstance(r.get("shift"), dict):  # the row's copy of the op must be the op (show prints the row's)
                self.n_checks += 1
                if r["shift"] != shifts[r["seq_id"]]:
                    self.fail(s, r["seq_id"], "serving", "context shift recorded once",
                              "the request's shift differs from the step's ops_before_step record of it")
        self.shifts = shifts
        for sid, op in shifts.items():
            n_past, n_keep, n_disc, after = op.get("n_past"), op.get("n_keep"), op.get("n_discard"), op.get("n_past_after")
            self.need(all(_int(x) for x in (n_past, n_keep, n_disc, after)), s, sid, "serving",
                      "context_shift needs int n_past, n_keep, n_discard, n_past_after")
            have = self.next_pos.get(sid, 0)
            self.n_checks += 1
            if sid in self.finished or n_past != have:
                self.fail(s, sid, "positions", "context shift of the cached positions",
                          f"the shift says n_past {n_past} but the sequence holds positions 0..{have - 1}"
                          if sid not in self.finished else "a finished sequence is shifted")
            self.n_checks += 1
            if not (0 <= n_keep and n_disc >= 1 and n_keep + n_disc <= n_past and after == n_past - n_disc):
                self.fail(s, sid, "positions", "context shift of the cached positions",
                          f"n_keep {n_keep}, n_discard {n_disc} of n_past {n_past} cannot leave n_past_after {after} "
                          f"(= n_past - n_discard, with n_keep + n_discard <= n_past)")
            self.n_checks += 1
            want = {"removed": f"{n_keep}..{n_keep + n_disc - 1}",
                    "moved": f"{n_keep + n_disc}..{n_past - 1} -> {n_keep}..{after - 1}" if n_keep + n_disc < n_past else None}
            for key, text in want.items():  # the ranges shown are the ones n_keep / n_discard imply
                if op.get(key) is not None and text is not None and op.get(key) != text:
                    self.fail(s, sid, "positions", "context shift of the cached positions",
                              f"the shift's {key} {op.get(key)!r} is not {text!r} (n_keep {n_keep}, n_discard {n_disc}, "
                              f"n_past {n_past})")
            self.next_pos[sid] = after
        prefix = sv.get("prefix") if isinstance(sv.get("prefix"), dict) else {}
        hits: dict[int, dict[str, Any]] = {}
        for r in reqs:
            h = r.get("prefix") if isinstance(r.get("prefix"), dict) else prefix.get(str(r["seq_id"]))
            if isinstance(h, dict):
                hits[r["seq_id"]] = h
        self.hits = hits
        self.start = dict(self.next_pos)

    def _positions(self, s: int, st: dict, reqs: list[dict]) -> None:
        packed = []
        for r in reqs:
            sid, C, T, pos = r["seq_id"], r["C"], r["T"], r["positions"]
            self.n_checks += 1
            if sid in self.finished:
                self.fail(s, sid, "positions", "lifetime", "a finished request is computed again")
            try:
                expect = spec_positions(r)  # C..C+T-1, or C + depth(node) for a speculative verify row
            except Bad as e:
                self.fail(s, sid, "positions", "schema", e.msg)
            if r.get("spec"):
                self.n_checks += 1
                bad = verify_row_problem(r)
                if bad:
                    self.fail(s, sid, "spec", "verify row consistent with its tree", bad)
            if pos != expect:
                self.fail(s, sid, "positions", "contiguous" if not r.get("spec") else "verify tree",
                          f"positions {pos[:8]} are not {'C..C+T-1 = ' if not r.get('spec') else 'C + depth = '}"
                          f"{expect[:8] if r.get('spec') else f'{C}..{C + T - 1}'}")
            want = self.next_pos.get(sid, 0)
            hit = self.hits.get(sid)
            if hit is not None:  # admitted this step through the prefix cache: computing starts where the hit ends
                h, n = hit.get("hit"), hit.get("prompt_len")
                self.n_checks += 1
                if not _int(h) or h < 0 or (_int(n) and h >= n):
                    self.fail(s, sid, "positions", "prefix hit inside the prompt",
                              f"hit {h!r} of a {n!r}-token prompt (a hit covers at most prompt_len - 1 tokens: "
                              "the last prompt token is computed for its logits)")
                if h and want != 0:
                    self.fail(s, sid, "positions", "prefix hit at admission",
                              f"a prefix hit of {h} tokens for a sequence that already holds positions 0..{want - 1}")
                if h and C != h:
                    self.fail(s, sid, "positions", "chunk starts where the prefix hit ends",
                              f"chunk starts at position {C}, the prefix-cache hit of this sequence covers 0..{h - 1}")
                want = h or want
            if C != want:
                after_shift = sid in self.shifts
                self.fail(s, sid, "positions", "contiguous across chunks",
                          f"chunk starts at position {C}, " + (f"after the context shift the sequence holds 0..{want - 1}"
                                                               if after_shift else
                                                               f"the previous chunk of this sequence ended at {want - 1}"))
            self.start[sid] = C
            self.next_pos[sid] = kept_len(r)
            packed += pos
        p = st.get("positions")
        if isinstance(p, dict):
            self.n_checks += 1
            if p.get("inp_pos") != packed:
                self.fail(s, None, "positions", "inp_pos = packed positions",
                          f"inp_pos {str(p.get('inp_pos'))[:80]} != batch positions {packed[:16]}")

    def _rope(self, s: int, st: dict) -> None:
        p = st.get("positions")
        if not isinstance(p, dict):
            return
        inv = p.get("inv_freq_first")
        cs = p.get("cos_sin")
        if not isinstance(inv, list) or not isinstance(cs, list):
            return
        self.need(all(isinstance(x, (int, float)) and math.isfinite(x) for x in inv), s, None, "positions", "inv_freq_first not numbers")
        ip = p.get("inp_pos") if isinstance(p.get("inp_pos"), list) else []
        for k, e in enumerate(cs):
            self.need(isinstance(e, dict) and _int(e.get("pos")) and isinstance(e.get("cos"), list) and isinstance(e.get("sin"), list),
                      s, None, "positions", "cos_sin entry malformed")
            if k < len(ip) and e["pos"] != ip[k]:
                self.fail(s, None, "positions", "RoPE angle consistent with position",
                          f"cos/sin entry {k} is for pos {e['pos']} but inp_pos[{k}] = {ip[k]}")
            for i, f in enumerate(inv[: len(e["cos"])]):
                a = e["pos"] * f
                c, sn = e["cos"][i], e["sin"][i] if i < len(e["sin"]) else None
                self.n_checks += 1
                if not isinstance(c, (int, float)) or not isinstance(sn, (int, float)) or abs(c - math.cos(a)) > 1e-5 \
                        or abs(sn - math.sin(a)) > 1e-5:
                    self.fail(s, None, "positions", "RoPE angle consistent with position",
                              f"pos {e['pos']} pair {i}: cos/sin {c}, {sn} != cos/sin({e['pos']} * {f}) = "
                              f"{math.cos(a):.6f}, {math.sin(a):.6f}")

    def _causal(self, s: int, st: dict, reqs: list[dict]) -> None:
        mask = st.get("mask")
        logical = mask.get("logical") if isinstance(mask, dict) else None
        for k, r in enumerate(reqs):
            sid, pos = r["seq_id"], r["positions"]
            vis = r.get("visible")
            if isinstance(vis, list):
                for i, v in enumerate(vis[: len(pos)]):
                    try:
                        keys = parse_ranges(v)
                    except ValueError as e:
                        self.fail(s, sid, "mask", "schema", f"visible[{i}]: {e}")
                    self.n_checks += 1
                    if keys and max(keys) > pos[i]:
                        self.fail(s, sid, "mask", "causality", f"query pos {pos[i]} sees key pos {max(keys)}")
                    if pos[i] not in keys:
                        self.fail(s, sid, "mask", "causality", f"query pos {pos[i]} does not see itself")
            if isinstance(logical, list) and k < len(logical) and isinstance(logical[k], list):
                L = r["C"] + r["T"]
                for i, row in enumerate(logical[k]):
                    self.need(isinstance(row, list), s, sid, "mask", "logical row is not a list")
                    self.n_checks += 1
                    if len(row) > L:
                        self.fail(s, sid, "mask", "no cross-sequence visibility",
                                  f"query pos {pos[i] if i < len(pos) else '?'} sees a key of another sequence (leak column)")
                    late = [j for j, x in enumerate(row) if x and i < len(pos) and j > pos[i]]
                    if late:
                        self.fail(s, sid, "mask", "causality", f"query pos {pos[i]} sees key pos {late[0]} (logical mask)")

    def _isolation(self, s: int, st: dict, reqs: list[dict]) -> None:
        mask = st.get("mask")
        km = mask.get("kq_mask") if isinstance(mask, dict) else None
        if not isinstance(km, dict):
            return
        rows, cpos, cseq = km.get("rows"), km.get("cell_pos"), km.get("cell_seq")
        if not (isinstance(rows, list) and isinstance(cpos, list) and isinstance(cseq, list)):
            return
        owner = [(r["seq_id"], p) for r in reqs for p in r["positions"]]  # packed row -> (seq, pos)
        for i, row in enumerate(rows[: len(owner)]):
            self.need(isinstance(row, list), s, None, "mask", "kq_mask row is not a list")
            sid, qp = owner[i]
            for c, x in enumerate(row[: min(len(cpos), len(cseq))]):
                self.n_checks += 1
                if x != "0":
                    continue
                seqs = cseq[c] if isinstance(cseq[c], list) else []
                if sid not in seqs:
                    self.fail(s, sid, "mask", "no cross-sequence visibility",
                              f"kq_mask row {i} (pos {qp}) keeps cell {c}, owned by seq {seqs}")
                if not _int(cpos[c]) or cpos[c] > qp or cpos[c] < 0:
                    self.fail(s, sid, "mask", "causality", f"kq_mask row {i} (pos {qp}) keeps cell {c} at pos {cpos[c]}")

    def _kv(self, s: int, st: dict, reqs: list[dict]) -> None:
        kv = st.get("kv")
        if not isinstance(kv, dict) or not isinstance(kv.get("physical"), dict):
            return
        phys = kv["physical"]
        if phys.get("kind") == "cells":
            self._cells(s, kv, phys, reqs)
        elif phys.get("kind") == "paged":
            self._paged(s, kv, phys, reqs)

    def _cells(self, s: int, kv: dict, phys: dict, reqs: list[dict]) -> None:
        cells = phys.get("cells")
        self.need(isinstance(cells, list), s, None, "kv", "physical.cells is not a list")
        now: dict[int, tuple[int, list[int]]] = {}
        held: dict[tuple[int, int], int] = {}
        retained = phys.get("retained") if phys.get("prefix_cache") is True and isinstance(phys.get("retained"), list) else []
        for c in cells:
            self.need(isinstance(c, dict) and _int(c.get("cell")) and _int(c.get("pos")) and isinstance(c.get("seq_ids"), list),
                      s, None, "kv", "a cell entry is malformed")
            now[c["cell"]] = (c["pos"], c["seq_ids"])
            for sid in c["seq_ids"]:
                self.n_checks += 1
                if (sid, c["pos"]) in held:
                    self.fail(s, sid, "kv", "one cell per (seq, pos)", f"pos {c['pos']} is in cells {held[(sid, c['pos'])]} and {c['cell']}")
                held[(sid, c["pos"])] = c["cell"]
                if sid in self.finished and sid not in retained:
                    self.fail(s, sid, "kv", "freed when finished", f"cell {c['cell']} still holds the finished sequence"
                              + (" (not listed as retained by the prefix cache)" if phys.get("prefix_cache") is True else ""))
        running = {r["seq_id"] for r in reqs if not r.get("finished")}
        for sid in retained:  # kept for reuse: a finished (or preempted) sequence the trace has computed
            self.n_checks += 1
            if not _int(sid) or sid not in self.next_pos or sid in running:
                self.fail(s, sid if _int(sid) else None, "kv", "retained sequences are finished ones",
                          f"the prefix cache lists seq {sid!r} as retained, but it "
                          + ("is running in this step" if sid in running else "was never computed"))
        mem = phys.get("llama_memory_seq_pos")  # --engine llama.cpp: llama_memory_seq_pos_min/max per seq
        if isinstance(mem, dict):
            for k, rng in mem.items():
                sid = int(k) if str(k).isdigit() else None
                own = sorted(p for (q, p) in held if q == sid)
                sp = phys.get("swa_pool")
                if isinstance(sp, dict):  # iSWA: llama_kv_cache_iswa::seq_pos_min/max answer from the SWA pool
                    own = sorted(c.get("pos") for c in sp.get("cells", []) if isinstance(c, dict) and sid in (c.get("seq_ids") or [])
                                 and _int(c.get("pos")))
                if own and phys.get("recurrent_cells"):  # llama_memory_hybrid: max of the mins, min of the maxes (recurrent: the last pos)
                    own = [own[-1]]
                self.n_checks += 1
                if own and rng != [own[0], own[-1]]:
                    self.fail(s, sid, "kv", "memory API agrees with the cells",
                              f"llama_memory_seq_pos_min/max {rng} but the cells hold pos {own[0]}..{own[-1]}")
        per = {d.get("seq_id"): d for d in kv.get("per_request", []) if isinstance(d, dict)}
        wrote: dict[int, set[int]] = {}
        for r in reqs:
            sid = r["seq_id"]
            d = per.get(sid)
            if d is not None and "cells" in d:
                try:
                    written = parse_ranges(d["cells"])
                except ValueError as e:
                    self.fail(s, sid, "kv", "schema", f"cells: {e}")
                wrote[sid] = set(written)
                for cell in written:
                    self.n_checks += 1
                    if cell in self.prev_cells and not self._released(*self.prev_cells[cell]):
                        self.fail(s, sid, "kv", "written cells were free",
                                  f"cell {cell} held pos {self.prev_cells[cell][0]} of seq {self.prev_cells[cell][1]} and was overwritten")
        # every request's written cells are known and the previous step's cells too: who joined which cell, and how
        if len(wrote) == len(reqs) and self.prev_kv_step == s - 1:
            for cell, (pos, seqs) in now.items():
                before = self.prev_cells.get(cell)
                for sid in seqs:
                    self.n_checks += 1
                    if cell in wrote.get(sid, ()):
                        continue
                    if before is not None and sid in before[1]:  # kept: same position, or moved by this step's shift
                        sh, want = self.shifts.get(sid), before[0]
                        if sh is not None and _int(want) and want >= sh["n_keep"] + sh["n_discard"]:
                            want -= sh["n_discard"]
                        if pos != want:
                            self.fail(s, sid, "kv", "a kept cell keeps its position",
                                      f"cell {cell} held pos {before[0]} of seq {sid} and now holds pos {pos}, expected {want}"
                                      + (" after the context shift" if sh is not None else " (no write, no context shift)"))
                        continue
                    h = self.hits.get(sid)
                    hit = h.get("hit") if isinstance(h, dict) else None
                    src = h.get("src") if isinstance(h, dict) else None
                    if not (_int(hit) and pos < hit and before is not None and before[0] == pos and src in before[1]):
                        self.fail(s, sid, "kv", "cells joined by a write or a prefix hit",
                                  f"cell {cell} (pos {pos}) joins seq {sid} without a write of it or a prefix hit "
                                  f"sharing it (seq_cp from {f'seq {src}' if _int(src) else 'no source'}, hit {hit!r})")
        for r in reqs:
            sid = r["seq_id"]
            own = sorted(p for (q, p) in held if q == sid)
            self.n_checks += 1
            if own != list(range(kept_len(r))):  # a verify step: the rejected candidates were rewound
                self.fail(s, sid, "kv", "cache holds 0..C+T-1" if not r.get("spec") else "cache holds the accepted positions",
                          f"after the step the cells of seq {sid} hold pos {own[:8]}{'...' if len(own) > 8 else ''}, expected 0..{kept_len(r) - 1}")
        self.prev_cells, self.prev_kv_step = now, s

    def _released(self, pos: Any, seqs: Any) -> bool:
        """Whether a cell that held ``pos`` of ``seqs`` after the previous step is free for a write:
        every holder finished (a retained one is evicted first), was preempted, no longer caches
        ``pos`` (the step began with fewer positions: a preemption, a rewind), or dropped it in a
        context shift before this step."""
        for q in seqs if isinstance(seqs, list) else ():
            if q in self.finished or q in self.preempted:
                continue
            sh = self.shifts.get(q)
            if sh is not None:  # pos is a position before the shift (checked consistent in _serving)
                if _int(pos) and (sh["n_keep"] <= pos < sh["n_keep"] + sh["n_discard"] or pos >= sh["n_past"]):
                    continue
            elif _int(pos) and pos >= self.start.get(q, 0):
                continue
            return False
        return True

    def _paged(self, s: int, kv: dict, phys: dict, reqs: list[dict]) -> None:
        B = phys.get("tokens_per_block")
        reqmap = phys.get("requests")
        self.need(_int(B) and B > 0 and isinstance(reqmap, dict), s, None, "kv", "paged physical malformed")
        owner: dict[int, int] = {}
        where: dict[int, int] = {}  # block -> its index in the tables holding it
        tables: dict[int, set[int]] = {}
        refs: dict[int, Any] = {}
        for k, d in reqmap.items():
            self.need(isinstance(d, dict) and isinstance(d.get("block_table"), list), s, None, "kv", "block table malformed")
            sid = int(k) if str(k).isdigit() else -1
            if sid in self.finished:
                self.fail(s, sid, "kv", "freed when finished", "a finished request still has a block table")
            for b in d.get("blocks") if isinstance(d.get("blocks"), list) else ():
                if isinstance(b, dict) and _int(b.get("block")):
                    refs[b["block"]] = b.get("ref")
            for i, b in enumerate(d["block_table"]):
                self.n_checks += 1
                self.need(_int(b), s, sid, "kv", "a block table entry is not an int")
                tables.setdefault(b, set()).add(sid)
                if b in owner:
                    # a shared prefix block (vLLM prefix caching): same table index, joined through a hit
                    h = self.hits.get(sid)
                    shared = h.get("shared_blocks") if isinstance(h, dict) else None
                    joined = (isinstance(shared, list) and b in shared) or (  # unknown without the previous step's tables
                        sid in self.prev_blocks.get(b, set()) if self.prev_kv_step == s - 1 else True)
                    if phys.get("prefix_cache") is not True or where[b] != i or not joined:
                        self.fail(s, sid, "kv", "one owner per block",
                                  f"block {b} is in the tables of seq {owner[b]} and {sid}"
                                  + (" (not a prefix block this sequence shares through a hit)" if phys.get("prefix_cache") is True else ""))
                    continue
                owner[b], where[b] = sid, i
        for b, sids in tables.items():
            self.n_checks += 1
            if len(sids) > 1 and b in refs and refs[b] != len(sids):
                self.fail(s, min(sids), "kv", "one owner per block", f"block {b} is in {len(sids)} tables but its ref_cnt is {refs[b]!r}")
        self.prev_blocks, self.prev_kv_step = tables, s
        per = {d.get("seq_id"): d for d in kv.get("per_request", []) if isinstance(d, dict)}
        for r in reqs:
            d = per.get(r["seq_id"])
            if d is None or not isinstance(d.get("slot_mapping"), list) or not isinstance(d.get("block_table"), list):
                continue
            tab = d["block_table"]
            stored = range(r["C"], r["C"] + r["T"])  # storage order: a verify tree's node i sits at slot of C + i
            for p, slot in zip(stored if r.get("spec") else r["positions"], d["slot_mapping"]):
                self.n_checks += 1
                want = tab[p // B] * B + p % B if p // B < len(tab) else None
                if slot != want:
                    self.fail(s, r["seq_id"], "kv", "slot = table[p // B] * B + p % B", f"pos {p}: slot {slot}, expected {want}")


def _ancestors(parents: list[int]) -> list[set[int]]:
    """Per node of a checked tree (``spec_positions`` passed): itself and its ancestors."""
    out: list[set[int]] = []
    for i, p in enumerate(parents):
        out.append({i} | (out[p] if p >= 0 else set()))
    return out


def verify_row_problem(r: dict[str, Any]) -> str | None:
    """What in a speculative verify row (``r["spec"]``, its tree already checked by
    :func:`~infertrace.trace.schema.spec_positions`) contradicts its tree, else None: ``drafted`` =
    T - 1, ``accepted`` = accepted path - 1, ``rejected_nodes`` = the other nodes, ``emitted`` = the
    accepted drafts' tokens then one more (cut short only when the request finished), and every
    recorded verify-mask form (``verify_mask`` rows, llama.cpp ``kq_mask_block``, TensorRT-LLM
    ``position_offsets`` / ``packed_mask``) equal to the ancestor relation / depths."""
    sp, T, toks = r["spec"], r["T"], r.get("token_ids")
    par, acc = sp["parents"], sp["accepted_nodes"]
    if sp.get("drafted") != T - 1:
        return f"drafted = {sp.get('drafted')!r} but the row verifies {T - 1} drafts"
    if sp.get("accepted") != len(acc) - 1:
        return f"accepted = {sp.get('accepted')!r} but the accepted path has {len(acc) - 1} drafts"
    if "rejected_nodes" in sp and sorted(sp["rejected_nodes"]) != sorted(set(range(T)) - set(acc)):
        return "rejected_nodes are not the nodes off the accepted path"
    em = sp.get("emitted")
    if not isinstance(em, list) or not 1 <= len(em) <= len(acc) or (len(em) < len(acc) and not r.get("finished")):
        return f"emits {len(em) if isinstance(em, list) else em!r} tokens for an accepted path of {len(acc)} (one per accepted node)"
    if isinstance(toks, list) and len(toks) == T and em[: len(acc) - 1] != [toks[a] for a in acc[1 : len(em) + 1]]:
        return "the emitted tokens do not begin with the accepted drafts' tokens"
    anc = _ancestors(par)
    want = ["".join("1" if j in anc[i] else "0" for j in range(T)) for i in range(T)]
    if "verify_mask" in sp and sp["verify_mask"] != want:
        return "verify_mask is not the ancestor relation of the tree"
    if "kq_mask_block" in sp and sp["kq_mask_block"] != [["0" if c == "1" else "-inf" for c in row] for row in want]:
        return "kq_mask_block is not 0 on ancestors, -inf elsewhere"
    if "position_offsets" in sp and sp["position_offsets"] != [p - r["C"] for p in spec_positions(r)]:
        return "position_offsets are not the depths of the tree's nodes"
    pm = sp.get("packed_mask")
    if pm is not None:
        if not isinstance(pm, list) or len(pm) != T:
            return f"packed_mask has {len(pm) if isinstance(pm, list) else pm!r} rows for T = {T}"
        for i, words in enumerate(pm):
            if not isinstance(words, list) or len(words) * 32 < T:
                return f"packed_mask row {i} has too few 32-bit words for T = {T}"
            bits = {w * 32 + b for w, x in enumerate(words) if _int(x) for b in range(32) if (x & 0xFFFFFFFF) >> b & 1}
            if bits != anc[i]:
                return f"packed_mask row {i} is not the ancestor set of node {i}"
    return None


def run_spec_problem(sp: Any) -> str | None:
    """What in the run's speculative summary (``RunTrace.spec``) is impossible, else None: a
    ``tree`` whose parents are not -1 / earlier nodes; ``tokens_per_target_forward`` other than
    ``decode_tokens / target_forwards``; an acceptance rate other than accepted / drafted."""
    if not isinstance(sp, dict):
        return None
    tree = sp.get("tree")
    if isinstance(tree, list) and any(not (_int(p) and -1 <= p < i) for i, p in enumerate(tree)):
        return "tree: each parent must be -1 or an earlier node"
    tf, dt, tpf = sp.get("target_forwards"), sp.get("decode_tokens"), sp.get("tokens_per_target_forward")
    if _int(tf) and _int(dt) and (tpf is not None if not tf else not isinstance(tpf, (int, float)) or not abs(tpf - dt / tf) <= 1e-3):
        return f"tokens_per_target_forward = {tpf!r} but decode_tokens / target_forwards = {dt}/{tf}"
    for sid, st in (sp.get("requests") or {}).items() if isinstance(sp.get("requests"), dict) else ():
        if not isinstance(st, dict):
            continue
        a, d, rate = st.get("accepted_by_pos") or [], st.get("drafted_by_pos") or [], st.get("acceptance_by_pos") or []
        for k, (x, y, q) in enumerate(zip(a, d, rate)):
            if not (_int(x) and _int(y)) or x > y or (q is None) != (y == 0) or (y and not abs(q - x / y) <= 1e-3):
                return f"requests[{sid}]: draft position {k + 1} accepted {x!r} of {y!r} drafted, rate {q!r}"
    return None


def kept_len(r: dict[str, Any]) -> int:
    """Positions a request holds after its step: ``C + T``, or ``C + accepted path`` after a verify."""
    sp = r.get("spec")
    if isinstance(sp, dict) and isinstance(sp.get("accepted_nodes"), list):
        return r["C"] + len(sp["accepted_nodes"])
    return r["C"] + r["T"]


def check_trace(manifest: dict[str, Any]) -> tuple[Violation | None, int]:
    """Check every invariant on a manifest (``trace.json`` as a dict; see the module docstring).

    Returns:
        ``(first violation or None, number of checks made)``.
    """
    c = _Checker(manifest)
    steps = manifest.get("steps") if isinstance(manifest, dict) else None
    try:
        if not isinstance(steps, list):
            c.fail(None, None, "schema", "schema", "the trace has no list of steps")
        for st in steps:
            c.step(st)
        c.n_checks += 1
        bad = run_spec_problem(manifest.get("spec"))
        if bad:
            c.fail(None, None, "spec", "run summary consistent", bad)
    except _Bad as b:
        return b.v, c.n_checks
    return None, c.n_checks


def iter_rules() -> Iterator[str]:
    """Names of the rules, for help texts."""
    yield from ("contiguous", "contiguous across chunks", "inp_pos = packed positions", "RoPE angle consistent with position",
                "causality", "no cross-sequence visibility", "one cell per (seq, pos)", "written cells were free",
                "cache holds 0..C+T-1", "freed when finished", "chunk starts where the prefix hit ends", "prefix hit inside the prompt",
                "prefix hit at admission", "context shift of the cached positions", "cells joined by a write or a prefix hit", "memory API agrees with the cells", "one owner per block", "slot = table[p // B] * B + p % B",
                "verify row consistent with its tree", "run summary consistent")
