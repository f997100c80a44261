"""``diff-backends --against llama.cpp``: our ``cells`` backend against llama.cpp itself, step by
step, on the same schedule, teacher-forced (llama.cpp consumes the tokens our run chose, so one
numeric divergence cannot cascade).

Three runs of the same requests:

1. ours, ``cells``, float32 (the reference side);
2. llama.cpp through :mod:`infertrace.engine.llamacpp_engine` (same ubatches, forced tokens);
3. ours again in a lower precision (``bfloat16`` by default), forced to the same tokens: the
   **noise floor**. Its spread from run 1 (max |Δ| per variable over all steps) is the spread our
   own engine shows under a precision change of the order of llama.cpp's (8-bit quantised
   activations in the CPU matmuls, an F16 KV cache): llama.cpp is held to that floor, not to a
   constant.

Integers and structure compare exactly: schedule, ``inp_pos``, ``n_kv`` and the mask's padded
shape (``ne``), the kq_mask cell for cell (0 / -inf; when llama.cpp placed tokens in other cells
the columns are mapped through each cell's (pos, seq_ids) and the report says so), ``out_ids``
against our logits rows, the cells each sequence owns after the step (and llama.cpp's
``llama_memory_seq_pos_min/max``), and the cache head. Floats: max |Δ| of the embedding output,
layer ``layer``'s K and V as written and the logits; the next-token metrics of
:mod:`infertrace.engine.kl_metrics`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.kl_metrics import NEAR_TIE_GAP, NEAR_TIE_TOPK, compare_rows
from infertrace.engine.sampler import SampleResult
from infertrace.errors import InfertraceError
from infertrace.model.ops import Ops
from infertrace.model.taps import EMBED, K_ROT, V

FLOAT_VARS = ("hidden", "k", "v", "logits")
#: tolerance = FLOOR_FACTOR x the measured floor: llama.cpp and the emulation are two independent
#: realisations of noise of the same size around ours, so |llama.cpp - ours| may reach the sum of two
FLOOR_FACTOR = 2.0
Q8_BLOCK = 32


def quantize_q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` ``[..., K]`` as ggml-cpu quantises a matmul's activations for quantised weights
    (``quantize_row_q8_0`` / ``q8_1``: blocks of 32 along K, ``d = max|x| / 127``, ``q = round(x / d)``),
    returned dequantised (``q * d``, float32). K not a multiple of 32: returned unchanged."""
    K = x.shape[-1]
    if K % Q8_BLOCK:
        return x
    b = x.float().reshape(*x.shape[:-1], K // Q8_BLOCK, Q8_BLOCK)  # [..., K/32, 32]
    d = b.abs().amax(-1, keepdim=True) / 127.0  # [..., K/32, 1]
    q = torch.where(d > 0, torch.round(b / torch.where(d > 0, d, torch.ones_like(d))), torch.zeros_like(b))
    return (q * d).reshape(x.shape).to(x.dtype)


class Q8ActivationOps(Ops):
    """The decoder's linear op with each matmul's input quantised as :func:`quantize_q8_blocks`
    (ggml-cpu's ``vec_dot`` with a quantised weight); the weight's own kernel does the rest."""

    def linear(self, x: torch.Tensor, w: Any, b: torch.Tensor | None = None) -> torch.Tensor:
        return super().linear(quantize_q8_blocks(x), w, b)


class F16CacheKV:
    """Mixin for :class:`~infertrace.kv.cells.CellsKV`: K/V rounded to float16 when written (llama.cpp's
    default cache type), kept in the compute dtype."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, inp: Any) -> None:  # type: ignore[override]
        super().write(layer, k.half().to(k.dtype), v.half().to(v.dtype), inp)  # type: ignore[misc]


class StepTap:
    """Tracer keeping, per step, everything the comparison needs (full tensors, not summaries)."""

    enabled = True

    def __init__(self, layer: int):
        self.layer = layer
        self.layers = frozenset({layer})
        self.taps = frozenset({K_ROT, V})
        self.steps: list[dict[str, Any]] = []
        self._t: dict[str, torch.Tensor] = {}

    def tap(self, name: str, **t: Any) -> None:
        if name == EMBED:
            self._t["hidden"] = t["value"].float().clone()  # [N, H]
        elif name == K_ROT and t["layer"] == self.layer:
            self._t["k"] = t["value"].float().clone()  # [N, nkv, hd]
        elif name == V and t["layer"] == self.layer:
            self._t["v"] = t["value"].float().clone()  # [N, nkv, hd]

    def begin_step(self) -> None:
        self._t = {}

    def end_step(self, ctx: dict[str, Any]) -> None:
        inp, kv = ctx["inp"], ctx["kv"]
        if inp is None:
            self.steps.append({"step": ctx["step"], "idle": True})
            return
        e, N = inp.extra, inp.n_tokens
        n_kv = int(e["n_kv"])
        mask = e["kq_mask"]  # [n_stream, 1, rows, n_kv]
        own = {}
        for sid in sorted(ctx["requests"]):
            cells = kv.cells_of(sid)
            if cells:
                own[sid] = [p for _, p in cells]
        self.steps.append({
            "step": ctx["step"], "idle": False,
            "chunks": [(c.seq_id, c.C, c.T) for c in inp.chunks],
            "positions": inp.positions.tolist(), "n_kv": n_kv,
            "ne": list(e.get("kq_mask_ne") or [n_kv, int(e["n_tokens_pad"]), 1, 1]),
            "mask_dtype": e.get("kq_mask_dtype") or str(mask.dtype).replace("torch.", ""),
            "mask": mask[0, 0, :N, :n_kv].float().clone(),  # [N, n_kv]
            "cell_idx": e["cell_idx"].tolist(), "cell_pos": e["cell_pos"].tolist(),
            "cell_seq": [frozenset(r.nonzero().flatten().tolist()) for r in e["cell_seq"]],
            "head": (e["head_before"], e["head_after"]), "logits_rows": list(ctx["logits_rows"]),
            "out_ids": e.get("out_ids"), "memory_seq_pos": e.get("memory_seq_pos"), "own": own,
            "logits": ctx["logits"].float().clone(), **self._t,
        })


class ForcedEngine(Engine):
    """Our engine with teacher forcing: the i-th token of request ``s`` is ``forced[s][i]``."""

    def __init__(self, *a: Any, forced: dict[int, list[int]], **k: Any):
        super().__init__(*a, **k)
        self.forced = forced

    def sample_row(self, logits: torch.Tensor, req: Any) -> SampleResult:
        res = super().sample_row(logits, req)
        f = self.forced.get(req.seq_id, [])
        i = len(req.output_ids)
        return SampleResult(int(f[i]), res.top) if i < len(f) else res


def _run_ours(model: Any, tok: Any, prompts: list[Any], opts: EngineOptions, layer: int,
              forced: dict[int, list[int]] | None) -> tuple[Engine, StepTap]:
    from infertrace.runner import encode_prompt

    tap = StepTap(layer)
    eng = ForcedEngine(model, tok, opts, tap, forced=forced or {})
    for s in prompts:
        eng.add_request(encode_prompt(tok, s), s.params, s.arrival_step, s.text)
    eng.run()
    return eng, tap


def _run_emulated(loaded: Any, prompts: list[Any], opts: EngineOptions, layer: int,
                  forced: dict[int, list[int]]) -> StepTap:
    """Our engine, float32, with llama.cpp's CPU numerics emulated (see :func:`quantize_q8_blocks`,
    :class:`F16CacheKV`), forced to ``forced``."""
    from infertrace.kv.cells import CellsKV
    from infertrace.runner import encode_prompt

    class _KV(F16CacheKV, CellsKV):
        pass

    tap = StepTap(layer)
    eng = ForcedEngine(loaded.model.with_ops(Q8ActivationOps()), loaded.tokenizer, opts, tap, forced=forced)
    cfg, m = loaded.model.cfg, loaded.model
    eng.kv = eng.scheduler.kv = _KV(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, opts.ctx_size, opts.n_seq_max, m.dtype, m.device)
    for s in prompts:
        eng.add_request(encode_prompt(loaded.tokenizer, s), s.params, s.arrival_step, s.text)
    eng.run()
    return tap


def _visible(st: dict[str, Any], row: int) -> set[tuple[int, frozenset]]:
    """Row ``row`` of the mask as the set of (pos, seq_ids) of the cells it keeps (placement-free)."""
    keep = (st["mask"][row] == 0).nonzero().flatten().tolist()
    return {(st["cell_pos"][c], st["cell_seq"][c]) for c in keep}


def structural_diff(a: list[dict[str, Any]], b: list[dict[str, Any]], name_b: str = "llama.cpp") -> dict[str, Any]:
    """Exact comparison of two :class:`StepTap` step lists (``a`` ours, ``b`` the other engine).

    Returns:
        ``{"checked": int, "mismatches": [{"step", "variable", "detail"}], "placement": text,
        "mask_dtype": {"ours", name_b}}``.
    """
    mism, n, placement_same = [], 0, True
    dtypes = set()

    def bad(step: int, var: str, detail: str) -> None:
        mism.append({"step": step, "variable": var, "detail": detail})

    if len(a) != len(b):
        bad(min(len(a), len(b)), "schedule", f"ours ran {len(a)} steps, {name_b} {len(b)}")
    for x, y in zip(a, b):
        s = x["step"]
        n += 1
        if x["idle"] or y["idle"]:
            if x["idle"] != y["idle"]:
                bad(s, "schedule", "one side idle")
            continue
        if x["chunks"] != y["chunks"]:
            bad(s, "schedule", f"chunks (seq, C, T) ours {x['chunks']} vs {name_b} {y['chunks']}")
            continue
        checks = [("positions", "inp_pos", x["positions"], y["positions"]), ("mask", "n_kv", x["n_kv"], y["n_kv"]),
                  ("mask", "kq_mask ne (n_kv, padded n_tokens, 1, n_stream)", x["ne"], y["ne"]),
                  ("decode", "rows producing logits (ours logits_rows vs out_ids)", x["logits_rows"],
                   y["out_ids"] if y["out_ids"] is not None else y["logits_rows"]),
                  ("kv", "sequence ownership after the step (positions per seq)", x["own"], y["own"]),
                  ("kv", "cache head before/after", x["head"], y["head"])]
        for var, what, u, v in checks:
            n += 1
            if u != v:
                bad(s, var, f"{what}: ours {str(u)[:120]} vs {name_b} {str(v)[:120]}")
        dtypes.add((x["mask_dtype"], y["mask_dtype"]))
        if y.get("memory_seq_pos"):
            for sid, (lo, hi) in y["memory_seq_pos"].items():
                n += 1
                own = x["own"].get(int(sid), [])
                if own and [lo, hi] != [min(own), max(own)]:
                    bad(s, "kv", f"seq {sid}: llama_memory_seq_pos_min/max {lo}..{hi}, ours {min(own)}..{max(own)}")
        same_cells = x["cell_idx"] == y["cell_idx"]
        placement_same &= same_cells
        N = len(x["positions"])
        if same_cells and x["mask"].shape == y["mask"].shape:
            n += 1
            d = ((x["mask"] == 0) != (y["mask"] == 0)).nonzero().tolist()
            if d:
                r, c = d[0]
                bad(s, "mask", f"kq_mask[{r}][{c}] (query pos {x['positions'][r]}, cell {c}): ours "
                    f"{'0' if x['mask'][r, c] == 0 else '-inf'} vs {name_b} {'0' if y['mask'][r, c] == 0 else '-inf'} "
                    f"({len(d)} cells differ)")
        else:
            for r in range(N):
                n += 1
                va, vb = _visible(x, r), _visible(y, r)
                if va != vb:
                    bad(s, "mask", f"query row {r} (pos {x['positions'][r]}): visible (pos, seqs) differ after mapping "
                        f"cells: only ours {sorted((p, sorted(q)) for p, q in va - vb)[:4]}, only {name_b} "
                        f"{sorted((p, sorted(q)) for p, q in vb - va)[:4]}")
                    break
    placement = ("identical: every token went to the same cell index" if placement_same else
                 "differs: llama.cpp chose other cell indices; kq_mask columns compared after mapping each cell to its (pos, seq_ids)")
    return {"checked": n, "mismatches": mism, "placement": placement,
            "mask_dtype": {"ours": sorted({d[0] for d in dtypes}), name_b: sorted({d[1] for d in dtypes})}}


def float_spread(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per step, max |Δ| of :data:`FLOAT_VARS` between two step lists (same schedule)."""
    out = []
    for x, y in zip(a, b):
        if x["idle"] or y["idle"]:
            continue
        d = {"step": x["step"]}
        for v in FLOAT_VARS:
            if v in x and v in y and x[v].shape == y[v].shape and x[v].numel():
                d[v] = float((x[v] - y[v]).abs().max())
        out.append(d)
    return out


