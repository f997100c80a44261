"""Positions (rule 1), RoPE (rule 2) and the serving events that move a sequence's next position: context
shifts and prefix hits (a hit's copies and ranges agree; the first chunk starts where it ends).
"""

from __future__ import annotations

import math
from typing import Any

from infertrace.ranges import parse_ranges
from infertrace.trace.check.base import _d, HYBRID_LISTED, _int, kept_len, _l, _show
from infertrace.trace.check.speculative import verify_row_problem
from infertrace.trace.schema import Bad, spec_positions


class PositionRules:
    """Positions and RoPE of each step (rules 1-2 of :mod:`infertrace.trace.check`), and the serving events that move them."""

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


def prefix_rules(c: Any, s: int, st: dict, reqs: list[dict]) -> None:
    """A prefix hit's copies and ranges (module docstring)."""
    sv = _d(_d(st.get("serving")).get("prefix"))
    ph = _d(_d(st.get("kv")).get("physical"))
    for r in reqs:
        sid = r["seq_id"]
        h, h2 = r.get("prefix"), sv.get(str(sid))
        c.n_checks += 1
        if isinstance(h, dict) and isinstance(h2, dict) and h != h2:
            c.fail(s, sid, "positions", "prefix hit recorded once", "the row's prefix record differs from serving.prefix's "
                   f"(hit {h.get('hit')!r} vs {h2.get('hit')!r})")
        h = h if isinstance(h, dict) else h2
        if not isinstance(h, dict) or not _int(h.get("hit")):
            continue
        hit = h["hit"]
        if isinstance(h.get("computed"), str):
            try:
                comp = parse_ranges(h["computed"])
            except ValueError:
                comp = []
            c.n_checks += 1
            if comp and comp[0] != hit:
                c.fail(s, sid, "positions", "chunk starts where the prefix hit ends",
                       f"the prefix record's computed range {h['computed'][:30]!r} starts at {comp[0]}, the hit covers 0..{hit - 1}")
        sb = h.get("shared_blocks")
        B = ph.get("tokens_per_block")
        tab = _l(_d(_d(ph.get("requests")).get(str(sid))).get("block_table"))
        if ph.get("kind") == "paged" and isinstance(sb, list) and _int(B) and B > 0 and (sb or hit >= B):
            c.n_checks += 1
            if sb != tab[:hit // B]:
                c.fail(s, sid, "kv", "shared blocks are the hit's full blocks", f"shared_blocks {str(sb)[:40]} but a hit of {hit} "
                       f"tokens covers the first {hit // B} blocks of the table {str(tab[:hit // B])[:40]} (B = {B})")
