"""Text of ``diff-runtimes vllm`` (:func:`infertrace.runtimes.vllm.compare.compare_with_vllm`):
the exact structural comparison, then the float agreement against the measured noise floor."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from infertrace.present.render_llamacpp import _t, agreement_table
from infertrace.safe_text import visible


def vllm_diff_lines(rep: dict[str, Any]) -> tuple[list[Text], Table, list[Text]]:
    """The report as styled lines before and after the float table (values made terminal-safe)."""
    st = rep["structural"]
    vl = rep.get("vllm") or {}
    head = [_t(("paged backend vs vLLM", "bold"), f" (vLLM's schedule and block ids replayed, teacher-forced, layer {visible(rep['layer'])})"),
            _t(f"vLLM: {visible(vl.get('version', '?'))}, {visible(str(vl.get('backend', '?')).rsplit('.', 1)[-1])} ISA "
               f"{visible(vl.get('isa', '?'))}, block {visible(vl.get('block_size', '?'))}, {visible(vl.get('num_blocks', '?'))} blocks "
               "(block 0 = null block)"),
            _t(f"structure ({visible(st['compared'])}): ",
               ("identical", "green") if st["identical"] else (f"{st['differences']} differing field(s)", "red"))]
    for m in st["mismatches"][:10]:
        head.append(_t("  ", (f"step {visible(m['step'])} {visible(m['variable'])}", "red"), f": {visible(m['detail'])}"))
    nt, fl = rep["next_token"], rep["floor"]
    t = agreement_table(rep, "vLLM")
    tail = [_t(f"noise floor: {visible(fl['how'])}")]
    fe = rep["first_exceeding"]
    tail.append(_t("first step over the floor: ", ("none", "green") if fe is None else
                   (f"step {fe['step']} {visible(fe['variable'])}: {fe['value']:.4g} > tolerance {fe['tolerance']:.4g}", "red")))
    tail.append(_t(f"near tie: {visible(rep['near_tie_rule'])}"))
    for d in nt["disagreements"]:
        tail.append(_t(f"  step {d['step']} seq {d['seq_id']} pos {d['pos']}: ours {d['base_top']}, vLLM {d['new_top']}: ",
                       "near tie" if d["near_tie"] else ("not a near tie", "red")))
    tail.append(_t(("identical in structure, within the noise floor", "green") if rep["identical"] else
                   (f"{len(rep['mismatches'])} mismatch(es)", "red")))
    return head, t, tail


def render_vllm_diff(con: Console, rep: dict[str, Any]) -> None:
    """Print the report built by :func:`vllm_diff_lines` (styled Text, never markup)."""
    head, table, tail = vllm_diff_lines(rep)
    for line in head:
        con.print(line)
    con.print(table)
    for line in tail:
        con.print(line)


def vllm_dropped_samples(st: Any) -> dict[int, tuple[int, int | None]]:
    """``run --runtime vllm``: the rows vLLM computed and whose sample it dropped, by seq_id:
    ``{seq_id: (packed row, token vLLM sampled there)}``. vLLM computes one logits row per scheduled request
    (plus one per draft: ``step.vllm.logits_indices``, in packed order) and discards the sample of a partial
    prefill (vllm/v1/core/sched/scheduler.py ``update_from_output``: a request still prefilling gets no token).
    Empty for a step without a ``vllm`` section."""
    vl = getattr(st, "vllm", None)
    if not isinstance(vl, dict) or not isinstance(vl.get("logits_indices"), list):
        return {}
    idx, sampled = vl["logits_indices"], vl.get("sampled_token_ids") or []
    out: dict[int, tuple[int, int | None]] = {}
    k = 0
    for i, r in enumerate(st.batch):  # st.batch is in packed order, as logits_indices
        n = 1 + (r.spec.get("drafted", 0) if isinstance(r.spec, dict) else 0)
        if r.logits_row is None and not r.spec and k < len(idx):
            tok = sampled[i][0] if i < len(sampled) and sampled[i] else None
            out[r.seq_id] = (int(idx[k]), tok if isinstance(tok, int) and tok >= 0 else None)
        k += n
    return out
