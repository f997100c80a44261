"""The checker: one pass over the steps applying every convention's rules in order, then the decode loop and
the run summary; :func:`check_trace` is the entry point.
"""

from __future__ import annotations

from typing import Any, Iterator

from infertrace.trace.check.base import _Bad, config_problem, _int, run_facts, Violation
from infertrace.trace.check.cells import CellRules
from infertrace.trace.check.decode import decode_loop_problem
from infertrace.trace.check.dense import dense_rules
from infertrace.trace.check.mask import MaskRules
from infertrace.trace.check.options import kernels_problem, kv_dtype_rules, layers_problem, options_problem
from infertrace.trace.check.paged import paged_table_rules, PagedRules
from infertrace.trace.check.positions import PositionRules, prefix_rules
from infertrace.trace.check.speculative import mtp_rules, run_spec_problem, SpecRules
from infertrace.trace.check.streams import streams_rules
from infertrace.trace.check.swa import swa_pool_rules, SwaRules
from infertrace.trace.check.vllm import vllm_rules


class _Checker(PositionRules, MaskRules, SwaRules, CellRules, PagedRules, SpecRules):
    """The running check of one trace: the sequences followed so far, composed of one rule mixin per convention."""

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
        for sid in preempted:  # only a sequence that has run and not finished can be preempted
            self.n_checks += 1
            if _int(sid) and (sid not in self.next_pos or sid in self.finished):
                self.fail(s, sid, "serving", "a preempted sequence was running",
                          f"seq {sid} is preempted but " + ("finished earlier" if sid in self.finished
                                                           else "no earlier step computed it"))
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
        for rules in (streams_rules, swa_pool_rules, mtp_rules, paged_table_rules, prefix_rules,
                      vllm_rules, dense_rules):
            rules(self, s, st, reqs)
        kv_dtype_rules(self, s, st)
        for r in reqs:
            if r.get("finished"):
                self.finished.add(r["seq_id"])


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
        for problem, variable, rule in ((config_problem, "config", "model config"),
                                        (layers_problem, "config", "layers of the model"),
                                        (options_problem, "options", "options agree with the steps"),
                                        (kernels_problem, "options", "quant kernels the chooser returns")):
            c.n_checks += 1
            bad = problem(manifest)
            if bad:
                c.fail(None, None, variable, rule, bad)
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
                # the newer sections (streams, swa, speculative, options, paged, positions, vllm)
                "streams as configured", "cells inside the sequence's stream", "kq_mask streams", "SWA pool cells",
                "MTP rows agree with the drafts", "kv dtype as configured", "quant kernels the chooser returns",
                "block table recorded once", "prefix hit recorded once", "shared blocks are the hit's full blocks",
                "the runtime named in the header", "scheduler counts", "free blocks of the pool",
                "new blocks owned by their sequence", "query_start_loc from the batch", "seq_lens from the batch",
                "num_actual_tokens from the batch", "max_query_len from the batch", "max_seq_len from the batch",
                "logits_indices", "sampled tokens are the chosen ones", "ranks = tensor_parallel_size",
                # the dense convention (--runtime hf, trace/check/dense.py)
                "dense layout [B, T]", "position_ids from the mask", "pad columns masked", "cache lengths",
                "K/V at the row's columns", "logits at the last real column")
