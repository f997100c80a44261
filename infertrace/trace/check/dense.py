"""The dense convention (``--runtime hf``, HF transformers' padded ``[B, T]`` batch): the ``hf`` section and the
``dense`` ``kv.physical`` recomputed from the requests and the 2-D ``attention_mask``.

Rules (transformers 5.19: ``generation/utils.py`` ``_prepare_position_ids_for_generation`` /
``_update_model_kwargs_for_generation``, ``masking_utils.py`` ``create_causal_mask`` /
``create_sliding_window_causal_mask``, ``cache_utils.py`` ``DynamicLayer`` / ``DynamicSlidingWindowLayer``):

* **the runtime named in the header** -- an ``hf`` section only in a trace whose runtime is ``hf``, and every
  computed step of such a trace has one (with ``backend = dense``).
* **dense layout [B, T]** -- the first forward's ``input_ids`` is ``[B, T]``, B = the requests, T = the longest
  prompt; row b holds its prompt at columns ``T - n .. T - 1`` (left padding) or ``0 .. n - 1`` (right), the
  ``attention_mask`` is 0 exactly at the other (pad) columns; every later forward is ``[B, 1]`` and the mask
  grows by one column: width ``L = T + k`` after decode step k; ``kv.physical`` says the same.
* **position_ids from the mask** -- ``position_ids`` are ``cumsum(attention_mask) - 1`` with pad columns 0, the
  last q columns; so a real token's position is the number of real tokens before it in its row (0..n-1 in
  the prompt, whatever the padding); each request's ``positions`` are the ``position_ids`` at its columns.
* **pad columns masked** -- in every mask HF built (per layer type), every real query keeps exactly the real key
  columns ``j <= i`` (sliding layers: ``i - W < j <= i``) and never a pad column; ``none: is_causal`` only when
  the mask has no 0.
* **cache lengths** -- after the step every layer's ``get_seq_length()`` is ``L = T + k``; a full-attention layer
  stores L columns, a sliding one ``min(L, W - 1)`` (HF keeps the last ``sliding_window - 1``).
* **K/V at the row's columns** -- ``kv.layer_view`` (by position) equals ``hf.kv_layer`` at the cache column the
  layout maps that position to; logits are read at each row's last real column.

:func:`padding_kv_problem` compares two traces of the same prompts run with different padding: the real tokens'
K/V must agree (HF's padding invariance, as far as its kernels give it).
"""

from __future__ import annotations

from typing import Any

from infertrace.trace.check.base import _d, _int, _l, intervals

#: the mask lines recorded per batch row (runtimes/hf/record.py): at most this many queries and key columns; a
#: longer mask is cut to them and marked ``truncated``
MASK_MAX_Q, MASK_MAX_KV = 256, 4096


def _runs_dense(engine: Any) -> bool:
    """True when the registry's runtime ``engine`` runs the dense convention (HF transformers)."""
    from infertrace.runtimes.api import REGISTRY

    r = REGISTRY.get(engine) if isinstance(engine, str) else None
    return r is not None and "dense" in r.conventions


def dense_rules(c: Any, s: int, st: dict, reqs: list[dict]) -> None:
    """Every dense rule of one step (module docstring); raises through ``c.fail``."""
    hf = st.get("hf")
    c.n_checks += 1
    dense_engine = _runs_dense(c.m.get("runtime"))
    if hf is None:
        if dense_engine and reqs:
            c.fail(s, None, "hf", "the runtime named in the header", "the header names the runtime hf but this computed step "
                   "has no hf section (--runtime hf records HF's own inputs every step)")
        return
    if not dense_engine or st.get("backend") != "dense":
        c.fail(s, None, "hf", "the runtime named in the header", f"the step has an hf section but the header names the runtime "
               f"{c.m.get('runtime')!r} and the step's backend is {st.get('backend')!r}")
    c.need(isinstance(hf, dict), s, None, "hf", "hf section is not an object")
    ids, am, pos = _l(hf.get("input_ids")), _l(hf.get("attention_mask")), _l(hf.get("position_ids"))
    c.need(ids and all(isinstance(r, list) for r in ids + am + pos) and len(am) == len(ids) == len(pos), s, None, "hf",
           "input_ids / attention_mask / position_ids must be [B, *] lists of the same B")
    state = c.__dict__.setdefault("_dense", {"k": 0})
    _layout(c, s, st, hf, state)
    _positions(c, s, st, hf, reqs)
    _masks(c, s, hf, reqs)
    _cache(c, s, st, hf)
    _kv_and_logits(c, s, st, hf, reqs)
    state["k"] += 1


