"""``infertrace bisect A B``: where two saved traces of one model and one token sequence first differ.

Walks token -> position -> layer -> tap, numpy only (no torch):

1. per position of the compared request, the next-token top-1 (``step{s}/logits_topk_ids[row, 0]``) and
   the logits row (its saved top-k values, compared on the token ids both sides kept, each centred on
   its mean there: softmax ignores a constant shift); the first
   position whose top-1 differs and the first whose logits differ beyond the floor;
2. at the earliest such position, the error of every per-layer tap both traces saved
   (``step{s}/layer{l}/{tap}`` row of that position, plus the embedding ``step{s}/hidden``), in firing
   order, and the first tap above the floor: ``attn_out`` names the attention branch, ``mlp_out`` the
   MLP, ``resid_post``/``hidden_in`` the residual stream;
3. the batch each trace ran at that step (seq ids, phase, tokens each, prefill chunk or not);
4. the floor: relative L2 (``||a - b|| / ||a||``), given (``--floor``), measured from a pair of
   traces taken as noise (``--floor-from C D``: the largest error over all their comparable
   positions, per layer and tap), or the stated default. Cosine similarity is reported beside it.

Comparable positions: those whose token history (prompt + generated tokens up to and including the
position's input token) is equal in both traces; after the first differing generated token the two
runs fed different inputs, and comparison stops there. Traces are untrusted: shapes are checked
against the step records and the model config before any row is read, and tensors are bounded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infertrace.errors import InfertraceError
from infertrace.trace.records import RunTrace, StepTrace
from infertrace.trace.store import TraceTensors

#: per-layer taps in firing order, as saved (``Recorder._capture`` / ``TENSOR_NAMES``)
TAP_ORDER = ("hidden_in", "q_pre_rope", "k_pre_rope", "v", "q_post_rope", "k_post_rope", "attn_out", "mlp_out",
             "resid_post")
#: what each tap names when it is the first one above the floor
TAP_BRANCH = {"embed": "embedding", "hidden_in": "residual stream entering the layer", "q_pre_rope": "attention (Q)",
              "k_pre_rope": "attention (K)", "v": "attention (V)", "q_post_rope": "attention (RoPE on Q)",
              "k_post_rope": "attention (RoPE on K)", "attn_out": "attention", "mlp_out": "MLP",
              "resid_post": "residual stream leaving the layer"}
#: default relative-L2 floors when neither --floor nor --floor-from is given (keyed by "both float32")
DEFAULT_FLOOR_FP32 = 1e-3
DEFAULT_FLOOR_LOW = 3e-2
#: lower bound of a measured floor (relative L2), keyed by "both float32": a noise pair that agrees
#: bit for bit measures 0, yet rounding alone (another batch shape, another kernel) moves fp32 rows by
#: ~1e-7..1e-6 and bf16 rows by ~1e-3
MIN_FLOOR_FP32 = 1e-5
MIN_FLOOR_LOW = 1e-2
#: bound on one tensor read for comparison (elements)
MAX_TENSOR_ELEMS = 1 << 26
#: config fields two traces must share to be "the same model"
MODEL_FIELDS = ("arch", "n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "vocab_size")


@dataclass
class Floor:
    """The relative-L2 noise floor: one value for logits rows and per ``(layer, tap)`` values for
    taps (``default`` where a tap has none), with where it came from (printed)."""

    logits: float
    default: float
    source: str
    taps: dict[tuple[int, str], float] = field(default_factory=dict)

    def tap(self, layer: int, tap: str) -> float:
        return self.taps.get((layer, tap), self.default)


@dataclass
class Side:
    """One trace's compared request: token history, and per position where its logits row and
    tap row live. ``logit_at[pos] = (step index, row in logits_topk)``, ``row_at[pos] = (step index,
    packed row)``."""

    name: str
    trace: RunTrace
    tensors: TraceTensors | None
    seq_id: int
    tokens: list[int]
    n_prompt: int
    logit_at: dict[int, tuple[int, int]]
    row_at: dict[int, tuple[int, int]]
    #: the arrays read for one step (walking a prefill reads each of its tensors once, not once per position)
    cache: tuple[int, dict[str, np.ndarray]] = field(default_factory=lambda: (-1, {}))
    #: rows of this request computed in speculative verify chunks (not compared: a verify row's logits are a draft's)
    verify_rows: int = 0


def err(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(relative L2 ``||a-b|| / ||a||``, cosine) of two equal-shape float arrays, in float64.
    ``||a|| = 0``: relative L2 is ``||b||`` (0 when both are zero); cosine of a zero vector is 1 when
    both are zero, else 0. Non-finite inputs give ``inf`` / ``nan`` (counted as above any floor)."""
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()  # [n] each
    na, nb, nd = float(np.linalg.norm(a64)), float(np.linalg.norm(b64)), float(np.linalg.norm(a64 - b64))
    if not (np.isfinite(na) and np.isfinite(nb) and np.isfinite(nd)):
        return float("inf"), float("nan")
    rel = nd / na if na > 0 else nb
    cos = float(a64 @ b64) / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb == 0 else 0.0)
    return rel, cos


