"""Text of ``diff-runtimes llama.cpp`` (:func:`infertrace.compare.llamacpp.compare_with_llamacpp`):
the exact structural checks, then the float agreement against the measured noise floor."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from infertrace.safe_text import visible


def _t(*parts: Any) -> Text:
    """A line from plain strings and ``(text, style)`` pairs: styles are Rich styles, never markup
    (the console does not interpret markup, see :class:`infertrace.safe_text.SafeConsole`)."""
    t = Text()
    for p in parts:
        if isinstance(p, tuple):
            t.append(p[0], style=p[1])
        else:
            t.append(p)
    return t


def agreement_table(rep: dict[str, Any], runtime: str) -> Table:
    """The float agreement of a runtime comparison (``diff-runtimes llama.cpp`` / ``vllm``): max |Δ| of hidden,
    K, V and logits, KL and the same-top rate, each beside the measured noise floor and the tolerance."""
    nt, fl = rep["next_token"], rep["floor"]
    t = Table(title="float agreement (ours float32 = base)", show_lines=False)
    for c in ("", runtime, "noise floor", "tolerance"):
        t.add_column(c)
    for v in ("hidden", "k", "v", "logits"):
        t.add_row(f"max |Δ| {v}", f"{rep['max_abs'][v]:.4g}", f"{fl['max_abs'][v]:.4g}", f"{fl['factor'] * fl['max_abs'][v]:.4g}")
    for k, name in (("kl_mean", "KL mean"), ("kl_p99", "KL p99"), ("kl_max", "KL max")):
        t.add_row(name, f"{nt[k]:.3g}", f"{fl['next_token'][k]:.3g}", "")
    t.add_row("same top token", f"{nt['same_top']}/{nt['rows']} ({nt['same_top_rate']:.1%})",
              f"{fl['next_token']['same_top']}/{fl['next_token']['rows']}", "")
    return t


def llamacpp_diff_lines(rep: dict[str, Any]) -> tuple[list[Text], Table, list[Text]]:
    """The report as styled lines before and after the float table; every value from the run is
    made terminal-safe with :func:`infertrace.safe_text.visible` (no markup anywhere)."""
    st = rep["structural"]
    ok = not st["mismatches"]
    head = [_t(("cells backend vs llama.cpp", "bold"), f" (teacher-forced, same ubatches, layer {visible(rep['layer'])})"),
            _t(f"structure: {st['checked']} exact checks (inp_pos, n_kv, kq_mask ne and cells, out_ids, ownership, head): ",
               ("all equal", "green") if ok else (f"{len(st['mismatches'])} differ", "red")),
            _t(f"cell placement: {visible(st['placement'])}")]
    if st.get("swa_checked"):
        head.append(_t(f"SWA pool (llama.cpp iSWA cache): {visible(st['swa_checked'])} of those checks: pool size, n_kv_swa, "
                       "kq_mask_swa ne and cells, k_idxs_swa, head, cells reused, positions per sequence"))
    if isinstance(rep.get("llama_cpp"), dict):
        head.append(_t(settings_text(rep["llama_cpp"])))
    md = st.get("mask_dtype", {})
    head.append(_t(f"kq_mask dtype: ours {visible(', '.join(md.get('ours', [])))}, llama.cpp "
                   f"{visible(', '.join(md.get('llama.cpp', [])))}"
                   " (F16 when llama.cpp uses flash attention; values are 0 / -inf either way)"))
    for m in st["mismatches"][:10]:
        head.append(_t("  ", (f"step {m['step']} {visible(m['variable'])}", "red"), f": {visible(m['detail'])}"))
    nt, fl = rep["next_token"], rep["floor"]
    t = agreement_table(rep, "llama.cpp")
    tail = [_t(f"noise floor: {visible(fl['how'])}")]
    fe = rep["first_exceeding"]
    tail.append(_t("first step over the floor: ", ("none", "green") if fe is None else
                   (f"step {fe['step']} layer {visible(fe['layer'])} {visible(fe['variable'])}: {fe['value']:.4g} > "
                    f"tolerance {fe['tolerance']:.4g}", "red")))
    tail.append(_t(f"near tie: {visible(rep['near_tie_rule'])}"))
    for d in nt["disagreements"]:
        tail.append(_t(f"  step {d['step']} seq {d['seq_id']} pos {d['pos']}: ours {d['base_top']} (rank "
                       f"{d['rank_of_base_top_in_new']} in llama.cpp), llama.cpp {d['new_top']} (rank "
                       f"{d['rank_of_new_top_in_base']} in ours), gaps {d['logp_gap_base']} / {d['logp_gap_new']} nats: ",
                       "near tie" if d["near_tie"] else ("not a near tie", "red")))
    tail.append(_t(("identical in structure, within the noise floor", "green") if rep["identical"] else
                   (f"{len(rep['mismatches'])} mismatch(es)", "red")))
    return head, t, tail


def render_llamacpp_diff(con: Console, rep: dict[str, Any]) -> None:
    """Print the report built by :func:`llamacpp_diff_lines` (styled Text, never markup)."""
    head, table, tail = llamacpp_diff_lines(rep)
    for line in head:
        con.print(line)
    con.print(table)
    for line in tail:
        con.print(line)


def _plain(x: Any) -> str:
    """Terminal-safe text of a value read from a trace (control characters escaped)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(x))


