"""The cells convention (llama.cpp): ownership of cells across steps (rule 5), display fields, the pool
as configured and the hybrid layer map (rule 8).
"""

from __future__ import annotations

from typing import Any

from infertrace.ranges import parse_ranges
from infertrace.trace.check.base import _int, kept_len, _show


class CellRules:
    """Cells ownership (rule 5, cells), display fields, the pool and the hybrid layer map (rule 8)."""

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
        """Rule 5 on a cells step: one cell per (seq, pos), nothing of a finished sequence unless retained,
        written cells free before, cells joined by a write or a prefix hit, each request holding 0..kept-1."""
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
        self._cells_retained(s, phys, reqs, held, retained)
        wrote = self._cells_written(s, kv, reqs)
        if len(wrote) == len(reqs) and self.prev_kv_step == s - 1:
            self._cells_joined(s, now, wrote)
        for r in reqs:
            sid = r["seq_id"]
            own = sorted(p for (q, p) in held if q == sid)
            self.n_checks += 1
            if own != list(range(kept_len(r))):  # a verify step: the rejected candidates were rewound
                self.fail(s, sid, "kv", "cache holds 0..C+T-1" if not r.get("spec") else "cache holds the accepted positions",
                          f"after the step the cells of seq {sid} hold pos {own[:8]}{'...' if len(own) > 8 else ''}, expected 0..{kept_len(r) - 1}")
        self.prev_cells, self.prev_kv_step = now, s

    def _cells_retained(self, s: int, phys: dict, reqs: list[dict], held: dict, retained: list) -> None:
        """Sequences the prefix cache retains are finished ones; llama.cpp's ``llama_memory_seq_pos_min/max``
        agree with the cells (the SWA pool's under iSWA; the recurrent state's last position when hybrid)."""
        running = {r["seq_id"] for r in reqs if not r.get("finished")}
        for sid in retained:  # kept for reuse: a finished (or preempted) sequence the trace has computed
            self.n_checks += 1
            if not _int(sid) or sid not in self.next_pos or sid in running:
                self.fail(s, sid if _int(sid) else None, "kv", "retained sequences are finished ones",
                          f"the prefix cache lists seq {sid!r} as retained, but it "
                          + ("is running in this step" if sid in running else "was never computed"))
        mem = phys.get("llama_memory_seq_pos")  # --runtime llama.cpp: llama_memory_seq_pos_min/max per seq
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

    def _cells_written(self, s: int, kv: dict, reqs: list[dict]) -> dict[int, set[int]]:
        """The cells each request wrote this step (``kv.per_request`` cells), each free or released before."""
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
        return wrote

    def _cells_joined(self, s: int, now: dict, wrote: dict[int, set[int]]) -> None:
        """Every request's written cells and the previous step's cells known: a sequence joins a cell only by
        writing it or through its prefix hit; a kept cell keeps its position (or moves by the shift)."""
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
        ``tokens_per_block`` = ``options.settings`` (``num_blocks`` unset: ctx_size / tokens_per_block
        rounded up; ``--runtime vllm``: vLLM's own pool in ``options.vllm``), ``used_blocks + free_blocks
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
