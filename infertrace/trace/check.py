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
   ``sin(...)`` for its position (1e-5: values are stored rounded to 6 digits; plus the float32
   rounding of the angle, ``|pos * inv_freq| * 2^-23``, which far positions make visible).
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

7. **window** -- recomputed from positions, seq ids and the config's window (``sliding_window`` on
   the layers ``swa_layers`` marks): a query at p sees exactly keys 0..p (``visible``) and p-W+1..p on
   the windowed layers (``visible_swa``); ``mask.swa`` names that window and those layers, its
   ``kq_mask_swa`` slice keeps exactly the cells of the query's sequence inside the window.
8. **verify cells, display fields, pool, hybrid** -- a verify row's ``spec.cells`` are T distinct cells,
   the ones written, holding the nodes' positions, the accepted path's after the rewind;
   ``cache_before``/``cache_after`` are 0..C-1 / 0..kept-1; ``hidden.rows`` are the packed tokens; the
   KV pool is the one the options configure; a hybrid step's layer map is ``config.layer_types``.
9. **tensors** (:func:`check_tensors`, ``--keep tensors``) -- names, shapes and quoted values agree.

Before the steps: the layers every record names exist (:func:`layers_problem`) and the options agree
with the steps (:func:`options_problem`: verify rows only with ``speculative`` set, ``draft_layers <
n_layer``); ``position_ids`` (and a hybrid step's M-RoPE ``inp_pos`` / ``position_ids``) are the packed
positions. After them, **decode** (:func:`decode_loop_problem`): greedy picks the top logit, the chosen
token is ``next_input`` and is fed next at ``next_pos``, each row's tokens are ``prompt_ids + output_ids``
at its positions, ``output_ids`` are the emitted tokens in order, every id is below ``vocab_size``.

Every field is validated before use: a malformed trace is a violation of "schema", not a crash.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterator

from infertrace.ranges import parse_ranges, ranges_text  # the range grammar lives in ranges.py (still importable from here)
from infertrace.trace import check_sections as sec
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


#: the positions a hybrid step's record lists (capture/hybrid_rec.py MAX_POS): position_ids' columns, inp_pos only up to N
HYBRID_LISTED = 16


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
        self.facts = run_facts(m if isinstance(m, dict) else {})

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
        self._window(s, st, reqs)
        self._spec_cells(s, st, reqs)
        self._isolation(s, st, reqs)
        self._swa_mask(s, st, reqs)
        self._kv(s, st, reqs)
        self._display(s, st, reqs)
        self._pool(s, st)
        self._hybrid(s, st)
        for rules in (sec.streams_rules, sec.swa_pool_rules, sec.mtp_rules, sec.paged_table_rules, sec.prefix_rules,
                      sec.vllm_rules):
            rules(self, s, st, reqs)
        sec.kv_dtype_rules(self, s, st)
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
            if p.get("position_ids") is not None:
                self.n_checks += 1
                if p.get("position_ids") != packed:
                    self.fail(s, None, "positions", "position_ids = packed positions",
                              f"position_ids {str(p.get('position_ids'))[:80]} != batch positions {packed[:16]}")
        hp = st.get("hybrid", {}).get("positions") if isinstance(st.get("hybrid"), dict) else None
        if isinstance(hp, dict):
            self._hybrid_positions(s, hp, packed)

    def _hybrid_positions(self, s: int, hp: dict, packed: list[int]) -> None:
        """A hybrid step's M-RoPE positions, derived from the packed positions (N of them): llama.cpp
        ``llm_graph_input_pos::set_input`` for text tokens with ``n_pos_per_embd = 4`` fills ``inp_pos`` as
        four sections of N -- the position three times (t, h, w), then 0 -- so ``inp_pos_len = 4 N`` and,
        when recorded (the recorder lists it only for N <= 16, else ``[]``), ``inp_pos = p + p + p + [0] * N``;
        HF / TensorRT-LLM ``position_ids [3, 1, N]`` are the positions on each axis, the first
        ``min(N, 16)`` columns listed (a 17-token prompt is listed cut: compared cut, not with the whole batch)."""
        n = len(packed)
        ip, pid, k = hp.get("inp_pos"), hp.get("position_ids"), hp.get("n_pos_per_embd")
        self.n_checks += 1
        cut = packed[:HYBRID_LISTED]
        if isinstance(pid, list) and any(row != cut for row in pid):
            self.fail(s, None, "positions", "hybrid inp_pos = packed positions",
                      f"hybrid.positions position_ids {str(pid)[:80]} are not the batch positions on each of the 3 axes "
                      f"(first {len(cut)} of N = {n}: {cut[:16]})")
        if not isinstance(ip, list):
            return
        want = packed * 3 + [0] * n if k == 4 else None
        self.n_checks += 1
        if (ip or n <= HYBRID_LISTED) and ip != want:
            self.fail(s, None, "positions", "hybrid inp_pos = packed positions",
                      f"hybrid.positions inp_pos {str(ip)[:80]} is not the batch positions {packed[:16]} as llama.cpp's "
                      f"M-RoPE layout for text (n_pos_per_embd 4: p, p, p, then 0; n_pos_per_embd here {_show(k)})")
        if _int(hp.get("inp_pos_len")) and _int(k) and hp["inp_pos_len"] != n * k:
            self.fail(s, None, "positions", "hybrid inp_pos = packed positions",
                      f"hybrid.positions inp_pos_len {hp['inp_pos_len']} but N x n_pos_per_embd = {n} x {k}")

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
                a = e["pos"] * f if isinstance(f, (int, float)) else math.inf
                if not math.isfinite(a):  # inv_freq 1e308 (or not a number): pos * f overflows; cos(inf) raises
                    self.n_checks += 1
                    self.fail(s, None, "positions", "RoPE angle consistent with position",
                              f"pos {e['pos']} pair {i}: angle pos * inv_freq {f!r} is not a finite number")
                    continue
                c, sn = e["cos"][i], e["sin"][i] if i < len(e["sin"]) else None
                # the angle is a float32 (the engine's and llama.cpp's RoPE: theta = pos * inv_freq in F32), rounded
                # by up to |a| * 2^-24, then cos/sin stored to 6 digits: at pos 700 the angle alone moves sin by ~4e-5
                tol = 1e-5 + abs(a) * 2.0 ** -23
                self.n_checks += 1
                if not isinstance(c, (int, float)) or not isinstance(sn, (int, float)) or abs(c - math.cos(a)) > tol \
                        or abs(sn - math.sin(a)) > tol:
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

    def _window(self, s: int, st: dict, reqs: list[dict]) -> None:
        """Visibility recomputed from positions, seq ids and the window (the facts the recorder's masks
        come from): a query at position p of a sequence sees exactly keys 0..p of it on the full-attention
        layers (``visible``) and p-W+1..p on the windowed ones (``visible_swa``, W = ``config.sliding_window``
        on the layers ``config.swa_layers`` marks; llama.cpp ``is_masked_swa`` with LLAMA_SWA_TYPE_STANDARD:
        masked iff ``p - p_key >= n_swa``); the mask record's copies (``mask.visible``, ``mask.swa``)
        are the rows' own and ``mask.swa`` names the window the config gives."""
        W, win, n_layer = self.facts["W"], self.facts["windowed"], self.facts["n_layer"]
        for r in reqs:
            sid, pos = r["seq_id"], r["positions"]
            vis, vs = r.get("visible"), r.get("visible_swa")
            for i, p in enumerate(pos):
                if isinstance(vis, list) and i < len(vis):
                    self.n_checks += 1
                    if self._iv(s, sid, f"visible[{i}]", vis[i]) != [(0, p)]:
                        self.fail(s, sid, "mask", "causality", f"query pos {p} sees keys {_show(vis[i])}, expected 0..{p} "
                                  "(every position of its sequence up to its own, none later)")
            if not W:
                self.n_checks += 1
                if vs is not None:
                    self.fail(s, sid, "mask", "window", "the row lists visible_swa but the model has no windowed layer "
                              "(config sliding_window / swa_layers)")
                continue
            self.n_checks += 1
            if not isinstance(vs, list) or len(vs) != len(pos):
                self.fail(s, sid, "mask", "window", f"the model has windowed layers {_layers(win)} (W = {W}) but the row's "
                          f"visible_swa is {'missing' if vs is None else 'not one entry per query'}")
            for i, p in enumerate(pos):
                lo = max(0, p - W + 1)
                self.n_checks += 1
                if self._iv(s, sid, f"visible_swa[{i}]", vs[i]) != [(lo, p)]:
                    self.fail(s, sid, "mask", "window", f"query pos {p} sees keys {_show(vs[i])} on the windowed layers, "
                              f"expected {lo}..{p} (keys p-W+1..p, W = {W})")
        mask = st.get("mask")
        if not isinstance(mask, dict):
            return
        rows = [{"seq_id": r["seq_id"], "queries": [{"pos": p, "keys": v} for p, v in zip(r["positions"], r.get("visible") or [])]}
                for r in reqs]
        self.n_checks += 1
        if "visible" in mask and mask["visible"] != rows:
            self.fail(s, None, "mask", "causality", "mask.visible is not the batch rows' visible keys")
        sw = mask.get("swa")
        self.n_checks += 1
        if bool(W) != isinstance(sw, dict):
            self.fail(s, None, "mask", "window", f"mask.swa is missing but the model has windowed layers {_layers(win)}" if W
                      else "mask.swa is recorded but the model has no windowed layer (config sliding_window / swa_layers)")
        if not W:
            return
        glob = [i for i in range(n_layer) if i not in set(win)]
        for key, got, want in (("n_swa", sw.get("n_swa"), W), ("layers", sw.get("layers"), win), ("global_layers", sw.get("global_layers"), glob)):
            self.n_checks += 1
            if got != want:
                self.fail(s, None, "mask", "window", f"mask.swa.{key} is {_show(got)} but the config gives {_show(want)} "
                          f"(sliding_window {W} on layers {_layers(win)} of {n_layer})")
        swa_rows = [{"seq_id": r["seq_id"], "queries": [{"pos": p, "keys": v} for p, v in zip(r["positions"], r["visible_swa"])]}
                    for r in reqs]
        self.n_checks += 1
        if "visible" in sw and sw["visible"] != swa_rows:
            self.fail(s, None, "mask", "window", "mask.swa.visible is not the batch rows' visible_swa")
        aw = {str(i): W for i in win}
        for where, d in (("mask.swa", sw), ("kv.physical", ((st.get("kv") or {}).get("physical") or {}))):
            self.n_checks += 1
            if isinstance(d, dict) and "attention_window" in d and d["attention_window"] != aw:
                self.fail(s, None, "mask", "window", f"{where}.attention_window is {_show(d['attention_window'])}, the config "
                          f"gives W = {W} on layers {_layers(win)}")
        ph = (st.get("kv") or {}).get("physical") if isinstance(st.get("kv"), dict) else None
        if isinstance(ph, dict) and ph.get("kind") == "cells" and "n_swa" in ph:
            got = (ph.get("n_swa"), ph.get("swa_layers"))
            self.n_checks += 1
            if got != (W, win):  # (--engine llama.cpp refuses windowed models: its iSWA cache is two caches)
                self.fail(s, None, "kv", "window", f"kv.physical n_swa {_show(got[0])} / swa_layers {_show(got[1])}, the config "
                          f"gives W = {W} on layers {_layers(win)}")

    def _iv(self, s: int, sid: int, what: str, text: Any) -> list[tuple[int, int]]:
        try:
            return intervals(text)
        except ValueError as e:
            self.fail(s, sid, "mask", "schema", f"{what}: {e}")
        return []  # pragma: no cover - fail raised

    def _cells_at_attention(self, st: dict, reqs: list[dict]) -> dict[int, tuple[int, list[int]]]:
        """Cell -> (pos, seq_ids) when the step's masks were filled, as far as the trace says: the
        cells after the step, the verify rows' cells (a rewind frees the rejected ones after
        attention), and the kq_mask slice's own ``cell_pos`` / ``cell_seq`` over them."""
        out: dict[int, tuple[int, list[int]]] = {}
        kv = st.get("kv")
        ph = kv.get("physical") if isinstance(kv, dict) else None
        if isinstance(ph, dict) and ph.get("kind") == "cells" and isinstance(ph.get("cells"), list):
            for c in ph["cells"]:
                if isinstance(c, dict) and _int(c.get("cell")) and _int(c.get("pos")) and isinstance(c.get("seq_ids"), list):
                    out[c["cell"]] = (c["pos"], c["seq_ids"])
        for r in reqs:
            sp = r.get("spec")
            cells = sp.get("cells") if isinstance(sp, dict) else None
            if isinstance(cells, list):
                for c, p in zip(cells, r["positions"]):
                    if _int(c):
                        out[c] = (p, [r["seq_id"]])
        mask = st.get("mask")
        km = mask.get("kq_mask") if isinstance(mask, dict) else None
        if isinstance(km, dict) and isinstance(km.get("cell_pos"), list) and isinstance(km.get("cell_seq"), list):
            for c, (p, q) in enumerate(zip(km["cell_pos"], km["cell_seq"])):
                if _int(p) and isinstance(q, list):
                    if p < 0:
                        out.pop(c, None)
                    else:
                        out[c] = (p, q)
        return out

    def _swa_mask(self, s: int, st: dict, reqs: list[dict]) -> None:
        """llama.cpp's ``kq_mask_swa`` slice recomputed; column c is cell ``col_start + c`` at
        ``cell_pos[c]``; an entry is 0 iff the cell holds the query's sequence at a position in p-W+1..p.

        One cell pool (no ``kv.physical.swa_pool`` / ``mask.swa.pool``: paged, prefix cache, older
        traces): the same tensor shape as ``kq_mask`` and the same slice, its ``cell_pos`` equal to
        ``kq_mask``'s, cells read from the base pool (a verify row's own tree cells are the verify
        block's, checked against the tree). A separate SWA pool (llama.cpp's iSWA cache,
        ``llama_kv_cache_iswa``; kv/iswa.py): ``ne = [n_kv_swa, n_tokens_pad, 1, 1]`` with ``n_kv_swa`` =
        ``mask.swa.pool.n_kv``, the same number of query rows as ``kq_mask``, and cells (pos, seq_ids)
        read from that pool's own record ``kv.physical.swa_pool.cells``, whose positions must agree
        with ``cell_pos``."""
        mask = st.get("mask")
        sw = mask.get("swa") if isinstance(mask, dict) else None
        kqs = sw.get("kq_mask_swa") if isinstance(sw, dict) else None
        W = self.facts["W"]
        if not isinstance(kqs, dict) or not W:
            return
        rows, cpos, start = kqs.get("rows"), kqs.get("cell_pos"), kqs.get("col_start", 0)
        self.need(isinstance(rows, list) and all(isinstance(x, list) for x in rows) and _int(start), s, None, "mask",
                  "kq_mask_swa rows malformed")
        km = mask.get("kq_mask")
        kv = st.get("kv")
        ph = kv.get("physical") if isinstance(kv, dict) else None
        spool = ph.get("swa_pool") if isinstance(ph, dict) else None
        mpool = sw.get("pool")
        if isinstance(spool, dict) or isinstance(mpool, dict):
            return self._swa_mask_pool(s, st, reqs, kqs, km, spool, mpool, W)
        if isinstance(km, dict) and isinstance(km.get("rows"), list):
            shape = (len(rows), len(rows[0]) if rows else 0)
            kshape = (len(km["rows"]), len(km["rows"][0]) if km["rows"] else 0)
            self.n_checks += 1
            if kqs.get("ne") != km.get("ne") or shape != kshape:
                self.fail(s, None, "mask", "window", f"kq_mask_swa is ne {_show(kqs.get('ne'))} with a {shape[0]}x{shape[1]} slice, "
                          f"kq_mask ne {_show(km.get('ne'))} with {kshape[0]}x{kshape[1]} (one cell pool: the same tensor shape and slice)")
            kp = km.get("cell_pos") if isinstance(km.get("cell_pos"), list) else []
            for c, p in enumerate(cpos if isinstance(cpos, list) else []):
                self.n_checks += 1
                if start + c < len(kp) and p != kp[start + c]:
                    self.fail(s, None, "mask", "window", f"kq_mask_swa says cell {start + c} holds pos {_show(p)}, kq_mask says {_show(kp[start + c])}")
        if not isinstance(cpos, list):
            return
        cells = self._cells_at_attention(st, reqs)
        owner = [(r["seq_id"], p, r) for r in reqs for p in r["positions"]]  # packed row -> (seq, pos, row)
        for i, row in enumerate(rows[: len(owner)]):
            sid, qp, r = owner[i]
            sp = r.get("spec")
            tree = set(sp["cells"]) if isinstance(sp, dict) and isinstance(sp.get("cells"), list) else set()
            for c, x in enumerate(row[: len(cpos)]):
                cell, kp = start + c, cpos[c]
                self.n_checks += 1
                if not _int(kp):
                    self.fail(s, sid, "mask", "schema", f"kq_mask_swa cell_pos[{c}] is not an int")
                held = cells.get(cell)
                seqs = held[1] if held is not None and held[0] == kp else None  # unknown: only the window is checked
                in_win = 0 <= kp <= qp and qp - kp < W
                if x == "0" and not in_win:
                    self.fail(s, sid, "mask", "causality" if kp > qp else "window",
                              f"kq_mask_swa row {i} (pos {qp}) keeps cell {cell} at pos {kp}"
                              + ("" if kp > qp else f", outside the window {max(0, qp - W + 1)}..{qp} (W = {W})"))
                if seqs is None or cell in tree:
                    continue
                if x == "0" and sid not in seqs:
                    self.fail(s, sid, "mask", "no cross-sequence visibility", f"kq_mask_swa row {i} (pos {qp}) keeps cell {cell}, owned by seq {seqs}")
                if x != "0" and sid in seqs and in_win:
                    self.fail(s, sid, "mask", "window", f"kq_mask_swa row {i} (pos {qp}) hides cell {cell} (pos {kp} of its sequence), "
                              f"inside the window {max(0, qp - W + 1)}..{qp} (W = {W})")

    def _swa_mask_pool(self, s: int, st: dict, reqs: list[dict], kqs: dict, km: Any, spool: Any, mpool: Any,
                       W: int) -> None:
        """``kq_mask_swa`` over llama.cpp's separate SWA pool (``llama_kv_cache_iswa``: the windowed
        layers' cells, ``kv_swa``): its width ``ne[0]`` is the pool's ``n_kv``, its query rows
        ``ne[1]`` those of ``kq_mask``; column c is SWA cell ``col_start + c`` at ``cell_pos[c]`` (-1:
        empty), which the pool's recorded cells (after the step) must agree with; an entry is 0 iff the
        cell holds the query's sequence at a position in p-W+1..p. Verify rows' hidden-cell check is
        skipped (their tree's cells are the base pool's numbering)."""
        rows, cpos, start = kqs["rows"], kqs.get("cell_pos"), kqs.get("col_start", 0)
        ne = kqs.get("ne")
        n_kv = mpool.get("n_kv") if isinstance(mpool, dict) else spool.get("n_kv") if isinstance(spool, dict) else None
        self.n_checks += 1
        if isinstance(ne, list) and len(ne) == 4 and _int(n_kv) and ne[0] != n_kv:
            self.fail(s, None, "mask", "window", f"kq_mask_swa is ne {_show(ne)} but the SWA pool's n_kv is {_show(n_kv)}")
        if isinstance(km, dict) and isinstance(km.get("rows"), list):
            kne = km.get("ne")
            self.n_checks += 1
            if (isinstance(ne, list) and isinstance(kne, list) and len(ne) == len(kne) == 4 and ne[1] != kne[1]) \
                    or len(rows) != len(km["rows"]):
                self.fail(s, None, "mask", "window", f"kq_mask_swa is ne {_show(ne)} with {len(rows)} rows, kq_mask ne {_show(kne)} "
                          f"with {len(km['rows'])} (the same query rows over both pools)")
        if not isinstance(cpos, list):
            return
        held: dict[int, tuple[int, list[int]]] = {}
        if isinstance(spool, dict) and isinstance(spool.get("cells"), list):
            for c in spool["cells"]:
                if isinstance(c, dict) and _int(c.get("cell")) and _int(c.get("pos")) and isinstance(c.get("seq_ids"), list):
                    held[c["cell"]] = (c["pos"], c["seq_ids"])
        for c, p in enumerate(cpos):
            got = held.get(start + c)
            self.n_checks += 1
            if _int(p) and p >= 0 and got is not None and got[0] != p:
                self.fail(s, None, "mask", "window", f"kq_mask_swa says SWA cell {start + c} holds pos {_show(p)}, "
                          f"kv.physical.swa_pool says {_show(got[0])}")
        owner = [(r["seq_id"], p, r) for r in reqs for p in r["positions"]]  # packed row -> (seq, pos, row)
        for i, row in enumerate(rows[: len(owner)]):
            sid, qp, r = owner[i]
            verify = isinstance(r.get("spec"), dict)
            for c, x in enumerate(row[: len(cpos)]):
                cell, kp = start + c, cpos[c]
                self.n_checks += 1
                if not _int(kp):
                    self.fail(s, sid, "mask", "schema", f"kq_mask_swa cell_pos[{c}] is not an int")
                if kp < 0:
                    if x == "0":
                        self.fail(s, sid, "mask", "window", f"kq_mask_swa row {i} (pos {qp}) keeps empty SWA cell {cell}")
                    continue
                got = held.get(cell)
                seqs = got[1] if got is not None and got[0] == kp else None  # unknown (freed after the step): window only
                in_win = kp <= qp and qp - kp < W
                if x == "0" and not in_win:
                    self.fail(s, sid, "mask", "causality" if kp > qp else "window",
                              f"kq_mask_swa row {i} (pos {qp}) keeps SWA cell {cell} at pos {kp}"
                              + ("" if kp > qp else f", outside the window {max(0, qp - W + 1)}..{qp} (W = {W})"))
                if seqs is None:
                    continue
                if x == "0" and sid not in seqs:
                    self.fail(s, sid, "mask", "no cross-sequence visibility", f"kq_mask_swa row {i} (pos {qp}) keeps SWA cell {cell}, owned by seq {seqs}")
                if x != "0" and sid in seqs and in_win and not verify:
                    self.fail(s, sid, "mask", "window", f"kq_mask_swa row {i} (pos {qp}) hides SWA cell {cell} (pos {kp} of its sequence), "
                              f"inside the window {max(0, qp - W + 1)}..{qp} (W = {W})")

    def _isolation(self, s: int, st: dict, reqs: list[dict]) -> None:
        mask = st.get("mask")
        km = mask.get("kq_mask") if isinstance(mask, dict) else None
        if not isinstance(km, dict):
            return
        if isinstance(km.get("streams"), list):  # non-unified KV: each stream's block of rows over its own cells
            return self._isolation_streams(s, km, reqs)
        rows, cpos, cseq = km.get("rows"), km.get("cell_pos"), km.get("cell_seq")
        if not (isinstance(rows, list) and isinstance(cpos, list) and isinstance(cseq, list)):
            return
        owner = [(r["seq_id"], p) for r in reqs for p in r["positions"]]  # packed row -> (seq, pos)
        reqs_of = [r for r in reqs for _ in r["positions"]]
        for i, row in enumerate(rows[: len(owner)]):
            self.need(isinstance(row, list), s, None, "mask", "kq_mask row is not a list")
            sid, qp = owner[i]
            sp = reqs_of[i].get("spec")
            tree = set(sp["cells"]) if isinstance(sp, dict) and isinstance(sp.get("cells"), list) else set()
            for c, x in enumerate(row[: min(len(cpos), len(cseq))]):
                self.n_checks += 1
                seqs = cseq[c] if isinstance(cseq[c], list) else []
                if x != "0":  # a cell of the query's sequence at an earlier position is seen (a verify row's tree: its block)
                    if sid in seqs and _int(cpos[c]) and 0 <= cpos[c] <= qp and c not in tree:
                        self.fail(s, sid, "mask", "causality", f"kq_mask row {i} (pos {qp}) hides cell {c}, which holds pos "
                                  f"{cpos[c]} of its sequence")
                    continue
                if sid not in seqs:
                    self.fail(s, sid, "mask", "no cross-sequence visibility",
                              f"kq_mask row {i} (pos {qp}) keeps cell {c}, owned by seq {seqs}")
                if not _int(cpos[c]) or cpos[c] > qp or cpos[c] < 0:
                    self.fail(s, sid, "mask", "causality", f"kq_mask row {i} (pos {qp}) keeps cell {c} at pos {cpos[c]}")

    def _isolation_streams(self, s: int, km: dict, reqs: list[dict]) -> None:
        """The isolation check per stream of a non-unified kq_mask: row ``ii`` of stream block ``j`` is
        packed row ``j * n_tps + ii`` (``n_tps = ne[1]``); a kept cell holds the query's seq_id and a
        position not after the query's."""
        owner = [(r["seq_id"], p) for r in reqs for p in r["positions"]]  # packed row -> (seq, pos)
        ne = km.get("ne")
        n_tps = ne[1] if isinstance(ne, list) and len(ne) == 4 and _int(ne[1]) else 0
        for j, blk in enumerate(km["streams"]):
            if not isinstance(blk, dict):
                continue
            rows, cpos, cseq = blk.get("rows"), blk.get("cell_pos"), blk.get("cell_seq")
            if not (isinstance(rows, list) and isinstance(cpos, list) and isinstance(cseq, list)):
                continue
            for ii, row in enumerate(rows[:n_tps]):
                i = j * n_tps + ii
                if i >= len(owner) or not isinstance(row, list):
                    break
                sid, qp = owner[i]
                for c, x in enumerate(row[: min(len(cpos), len(cseq))]):
                    self.n_checks += 1
                    if x != "0":
                        continue
                    seqs = cseq[c] if isinstance(cseq[c], list) else []
                    if sid not in seqs:
                        self.fail(s, sid, "mask", "no cross-sequence visibility",
                                  f"kq_mask stream {blk.get('stream')} row {ii} (pos {qp}) keeps cell {c}, owned by seq {seqs}")
                    if not _int(cpos[c]) or cpos[c] > qp or cpos[c] < 0:
                        self.fail(s, sid, "mask", "causality",
                                  f"kq_mask stream {blk.get('stream')} row {ii} (pos {qp}) keeps cell {c} at pos {cpos[c]}")

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

    def _spec_cells(self, s: int, st: dict, reqs: list[dict]) -> None:
        """A cells verify row's ``spec.cells`` (llama.cpp ``k_idxs`` of its T nodes): T distinct cells,
        the ones the step wrote for the sequence (``kv.per_request`` cells), each holding its node's
        position when the mask was filled, ``kq_mask`` over them equal to the verify block; after the
        rewind the accepted path's cells hold positions C, C+1, ... and the rejected nodes' are freed."""
        kv = st.get("kv") if isinstance(st.get("kv"), dict) else {}
        ph = kv.get("physical") if isinstance(kv.get("physical"), dict) else {}
        per = {d.get("seq_id"): d for d in kv.get("per_request", []) if isinstance(d, dict)}
        after = {c["cell"]: (c.get("pos"), c.get("seq_ids")) for c in ph.get("cells", []) if isinstance(c, dict) and _int(c.get("cell"))} \
            if ph.get("kind") == "cells" and isinstance(ph.get("cells"), list) else None
        mask = st.get("mask")
        km = mask.get("kq_mask") if isinstance(mask, dict) and isinstance(mask.get("kq_mask"), dict) else {}
        kpos, kseq, krows = km.get("cell_pos") or [], km.get("cell_seq") or [], km.get("rows") or []
        for r in reqs:
            sp = r.get("spec")
            cells = sp.get("cells") if isinstance(sp, dict) else None
            if cells is None:
                continue
            sid, T, pos = r["seq_id"], r["T"], r["positions"]
            self.n_checks += 1
            if not (isinstance(cells, list) and len(cells) == T and all(_int(c) for c in cells) and len(set(cells)) == T):
                self.fail(s, sid, "kv", "verify cells", f"spec.cells {_show(cells)} are not {T} distinct cells, one per node of the tree")
            d = per.get(sid)
            if isinstance(d, dict) and "cells" in d:
                self.n_checks += 1
                if self._iv(s, sid, "kv.per_request.cells", d["cells"]) != intervals_of(cells):
                    self.fail(s, sid, "kv", "verify cells", f"spec.cells {_show(cells)} are not the cells the step wrote for the "
                              f"sequence ({_show(d['cells'])})")
            for i, c in enumerate(cells):
                if c < min(len(kpos), len(kseq)):
                    self.n_checks += 1
                    if kpos[c] != pos[i] or not isinstance(kseq[c], list) or sid not in kseq[c]:
                        self.fail(s, sid, "kv", "verify cells", f"node {i} (pos {pos[i]}) is in cell {c}, which holds pos "
                                  f"{_show(kpos[c])} of seq {_show(kseq[c])} when the mask is filled")
            blk = sp.get("kq_mask_block")
            row0 = r["rows"][0] if r.get("rows") else None
            if isinstance(blk, list) and _int(row0):
                for i in range(min(T, len(blk), max(0, len(krows) - row0))):
                    for j, c in enumerate(cells):
                        if isinstance(krows[row0 + i], list) and c < len(krows[row0 + i]) and isinstance(blk[i], list) and j < len(blk[i]):
                            self.n_checks += 1
                            if krows[row0 + i][c] != blk[i][j]:
                                self.fail(s, sid, "spec", "verify row consistent with its tree",
                                          f"kq_mask row {row0 + i} at cell {c} (node {j}) is {krows[row0 + i][c]} but "
                                          f"kq_mask_block[{i}][{j}] is {_show(blk[i][j])}")
            acc = sp.get("accepted_nodes") or []
            if after is not None:
                for k, a in enumerate(acc):
                    self.n_checks += 1
                    got = after.get(cells[a])
                    if got is None or got[0] != r["C"] + k or not isinstance(got[1], list) or sid not in got[1]:
                        self.fail(s, sid, "kv", "verify cells", f"accepted node {a} was written to cell {cells[a]}, which after "
                                  f"the rewind holds {'nothing' if got is None else f'pos {got[0]} of seq {got[1]}'}, "
                                  f"expected pos {r['C'] + k} of seq {sid}")
            rw = sp.get("rewind")
            if isinstance(rw, dict) and "freed" in rw:
                self.n_checks += 1
                rej = [cells[j] for j in range(T) if j not in set(acc)]
                if self._iv(s, sid, "spec.rewind.freed", rw["freed"]) != intervals_of(rej):
                    self.fail(s, sid, "kv", "verify cells", f"the rewind frees cells {_show(rw['freed'])}, the rejected nodes "
                              f"are in cells {_show(ranges_text(rej))}")

    def _display(self, s: int, st: dict, reqs: list[dict]) -> None:
        """The fields shown beside the variables agree with them: ``cache_before`` / ``cache_after``
        are the positions the request holds before / after the step (0..C-1, 0..kept-1), and
        ``hidden.rows[k]`` is packed token k (its seq_id, position and token id)."""
        for r in reqs:
            sid = r["seq_id"]
            for key, n in (("cache_before", r["C"]), ("cache_after", kept_len(r))):
                self.n_checks += 1
                if self._iv(s, sid, key, r.get(key)) != ([(0, n - 1)] if n else []):
                    self.fail(s, sid, "kv", "cache ranges", f"{key} is {_show(r.get(key))} but the request holds positions "
                              + (f"0..{n - 1}" if n else "none") + (" before" if key == "cache_before" else " after") + " the step")
        h = st.get("hidden")
        rows = h.get("rows") if isinstance(h, dict) else None
        if not isinstance(rows, list):
            return
        packed = [(r["seq_id"], p, t) for r in reqs for p, t in zip(r["positions"], r.get("token_ids") or [])]
        for k, x in enumerate(rows):
            self.n_checks += 1
            got = (x.get("seq_id"), x.get("pos"), x.get("token_id")) if isinstance(x, dict) else None
            if k >= len(packed) or got != packed[k]:
                self.fail(s, got[0] if got else None, "hidden", "rows are the packed tokens",
                          f"hidden row {k} is seq/pos/token {_show(got)}, the packed token {k} is "
                          + (f"{packed[k]}" if k < len(packed) else f"none (N = {len(packed)})"))

    def _pool(self, s: int, st: dict) -> None:
        """The KV pool in the step is the one the run configured: paged ``num_blocks`` /
        ``tokens_per_block`` = ``options.engine`` (``num_blocks`` unset: ctx_size / tokens_per_block
        rounded up; ``--engine vllm``: vLLM's own pool in ``options.vllm``), ``used_blocks + free_blocks
        = num_blocks``; cells ``size`` = ``ctx_size``, ``used`` = the cells listed."""
        kv = st.get("kv")
        ph = kv.get("physical") if isinstance(kv, dict) else None
        if not isinstance(ph, dict):
            return
        want = self.facts["pool"]
        if ph.get("kind") == "paged":
            checks = [("num_blocks", want.get("num_blocks")), ("tokens_per_block", want.get("tokens_per_block"))]
            if _int(ph.get("used_blocks")) and _int(ph.get("free_blocks")) and _int(ph.get("num_blocks")):
                self.n_checks += 1
                if ph["used_blocks"] + ph["free_blocks"] != ph["num_blocks"]:
                    self.fail(s, None, "kv", "pool as configured", f"used_blocks {ph['used_blocks']} + free_blocks "
                              f"{ph['free_blocks']} != num_blocks {ph['num_blocks']}")
        elif ph.get("kind") == "cells":
            checks = [("size", want.get("size"))]
            if isinstance(ph.get("cells"), list) and _int(ph.get("used")):
                self.n_checks += 1
                if ph["used"] != len(ph["cells"]):
                    self.fail(s, None, "kv", "pool as configured", f"used = {ph['used']} but {len(ph['cells'])} cells are listed")
        else:
            return
        for key, w in checks:
            self.n_checks += 1
            if w is not None and ph.get(key) != w:
                self.fail(s, None, "kv", "pool as configured", f"kv.physical.{key} is {_show(ph.get(key))} but the run's options "
                          f"give {w} ({self.facts['pool_src']})")

    def _hybrid(self, s: int, st: dict) -> None:
        """A hybrid step's layer map is the config's ``layer_types`` (GDN = linear_attention, attn =
        full_attention); a step of a hybrid model has one, a step of another model none."""
        h = st.get("hybrid")
        lt = self.facts["layer_types"]
        self.n_checks += 1
        if h is None:
            if lt and any(t == "linear_attention" for t in lt) and st.get("batch"):
                self.fail(s, None, "hybrid", "layer map", "config.layer_types lists linear_attention layers but the step has no hybrid section")
            return
        types = h.get("layer_map", {}).get("types") if isinstance(h, dict) and isinstance(h.get("layer_map"), dict) else None
        want = [{"linear_attention": "GDN", "full_attention": "attn"}.get(t, "?") for t in lt] if lt is not None else None
        if want is None or types != want:
            self.fail(s, None, "hybrid", "layer map", f"hybrid.layer_map.types {_show(types)} but config.layer_types "
                      f"{_show(lt)} gives {_show(want)}")

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


def _show(v: Any) -> str:
    """A value for a violation line, bounded (the trace is untrusted; the CLI escapes it)."""
    t = repr(v) if not isinstance(v, str) else repr(v)
    return t if len(t) <= 60 else t[:57] + "..."


def _layers(ls: list[int]) -> str:
    return ",".join(map(str, ls)) or "none"


def intervals(text: Any) -> list[tuple[int, int]]:
    """The integer set of a range text (``"0..3,7"``) as merged ascending intervals ``[(0, 3), (7, 7)]``,
    without expanding it (a hostile ``"0..99999999"`` costs nothing); ``"-"`` is ``[]``.

    Raises:
        ValueError: not a string, a malformed part, ``b < a``.
    """
    if not isinstance(text, str) or len(text) > 1 << 20:
        raise ValueError(f"expected range text, got {type(text).__name__}")
    if text == "-":
        return []
    parts = []
    for part in text.split(","):
        a, sep, b = part.strip().partition("..")
        if not (a.isdigit() and (not sep or b.isdigit())) or len(a) > 12 or len(b) > 12:
            raise ValueError(f"bad range {part[:40]!r}")
        lo, hi = int(a), int(b) if sep else int(a)
        if hi < lo:
            raise ValueError(f"bad range {part[:40]!r}")
        parts.append((lo, hi))
    parts.sort()
    out: list[tuple[int, int]] = []
    for lo, hi in parts:
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def intervals_of(values: list[int]) -> list[tuple[int, int]]:
    """:func:`intervals` of a list of ints."""
    return intervals(ranges_text(sorted(set(values))))


def run_facts(m: dict[str, Any]) -> dict[str, Any]:
    """What the run's header fixes for every step (the facts the recorder wrote the steps from):
    ``n_layer``; the window ``W`` (``config.sliding_window``, 0 when no layer is windowed) and the
    windowed layers (``config.swa_layers``: ModelConfig.windowed_layers); ``layer_types`` (hybrid
    models) and the KV pool the options configure (``pool``, ``pool_src``)."""
    cfg = m.get("config") if isinstance(m.get("config"), dict) else {}
    n_layer = cfg.get("n_layer") if _int(cfg.get("n_layer")) else 0
    sw = cfg.get("sliding_window")
    flags = cfg.get("swa_layers") if isinstance(cfg.get("swa_layers"), list) else []
    W = sw if _int(sw) and sw > 0 else 0
    win = [i for i in range(min(n_layer, len(flags))) if flags[i] is True] if W else []
    lt = cfg.get("layer_types") if isinstance(cfg.get("layer_types"), list) else None
    opts = m.get("options") if isinstance(m.get("options"), dict) else {}
    eng = opts.get("engine") if isinstance(opts.get("engine"), dict) else {}
    vl = opts.get("vllm") if isinstance(opts.get("vllm"), dict) else None
    pool: dict[str, Any] = {}
    B, nb, ctx = eng.get("tokens_per_block"), eng.get("num_blocks"), eng.get("ctx_size")
    if vl is not None:  # --engine vllm: vLLM's own pool (block 0 its null block)
        pool = {"num_blocks": vl.get("num_blocks") if _int(vl.get("num_blocks")) else None,
                "tokens_per_block": vl.get("block_size") if _int(vl.get("block_size")) else None}
        src = "options.vllm num_blocks / block_size"
    else:
        if _int(B) and B > 0:
            pool["tokens_per_block"] = B
            pool["num_blocks"] = nb if _int(nb) else (-(-ctx // B) if _int(ctx) else None)
        ns = eng.get("n_seq_max")
        if _int(ctx) and eng.get("kv_unified") is False and _int(ns) and ns > 0:
            # --kv-unified off: n_seq_max streams of llama.cpp's n_ctx_seq = pad256(pad256(ctx) / n_seq_max) cells
            pool["size"] = ns * (-(-((-(-ctx // 256) * 256) // ns) // 256) * 256)
        elif _int(ctx):
            pool["size"] = ctx
        src = ("options.engine num_blocks / tokens_per_block" if _int(nb)
               else "options.engine ctx_size / tokens_per_block, rounded up, or ctx_size (--kv-unified off: n_seq_max × "
               "pad256(pad256(ctx_size) / n_seq_max))")
    return {"n_layer": n_layer, "W": W if win else 0, "windowed": win, "layer_types": lt, "pool": pool, "pool_src": src}


def config_problem(m: dict[str, Any]) -> str | None:
    """What in the run's config cannot describe a model, else None: ``swa_layers`` not one flag per
    layer, ``layer_types`` not one of linear_attention / full_attention per layer, a window on no layer's
    flag list."""
    cfg = m.get("config") if isinstance(m.get("config"), dict) else {}
    n = cfg.get("n_layer")
    flags, lt, sw = cfg.get("swa_layers"), cfg.get("layer_types"), cfg.get("sliding_window")
    if sw is not None and not (_int(sw) and sw >= 0):
        return f"config.sliding_window {_show(sw)} is not a window size in tokens"
    if flags is not None and (not isinstance(flags, list) or any(not isinstance(x, bool) for x in flags)
                              or (flags and len(flags) != n)):
        return f"config.swa_layers must be one true/false flag per layer (n_layer = {_show(n)})"
    if lt is not None and (not isinstance(lt, list) or len(lt) != n
                           or any(t not in ("linear_attention", "full_attention") for t in lt)):
        return f"config.layer_types {_show(lt)} must be n_layer = {_show(n)} entries of linear_attention / full_attention"
    return None


def _ancestors(parents: list[int]) -> list[set[int]]:
    """Per node of a checked tree (``spec_positions`` passed): itself and its ancestors."""
    out: list[set[int]] = []
    for i, p in enumerate(parents):
        out.append({i} | (out[p] if p >= 0 else set()))
    return out


def _mtp_problem(mt: Any, C: int, toks: Any) -> str | None:
    """What in an MTP draft record (``spec.mtp``, engine/drafters.py ``MTPDrafter``) contradicts the
    verify row it drafted, else None: its first row is the pending token's (position C-1, the token
    verified first, the target's hidden state at C-1); a chained row reads the MTP's own hidden state
    from the position before its own; the catch-up ends at C-1."""
    if not isinstance(mt, dict):
        return None
    rows = mt.get("rows") or []
    if not rows:
        return "the MTP record has no rows"
    r0 = rows[0]
    if (r0.get("node"), r0.get("position"), r0.get("hidden_from"), r0.get("hidden_position")) != (-1, C - 1, "target", C - 1):
        return (f"the MTP's first row must pair the target's hidden at position {C - 1} with the pending token "
                f"(node -1 at {C - 1}); it is node {r0.get('node')!r} at {r0.get('position')!r} reading "
                f"{r0.get('hidden_from')!r} at {r0.get('hidden_position')!r}")
    if isinstance(toks, list) and toks and r0.get("token") != toks[0]:
        return f"the MTP's first row embeds token {r0.get('token')!r}, the verify row's pending token is {toks[0]}"
    for x in rows[1:]:
        if x.get("hidden_from") != "mtp" or x.get("hidden_position") != x.get("position", 0) - 1 or x.get("position", 0) < C:
            return f"a chained MTP row (node {x.get('node')!r}) must read the MTP's own hidden state at its position - 1"
    cu = mt.get("catch_up")
    if isinstance(cu, dict) and (cu.get("positions") or [None, None])[1] != C - 1:
        return f"the MTP catch-up ends at {(cu.get('positions') or [None, None])[1]!r}, not at the pending token's row {C - 1}"
    return None


def verify_row_problem(r: dict[str, Any]) -> str | None:
    """What in a speculative verify row (``r["spec"]``, its tree already checked by
    :func:`~infertrace.trace.schema.spec_positions`) contradicts its tree, else None: ``drafted`` =
    T - 1, ``accepted`` = accepted path - 1, ``rejected_nodes`` = the other nodes, ``emitted`` = the
    accepted drafts' tokens then one more (cut short only when the request finished), and every
    recorded verify-mask form (``verify_mask`` rows, llama.cpp ``kq_mask_block``, TensorRT-LLM
    ``position_offsets`` / ``packed_mask``) equal to the ancestor relation / depths; on a hybrid
    model the kept GDN state snapshot (``rewind.state``) is the accepted path's last node (indexed as
    the convention names it: llama.cpp ``rs_idx`` = tokens rolled back for a chain on cells) and
    every other snapshot is dropped."""
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
    rw = sp.get("rewind")
    gs = rw.get("state") if isinstance(rw, dict) else None
    if isinstance(gs, dict):  # a hybrid model: the kept GDN state snapshot is the last accepted candidate's
        chain = par == list(range(-1, T - 1))
        idx = T - len(acc) if chain and gs.get("convention") == "cells" else acc[-1]
        if gs.get("snapshots") != T or gs.get("kept_node") != acc[-1] or gs.get("kept_snapshot") != idx:
            return (f"the GDN state kept snapshot {gs.get('kept_snapshot')!r} (node {gs.get('kept_node')!r} of "
                    f"{gs.get('snapshots')!r}) but the accepted path ends at node {acc[-1]} of {T}")
        if sorted(gs.get("dropped_nodes") or []) != [i for i in range(T) if i != acc[-1]]:
            return "the GDN state's dropped_nodes are not every snapshot but the kept one"
    bad = _mtp_problem(sp.get("mtp"), r["C"], toks)
    if bad:
        return bad
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


def options_problem(m: dict[str, Any]) -> str | None:
    """What in the run's options contradicts its steps or config, else None: verify rows (a batch
    row's ``spec``) while ``options.engine.speculative`` says no speculation ran; ``draft_layers``
    not fewer than the model's ``n_layer`` (the draft is the target's first layers)."""
    opts = m.get("options") if isinstance(m.get("options"), dict) else {}
    eng = opts.get("engine") if isinstance(opts.get("engine"), dict) else {}
    n_layer = (m.get("config") or {}).get("n_layer") if isinstance(m.get("config"), dict) else None
    steps = m.get("steps") if isinstance(m.get("steps"), list) else []
    if "speculative" in eng and eng.get("speculative") in (None, False, "off", "none"):
        for st in steps:
            rows = st.get("batch") if isinstance(st, dict) and isinstance(st.get("batch"), list) else []
            if any(isinstance(r, dict) and r.get("spec") for r in rows):
                return (f"step {st.get('step')!r} verifies speculative drafts but options.engine.speculative is "
                        f"{_show(eng.get('speculative'))}")
    dl = eng.get("draft_layers")
    if dl is not None and (not _int(dl) or dl < 1 or (_int(n_layer) and dl >= n_layer)):
        return f"options.engine.draft_layers {_show(dl)} must be 1..n_layer - 1 (n_layer = {_show(n_layer)})"
    return None


def layers_problem(m: dict[str, Any]) -> str | None:
    """What names a layer the model does not have, else None: ``config.n_layer`` not a positive int;
    ``options.layer``, ``store.tensor_layers``, a step's ``kv.layer_view.layer`` outside 0..n_layer-1;
    a step's ``kv.layers`` (the layers the cache holds) other than n_layer (a model without linear layers)."""
    cfg = m.get("config") if isinstance(m.get("config"), dict) else {}
    n = cfg.get("n_layer")
    if not (_int(n) and n > 0):
        return f"config.n_layer {_show(n)} is not a positive layer count"
    opts = m.get("options") if isinstance(m.get("options"), dict) else {}
    named = [("options.layer", opts.get("layer"))]
    store = m.get("store") if isinstance(m.get("store"), dict) else {}
    named += [("store.tensor_layers", x) for x in (store.get("tensor_layers") or [])]
    for st in m.get("steps") if isinstance(m.get("steps"), list) else []:
        kv = st.get("kv") if isinstance(st, dict) and isinstance(st.get("kv"), dict) else {}
        lv = kv.get("layer_view")
        if isinstance(lv, dict):
            named.append((f"step {st.get('step')!r} kv.layer_view.layer", lv.get("layer")))
        if _int(kv.get("layers")) and not cfg.get("layer_types") and kv["layers"] != n:
            return f"step {st.get('step')!r} kv.layers {kv['layers']} but config.n_layer {n}"
    for what, x in named:
        if x is not None and not (_int(x) and 0 <= x < n):
            return f"{what} {_show(x)} is not a layer 0..{n - 1} of config.n_layer {n}"
    return None


def decode_loop_problem(m: dict[str, Any]) -> tuple[Any, Any, str, str] | None:
    """What in the decode loop contradicts itself, else None (as ``(step, seq_id, rule, detail)``):
    every id of ``prompt_ids`` / ``output_ids`` / a chosen token below ``config.vocab_size``; a
    greedy request's (temperature 0, no repetition penalty, not teacher-forced: llama.cpp keeps its
    own choice in ``top``) chosen token the top logit; ``next_input`` the chosen token and
    ``next_pos`` the positions the sequence holds after the step (``kept_len``); the next step of the
    sequence feeding ``next_input`` first (unless it was preempted: recompute re-prefills); each
    row's tokens the sequence's tokens ``prompt_ids + output_ids`` at its positions (until a context
    shift renumbers them; a verify row only its first, pending token); ``output_ids`` the emitted
    tokens (a verify row's ``spec.emitted``, else ``chosen``) in order."""
    cfg = m.get("config") if isinstance(m.get("config"), dict) else {}
    V = cfg.get("vocab_size") if _int(cfg.get("vocab_size")) and cfg.get("vocab_size") > 0 else None
    opts = m.get("options") if isinstance(m.get("options"), dict) else {}
    lc = opts.get("llama_cpp") if isinstance(opts.get("llama_cpp"), dict) else {}
    forced = bool(lc.get("teacher_forced"))
    reqs = {r.get("seq_id"): r for r in (m.get("requests") or []) if isinstance(r, dict) and _int(r.get("seq_id"))}
    full: dict[int, list[int] | None] = {}
    for sid, r in reqs.items():
        ids = [x for k in ("prompt_ids", "output_ids") for x in (r.get(k) if isinstance(r.get(k), list) else [])]
        for k in ("prompt_ids", "output_ids"):
            bad = [x for x in (r.get(k) if isinstance(r.get(k), list) else []) if not _int(x) or x < 0 or (V and x >= V)]
            if bad:
                return None, sid, "token ids in the vocabulary", f"requests[seq {sid}].{k} holds {_show(bad[0])}, not an id 0..{(V or 0) - 1} (config.vocab_size {V})"
        full[sid] = ids if isinstance(r.get("prompt_ids"), list) and isinstance(r.get("output_ids"), list) else None
    pending: dict[int, Any] = {}
    emitted: dict[int, list[int]] = {}
    decoded: set[int] = set()
    shifted: set[int] = set()
    steps = m.get("steps") if isinstance(m.get("steps"), list) else []
    for st in steps:
        s = st.get("step")
        rows = {r["seq_id"]: r for r in st.get("batch") or [] if isinstance(r, dict) and _int(r.get("seq_id"))}
        sv = st.get("serving") if isinstance(st.get("serving"), dict) else {}
        for op in sv.get("ops_before_step") or []:
            if isinstance(op, dict) and op.get("op") == "context_shift":
                shifted.add(op.get("seq_id"))
        for sid in st.get("preempted") or []:
            pending.pop(sid, None)
        for sid, r in rows.items():
            if isinstance(r.get("shift"), dict):
                shifted.add(sid)
            toks, C = r.get("token_ids"), r.get("C")
            if not isinstance(toks, list) or not toks:
                continue
            if sid in pending:
                want = pending.pop(sid)
                if toks[0] != want:
                    return s, sid, "the chosen token is fed next", f"the step's first token is {_show(toks[0])} but the previous step chose {_show(want)} as next_input"
            f = full.get(sid)
            if f is not None and sid not in shifted and _int(C):
                want_t = f[C:C + (1 if r.get("spec") else len(toks))]
                if (toks[:1] if r.get("spec") else toks) != want_t:
                    return s, sid, "row tokens are the sequence's tokens", (
                        f"token_ids {str(toks[:8])} at positions {C}.. are not prompt_ids + output_ids there {str(want_t[:8])}")
        dec = st.get("decode") if isinstance(st.get("decode"), dict) else {}
        for pr in dec.get("per_request") or []:
            if not isinstance(pr, dict) or not _int(pr.get("seq_id")):
                continue
            sid, ch = pr["seq_id"], pr.get("chosen")
            if pr.get("row") is None and "chosen" not in pr:  # a prefill chunk that needs no logits
                continue
            r = rows.get(sid)
            if r is None:
                return s, sid, "decode of a computed row", "a decode record for a sequence that is not in the step's batch"
            decoded.add(sid)
            if not _int(ch) or ch < 0 or (V and ch >= V):
                return s, sid, "token ids in the vocabulary", f"chosen {_show(ch)} is not an id 0..{(V or 0) - 1}"
            sp = pr.get("sampler") if isinstance(pr.get("sampler"), dict) else (reqs.get(sid) or {}).get("params") or {}
            top = pr.get("top") if isinstance(pr.get("top"), list) else []
            if (not forced and sp.get("temperature") == 0 and sp.get("repetition_penalty") in (None, 1, 1.0) and top
                    and all(isinstance(t, dict) for t in top)):
                best = max((t.get("logit") for t in top if isinstance(t.get("logit"), (int, float))), default=None)
                mine = [t.get("logit") for t in top if t.get("id") == ch]
                if best is not None and not (mine and mine[0] == best):
                    return s, sid, "greedy chooses the top logit", (
                        f"chosen {ch} but the step's top logit is id {_show(top[0].get('id'))} ({best}) and the request samples greedily (temperature 0)")
            sp_row = r.get("spec") if isinstance(r.get("spec"), dict) else None
            em = sp_row.get("emitted") if sp_row and isinstance(sp_row.get("emitted"), list) else [ch]
            if em and em[-1] != ch:
                return s, sid, "chosen is the last emitted token", f"chosen {ch} but the verify row emits {str(em)[:60]}"
            emitted.setdefault(sid, []).extend(em)
            if pr.get("stop") is None:
                if pr.get("next_input") != ch:
                    return s, sid, "next_input is the chosen token", f"next_input {_show(pr.get('next_input'))} but chosen {ch}"
                if _int(r.get("C")) and _int(r.get("T")) and pr.get("next_pos") != kept_len(r):
                    return s, sid, "next_pos is the next position", (
                        f"next_pos {_show(pr.get('next_pos'))} but the sequence holds positions 0..{kept_len(r) - 1} after the step")
                pending[sid] = ch
    for sid in sorted(decoded):
        r = reqs.get(sid)
        if r is not None and isinstance(r.get("output_ids"), list) and r["output_ids"] != emitted.get(sid, []):
            return None, sid, "output_ids are the chosen tokens", (
                f"requests[seq {sid}].output_ids {str(r['output_ids'][:12])} but the steps chose {str(emitted.get(sid, [])[:12])}")
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
        c.n_checks += 1
        bad = config_problem(manifest)
        if bad:
            c.fail(None, None, "config", "model config", bad)
        c.n_checks += 1
        bad = layers_problem(manifest)
        if bad:
            c.fail(None, None, "config", "layers of the model", bad)
        c.n_checks += 1
        bad = options_problem(manifest)
        if bad:
            c.fail(None, None, "options", "options agree with the steps", bad)
        c.n_checks += 1
        bad = sec.kernels_problem(manifest)
        if bad:
            c.fail(None, None, "options", "quant kernels the chooser returns", bad)
        for st in steps:
            c.step(st)
        c.n_checks += 1
        where = decode_loop_problem(manifest)
        if where:
            c.fail(where[0], where[1], "decode", where[2], where[3])
        c.n_checks += 1
        bad = run_spec_problem(manifest.get("spec"))
        if bad:
            c.fail(None, None, "spec", "run summary consistent", bad)
    except _Bad as b:
        return b.v, c.n_checks
    return None, c.n_checks


_TENSOR = re.compile(r"step([0-9]+)/(?:layer([0-9]+)/(?:seq([0-9]+)/)?)?([a-z0-9_]+)")
#: per-token tensors of a layer: [N, n_head, head_dim] (q), [N, n_head_kv, head_dim] (k, v), else [N, n_embd]
_HEADS = {"q_pre_rope": "n_head", "q_post_rope": "n_head", "k_pre_rope": "n_head_kv", "k_post_rope": "n_head_kv", "v": "n_head_kv"}


def check_tensors(manifest: dict[str, Any], tensors: Any) -> tuple[Violation | None, int]:
    """The saved tensors agree with the records of ``trace.json`` (``tensors``: a
    :class:`~infertrace.trace.store.TraceTensors` whose header :func:`~infertrace.trace.store.load_tensors`
    already checked against the manifest's index). Each name's step is a step of the trace and its layer
    one of ``store.tensor_layers``; per-token tensors have the step's N rows (``hidden`` / ``hidden_in`` /
    ``attn_out`` / ``mlp_out`` / ``resid_post`` ``[N, n_embd]``, ``q_*`` ``[N, n_head, head_dim]``, ``k_*`` / ``v``
    ``[N, n_head_kv, head_dim]``), ``seq{id}/k_cache`` / ``v_cache`` hold the positions the request holds
    after the step ``[C + kept, n_head_kv, head_dim]``, ``logits_topk_*`` one row per logits row; and the
    values the records quote are the tensors' values (``hidden.rows[k].first`` = ``step{s}/hidden[k, :n]``,
    ``kv.layer_view`` K/V rows = ``seq{id}/k_cache[pos, 0, :n]`` / ``v_cache``; stored rounded to 6 digits: 1e-5).

    Returns:
        ``(first violation or None, number of checks made)``.
    """
    n = 0
    cfg = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    steps = {st["step"]: st for st in manifest.get("steps", []) if isinstance(st, dict) and _int(st.get("step"))}
    layers = set((manifest.get("store") or {}).get("tensor_layers") or [])

    def bad(step: Any, sid: Any, rule: str, detail: str) -> tuple[Violation, int]:
        return Violation(step if _int(step) else None, sid if _int(sid) else None, "tensors", rule, detail), n

    def close(a: Any, b: Any) -> bool:
        return isinstance(b, (int, float)) and abs(float(a) - b) <= 1e-5 * max(1.0, abs(b))

    for name in sorted(tensors.index):
        m = _TENSOR.fullmatch(name)
        shape = list(tensors.index[name].get("shape") or [])
        n += 1
        if m is None:
            return bad(None, None, "tensor names", f"{name[:60]!r} is not stepN/[layerL/[seqS/]]name")
        s, il, sid, leaf = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        st = steps.get(s)
        if st is None:
            return bad(s, None, "tensors of the trace's steps", f"{name} names step {s}, which the trace does not have")
        if il is not None and int(il) not in layers:
            return bad(s, None, "tensors of the trace's steps", f"{name} names layer {il}, not one of store.tensor_layers")
        N = st.get("N")
        if sid is not None:
            r = next((r for r in st.get("batch", []) if r.get("seq_id") == int(sid)), None)
            want = [kept_len(r) if r is not None else None, cfg.get("n_head_kv"), cfg.get("head_dim")]
        elif leaf.startswith("logits_topk"):
            rows = (st.get("decode") or {}).get("logits_rows")
            want = [len(rows) if isinstance(rows, list) else None, None]
        elif leaf in _HEADS:
            want = [N, cfg.get(_HEADS[leaf]), cfg.get("head_dim")]
        else:
            want = [N, cfg.get("n_embd")]
        if len(shape) != len(want) or any(w is not None and x != w for x, w in zip(shape, want)):
            return bad(s, int(sid) if sid else None, "tensor shapes agree with the records",
                       f"{name} is {shape}, the step's records give {[w if w is not None else '*' for w in want]}")
    for s, st in steps.items():
        h = st.get("hidden")
        if isinstance(h, dict) and f"step{s}/hidden" in tensors.index:
            x = tensors.array(f"step{s}/hidden")  # [N, n_embd]
            for k, row in enumerate(h.get("rows") or []):
                for j, v in enumerate((row.get("first") or [])[: x.shape[1]] if k < x.shape[0] else []):
                    n += 1
                    if not close(x[k, j], v):
                        return bad(s, row.get("seq_id"), "recorded values are the tensors'",
                                   f"hidden.rows[{k}].first[{j}] = {v!r} but step{s}/hidden[{k}, {j}] = {float(x[k, j]):.6g}")
        lv = (st.get("kv") or {}).get("layer_view") if isinstance(st.get("kv"), dict) else None
        if not isinstance(lv, dict):
            continue
        for req in lv.get("requests") or []:
            for kind in ("k", "v"):
                name = f"step{s}/layer{lv.get('layer')}/seq{req.get('seq_id')}/{kind}_cache"
                if name not in tensors.index:
                    continue
                x = tensors.array(name)  # [len, n_head_kv, head_dim]
                for row in req.get("rows") or []:
                    p = row.get("pos")
                    for j, v in enumerate(row.get(kind) or []):
                        if not (_int(p) and p < x.shape[0] and j < x.shape[2]):
                            continue
                        n += 1
                        if not close(x[p, 0, j], v):
                            return bad(s, req.get("seq_id"), "recorded values are the tensors'",
                                       f"kv.layer_view {kind} of pos {p}[{j}] = {v!r} but {name}[{p}, 0, {j}] = {float(x[p, 0, j]):.6g}")
    return None, n

def iter_rules() -> Iterator[str]:
    """Names of the rules, for help texts."""
    yield from ("contiguous", "contiguous across chunks", "inp_pos = packed positions", "RoPE angle consistent with position",
                "causality", "no cross-sequence visibility", "one cell per (seq, pos)", "written cells were free",
                "cache holds 0..C+T-1", "freed when finished", "chunk starts where the prefix hit ends", "prefix hit inside the prompt",
                "prefix hit at admission", "context shift of the cached positions", "cells joined by a write or a prefix hit", "memory API agrees with the cells", "one owner per block", "slot = table[p // B] * B + p % B",
                "verify row consistent with its tree", "run summary consistent", "window", "verify cells", "cache ranges",
                "rows are the packed tokens", "pool as configured", "layer map", "model config",
                "tensor shapes agree with the records", "recorded values are the tensors'",
                "position_ids = packed positions", "hybrid inp_pos = packed positions", "layers of the model",
                "options agree with the steps", "token ids in the vocabulary", "greedy chooses the top logit",
                "next_input is the chosen token", "next_pos is the next position", "the chosen token is fed next",
                "row tokens are the sequence's tokens", "chosen is the last emitted token", "output_ids are the chosen tokens",
                # the newer sections (check_sections.py)
                "streams as configured", "cells inside the sequence's stream", "kq_mask streams", "SWA pool cells",
                "MTP rows agree with the drafts", "kv dtype as configured", "quant kernels the chooser returns",
                "block table recorded once", "prefix hit recorded once", "shared blocks are the hit's full blocks",
                "the engine named in the header", "scheduler counts", "free blocks of the pool",
                "new blocks owned by their sequence", "query_start_loc from the batch", "seq_lens from the batch",
                "num_actual_tokens from the batch", "max_query_len from the batch", "max_seq_len from the batch",
                "logits_indices", "sampled tokens are the chosen ones", "ranks = tensor_parallel_size")
