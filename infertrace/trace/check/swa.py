"""Sliding window: llama.cpp's ``kq_mask_swa`` (one pool, or the iSWA SWA pool ``llama_kv_cache_iswa``)
and the SWA pool's own cells.
"""

from __future__ import annotations

from typing import Any

from infertrace.trace.check.base import _d, _int, kept_len, _l, _show


class SwaRules:
    """llama.cpp's ``kq_mask_swa`` slice, over one cell pool or the iSWA SWA pool (rule 7)."""

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


# ----------------------------------------------------------------------------- iSWA SWA pool
def swa_pool_rules(c: Any, s: int, st: dict, reqs: list[dict]) -> None:
    """The iSWA SWA pool's cells (module docstring)."""
    ph = _d(_d(st.get("kv")).get("physical"))
    sp = ph.get("swa_pool")
    if not isinstance(sp, dict) or not isinstance(sp.get("cells"), list):
        return
    seen: set[int] = set()
    held: dict[tuple[int, int], int] = {}
    for cell in sp["cells"]:
        if not (isinstance(cell, dict) and _int(cell.get("cell")) and _int(cell.get("pos"))):
            continue
        c.n_checks += 1
        if cell["cell"] in seen:
            c.fail(s, None, "kv", "SWA pool cells", f"kv.physical.swa_pool lists cell {cell['cell']} twice")
        seen.add(cell["cell"])
        for q in _l(cell.get("seq_ids")):
            if (q, cell["pos"]) in held:
                c.fail(s, q, "kv", "SWA pool cells", f"SWA pool cells {held[(q, cell['pos'])]} and {cell['cell']} both hold "
                       f"pos {cell['pos']} of seq {q}")
            held[(q, cell["pos"])] = cell["cell"]
    c.n_checks += 1
    if _int(sp.get("used")) and sp["used"] != len(sp["cells"]):
        c.fail(s, None, "kv", "SWA pool cells", f"kv.physical.swa_pool.used = {sp['used']} but {len(sp['cells'])} cells are listed")
    base = {(q, x.get("pos")) for x in _l(ph.get("cells")) if isinstance(x, dict) for q in _l(x.get("seq_ids"))}
    for (q, p), cell in held.items():
        c.n_checks += 1
        if (q, p) not in base:
            c.fail(s, q, "kv", "SWA pool cells", f"SWA pool cell {cell} holds pos {p} of seq {q}, which the base pool does not hold")
    W = c.facts["W"]
    for r in reqs:
        if r.get("finished") or not W:
            continue
        k = kept_len(r)
        need = [p for p in range(max(0, k - W + 1), k) if (r["seq_id"], p) not in held]
        c.n_checks += 1
        if need:
            c.fail(s, r["seq_id"], "kv", "SWA pool cells", f"the SWA pool lacks pos {need[0]} of seq {r['seq_id']}, inside the window "
                   f"{max(0, k - W + 1)}..{k - 1} its next query reads (W = {W})")