def _prompts(c: Any) -> list[list[int]]:
    rq = sorted((r for r in _l(c.m.get("requests")) if isinstance(r, dict) and _int(r.get("seq_id"))), key=lambda r: r["seq_id"])
    return [_l(r.get("prompt_ids")) for r in rq]


def _layout(c: Any, s: int, st: dict, hf: dict, state: dict) -> None:
    ids, am = hf["input_ids"], hf["attention_mask"]
    q, L = len(ids[0]), len(am[0])
    if state["k"] == 0:
        prompts = _prompts(c)
        B, T = len(prompts), max((len(p) for p in prompts), default=0)
        state["T"] = T
        c.n_checks += 1
        if len(ids) != B or any(len(r) != T for r in ids):
            c.fail(s, None, "hf", "dense layout [B, T]", f"the first forward's input_ids are [{len(ids)}, "
                   f"{_widths(ids)}] but the {B} requests' longest prompt gives [B, T] = [{B}, {T}]")
        _ragged(c, s, am, T, "the first forward's")
        left = hf.get("padding") == "left"
        for b, p in enumerate(prompts):
            cols = list(range(T - len(p), T)) if left else list(range(len(p)))
            want = [1 if j in cols else 0 for j in range(T)]
            c.n_checks += 1
            if am[b] != want or [ids[b][j] for j in cols] != p:
                c.fail(s, None, "hf", "dense layout [B, T]", f"row {b} ({hf.get('padding')} padding, prompt of {len(p)} tokens "
                       f"in T = {T}): attention_mask {str(am[b])[:60]}, expected {str(want)[:60]} with the prompt at those columns")
    T = state.get("T", 0)
    want_L = T + state["k"]
    _ragged(c, s, am, L, f"forward {state['k']}'s")
    c.n_checks += 1
    if (state["k"] > 0 and q != 1) or L != want_L or hf.get("past_seen_tokens") != L - q \
            or hf.get("cache_position") != list(range(L - q, L)):
        c.fail(s, None, "hf", "dense layout [B, T]", f"forward {state['k']}: input_ids [B, {q}], attention_mask width {L}, "
               f"past_seen_tokens {hf.get('past_seen_tokens')!r}; expected [B, {1 if state['k'] else T}], L = T + {state['k']} = "
               f"{want_L}, cache_position {L - q if state['k'] else 0}..{want_L - 1}")
    if state["k"] > 0 and any(r[-1] != 1 for r in am):
        c.fail(s, None, "hf", "dense layout [B, T]", "a decode forward's new mask column is not all ones (generate() appends ones)")
    ph = _d(_d(st.get("kv")).get("physical"))
    if ph.get("kind") == "dense":
        c.n_checks += 1
        if ph.get("padded_len") != T or ph.get("columns") != L or ph.get("batch_size") != len(ids):
            c.fail(s, None, "kv", "dense layout [B, T]", f"kv.physical batch_size {ph.get('batch_size')!r} padded_len "
                   f"{ph.get('padded_len')!r} columns {ph.get('columns')!r}, but the forward gives {len(ids)}, {T}, {L}")
        for r in _l(ph.get("rows")):
            b = r.get("row") if isinstance(r, dict) else None
            if _int(b) and 0 <= b < len(am):
                real = [j for j, m in enumerate(am[b]) if m]
                c.n_checks += 1
                if _span(r.get("real_cols")) != real or _span(r.get("pad_cols")) != [j for j in range(L) if not am[b][j]]:
                    c.fail(s, None, "kv", "dense layout [B, T]", f"kv.physical row {b}: real_cols {r.get('real_cols')!r} / "
                           f"pad_cols {r.get('pad_cols')!r} are not the attention_mask's 1 / 0 columns")


def _widths(rows: list[list]) -> str:
    """The row widths of a [B, *] list: ``5`` when all agree, else ``5 / 2`` (ragged)."""
    w = sorted({len(r) for r in rows})
    return " / ".join(map(str, w)) if w else "0"


