"""``infertrace check`` rules for the newer trace sections, each derived from the facts the section
summarises (issue 31 item 11): a section is a copy of something the trace already says, so the copy
is recomputed from the convention's own definition and compared.

* **streams** (``--kv-unified off``, llama.cpp ``kv_unified = false``): ``n_stream = kv_unified ? 1 :
  n_seq_max`` and ``seq_to_stream[s] = s`` (``llama_kv_cache`` constructor), so each cell holding
  sequence s lies in stream s (``cell // stream_size == s``); a stream's ``used`` / ``used_max_p1`` count
  its own cells; ``kq_mask`` ``ne[3]`` is the ubatch's streams, block j's rows are queries of the
  sequence of stream j and keep only that sequence's cells.
* **SWA pool** (llama.cpp ``llama_kv_cache_iswa``, kv/iswa.py): one entry per cell, one cell per
  (seq, pos), ``used`` = the cells listed; it holds positions the base pool holds, at least the window
  the next query reads (``p - W + 1 .. p``).
* **MTP** (``--speculative mtp``, engine/drafters.py ``MTPDrafter``, a chain): MTP row k embeds the
  verify row's token k (node k - 1 at position C - 1 + k) and its greedy ``argmax`` is draft k, the
  token verified at node k + 1 (the first T - 1 drafts: a request near its token limit verifies fewer); ``spec.mtp.drafts`` lists them; a trace with MTP rows ran
  ``options.engine.speculative = mtp`` on a model with ``config.mtp_layers >= 1``.
* **kv.dtype** is ``options.engine.kv_dtype`` (f32 / f16 / bf16 -> float32 / float16 / bfloat16),
  else the compute dtype ``options.dtype`` (our engine); llama.cpp's ``options.llama_cpp.type_k``.
* **quant kernels**: each ``options.weights.kernels`` entry is a kernel that
  :func:`infertrace.quant.source.choose_kernel` can return for that GGUF type and ``options.dtype``
  (its rule, :mod:`infertrace.quant.choice`, is torch-free).
* **paged tables**: a request's ``kv.per_request`` block table (the one its slots were written
  through) is ``kv.physical.requests`` 's table (after a verify rewind: that table is its prefix), which
  covers ``len`` = the positions the request holds after the step.
* **prefix hits**: the row's copy of a hit is ``serving.prefix`` 's; its ``computed`` range starts at
  the hit; paged ``shared_blocks`` are the table's first ``hit // B`` blocks (the full blocks the hit covers).
* **vllm** (``run --engine vllm``, vLLM v1 ``GPUModelRunner._prepare_inputs``): with B =
  ``options.vllm.block_size``, for batch row i at positions p: ``query_start_loc`` = cumulative T,
  ``seq_lens`` = C + T (vLLM's seq_lens are kv lengths), ``slot_mapping`` = ``block_table[i][p // B] * B
  + p % B``, ``block_table`` = the request's table; ``logits_indices`` = the last ``1 + drafts`` rows of each
  request (``query_start_loc[i + 1] - 1`` without drafts), inside ``0..N-1``; the scheduler's per-request
  ``num_scheduled_tokens`` / ``num_computed_tokens`` are T / C and ``total_num_scheduled_tokens`` = N;
  ``sampled_token_ids`` of a row whose sample is kept are its emitted tokens; ``free_blocks`` is the
  pool's and at most ``num_blocks - 1`` (block 0 is vLLM's null block); ``new_block_ids`` are blocks of the
  sequence's own table; ``tp_ranks`` one per rank of ``tensor_parallel_size``; a ``vllm`` section only in
  a trace whose header names the engine ``vllm`` (and every computed step of such a trace has one).

Each ``*_rules`` function takes the running checker (``c.fail`` / ``c.n_checks``, see
:mod:`infertrace.trace.check`) and raises through ``c.fail`` on the first violation.
"""

from __future__ import annotations

from typing import Any

from infertrace.quant.choice import possible_kernels  # torch-free: the kernel chooser's rule, by dtype name
from infertrace.ranges import parse_ranges

