"""``diff-backends``: the same requests through the ``cells`` and ``paged`` backends, stepped in lockstep.

Two engines (same model, prompts, arrivals, sampling, chunking) advance one step at a time.
The scheduler is deterministic, so both must schedule the same chunks every step; each step
is then compared on the LOGICAL variables (what must be equal whatever the layout):

* ``schedule``  -- (seq_id, phase, C, T) of every chunk, in packed order;
* ``positions`` -- the packed position ids;
* ``mask``      -- the visible-key sets, materialised by each backend (``kv.logical_mask``:
  cells reads back its real kq_mask, paged derives them from lengths);
* ``kv``        -- K and V of every layer for every request holding cache (max |Δ|);
* ``tokens``    -- sampled tokens;
* ``logits``    -- the logits rows used for sampling (max |Δ|),

beside the PHYSICAL difference (cells: kq_mask ``ne`` and cell indices, storage
``[size, n_kv_heads, hd]``; paged: metadata lengths, block tables, slot mapping, pool
``[num_blocks, 2, n_kv_heads, B, hd]``), which is expected to differ.

Mirrors llama.cpp ``src/llama-kv-cache.cpp`` (cells, ``set_input_kq_mask``) against
TensorRT-LLM ``_torch/pyexecutor/resource_manager.py`` / vLLM block manager (pages).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from infertrace.engine.drive import encode_requests, submit
from infertrace.engine.engine import Engine, EngineOptions
from infertrace.capture.kv_views import conventions, step_summary
from infertrace.kv.base import Memory
from infertrace.ranges import ranges_text

#: default tolerance on logits and K/V: float32 vs reduced precision
ATOL = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 2e-2}
#: the logical variables, in report order
LOGICAL = ("schedule", "positions", "mask", "kv", "tokens", "logits")


class StepCapture:
    """A tracer that keeps, for each step, what the comparison needs, read before the engine
    frees finished requests: chunks, positions, logical masks, all layers' K/V of every
    request holding cache, logits rows and sampled tokens, and a physical summary.

    Only the last step is kept (``self.last``); the caller compares and drops it.
    """

    enabled = True
    layers: frozenset[int] = frozenset()
    taps: frozenset[str] = frozenset()

    def __init__(self) -> None:
        self.last: dict[str, Any] | None = None

    def tap(self, name: str, **tensors: Any) -> None:
        return None

    def begin_step(self) -> None:
        return None

    def end_step(self, ctx: dict[str, Any]) -> None:
        batch, inp, kv = ctx["batch"], ctx["inp"], ctx["kv"]
        chunks = [(c.req.seq_id, c.phase, c.C, c.T) for c in batch.chunks]
        cap: dict[str, Any] = {"step": ctx["step"], "chunks": chunks, "idle": inp is None, "preempted": list(batch.preempted)}
        if inp is None:
            cap.update(positions=[], masks=[], kv={}, logits={}, tokens={}, physical=physical_summary(kv, None))
            self.last = cap
            return
        logits, j = {}, 0
        for c in batch.chunks:
            if c.need_logits:
                logits[c.req.seq_id] = ctx["logits"][j]  # [V]
                j += 1
        holders = sorted(sid for sid, r in ctx["requests"].items() if r.num_computed > 0 and r.status == "running")
        kvs = {}
        for sid in holders:
            ks, vs = zip(*(kv.read(layer, sid) for layer in kv.kv_layers))
            kvs[sid] = (torch.stack(ks), torch.stack(vs))  # [n_layer, L, n_kv_heads, hd] each
        st = kv.recurrent_state()  # hybrid: GDN conv + recurrent state of each holder, compared with K/V
        states = {sid: (torch.stack([st.state_of(il, sid)[0] for il in st.layers]),  # [n_gdn, conv_dim, K-1]
                        torch.stack([st.state_of(il, sid)[1] for il in st.layers]))  # [n_gdn, Hv, dk, dv]
                  for sid in holders if st is not None and st.slot_of(sid) is not None}
        cap.update(positions=inp.positions.tolist(), masks=kv.logical_mask(inp), kv=kvs, logits=logits, state=states,
                   tokens={sid: s.token for sid, s in ctx["samples"].items()}, physical=physical_summary(kv, inp))
        self.last = cap


def physical_summary(kv: Memory, inp: Any) -> dict[str, Any]:
    """JSON-ready physical side of one step: where the step's K/V went and what attention got
    (:func:`infertrace.capture.kv_views.step_summary`)."""
    return step_summary(kv, inp)


def _mask_text(m: torch.Tensor, C: int, row: int) -> str:
    keys = [j for j in range(m.shape[1]) if bool(m[row, j])]
    leak = m.shape[1] > C + m.shape[0] and bool(m[row, -1])
    return ranges_text([k for k in keys if k < m.shape[1] - (1 if leak else 0)]) + (" + a key of another sequence" if leak else "")


def compare_step(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str], atol: float) -> dict[str, Any]:
    """Compare two :class:`StepCapture` records of the same step.

    Returns:
        ``{"step", "idle", "batch": [{seq_id, phase, C, T}], "checks": {variable: {"ok": bool, "detail": str,
        "max_abs"?: float}}, "physical": {name_a: .., name_b: ..}}``.
    """
    na, nb = names
    checks: dict[str, dict[str, Any]] = {}
    same_sched = a["chunks"] == b["chunks"]
    checks["schedule"] = {"ok": same_sched, "detail": "same chunks" if same_sched else
                          f"{na} {_chunks_text(a['chunks'])} vs {nb} {_chunks_text(b['chunks'])}"}
    out = {"step": a["step"], "idle": a["idle"],
           "batch": [{"seq_id": s, "phase": p, "C": C, "T": T} for s, p, C, T in a["chunks"]],
           "checks": checks, "physical": {na: a["physical"], nb: b["physical"]}}
    if not same_sched or a["idle"]:
        return out
    ok = a["positions"] == b["positions"]
    checks["positions"] = {"ok": ok, "detail": "" if ok else f"{na} {a['positions']} vs {nb} {b['positions']}"}
    checks["mask"] = _check_mask(a, b, na, nb)
    checks["kv"] = _check_kv(a, b, na, nb, atol)
    ok = a["tokens"] == b["tokens"]
    checks["tokens"] = {"ok": ok, "detail": "" if ok else f"{na} {a['tokens']} vs {nb} {b['tokens']}"}
    checks["logits"] = _check_logits(a, b, atol)
    return out


def _check_mask(a: dict[str, Any], b: dict[str, Any], na: str, nb: str) -> dict[str, Any]:
    """The visible-key sets of every query (``[T, n_keys]`` bool per chunk) agree."""
    bad = []
    for (sid, _, C, T), ma, mb in zip(a["chunks"], a["masks"], b["masks"]):
        if ma.shape == mb.shape and torch.equal(ma, mb):
            continue
        for i in range(T):
            ta, tb = _mask_text(ma, C, i), _mask_text(mb, C, i)
            if ta != tb:
                bad.append(f"seq {sid} query pos {C + i}: {na} sees {ta}, {nb} sees {tb}")
    n_q = sum(T for *_, T in a["chunks"])
    return {"ok": not bad, "detail": f"{n_q} queries, same visible keys" if not bad else
            "; ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")}


def _check_kv(a: dict[str, Any], b: dict[str, Any], na: str, nb: str, atol: float) -> dict[str, Any]:
    """K/V of every layer for every request holding cache (``[n_layer, L, n_kv_heads, hd]``), max |Δ|
    within ``atol``; on a hybrid model the GDN state too (:func:`_check_state`)."""
    worst, why = 0.0, []
    if set(a["kv"]) != set(b["kv"]):
        why.append(f"requests holding cache differ: {na} {sorted(a['kv'])} vs {nb} {sorted(b['kv'])}")
    for sid in sorted(set(a["kv"]) & set(b["kv"])):
        (ka, va), (kb, vb) = a["kv"][sid], b["kv"][sid]
        if ka.shape != kb.shape:
            why.append(f"seq {sid}: K/V shape {list(ka.shape)} vs {list(kb.shape)}")
            continue
        if not ka.numel():
            continue
        per_layer = torch.maximum((ka.float() - kb.float()).abs().amax(dim=(1, 2, 3)),
                                  (va.float() - vb.float()).abs().amax(dim=(1, 2, 3)))  # [n_layer]
        d = float(per_layer.max())
        worst = max(worst, d)
        if d > atol:
            first = int((per_layer > atol).nonzero()[0])
            why.append(f"seq {sid}: max |ΔK|,|ΔV| = {d:.3g} (above atol from layer {first} on)")
    n_layer = next(iter(a["kv"].values()))[0].shape[0] if a["kv"] else 0
    detail = f"{len(a['kv'])} seq(s) × {n_layer} layers, max |Δ| {worst:.3g}"
    sa, sb = a.get("state") or {}, b.get("state") or {}
    state_abs = None
    if sa or sb:  # hybrid: fixed-size GDN state (conv + recurrent) must agree like K/V does
        sworst, state_abs = _check_state(sa, sb, na, nb, atol, why)
        worst = max(worst, sworst)
        detail += f"; GDN conv+recurrent state of {len(sa)} seq(s), max |Δ| {sworst:.3g}"
    out = {"ok": not why, "max_abs": worst, "detail": detail if not why else "; ".join(why)}
    if state_abs is not None:
        out["state_max_abs"] = state_abs  # GDN state alone: conv and recurrent max |Δ|
    return out


def _check_state(sa: dict[int, Any], sb: dict[int, Any], na: str, nb: str, atol: float,
                 why: list[str]) -> tuple[float, dict[str, float]]:
    """GDN conv state ``[n_gdn, conv_dim, K-1]`` and recurrent state ``[n_gdn, Hv, dk, dv]`` per
    sequence; appends what differs to ``why``. Returns ``(max |Δ|, {"conv", "recurrent"} max |Δ|)``."""
    sworst, cworst, rworst = 0.0, 0.0, 0.0
    if set(sa) != set(sb):
        why.append(f"requests holding GDN state differ: {na} {sorted(sa)} vs {nb} {sorted(sb)}")
    for sid in sorted(set(sa) & set(sb)):
        dc = float((sa[sid][0].float() - sb[sid][0].float()).abs().max())  # conv state [n_gdn, conv_dim, K-1]
        dr = float((sa[sid][1].float() - sb[sid][1].float()).abs().max())  # recurrent state [n_gdn, Hv, dk, dv]
        d = max(dc, dr)
        sworst, cworst, rworst = max(sworst, d), max(cworst, dc), max(rworst, dr)
        if d > atol:
            why.append(f"seq {sid}: GDN state max |Δ| = {d:.3g}")
    return sworst, {"conv": cworst, "recurrent": rworst}


def _check_logits(a: dict[str, Any], b: dict[str, Any], atol: float) -> dict[str, Any]:
    """The logits rows used for sampling (``[V]`` per sampling request), max |Δ| within ``atol``."""
    worst, why = 0.0, []
    for sid in sorted(set(a["logits"]) | set(b["logits"])):
        if sid not in a["logits"] or sid not in b["logits"]:
            why.append(f"seq {sid}: logits in only one backend")
            continue
        d = float((a["logits"][sid] - b["logits"][sid]).abs().max())
        worst = max(worst, d)
        if d > atol:
            why.append(f"seq {sid}: max |Δlogits| = {d:.3g}")
    return {"ok": not why, "max_abs": worst, "rows": len(a["logits"]),
            "detail": f"{len(a['logits'])} row(s), max |Δ| {worst:.3g}" if not why else "; ".join(why)}


def _chunks_text(chunks: list[tuple]) -> str:
    return "[" + ", ".join(f"seq {s} {p} C={C} T={T}" for s, p, C, T in chunks) + "]" if chunks else "[] (idle)"


def diff_backends(loaded: Any, prompts: list[Any], opts: EngineOptions, atol: float | None = None,
                  backends: tuple[str, str] = ("cells", "paged"), max_steps: int = 100_000) -> dict[str, Any]:
    """Run ``prompts`` through two backends in lockstep and compare every step.

    Args:
        loaded: from :func:`infertrace.runner.load_model`.
        prompts: :class:`~infertrace.runner.PromptSpec` list.
        opts: engine options; ``backend`` is replaced by each of ``backends`` (attention
            ``triton`` only applies to ``paged``; ``cells`` always uses its kq_mask path).
        atol: tolerance on logits and K/V (default :data:`ATOL` for the model dtype).

    Returns:
        JSON-ready report: ``{"backends", "atol", "dtype", "requests", "storage", "steps": [compare_step ...],
        "mismatches": [{"step", "variable", "detail"}], "summary": {...}, "identical": bool}``.
        A schedule mismatch ends the comparison at that step.

    Raises:
        InfertraceError: as the engine does (prompt too long, cache too small, ...).
    """
    dtype = str(loaded.model.dtype).replace("torch.", "")
    atol = ATOL.get(dtype, 1e-4) if atol is None else atol
    engines, caps = [], []
    for be in backends:
        o = replace(opts, backend=be, attention=opts.attention if be == "paged" else "torch",
                    sampler_order=opts.sampler_order or "hf")  # one order for both: the caches are compared
        cap = StepCapture()
        e = Engine(loaded.model, loaded.tokenizer, o, cap)
        submit(e, encode_requests(loaded.tokenizer, prompts))
        engines.append(e)
        caps.append(cap)
    steps, mismatches = [], []
    for _ in range(max_steps):
        caps[0].last = caps[1].last = None
        ra, rb = engines[0].step(), engines[1].step()
        if ra is None and rb is None:
            break
        if (ra is None) != (rb is None):
            done, going = (backends[0], backends[1]) if ra is None else (backends[1], backends[0])
            mismatches.append({"step": engines[0].step_no if ra is not None else engines[1].step_no, "variable": "schedule",
                               "detail": f"{done} finished all requests while {going} still has work"})
            break
        rep = compare_step(caps[0].last, caps[1].last, backends, atol)
        steps.append(rep)
        for var, c in rep["checks"].items():
            if not c["ok"]:
                mismatches.append({"step": rep["step"], "variable": var, "detail": c["detail"]})
        if not rep["checks"]["schedule"]["ok"]:
            break
    reqs = []
    for sid in sorted(engines[0].requests):
        ra, rb = engines[0].requests[sid], engines[1].requests[sid]
        reqs.append({"seq_id": sid, "prompt": ra.prompt_text, "prompt_len": len(ra.prompt_ids),
                     "arrival_step": ra.arrival_step, "output_ids": {backends[0]: ra.output_ids, backends[1]: rb.output_ids},
                     "text": loaded.tokenizer.decode(ra.output_ids),
                     "preemptions": {backends[0]: ra.num_preemptions, backends[1]: rb.num_preemptions}})
    summary = _summary(steps, mismatches)
    storage = {be: _storage(e) for be, e in zip(backends, engines)}
    return {"backends": list(backends), "atol": atol, "dtype": dtype, "requests": reqs, "storage": storage,
            "steps": steps, "mismatches": mismatches, "summary": summary, "identical": not mismatches}


def _storage(e: Engine) -> dict[str, Any]:
    """Storage facts: ``layers`` counts the layers holding K/V (hybrid models: the attention layers only,
    named in ``kv_layers``); ``state`` (hybrid only) the GDN conv and recurrent state per layer."""
    kv, cfg = e.kv, e.model.cfg
    mem = kv.describe()
    out = {"kind": mem["kind"], "shape": mem["physical_shape"], **conventions(kv)}
    out.update(layers=len(mem["kv_layers"]), n_layer=cfg.n_layer, kv_layers=mem["kv_layers"])
    st = kv.recurrent_state()
    if st is not None:
        out["state"] = {"layers": list(st.layers), "conv": [st.n_slots, *st.conv_shape], "recurrent": [st.n_slots, *st.rec_shape]}
    return out


def _summary(steps: list[dict[str, Any]], mismatches: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": len(steps), "idle_steps": sum(s["idle"] for s in steps)}
    for var in LOGICAL:
        cs = [s["checks"][var] for s in steps if var in s["checks"]]
        out[var] = {"compared": len(cs), "mismatched_steps": sorted({m["step"] for m in mismatches if m["variable"] == var})}
        if var in ("kv", "logits"):
            out[var]["max_abs"] = max((c["max_abs"] for c in cs), default=0.0)
    sts = [c["state_max_abs"] for c in (s["checks"].get("kv", {}) for s in steps) if "state_max_abs" in c]
    if sts:  # hybrid: the GDN state compared beside K/V
        out["state"] = {k: max(x[k] for x in sts) for k in ("conv", "recurrent")}
    out["queries"] = sum(sum(b["T"] for b in s["batch"]) for s in steps if "mask" in s["checks"])
    out["logits_rows"] = sum(s["checks"]["logits"]["rows"] for s in steps if "logits" in s["checks"])
    return out
