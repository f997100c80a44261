"""Non-unified KV (``--kv-unified off``, llama.cpp ``kv_unified = false``): stream membership.
"""

from __future__ import annotations

from typing import Any

from infertrace.trace.check.base import _d, _int, _l


# ----------------------------------------------------------------------------- streams (--kv-unified off)
def streams_rules(c: Any, s: int, st: dict, reqs: list[dict]) -> None:
    """Stream membership of a cells step under ``--kv-unified off`` (module docstring)."""
    eng = _d(_d(c.m.get("options")).get("settings"))
    ph = _d(_d(st.get("kv")).get("physical"))
    km = _d(_d(st.get("mask")).get("kq_mask"))
    if ph.get("kind") != "cells":
        return
    unified = eng.get("kv_unified") is not False
    n = ph.get("n_stream")
    c.n_checks += 1
    if unified and ((_int(n) and n > 1) or isinstance(km.get("streams"), list)):
        c.fail(s, None, "kv", "streams as configured", f"kv.physical has {n!r} streams / kq_mask lists streams but "
               "options.settings.kv_unified is not false (a unified cache is one stream: llama.cpp n_stream = 1)")
    if unified:
        return
    ns = eng.get("n_seq_max")
    if n != ns:
        c.fail(s, None, "kv", "streams as configured", f"kv.physical.n_stream {n!r} but options.settings.n_seq_max is {ns!r} "
               "(kv_unified false: llama.cpp n_stream = n_seq_max)")
    ss = ph.get("stream_size")
    if not (_int(ss) and ss > 0 and _int(n) and ph.get("size") == n * ss):
        return  # streams that do not add up to the cells: the schema's cross-field check names it
    per_stream: dict[int, list[int]] = {}
    for cell in _l(ph.get("cells")):
        if not (isinstance(cell, dict) and _int(cell.get("cell"))):
            continue
        j = cell["cell"] // ss
        per_stream.setdefault(j, []).append(cell["cell"] - j * ss)
        for q in _l(cell.get("seq_ids")):
            c.n_checks += 1
            if q != j:
                c.fail(s, q, "kv", "cells inside the sequence's stream", f"cell {cell['cell']} (stream {j} of {ss} cells) "
                       f"holds seq {q}, whose stream is {q} (llama.cpp seq_to_stream[s] = s)")
    for rec in _l(ph.get("streams")):
        if not (isinstance(rec, dict) and _int(rec.get("stream")) and rec["stream"] < n):
            continue  # a stream id past n_stream: the schema's cross-field check names it
        j, mine = rec["stream"], per_stream.get(rec["stream"], [])
        c.n_checks += 1
        want = {"seq_ids": [j], "used": len(mine), "used_max_p1": max(mine) + 1 if mine else 0}
        for key, w in want.items():
            if key in rec and rec[key] != w:
                c.fail(s, None, "kv", "cells inside the sequence's stream",
                       f"kv.physical.streams[{j}].{key} is {str(rec[key])[:40]} but the stream's cells give {w}")
    for d in _l(_d(st.get("kv")).get("per_request")):
        if isinstance(d, dict) and "stream" in d:
            c.n_checks += 1
            if d["stream"] != d.get("seq_id"):
                c.fail(s, d.get("seq_id"), "kv", "cells inside the sequence's stream",
                       f"kv.per_request stream {d['stream']!r} for seq {d.get('seq_id')!r} (seq_to_stream[s] = s)")
    _mask_streams(c, s, km, reqs)


def _mask_streams(c: Any, s: int, km: dict, reqs: list[dict]) -> None:
    blocks = km.get("streams")
    if not isinstance(blocks, list):
        return
    ne = km.get("ne")
    c.n_checks += 1
    seqs_in_batch = sorted({r["seq_id"] for r in reqs})
    if isinstance(ne, list) and len(ne) == 4 and ne[3] != len(blocks):
        c.fail(s, None, "mask", "kq_mask streams", f"kq_mask ne[3] = {ne[3]!r} but it lists {len(blocks)} stream blocks")
    if km.get("n_stream") is not None and _int(km.get("n_stream")) and [b.get("stream") for b in blocks if isinstance(b, dict)] \
            != seqs_in_batch:
        c.fail(s, None, "mask", "kq_mask streams", f"kq_mask stream blocks {[b.get('stream') for b in blocks if isinstance(b, dict)]} "
               f"are not the streams of the ubatch's sequences {seqs_in_batch} (seq_to_stream[s] = s)")
    n_tps = ne[1] if isinstance(ne, list) and len(ne) == 4 and _int(ne[1]) else 0
    owner = [r["seq_id"] for r in reqs for _ in r["positions"]]
    for j, b in enumerate(blocks):
        if not isinstance(b, dict):
            continue
        sj = b.get("stream")
        c.n_checks += 1
        if b.get("seq_ids") is not None and b.get("seq_ids") != [sj]:
            c.fail(s, None, "mask", "kq_mask streams", f"kq_mask stream {sj!r} lists seq_ids {str(b.get('seq_ids'))[:40]}, "
                   f"not [{sj!r}]")
        rows = owner[j * n_tps:(j + 1) * n_tps]
        if any(q != sj for q in rows):
            c.fail(s, None, "mask", "kq_mask streams", f"kq_mask stream block {j} (stream {sj!r}) holds the rows of seq "
                   f"{sorted(set(rows))}")
        for k, held in enumerate(_l(b.get("cell_seq"))):
            if isinstance(held, list) and any(q != sj for q in held):
                c.fail(s, None, "mask", "kq_mask streams", f"kq_mask stream {sj!r} cell {k} holds seq {held} of another stream")