def _ragged(c: Any, s: int, am: list[list], width: int, which: str) -> None:
    """Every ``attention_mask`` row is ``width`` wide (HF's 2-D mask is one [B, L] tensor); else the first row
    that is not, named with its width."""
    c.n_checks += 1
    for b, row in enumerate(am):
        if len(row) != width:
            c.fail(s, None, "hf", "dense layout [B, T]", f"{which} attention_mask row {b} is {len(row)} columns wide, but "
                   f"the [B, L] mask is L = {width} wide in every row")


def _span(text: Any) -> list[int] | None:
    try:
        return [x for lo, hi in intervals(text) for x in range(lo, hi + 1)] if len(str(text)) < 4096 else None
    except ValueError:
        return None


def _cols_of(hf: dict, b: int, T: int) -> list[int]:
    """The forward's query columns (0..q-1) holding row b's real computed tokens."""
    q, L = len(hf["input_ids"][b]), len(hf["attention_mask"][b])
    return [i for i in range(q) if hf["attention_mask"][b][L - q + i]]


def _row_of(hf: dict, sid: int) -> int | None:
    rs = _l(hf.get("row_seq_ids"))
    return rs.index(sid) if sid in rs else (sid if sid < len(hf["input_ids"]) else None)


def _positions(c: Any, s: int, st: dict, hf: dict, reqs: list[dict]) -> None:
    am, pos = hf["attention_mask"], hf["position_ids"]
    for b, row in enumerate(am):
        n, want = 0, []
        for m in row:
            want.append(n if m else 0)
            n += 1 if m else 0
        q = len(pos[b])
        c.n_checks += 1
        if pos[b] != want[len(row) - q:]:
            c.fail(s, None, "hf", "position_ids from the mask", f"row {b}: position_ids {str(pos[b])[:60]} but cumsum(attention_mask) "
                   f"- 1 with pad columns 0 gives {str(want[len(row) - q:])[:60]}")
    for r in reqs:
        b = _row_of(hf, r["seq_id"])
        got = [pos[b][i] for i in _cols_of(hf, b, 0)] if b is not None else None
        c.n_checks += 1
        if got != r["positions"]:
            c.fail(s, r["seq_id"], "positions", "position_ids from the mask", f"the request's positions {str(r['positions'])[:40]} "
                   f"but HF was fed position_ids {str(got)[:40]} at its real columns (row {b})")


def _window(c: Any, lt: str) -> int | None:
    """The sliding window of a ``sliding_attention`` mask (config.sliding_window), None for full attention."""
    W = _d(c.m.get("config")).get("sliding_window")
    return W if lt == "sliding_attention" and _int(W) and W > 0 else None


def _masks(c: Any, s: int, hf: dict, reqs: list[dict]) -> None:
    am = hf["attention_mask"]
    L = len(am[0])
    q = len(hf["input_ids"][0])
    has_pad = any(0 in r for r in am)
    for lt, m in _d(hf.get("masks")).items():
        c.need(isinstance(m, dict), s, None, "hf", f"hf.masks.{lt} is not an object")
        if m.get("returned") == "none: is_causal":
            c.n_checks += 1
            if has_pad:
                c.fail(s, None, "mask", "pad columns masked", f"HF's {lt} mask is none (is_causal) but the attention_mask has pad "
                       "columns: nothing would drop them")
            continue
        rows, off = _l(m.get("rows")), m.get("kv_offset", 0)
        c.need(_int(off) and 0 <= off < L, s, None, "mask", f"hf.masks.{lt}.kv_offset {off!r} is not a column 0..{L - 1}")
        nq, nk = _mask_shape(c, s, lt, m, rows, q, L - off)
        W = _window(c, lt)
        for r in reqs:
            b = _row_of(hf, r["seq_id"])
            c.need(b is not None and b < len(rows) and isinstance(rows[b], list), s, r["seq_id"], "mask",
                   f"hf.masks.{lt} has no row for seq {r['seq_id']}")
            for i in (i for i in _cols_of(hf, b, 0) if i < nq):  # a truncated record lists the first MASK_MAX_Q queries
                _mask_line(c, s, r["seq_id"], lt, am[b], b, rows[b][i], L - q + i, off, W)