def compare_with_llamacpp(loaded: Any, prompts: list[Any], opts: EngineOptions, layer: int = 0,
                          floor_dtype: str = "llama.cpp-numerics") -> dict[str, Any]:
    """The three runs of the module docstring and their comparison.

    Returns:
        ``{"against": "llama.cpp", "structural": structural_diff(...), "next_token": compare_rows(...),
        "max_abs": {var: float}, "floor": {"how", "dtype", "max_abs": {var: float}, "next_token": {...}},
        "first_exceeding": {"step", "layer", "variable", "value", "floor"} | None, "requests": [...],
        "identical": bool, "mismatches": [...]}``.

    Raises:
        InfertraceError: llama-cpp-python missing, non-GGUF model, engine errors.
    """
    from infertrace.engine.llamacpp_engine import run_llamacpp
    from infertrace.runner import load_model

    o = replace(opts, backend="cells", attention="torch")
    if getattr(loaded.config, "is_hybrid", False):
        raise InfertraceError("--against llama.cpp reads per-layer K/V from llama.cpp's graph, which this comparison does not "
                              "do yet for hybrid (GDN) models; use --against hf (tests compare llama.cpp's logits directly)")
    if not 0 <= layer < loaded.config.n_layer:
        raise InfertraceError(f"--layer {layer} out of range: the model has layers 0..{loaded.config.n_layer - 1}")
    eng, ours = _run_ours(loaded.model, loaded.tokenizer, prompts, o, layer, None)
    forced = {sid: list(r.output_ids) for sid, r in eng.requests.items()}
    ltap = StepTap(layer)
    leng, notes = run_llamacpp(loaded, prompts, o, ltap, layer, forced)
    leng.close()
    if floor_dtype == "llama.cpp-numerics":
        floor = _run_emulated(loaded, prompts, o, layer, forced)
        how = ("ours float32 vs ours with llama.cpp's numerics emulated (matmul inputs quantised to 8-bit blocks of 32 "
               "as ggml-cpu's Q8_0/Q8_1 vec_dot, K/V rounded to F16 as the cache) on the same forced tokens: max |Δ| per "
               f"variable over all steps; tolerance = {FLOOR_FACTOR:g} x floor")
    else:
        low = load_model(loaded.ckpt.path, dtype=floor_dtype)
        _, floor = _run_ours(low.model, low.tokenizer, prompts, o, layer, forced)
        how = (f"ours float32 vs ours {floor_dtype} on the same forced tokens: max |Δ| per variable over all steps; "
               f"tolerance = {FLOOR_FACTOR:g} x floor")

    struct = structural_diff(ours.steps, ltap.steps)
    spread, floor_spread = float_spread(ours.steps, ltap.steps), float_spread(ours.steps, floor.steps)
    fmax = {v: max((d.get(v, 0.0) for d in floor_spread), default=0.0) for v in FLOAT_VARS}
    lmax = {v: max((d.get(v, 0.0) for d in spread), default=0.0) for v in FLOAT_VARS}
    first = None
    order = ("hidden", "k", "v", "logits")  # the order the forward pass produces them
    for d in spread:
        for v in order:
            if d.get(v, 0.0) > FLOOR_FACTOR * fmax[v]:
                first = {"step": d["step"], "layer": layer if v in ("k", "v") else (-1 if v == "hidden" else "output"),
                         "variable": v, "value": d[v], "floor": fmax[v], "tolerance": FLOOR_FACTOR * fmax[v]}
                break
        if first:
            break

    def rows(steps: list[dict[str, Any]]) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        out, lab = [], []
        for st in steps:
            if st["idle"] or not st["logits_rows"]:
                continue
            out.append(st["logits"])
            r2s = {}
            r = 0
            for sid, C, T in st["chunks"]:
                r2s[r + T - 1] = (sid, C + T - 1)
                r += T
            lab += [{"step": st["step"], "seq_id": r2s[r][0], "pos": r2s[r][1]} for r in st["logits_rows"]]
        return (torch.cat(out) if out else torch.zeros(0, 1)), lab

    base, labels = rows(ours.steps)
    lrows, _ = rows(ltap.steps)
    frows, _ = rows(floor.steps)
    nt = compare_rows(base, lrows, labels)
    nt_floor = compare_rows(base, frows, labels)
    nt_floor.pop("disagreements")
    reqs = [{"seq_id": sid, "prompt": r.prompt_text, "tokens": list(r.output_ids),
             "text": loaded.tokenizer.decode(r.output_ids)} for sid, r in sorted(eng.requests.items())]
    mism = list(struct["mismatches"])
    if first is not None:
        mism.append({"step": first["step"], "variable": first["variable"],
                     "detail": f"max |Δ| {first['value']:.4g} exceeds the tolerance {first['tolerance']:.4g} = "
                               f"{FLOOR_FACTOR:g} x noise floor (layer {first['layer']})"})
    for d in nt["disagreements"]:
        if not d["near_tie"]:
            mism.append({"step": d["step"], "variable": "decode",
                         "detail": f"seq {d['seq_id']} pos {d['pos']}: top token ours {d['base_top']} vs llama.cpp "
                                   f"{d['new_top']} is not a near tie (ranks {d['rank_of_new_top_in_base']}, "
                                   f"{d['rank_of_base_top_in_new']}; gaps {d['logp_gap_base']}, {d['logp_gap_new']} nats)"})
    return {"against": "llama.cpp", "backend": "cells", "layer": layer, "structural": struct, "next_token": nt,
            "max_abs": lmax, "per_step": spread,
            "floor": {"dtype": floor_dtype, "max_abs": fmax, "next_token": nt_floor, "how": how, "factor": FLOOR_FACTOR},
            "near_tie_rule": f"the other side's choice is in both top-{NEAR_TIE_TOPK} and within {NEAR_TIE_GAP} nats of the top log-probability in both",
            "first_exceeding": first, "requests": reqs, "notes": notes, "mismatches": mism, "identical": not mism}
