"""The mask rules: causality (rule 3), isolation in the kq_mask slice (rule 4, per stream when non-unified)
and the window recomputed from positions, seq ids and the config (rule 7).
"""

from __future__ import annotations

from typing import Any

from infertrace.ranges import parse_ranges
from infertrace.trace.check.base import _int, intervals, _layers, _show


class MaskRules:
    """Causality, the window and isolation in the recorded masks (rules 3, 4 and 7)."""

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
            if got != (W, win):  # (--runtime llama.cpp refuses windowed models: its iSWA cache is two caches)
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