def _mask_shape(c: Any, s: int, lt: str, m: dict, rows: list, q: int, kv: int) -> tuple[int, int]:
    """Every batch row of the recorded mask is ``q`` query lines of ``kv`` key characters (``0``/``1``), cut to
    :data:`MASK_MAX_Q` x :data:`MASK_MAX_KV` exactly when ``truncated`` (runtimes/hf/record.py sets it only then);
    returns the (queries, keys) listed. Raises through ``c.fail`` (variable ``mask``)."""
    cut = q > MASK_MAX_Q or kv > MASK_MAX_KV
    c.n_checks += 1
    if bool(m.get("truncated")) != cut:
        c.fail(s, None, "mask", "pad columns masked", f"HF's {lt} mask is {q} queries x {kv} keys, "
               f"{'over' if cut else 'within'} the recorded bound {MASK_MAX_Q} x {MASK_MAX_KV}, but is marked truncated: "
               f"{bool(m.get('truncated'))} (the recorder cuts it exactly when it is over)")
    shape = m.get("shape")
    c.n_checks += 1
    if isinstance(shape, list) and shape[-2:] != [q, kv]:
        c.fail(s, None, "mask", "pad columns masked", f"HF's {lt} mask has shape {str(shape)[:40]} but the forward has "
               f"q = {q} queries over kv = {kv} key columns (L - kv_offset)")
    nq, nk = min(q, MASK_MAX_Q), min(kv, MASK_MAX_KV)
    for b, row in enumerate(rows):
        c.n_checks += 1
        if not isinstance(row, list) or len(row) != nq:
            c.fail(s, None, "mask", "pad columns masked", f"HF's {lt} mask, row {b}: "
                   f"{len(row) if isinstance(row, list) else type(row).__name__} query lines, expected {nq} (q = {q})")
        for i, line in enumerate(row):
            if not isinstance(line, str) or len(line) != nk or line.strip("01"):
                c.fail(s, None, "mask", "pad columns masked", f"HF's {lt} mask, row {b} query line {i}: "
                       f"{str(line)[:40]!r} is not {nk} key columns of 0/1 (kv = {kv} keys)")
    return nq, nk


def _mask_line(c: Any, s: int, sid: int, lt: str, am_row: list, b: int, line: str, qi: int, off: int, W: int | None) -> None:
    """One real query's recorded mask line (key columns ``off ..``; ``qi`` the query's cache column): it keeps exactly
    the real key columns ``j <= qi`` (and ``qi - j < W`` on a sliding layer)."""
    L = len(am_row)
    for j, x in enumerate(line):
        col = off + j
        keep = col < L and am_row[col] == 1 and col <= qi and (W is None or qi - col < W)
        c.n_checks += 1
        if (x == "1") != keep:
            what = ("a pad column" if col < L and am_row[col] == 0 else "a later column" if col > qi
                    else "a column outside the window" if W is not None and qi - col >= W else "a real earlier column")
            c.fail(s, sid, "mask", "pad columns masked", f"HF's {lt} mask, row {b} query column {qi}: key column "
                   f"{col} ({what}) is {'kept' if x == '1' else 'dropped'}")


def _cache(c: Any, s: int, st: dict, hf: dict) -> None:
    L = len(hf["attention_mask"][0])
    Wc = _d(c.m.get("config")).get("sliding_window")
    for d in _l(_d(hf.get("cache")).get("layers")):
        c.need(isinstance(d, dict) and _int(d.get("seq_length")) and _int(d.get("stored")), s, None, "hf", "hf.cache.layers entry malformed")
        W = d.get("sliding_window", Wc) if d.get("is_sliding") else None
        want = min(L, W - 1) if _int(W) and W > 1 else L
        c.n_checks += 1
        if d["seq_length"] != L or d["stored"] != want:
            c.fail(s, None, "kv", "cache lengths", f"layer {d.get('layer')} ({d.get('class')}): get_seq_length() {d['seq_length']}, stored "
                   f"{d['stored']}; expected T + decode steps = {L}" + (f", stored min(L, sliding_window - 1) = {want}" if W else f", stored {L}"))
    ph = _d(_d(st.get("kv")).get("physical"))
    for lt, v in _d(ph.get("cache")).items():
        c.n_checks += 1
        if _d(v).get("seq_length") != L:
            c.fail(s, None, "kv", "cache lengths", f"kv.physical.cache.{lt}.seq_length {_d(v).get('seq_length')!r}, expected L = {L}")