def above(rel: float, floor: float) -> bool:
    """True when ``rel`` is above ``floor`` (a non-finite error always is)."""
    return not np.isfinite(rel) or rel > floor


# ----------------------------------------------------------------------------- loading the compared request


def same_model(ma: dict[str, Any], mb: dict[str, Any], na: str, nb: str) -> None:
    """Raise (exit 2) when the two manifests' configs differ in an architecture field."""
    ca, cb = ma.get("config", {}), mb.get("config", {})
    for k in MODEL_FIELDS:
        if ca.get(k) != cb.get(k):
            raise InfertraceError(f"{na} and {nb} are traces of different models (config {k}: {ca.get(k)!r} vs "
                                  f"{cb.get(k)!r}); bisect compares two runs of one model")


def pick_request(trace: RunTrace, name: str, seq: int | None, prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """The request to compare: ``seq`` (A), or in B the same seq id when its prompt matches, else the
    first request with ``prompt_ids``. Raises InfertraceError (exit 2) when there is none."""
    reqs = [r for r in trace.requests if isinstance(r, dict)]
    if prompt_ids is None:
        if not reqs:
            raise InfertraceError(f"{name}: the trace holds no request")
        hit = [r for r in reqs if seq is None or r.get("seq_id") == seq]
        if not hit:
            raise InfertraceError(f"{name}: no request with seq_id {seq} (the trace has "
                                  f"{', '.join(str(r.get('seq_id')) for r in reqs[:20])})")
        return hit[0]
    same = [r for r in reqs if r.get("prompt_ids") == prompt_ids]
    if not same:
        raise InfertraceError(f"{name}: no request has the prompt tokens of the compared request (different token "
                              "sequences); bisect compares two runs of one token sequence")
    return next((r for r in same if r.get("seq_id") == seq), same[0])


def _ids(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise InfertraceError(f"{what}: expected a list of token ids")
    return list(v)


def load_side(name: str, trace: RunTrace, tensors: TraceTensors | None, req: dict[str, Any]) -> Side:
    """Index one trace's request: the position of each logits row and packed row (first computation
    of a position wins, e.g. before a preemption's recompute). Speculative verify chunks are skipped."""
    sid = req.get("seq_id")
    prompt = _ids(req.get("prompt_ids"), f"{name}: request {sid} prompt_ids")
    out = _ids(req.get("output_ids", []), f"{name}: request {sid} output_ids")
    logit_at: dict[int, tuple[int, int]] = {}
    row_at: dict[int, tuple[int, int]] = {}
    verify = 0
    for si, st in enumerate(trace.steps):
        for b in st.batch:
            if b.seq_id == sid and b.spec is not None:
                verify += b.T
            if b.seq_id != sid or b.spec is not None:
                continue
            if len(b.rows) != len(b.positions) or any(not 0 <= r < st.N for r in b.rows):
                raise InfertraceError(f"{name}: step {st.step}: seq {sid} rows do not match its positions or N")
            for r, p in zip(b.rows, b.positions):
                row_at.setdefault(int(p), (si, int(r)))
            if b.logits_row is not None and b.positions:
                logit_at.setdefault(int(b.positions[-1]), (si, int(b.logits_row)))
    return Side(name, trace, tensors, int(sid), prompt + out, len(prompt), logit_at, row_at, verify_rows=verify)


# ----------------------------------------------------------------------------- reading rows, checked


def _tensor(side: Side, name: str, st: StepTrace, row_dim: int, tail: tuple[int, ...] | None) -> np.ndarray | None:
    """``name`` of ``side`` when saved, checked: ``[row_dim, *tail]`` (``tail`` None: any trailing
    shape), at most :data:`MAX_TENSOR_ELEMS` elements. None when not saved."""
    tt = side.tensors
    if tt is None or name not in tt:
        return None
    shape = [int(x) for x in tt.index[name].get("shape", [])]
    if not shape or shape[0] != row_dim or (tail is not None and tuple(shape[1:]) != tail):
        raise InfertraceError(f"{side.name}: tensor {name} has shape {shape}, expected [{row_dim}, ...] for step "
                              f"{st.step}; the trace is inconsistent, re-save it")
    if int(np.prod(shape, dtype=np.int64)) > MAX_TENSOR_ELEMS:
        raise InfertraceError(f"{side.name}: tensor {name} has {int(np.prod(shape, dtype=np.int64))} elements "
                              f"(limit {MAX_TENSOR_ELEMS}); bisect refuses it")
    if side.cache[0] != st.step:
        side.cache = (st.step, {})
    got = side.cache[1]
    if name not in got:
        got[name] = tt.array(name)
        if list(got[name].shape) != shape:  # the file and the manifest index were checked to agree; keep it so
            raise InfertraceError(f"{side.name}: tensor {name} reads back as {list(got[name].shape)}, not {shape}")
    return got[name]


def logits_row(side: Side, pos: int, vocab: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids ``[k]`` int64, values ``[k]`` float) of the saved top-k logits at ``pos``, or None."""
    si, j = side.logit_at[pos]
    st = side.trace.steps[si]
    m = len(st.decode.logits_rows) if st.decode is not None else None
    if m is None or not 0 <= j < m:
        raise InfertraceError(f"{side.name}: step {st.step}: logits row {j} outside the step's {m} logits rows")
    ids = _tensor(side, f"step{st.step}/logits_topk_ids", st, m, None)
    vals = _tensor(side, f"step{st.step}/logits_topk_values", st, m, None)
    if ids is None or vals is None:
        return None
    if ids.shape != vals.shape or ids.ndim != 2 or ids.shape[1] < 1:
        raise InfertraceError(f"{side.name}: step {st.step}: logits_topk ids {list(ids.shape)} and values "
                              f"{list(vals.shape)} do not match")
    r_ids = ids[j].astype(np.int64)  # [k]
    if (r_ids < 0).any() or (r_ids >= vocab).any():
        raise InfertraceError(f"{side.name}: step {st.step}: a top-k token id lies outside the vocabulary ({vocab})")
    return r_ids, vals[j]


def compare_logits(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    """Top-1 of each side and the error of the logits on the token ids both top-k lists hold (A's order),
    each side centred on its mean over those ids (relative L2 and cosine of the centred values).
    Fewer than two shared ids: relative L2 ``inf`` (the rows are too far apart to compare)."""
    (ia, va), (ib, vb) = a, b
    where_b = {int(t): i for i, t in enumerate(ib.tolist())}
    common = [(i, where_b[int(t)]) for i, t in enumerate(ia.tolist()) if int(t) in where_b]
    if len(common) >= 2:  # centred: logits are defined up to a constant per row (softmax ignores it)
        xa = va[[i for i, _ in common]].astype(np.float64)  # [c]
        xb = vb[[j for _, j in common]].astype(np.float64)  # [c]
        rel, cos = err(xa - xa.mean(), xb - xb.mean())
    else:
        rel, cos = float("inf"), float("nan")
    return {"top1_a": int(ia[0]), "top1_b": int(ib[0]), "rel_l2": rel, "cosine": cos,
            "shared_topk": len(common), "k": int(len(ia))}


def tap_rows(side: Side, pos: int, cfg: dict[str, Any]) -> dict[tuple[int, str], np.ndarray]:
    """``{(layer, tap): row}`` at ``pos``: the embedding as ``(-1, "embed")`` and every saved
    per-layer tap of :data:`TAP_ORDER`; each checked against the step's N and the model's widths."""
    if pos not in side.row_at:
        return {}
    si, r = side.row_at[pos]
    st = side.trace.steps[si]
    H, nh, nkv, hd = (int(cfg.get(k) or 0) for k in ("n_embd", "n_head", "n_head_kv", "head_dim"))
    tails = {"q_pre_rope": (nh, hd), "q_post_rope": (nh, hd), "k_pre_rope": (nkv, hd), "k_post_rope": (nkv, hd),
             "v": (nkv, hd)}
    out: dict[tuple[int, str], np.ndarray] = {}
    emb = _tensor(side, f"step{st.step}/hidden", st, st.N, (H,))
    if emb is not None:
        out[(-1, "embed")] = emb[r]
    for layer in range(int(cfg.get("n_layer") or 0)):
        for tap in TAP_ORDER:
            t = _tensor(side, f"step{st.step}/layer{layer}/{tap}", st, st.N, tails.get(tap, (H,)))
            if t is not None:
                out[(layer, tap)] = t[r]
    return out


# ----------------------------------------------------------------------------- the walk


def comparable(a: Side, b: Side) -> tuple[int, int | None]:
    """(number of leading positions whose token history agrees, index of the first differing token or None).

    Position ``p`` is comparable when ``tokens[0..p]`` agree: both runs computed it from the same inputs.

    Raises:
        InfertraceError: the prompts differ (different token sequences; exit 2).
    """
    if a.tokens[:a.n_prompt] != b.tokens[:b.n_prompt]:
        raise InfertraceError(f"{a.name} and {b.name} ran different token sequences (prompt ids differ); "
                              "bisect compares two runs of one token sequence")
    n = min(len(a.tokens), len(b.tokens))
    first = next((i for i in range(n) if a.tokens[i] != b.tokens[i]), None)
    return (first if first is not None else n), first


def walk_logits(a: Side, b: Side, vocab: int, n_cmp: int) -> list[dict[str, Any]]:
    """Per comparable position with a logits row in both traces: :func:`compare_logits` plus ``pos``."""
    rows = []
    for pos in range(n_cmp):
        if pos not in a.logit_at or pos not in b.logit_at:
            continue
        la, lb = logits_row(a, pos, vocab), logits_row(b, pos, vocab)
        if la is None or lb is None:
            continue
        rows.append({"pos": pos, **compare_logits(la, lb)})
    return rows


def tap_errors(a: Side, b: Side, pos: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (layer, tap) both traces saved at ``pos``, in firing order: relative L2 and cosine."""
    ra, rb = tap_rows(a, pos, cfg), tap_rows(b, pos, cfg)
    out = []
    for key in sorted(set(ra) & set(rb), key=lambda k: (k[0], TAP_ORDER.index(k[1]) if k[1] in TAP_ORDER else -1)):
        if ra[key].shape != rb[key].shape:
            raise InfertraceError(f"tap {key[1]} of layer {key[0]}: shapes {list(ra[key].shape)} vs {list(rb[key].shape)}")
        rel, cos = err(ra[key], rb[key])
        out.append({"layer": key[0], "tap": key[1], "rel_l2": rel, "cosine": cos})
    return out


def measure_floor(c: Side, d: Side, cfg: dict[str, Any], source: str, minimum: float = MIN_FLOOR_FP32) -> Floor:
    """The floor from a noise pair: the largest relative L2 of logits rows over their comparable
    positions, and per (layer, tap) the largest over the positions both saved, each raised to at least
    ``minimum`` (:data:`MIN_FLOOR_FP32`: a bit-identical pair measures 0); ``default`` (for taps the
    pair lacks) is the largest tap value measured (or the logits floor when none)."""
    n_cmp, _ = comparable(c, d)
    logit = [r["rel_l2"] for r in walk_logits(c, d, int(cfg.get("vocab_size") or 0), n_cmp)]
    if not logit:
        raise InfertraceError(f"--floor-from {c.name} {d.name}: the pair shares no comparable logits row to measure a floor")
    taps: dict[tuple[int, str], float] = {}
    for pos in range(n_cmp):
        for e in tap_errors(c, d, pos, cfg):
            k = (e["layer"], e["tap"])
            taps[k] = max(taps.get(k, 0.0), e["rel_l2"])
    taps = {k: max(v, minimum) for k, v in taps.items()}
    lf = max(max(logit), minimum)
    return Floor(logits=lf, default=max(taps.values(), default=lf), source=f"{source}, at least {minimum:g}", taps=taps)


def batch_at(side: Side, pos: int) -> dict[str, Any] | None:
    """The step that computed ``pos`` in ``side``: step number and its batch (seq ids, phase, C, T,
    prefill chunk or the whole prompt), from the trace's step records."""
    hit = side.row_at.get(pos)
    if hit is None:
        return None
    st = side.trace.steps[hit[0]]
    n_prompt = {r.get("seq_id"): len(r.get("prompt_ids") or []) for r in side.trace.requests if isinstance(r, dict)}
    reqs = []
    for b in st.batch:
        kind = b.phase
        if b.phase == "prefill":
            lp = n_prompt.get(b.seq_id, b.C + b.T)
            kind = "prefill" if b.C == 0 and b.T >= lp else f"prefill chunk {b.C}..{b.C + b.T - 1} of {lp}"
        reqs.append({"seq_id": b.seq_id, "phase": b.phase, "kind": kind, "C": b.C, "T": b.T})
    return {"step": st.step, "N": st.N, "requests": reqs}


def one_sided(a: Side, b: Side, pos: int | None, cfg: dict[str, Any]) -> list[str]:
    """A note per trace holding taps at ``pos`` the other lacks (not compared): e.g. llama.cpp computes its last
    layer's FFN for the logits rows only, an HF trace has no post-RoPE tap."""
    if pos is None:
        return []
    ka, kb = set(tap_rows(a, pos, cfg)), set(tap_rows(b, pos, cfg))
    out = []
    for x, y, only in ((a, b, sorted(ka - kb)), (b, a, sorted(kb - ka))):
        if only:
            by: dict[str, list[int]] = {}
            for layer, tap in only:
                by.setdefault(tap, []).append(layer)
            shown = ", ".join(f"{t} ({len(ls)} layers)" if len(ls) > 2 else f"{t} (layer {', '.join(map(str, ls))})"
                              for t, ls in sorted(by.items()))
            out.append(f"{len(only)} tap(s) at position {pos} saved by {x.name} only, not compared ({shown}): {y.name} did "
                       "not save them there (see its trace notes and options.tap_sources)")
    return out


def bisect(a: Side, b: Side, cfg: dict[str, Any], floor: Floor) -> dict[str, Any]:
    """The whole report (module docstring): ``first_top1``, ``first_logits`` (each ``{pos, ...}`` or
    None), ``position`` (the earliest of the two), ``taps`` and ``first_tap`` there, ``batch`` per
    trace, ``floor``, ``diverged`` (a logits row, or a tap at the position, above the floor), ``tokens``."""
    n_cmp, first_tok = comparable(a, b)
    rows = walk_logits(a, b, int(cfg.get("vocab_size") or 0), n_cmp)
    if not rows:
        raise InfertraceError(f"{a.name} and {b.name}: no position has saved logits in both traces; save both "
                              "with tensors kept (run --save DIR --keep tensors)")
    top1 = next((r for r in rows if r["top1_a"] != r["top1_b"]), None)
    over = next((r for r in rows if above(r["rel_l2"], floor.logits)), None)
    pos = min((r["pos"] for r in (top1, over) if r is not None), default=None)
    taps, first_tap = [], None
    if pos is not None:
        taps = tap_errors(a, b, pos, cfg)
        for e in taps:
            e["floor"] = floor.tap(e["layer"], e["tap"])
            e["above"] = above(e["rel_l2"], e["floor"])
        first_tap = next((e for e in taps if e["above"]), None)
        if first_tap is not None:
            first_tap = {**first_tap, "branch": TAP_BRANCH.get(first_tap["tap"], first_tap["tap"])}
            saved = {e["layer"] for e in taps}
            # layers before the first tap that were not compared: the divergence may start there
            first_tap["layers_not_compared_before"] = [x for x in range(max(first_tap["layer"], 0)) if x not in saved]
    return {
        "a": a.name, "b": b.name, "seq_id_a": a.seq_id, "seq_id_b": b.seq_id,
        "tokens": {"prompt": a.n_prompt, "compared_positions": n_cmp, "first_token_differs_at": first_tok,
                   "positions_with_logits": len(rows)},
        "floor": {"logits_rel_l2": floor.logits, "taps_default_rel_l2": floor.default, "source": floor.source,
                  "per_tap": len(floor.taps) > 0},
        "first_top1": top1, "first_logits": over, "position": pos,
        "max_logits_rel_l2": max(r["rel_l2"] for r in rows),
        "taps": taps, "first_tap": first_tap,
        "batch": None if pos is None else {"a": batch_at(a, pos), "b": batch_at(b, pos)},
        # a top-1 flip with logits inside the floor is a near tie at noise level: reported, not a divergence
        "diverged": over is not None or first_tap is not None,
        "notes": [f"{s.name} ran {s.verify_rows} row(s) of this request in speculative verify steps: those positions are "
                  "not compared (only ordinary prefill / decode rows are); run both without --speculative to compare "
                  "every position" for s in (a, b) if s.verify_rows] + one_sided(a, b, pos, cfg),
    }
