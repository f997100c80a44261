"""The decode loop (after the steps): greedy picks the top logit, the chosen token is fed next, rows' tokens
are the sequence's, output_ids the emitted tokens, ids inside the vocabulary.
"""

from __future__ import annotations

from typing import Any

from infertrace.trace.check.base import _int, kept_len, _show


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
    forced = bool(lc.get("teacher_forced")) or isinstance(opts.get("teacher_force"), dict)  # run --teacher-force DIR
    reqs = {r.get("seq_id"): r for r in (m.get("requests") or []) if isinstance(r, dict) and _int(r.get("seq_id"))}
    full, bad = _request_ids(reqs, V)
    if bad:
        return bad
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
        bad = _rows_problem(s, rows, full, pending, shifted)
        if bad is None:
            bad = _decode_problem(st, rows, reqs, V, forced, pending, emitted, decoded)
        if bad:
            return bad
    for sid in sorted(decoded):
        r = reqs.get(sid)
        if r is not None and isinstance(r.get("output_ids"), list) and r["output_ids"] != emitted.get(sid, []):
            return None, sid, "output_ids are the chosen tokens", (
                f"requests[seq {sid}].output_ids {str(r['output_ids'][:12])} but the steps chose {str(emitted.get(sid, [])[:12])}")
    return None


def _rows_problem(s: Any, rows: dict[int, dict], full: dict[int, list[int] | None], pending: dict[int, Any],
                  shifted: set[int]) -> tuple[Any, Any, str, str] | None:
    """The batch rows of step ``s`` (``rows``: seq_id -> row) against the loop so far: the row's first token is
    the ``next_input`` the sequence's previous decode chose (``pending``, popped when checked), and its
    ``token_ids`` are the sequence's tokens ``full`` (``prompt_ids + output_ids``) at its positions from ``C``
    (a verify row only its first, pending token) until a context shift (``shifted``, grown here) renumbers them."""
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
    return None


def _decode_problem(st: dict, rows: dict[int, dict], reqs: dict[int, dict], V: int | None, forced: bool,
                    pending: dict[int, Any], emitted: dict[int, list[int]], decoded: set[int]) -> tuple[Any, Any, str, str] | None:
    """The ``decode.per_request`` records of step ``st``: each of a row in the step's batch (``rows``), its
    chosen id in the vocabulary ``0..V-1``, the top logit when greedy (unless ``forced``: teacher-forced), the
    last token its verify row emits; ``next_input`` the chosen token and ``next_pos`` the positions kept
    after the step, unless it stopped. Records the sequence in ``decoded``, its emitted tokens in ``emitted``
    and the chosen token the next step must feed first in ``pending``."""
    s = st.get("step")
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
        bad_greedy = None if forced else _greedy_problem(pr, ch, sp)
        if bad_greedy:
            return s, sid, "greedy chooses the top logit", bad_greedy
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
    return None


def _request_ids(reqs: dict[int, dict], V: int | None) -> tuple[dict[int, list[int] | None], tuple[Any, Any, str, str] | None]:
    """Each request's tokens ``prompt_ids + output_ids`` (None when either is not recorded), and the first
    id outside the vocabulary ``0..V-1`` as a decode-loop problem."""
    full: dict[int, list[int] | None] = {}
    for sid, r in reqs.items():
        ids = [x for k in ("prompt_ids", "output_ids") for x in (r.get(k) if isinstance(r.get(k), list) else [])]
        for k in ("prompt_ids", "output_ids"):
            bad = [x for x in (r.get(k) if isinstance(r.get(k), list) else []) if not _int(x) or x < 0 or (V and x >= V)]
            if bad:
                return full, (None, sid, "token ids in the vocabulary",
                              f"requests[seq {sid}].{k} holds {_show(bad[0])}, not an id 0..{(V or 0) - 1} (config.vocab_size {V})")
        full[sid] = ids if isinstance(r.get("prompt_ids"), list) and isinstance(r.get("output_ids"), list) else None
    return full, None


def _greedy_problem(pr: dict, ch: int, sp: dict) -> str | None:
    """A greedy request's (temperature 0, no repetition penalty) chosen token against the step's recorded
    top logits: the chosen id must carry the largest logit."""
    top = pr.get("top") if isinstance(pr.get("top"), list) else []
    if not (sp.get("temperature") == 0 and sp.get("repetition_penalty") in (None, 1, 1.0) and top
            and all(isinstance(t, dict) for t in top)):
        return None
    best = max((t.get("logit") for t in top if isinstance(t.get("logit"), (int, float))), default=None)
    mine = [t.get("logit") for t in top if t.get("id") == ch]
    if best is not None and not (mine and mine[0] == best):
        return (f"chosen {ch} but the step's top logit is id {_show(top[0].get('id'))} ({best}) and the request samples "
                "greedily (temperature 0)")
    return None