def _kv_and_logits(c: Any, s: int, st: dict, hf: dict, reqs: list[dict]) -> None:
    kl = _d(hf.get("kv_layer"))
    by_row = {x.get("row"): {y.get("col"): y for y in _l(x.get("columns")) if isinstance(y, dict)}
              for x in _l(kl.get("rows")) if isinstance(x, dict)}
    kv = _d(st.get("kv"))
    per = {d.get("seq_id"): d for d in _l(kv.get("per_request")) if isinstance(d, dict)}
    L, q = len(hf["attention_mask"][0]), len(hf["input_ids"][0])
    for rv in _l(_d(kv.get("layer_view")).get("requests")):
        sid = rv.get("seq_id") if isinstance(rv, dict) else None
        d, b = per.get(sid), _row_of(hf, sid) if _int(sid) else None
        if d is None or b is None:
            continue
        cols = dict(zip(_span(d.get("written_pos")) or [], _span(d.get("columns")) or []))
        c.n_checks += 1
        if sorted(cols.values()) != [L - q + i for i in _cols_of(hf, b, 0)]:
            c.fail(s, sid, "kv", "K/V at the row's columns", f"kv.per_request columns {d.get('columns')!r} are not row {b}'s real "
                   "columns of this forward")
        for e in _l(rv.get("rows")):
            col = cols.get(_d(e).get("pos"))
            got = by_row.get(b, {}).get(col)
            c.n_checks += 1
            if got is None or got.get("k") != e.get("k") or got.get("v") != e.get("v"):
                c.fail(s, sid, "kv", "K/V at the row's columns", f"kv.layer_view pos {_d(e).get('pos')} of seq {sid} differs from "
                       f"hf.kv_layer row {b} column {col}")
    want = sorted([_row_of(hf, r["seq_id"]), _cols_of(hf, _row_of(hf, r["seq_id"]), 0)[-1]] for r in reqs if r.get("sampled") is not None)
    c.n_checks += 1
    if sorted(_l(_d(hf.get("logits")).get("columns"))) != want:
        c.fail(s, None, "decode", "logits at the last real column", f"hf.logits.columns {str(_d(hf.get('logits')).get('columns'))[:60]} "
               f"but each sampling row reads its last real column: {str(want)[:60]}")


def padding_kv_problem(a: dict[str, Any], b: dict[str, Any], atol: float = 1e-4) -> str | None:
    """Two ``--runtime hf`` traces of the same prompts (e.g. left and right padding): where the real tokens' K/V
    (``kv.layer_view``, by step, seq_id and position) differ by more than ``atol``, else None.

    Returns:
        one line naming the first (step, seq, pos) that differs, a missing counterpart, or different prompts.
    """
    if _prompts_of(a) != _prompts_of(b):
        return "the two traces ran different prompts"

    def rows(m: dict[str, Any]) -> dict[tuple[int, int, int], dict]:
        out = {}
        for st in _l(m.get("steps")):
            for rv in _l(_d(_d(_d(st).get("kv")).get("layer_view")).get("requests")):
                for e in _l(_d(rv).get("rows")):
                    out[(st.get("step"), rv.get("seq_id"), _d(e).get("pos"))] = e
        return out

    ra, rb = rows(a), rows(b)
    if set(ra) != set(rb):
        return f"K/V recorded at different (step, seq, pos): {sorted(set(ra) ^ set(rb), key=repr)[:3]}"
    for key in sorted(ra, key=repr):
        for kind in ("k", "v"):
            xa, xb = _l(ra[key].get(kind)), _l(rb[key].get(kind))
            if len(xa) != len(xb) or any(abs(x - y) > atol for x, y in zip(xa, xb)):
                return f"step {key[0]} seq {key[1]} pos {key[2]}: {kind} {xa} vs {xb} (atol {atol:g})"
    return None


def _prompts_of(m: dict[str, Any]) -> list[Any]:
    return [r.get("prompt_ids") for r in sorted(_l(m.get("requests")), key=lambda r: _d(r).get("seq_id", 0))]