def settings_text(st: dict[str, Any]) -> str:
    """One line of llama.cpp's context settings that change its numbers (report header, ``show``)."""
    fa = st.get("flash_attn")
    asked = st.get("flash_attn_type")
    return (f"llama.cpp context: flash attention {_plain(fa if fa is not None else 'not recorded')}"
            + (f" (asked {_plain(asked)})" if asked is not None else "")
            + f", K/V cache {_plain(st.get('type_k', '?'))}/{_plain(st.get('type_v', '?'))}, n_ctx {_plain(st.get('n_ctx', '?'))}, "
            f"n_batch {_plain(st.get('n_batch', '?'))}, n_ubatch {_plain(st.get('n_ubatch', '?'))}, "
            f"threads {_plain(st.get('n_threads', '?'))}/{_plain(st.get('n_threads_batch', '?'))}")


def settings_lines(diffs: list[dict[str, Any]], cross: bool) -> list[str]:
    """``diff``: the llama.cpp settings two traces differ in, each named (they change llama.cpp's numbers;
    ``cross``: only one side is a llama.cpp trace, its settings listed)."""
    if cross:
        return ["llama.cpp settings (one side only): " + ", ".join(
            f"{_plain(d['setting'])} {_plain(d['a'] if d['a'] is not None else d['b'])}" for d in diffs
            if d["setting"] != "system_info")]
    lines = [f"llama.cpp settings differ ({len(diffs)}; they change llama.cpp's numbers):"]
    for d in diffs:
        lines.append(f"  {_plain(d['setting'])}: A {_plain(d['a'] if d['a'] is not None else 'not recorded')[:200]}"
                     f" vs B {_plain(d['b'] if d['b'] is not None else 'not recorded')[:200]}")
    return lines


def rate_text(label: str, f: dict[str, Any], unit: str = "") -> str:
    """``same top token 3/4 (75.0%)``, or ``same top token: not compared (no logits row in both traces)``
    when there is no row: a rate over zero rows is never printed."""
    if not f.get("rows"):
        return f"{label}: not compared (no logits row in both traces)"
    return f"{label} {f['same_top']}/{f['rows']}{unit} ({f['same_top_rate']:.1%})"


def cross_engine_lines(res: Any, cross: dict[str, Any]) -> list[str]:
    """Header lines of ``diff A B`` across engines: what was compared exactly and the float agreement."""
    f = cross["floats"]
    e = [_plain(x) for x in cross["engines"]]
    da, db = cross["dtypes"]["a"], cross["dtypes"]["b"]
    lines = [f"engines differ (A: {e[0]}, B: {e[1]}): structure compared exactly (schedule, tokens, inp_pos, kq_mask ne/n_kv/"
             "rows/cells, visible keys, cells and ownership, logits rows); floats summarised",
             f"representation: kq_mask dtype A {_plain(da['kq_mask'])} B {_plain(db['kq_mask'])}; KV cache dtype A "
             f"{_plain(da['kv'])} B {_plain(db['kv'])}",
             f"floats: {rate_text('same top token', f)}; max |Δ| of recorded values: "
             f"hidden {f['max_abs']['hidden']:.3g}, K/V {f['max_abs']['kv']:.3g}, logits {f['max_abs']['logits']:.3g}"]
    ft = f.get("first_different_top")
    if ft:
        lines.append(f"first different top token: step {_plain(ft['step'])} seq {_plain(ft['seq_id'])}: A {_plain(ft['a'])} vs B {_plain(ft['b'])}")
    lines.append("structure: identical" if res.equal else f"structure: {res.count} difference(s)")
    return lines
