"""Speculative decoding: verify rows against their tree (rule 6), a cells verify row's cells (rule 8),
the run's summary, and MTP rows against the drafts.
"""

from __future__ import annotations

from typing import Any

from infertrace.ranges import ranges_text
from infertrace.trace.check.base import _d, _int, intervals_of, _l, _show
from infertrace.trace.schema import spec_positions


class SpecRules:
    """A cells verify row's ``spec.cells`` (rule 8)."""

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


# ----------------------------------------------------------------------------- MTP rows
def mtp_rules(c: Any, s: int, st: dict, reqs: list[dict]) -> None:
    """MTP rows against the verify row they drafted (module docstring)."""
    eng = _d(_d(c.m.get("options")).get("settings"))
    for r in reqs:
        sp = r.get("spec")
        mt = sp.get("mtp") if isinstance(sp, dict) else None
        if not isinstance(mt, dict):
            continue
        sid, C, toks = r["seq_id"], r["C"], _l(r.get("token_ids"))
        c.n_checks += 1
        if eng.get("speculative") != "mtp" or not (_int(_d(c.m.get("config")).get("mtp_layers")) and c.m["config"]["mtp_layers"] >= 1):
            c.fail(s, sid, "spec", "MTP rows agree with the drafts",
                   f"the verify row has MTP rows but options.settings.speculative is {eng.get('speculative')!r} and config.mtp_layers "
                   f"{_d(c.m.get('config')).get('mtp_layers')!r} (an MTP draft needs speculative mtp and a model with an MTP layer)")
        rows = [x for x in _l(mt.get("rows")) if isinstance(x, dict)]
        argmax = [x.get("argmax") for x in rows]
        drafts = mt.get("drafts")
        if isinstance(drafts, list) and drafts != argmax:
            c.fail(s, sid, "spec", "MTP rows agree with the drafts", f"spec.mtp.drafts {str(drafts)[:40]} are not the MTP rows' "
                   f"argmax {str(argmax)[:40]} (the drafter is greedy)")
        if sp.get("parents") != list(range(-1, r["T"] - 1)):
            continue  # a tree: its rows draft several children; the chain rules below do not apply
        if argmax[:r["T"] - 1] != toks[1:]:  # the drafter drafts K; a request near its limit verifies the first T - 1
            c.fail(s, sid, "spec", "MTP rows agree with the drafts", f"the MTP rows' argmax {str(argmax)[:40]} do not begin with "
                   f"the {r['T'] - 1} drafted tokens the row verifies {str(toks[1:])[:40]}")
        for k, x in enumerate(rows):
            c.n_checks += 1
            want = (k - 1, C - 1 + k, toks[k] if k < len(toks) else argmax[k - 1])
            if (x.get("node"), x.get("position"), x.get("token")) != want:
                c.fail(s, sid, "spec", "MTP rows agree with the drafts", f"MTP row {k} is node {x.get('node')!r} at "
                       f"{x.get('position')!r} embedding {x.get('token')!r}, expected node {want[0]} at {want[1]} embedding "
                       f"the row's token {want[2]!r}")