#: ``--kv-dtype`` names (llama.cpp cache types) -> the torch dtype names the trace records
KV_DTYPE_NAMES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _d(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def _l(x: Any) -> list:
    return x if isinstance(x, list) else []


def _kept(r: dict) -> int:
    sp = r.get("spec")
    if isinstance(sp, dict) and isinstance(sp.get("accepted_nodes"), list):
        return r["C"] + len(sp["accepted_nodes"])
    return r["C"] + r["T"]


# ----------------------------------------------------------------------------- streams (--kv-unified off)
def streams_rules(c: Any, s: int, st: dict, reqs: list[dict]) -> None:
    """Stream membership of a cells step under ``--kv-unified off`` (module docstring)."""
    eng = _d(_d(c.m.get("options")).get("engine"))
    ph = _d(_d(st.get("kv")).get("physical"))
    km = _d(_d(st.get("mask")).get("kq_mask"))
    if ph.get("kind") != "cells":
        return
    unified = eng.get("kv_unified") is not False
    n = ph.get("n_stream")
    c.n_checks += 1
    if unified and ((_int(n) and n > 1) or isinstance(km.get("streams"), list)):
        c.fail(s, None, "kv", "streams as configured", f"kv.physical has {n!r} streams / kq_mask lists streams but "
               "options.engine.kv_unified is not false (a unified cache is one stream: llama.cpp n_stream = 1)")
    if unified:
        return
    ns = eng.get("n_seq_max")
    if n != ns:
        c.fail(s, None, "kv", "streams as configured", f"kv.physical.n_stream {n!r} but options.engine.n_seq_max is {ns!r} "
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
        k = _kept(r)
        need = [p for p in range(max(0, k - W + 1), k) if (r["seq_id"], p) not in held]
        c.n_checks += 1
        if need:
            c.fail(s, r["seq_id"], "kv", "SWA pool cells", f"the SWA pool lacks pos {need[0]} of seq {r['seq_id']}, inside the window "
                   f"{max(0, k - W + 1)}..{k - 1} its next query reads (W = {W})")


# ----------------------------------------------------------------------------- MTP rows
def mtp_rules(c: Any, s: int, st: dict, reqs: list[dict]) -> None:
    """MTP rows against the verify row they drafted (module docstring)."""
    eng = _d(_d(c.m.get("options")).get("engine"))
    for r in reqs:
        sp = r.get("spec")
        mt = sp.get("mtp") if isinstance(sp, dict) else None
        if not isinstance(mt, dict):
            continue
        sid, C, toks = r["seq_id"], r["C"], _l(r.get("token_ids"))
        c.n_checks += 1
        if eng.get("speculative") != "mtp" or not (_int(_d(c.m.get("config")).get("mtp_layers")) and c.m["config"]["mtp_layers"] >= 1):
            c.fail(s, sid, "spec", "MTP rows agree with the drafts",
                   f"the verify row has MTP rows but options.engine.speculative is {eng.get('speculative')!r} and config.mtp_layers "
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


# ----------------------------------------------------------------------------- dtype, kernels
def kv_dtype_rules(c: Any, s: int, st: dict) -> None:
    """``kv.dtype`` against the options (module docstring)."""
    kv = _d(st.get("kv"))
    opts = _d(c.m.get("options"))
    if c.m.get("engine") == "llama.cpp":  # llama.cpp's cache type (type_k), as the context reports it
        kd = _d(opts.get("llama_cpp")).get("type_k")
        want = KV_DTYPE_NAMES.get(kd)
    elif c.m.get("engine") in (None, "infertrace"):
        kd = _d(opts.get("engine")).get("kv_dtype")
        want = KV_DTYPE_NAMES.get(kd) if kd is not None else opts.get("dtype")
    else:
        return
    if "dtype" not in kv:
        return
    c.n_checks += 1
    if want is not None and kv["dtype"] != want:
        c.fail(s, None, "kv", "kv dtype as configured", f"kv.dtype is {str(kv['dtype'])[:20]!r} but options give "
               + (f"kv_dtype {kd!r} = {want}" if kd is not None else f"no kv_dtype: the compute dtype {want}"))


def kernels_problem(m: dict[str, Any]) -> str | None:
    """What in ``options.weights.kernels`` no kernel chooser run could have written, else None: each
    GGUF type's kernels (a comma-joined set when matrices of one type took different kernels) must be
    ones :func:`~infertrace.quant.source.choose_kernel` returns for that type with the run's
    ``options.dtype`` activations, for a shape the int4 tile packs or one it does not."""
    opts = _d(m.get("options"))
    w = _d(opts.get("weights"))
    ks = w.get("kernels")
    if not isinstance(ks, dict) or not ks:
        return None
    if w.get("weights") != "quant":
        return f"options.weights.kernels are listed but options.weights.weights is {w.get('weights')!r}, not quant"
    dt = opts.get("dtype")
    if dt not in ("float32", "bfloat16", "float16"):
        return f"options.dtype {str(dt)[:20]!r} is not a compute dtype (float32, bfloat16, float16)"
    for t, k in ks.items():
        can = possible_kernels(t, dt)
        if not can:
            return f"options.weights.kernels names GGUF type {t[:20]!r}, which has no quantised kernel"
        got = set(str(k).split(","))
        if not got <= can:
            return (f"options.weights.kernels[{t[:20]!r}] is {str(k)[:40]!r}, but the kernel chooser returns "
                    f"{' or '.join(sorted(can))} for {t} with {opts.get('dtype')} activations")
    return None


# ----------------------------------------------------------------------------- paged tables, prefix hits
def paged_table_rules(c: Any, s: int, st: dict, reqs: list[dict]) -> None:
    """A paged request's write-time block table against ``kv.physical`` (module docstring)."""
    kv = _d(st.get("kv"))
    ph = _d(kv.get("physical"))
    if ph.get("kind") != "paged" or not isinstance(ph.get("requests"), dict):
        return
    B = ph.get("tokens_per_block")
    per = {d.get("seq_id"): d for d in _l(kv.get("per_request")) if isinstance(d, dict)}
    for r in reqs:
        sid = r["seq_id"]
        d, p = per.get(sid), ph["requests"].get(str(sid))
        if not isinstance(d, dict) or not isinstance(p, dict) or not isinstance(d.get("block_table"), list):
            continue
        tab, after = d["block_table"], _l(p.get("block_table"))
        c.n_checks += 1
        if after != tab[:len(after)] or (not r.get("spec") and after != tab):
            c.fail(s, sid, "kv", "block table recorded once", f"kv.per_request block table {str(tab)[:40]} but "
                   f"kv.physical.requests[{sid}] holds {str(after)[:40]}")
        c.n_checks += 1
        if _int(B) and B > 0 and (p.get("len") != _kept(r) or len(after) != -(-_kept(r) // B)):
            c.fail(s, sid, "kv", "block table recorded once", f"kv.physical.requests[{sid}] len {p.get('len')!r} with "
                   f"{len(after)} blocks, but the request holds {_kept(r)} positions ({-(-_kept(r) // B)} blocks of {B})")


def prefix_rules(c: Any, s: int, st: dict, reqs: list[dict]) -> None:
    """A prefix hit's copies and ranges (module docstring)."""
    sv = _d(_d(st.get("serving")).get("prefix"))
    ph = _d(_d(st.get("kv")).get("physical"))
    for r in reqs:
        sid = r["seq_id"]
        h, h2 = r.get("prefix"), sv.get(str(sid))
        c.n_checks += 1
        if isinstance(h, dict) and isinstance(h2, dict) and h != h2:
            c.fail(s, sid, "positions", "prefix hit recorded once", "the row's prefix record differs from serving.prefix's "
                   f"(hit {h.get('hit')!r} vs {h2.get('hit')!r})")
        h = h if isinstance(h, dict) else h2
        if not isinstance(h, dict) or not _int(h.get("hit")):
            continue
        hit = h["hit"]
        if isinstance(h.get("computed"), str):
            try:
                comp = parse_ranges(h["computed"])
            except ValueError:
                comp = []
            c.n_checks += 1
            if comp and comp[0] != hit:
                c.fail(s, sid, "positions", "chunk starts where the prefix hit ends",
                       f"the prefix record's computed range {h['computed'][:30]!r} starts at {comp[0]}, the hit covers 0..{hit - 1}")
        sb = h.get("shared_blocks")
        B = ph.get("tokens_per_block")
        tab = _l(_d(_d(ph.get("requests")).get(str(sid))).get("block_table"))
        if ph.get("kind") == "paged" and isinstance(sb, list) and _int(B) and B > 0 and (sb or hit >= B):
            c.n_checks += 1
            if sb != tab[:hit // B]:
                c.fail(s, sid, "kv", "shared blocks are the hit's full blocks", f"shared_blocks {str(sb)[:40]} but a hit of {hit} "
                       f"tokens covers the first {hit // B} blocks of the table {str(tab[:hit // B])[:40]} (B = {B})")


# ----------------------------------------------------------------------------- run --engine vllm
def vllm_rules(c: Any, s: int, st: dict, reqs: list[dict]) -> None:
    """The per-step ``vllm`` section recomputed from the batch rows and the cache (module docstring)."""
    v = st.get("vllm")
    opts = _d(c.m.get("options"))
    vo = opts.get("vllm")
    c.n_checks += 1
    if v is None:
        if c.m.get("engine") == "vllm" and reqs:
            c.fail(s, None, "vllm", "the engine named in the header", "the header names the engine vllm but this computed "
                   "step has no vllm section (run --engine vllm records vLLM's own metadata every step)")
        return
    if c.m.get("engine") != "vllm" or not isinstance(vo, dict):
        c.fail(s, None, "vllm", "the engine named in the header", f"the step has a vllm section but the header names the engine "
               f"{c.m.get('engine')!r}" + ("" if isinstance(vo, dict) else " and options.vllm is missing"))
    _vllm_scheduler(c, s, st, reqs, _d(v.get("scheduler")))
    _vllm_metadata(c, s, st, reqs, _d(v.get("attn_metadata")), vo.get("block_size"))
    _vllm_logits(c, s, st, reqs, v)
    _vllm_ranks(c, s, v, vo)


def _spec_tokens(sched: dict) -> dict[Any, list]:
    return {x.get("seq_id"): _l(x.get("spec_tokens")) for x in _l(sched.get("scheduled")) if isinstance(x, dict)}


def _vllm_scheduler(c: Any, s: int, st: dict, reqs: list[dict], sch: dict) -> None:
    N = sum(r["T"] for r in reqs)
    got = [(x.get("seq_id"), x.get("num_scheduled_tokens"), x.get("num_computed_tokens")) for x in _l(sch.get("scheduled"))
           if isinstance(x, dict)]
    want = [(r["seq_id"], r["T"], r["C"]) for r in reqs]
    c.n_checks += 1
    if got != want:
        c.fail(s, None, "vllm", "scheduler counts", f"vllm.scheduler.scheduled (seq, num_scheduled_tokens, num_computed_tokens) "
               f"{str(got)[:60]} but the batch rows give (seq, T, C) {str(want)[:60]}")
    tot = sch.get("total_num_scheduled_tokens")
    if tot is not None and tot != N:
        c.fail(s, None, "vllm", "scheduler counts", f"total_num_scheduled_tokens {tot!r} but the batch holds N = {N} tokens")
    spec = _spec_tokens(sch)
    for r in reqs:
        d = spec.get(r["seq_id"], [])
        want_d = _l(r.get("token_ids"))[1:] if r.get("spec") else []
        c.n_checks += 1
        if d != want_d:
            c.fail(s, r["seq_id"], "vllm", "scheduler counts", f"scheduled spec_tokens {str(d)[:40]} but the row verifies the drafts "
                   f"{str(want_d)[:40]}")
    ph = _d(_d(st.get("kv")).get("physical"))
    free, nb = sch.get("free_blocks"), ph.get("num_blocks")
    if _int(free):
        c.n_checks += 1
        if ph.get("free_blocks") is not None and ph["free_blocks"] != free:
            c.fail(s, None, "vllm", "free blocks of the pool", f"vllm.scheduler.free_blocks {free} but kv.physical.free_blocks "
                   f"{ph['free_blocks']!r}")
        held = {b for t in _d(ph.get("requests")).values() if isinstance(t, dict) for b in _l(t.get("block_table"))}
        if _int(nb) and (free > nb - 1 or len(held) > nb - 1 - free):
            c.fail(s, None, "vllm", "free blocks of the pool", f"free_blocks {free} of num_blocks {nb} (block 0 is vLLM's null "
                   f"block) leaves {nb - 1 - free} blocks held, but the tables hold {len(held)} distinct blocks")
    tables = {r["seq_id"]: _l(_d(_d(ph.get("requests")).get(str(r["seq_id"]))).get("block_table")) for r in reqs}
    md_bt = _l(_d(st.get("vllm")).get("attn_metadata", {}).get("block_table") if isinstance(st.get("vllm"), dict) else [])
    for k, blocks in _d(sch.get("new_block_ids")).items():
        sid = int(k) if str(k).isdigit() else None
        i = next((j for j, r in enumerate(reqs) if r["seq_id"] == sid), None)
        own = set(tables.get(sid, [])) | (set(_l(md_bt[i])) if i is not None and i < len(md_bt) else set())
        c.n_checks += 1
        bad = [b for b in _l(blocks) if b not in own]
        if bad:
            c.fail(s, sid, "vllm", "new blocks owned by their sequence", f"new_block_ids of seq {k} include block {bad[0]}, "
                   f"which is not in its block table {str(sorted(own))[:40]}")


def _vllm_metadata(c: Any, s: int, st: dict, reqs: list[dict], md: dict, B: Any) -> None:
    N = sum(r["T"] for r in reqs)
    qsl = [0]
    for r in reqs:
        qsl.append(qsl[-1] + r["T"])
    for key, want in (("query_start_loc", qsl), ("seq_lens", [r["C"] + r["T"] for r in reqs]), ("num_actual_tokens", N),
                      ("max_query_len", max((r["T"] for r in reqs), default=0)),
                      ("max_seq_len", max((r["C"] + r["T"] for r in reqs), default=0))):
        c.n_checks += 1
        if key in md and md[key] != want:
            c.fail(s, None, "vllm", f"{key} from the batch", f"vllm.attn_metadata.{key} {str(md[key])[:60]} but the batch rows give "
                   f"{str(want)[:60]}" + (" (cumulative T)" if key == "query_start_loc" else " (C + T: vLLM's seq_lens are kv lengths)"
                                          if key == "seq_lens" else ""))
    bt, slots = md.get("block_table"), md.get("slot_mapping")
    if not (_int(B) and B > 0 and isinstance(bt, list) and isinstance(slots, list)):
        return
    c.n_checks += 1
    if len(bt) != len(reqs) or len(slots) != N:
        c.fail(s, None, "vllm", "slot = table[p // B] * B + p % B", f"{len(bt)} block-table rows and {len(slots)} slots for "
               f"{len(reqs)} requests of N = {N} tokens")
    per = {d.get("seq_id"): d for d in _l(_d(st.get("kv")).get("per_request")) if isinstance(d, dict)}
    k = 0
    for i, r in enumerate(reqs):
        row = _l(bt[i])
        mine = _l(_d(per.get(r["seq_id"])).get("block_table"))
        c.n_checks += 1
        if mine and row != mine[:len(row)]:
            c.fail(s, r["seq_id"], "vllm", "block table recorded once", f"vllm.attn_metadata.block_table[{i}] {str(row)[:40]} but "
                   f"kv.per_request's table is {str(mine)[:40]}")
        for p in range(r["C"], r["C"] + r["T"]):  # storage order: a draft at node j sits at C + j
            want = row[p // B] * B + p % B if p // B < len(row) and _int(row[p // B]) else None
            c.n_checks += 1
            if slots[k] != want:
                c.fail(s, r["seq_id"], "vllm", "slot = table[p // B] * B + p % B",
                       f"vllm.attn_metadata.slot_mapping[{k}] (pos {p}) is {slots[k]!r}, block_table[{i}][{p // B}] * {B} + "
                       f"{p % B} = {want!r}")
            k += 1


def _vllm_logits(c: Any, s: int, st: dict, reqs: list[dict], v: dict) -> None:
    spec = _spec_tokens(_d(v.get("scheduler")))
    N = sum(r["T"] for r in reqs)
    want, end = [], 0
    for r in reqs:
        end += r["T"]
        d = len(spec.get(r["seq_id"], []))
        want += list(range(end - 1 - d, end))
    li = v.get("logits_indices")
    c.n_checks += 1
    if isinstance(li, list) and (li != want or any(not (_int(x) and 0 <= x < N) for x in li)):
        c.fail(s, None, "vllm", "logits_indices", f"vllm.logits_indices {str(li)[:60]} but vLLM samples the last 1 + drafts rows of "
               f"each request: {str(want)[:60]} (inside 0..{N - 1})")
    sampled = v.get("sampled_token_ids")
    if not isinstance(sampled, list):
        return
    c.n_checks += 1
    if len(sampled) != len(reqs):
        c.fail(s, None, "vllm", "sampled tokens are the chosen ones", f"{len(sampled)} sampled_token_ids rows for {len(reqs)} requests")
    dec = {p.get("seq_id"): p for p in _l(_d(st.get("decode")).get("per_request")) if isinstance(p, dict)}
    for i, r in enumerate(reqs):
        p = dec.get(r["seq_id"])
        if not isinstance(p, dict) or not _int(p.get("chosen")):
            continue
        got = [t for t in _l(sampled[i]) if _int(t) and t >= 0]
        em = _l(_d(r.get("spec")).get("emitted")) if r.get("spec") else [p["chosen"]]
        c.n_checks += 1
        if got[:len(em)] != em:
            c.fail(s, r["seq_id"], "vllm", "sampled tokens are the chosen ones", f"vllm.sampled_token_ids[{i}] {str(got)[:40]} but "
                   f"the step emits {str(em)[:40]} for seq {r['seq_id']}")


def _vllm_ranks(c: Any, s: int, v: dict, vo: dict) -> None:
    tp = vo.get("tensor_parallel_size", 1)
    ranks = v.get("tp_ranks")
    c.n_checks += 1
    if ranks is None:
        if _int(tp) and tp > 1:
            c.fail(s, None, "vllm", "ranks = tensor_parallel_size", f"options.vllm.tensor_parallel_size {tp} but the step records no "
                   "tp_ranks")
        return
    n_kv = _d(c.m.get("config")).get("n_head_kv")
    got = [x.get("tp_rank") for x in _l(ranks) if isinstance(x, dict)]
    if got != list(range(tp if _int(tp) else -1)):
        c.fail(s, None, "vllm", "ranks = tensor_parallel_size", f"tp_ranks {str(got)[:40]} but tensor_parallel_size is {tp!r}")
    for x in ranks:
        held = x.get("kv_heads_held")
        if held is not None and _int(n_kv) and held != n_kv // tp:
            c.fail(s, None, "vllm", "ranks = tensor_parallel_size", f"rank {x.get('tp_rank')} holds {held} KV heads, "
                   f"n_head_kv / tensor_parallel_size = {n_kv} / {tp}")
        if x.get("metadata_equals_rank0") is False:
            c.fail(s, None, "vllm", "ranks = tensor_parallel_size", f"rank {x.get('tp_rank')} built other metadata than rank 0 "
                   "(every rank schedules the same batch)")
