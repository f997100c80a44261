"""``infertrace collect SPOOL``: a served vLLM's spool (:mod:`.plugin`) joined by engine step and rank into an
ordinary ``runtime: vllm`` trace of the marked requests.

The join: the engine core's record of step s (scheduler data, block pool, outputs) and, for every
tensor-parallel rank, its capture of step s (both count one step per ``Scheduler.schedule`` /
``execute_model`` call). The captured batch holds every request of the step; the trace keeps the rows of
the selected marked requests (their tokens, metadata rows, logits rows, K/V) and records the whole
batch (each request's vLLM id and scheduled tokens) in ``step.vllm.served``. The rows then go through
the same conversion as ``run --runtime vllm`` (:func:`~infertrace.runtimes.vllm.steprec.record_step`).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from infertrace.engine.options import EngineOptions, SamplingParams
from infertrace.engine.request import Request
from infertrace.errors import InfertraceError
from infertrace.runtimes.vllm.spool_read import Spool
from infertrace.runtimes.vllm.steprec import ours, record_step

#: capture fields holding one row per packed token
_TOKEN_FIELDS = ("input_ids", "positions", "slot_mapping", "hidden", "q_pre", "q_rot", "k_pre", "k_rot",
                 "k_written", "v_written", "k_cache", "v_cache")


class _Facts:
    def __init__(self, block_size: int, layer: int):
        self.block_size, self.layer = block_size, layer


def marked_requests(sp: Spool) -> list[dict[str, Any]]:
    """The marked requests in admission order: ``{vllm_id, label, step, prompt_ids, params}``."""
    out = []
    for s in sorted(sp.steps):
        rec = sp.steps[s]
        for r in rec["sd"]["new"]:
            info = rec["requests"].get(r["req_id"]) or {}
            if isinstance(info, dict) and info.get("marked"):
                out.append({"vllm_id": r["req_id"], "label": str(info["marked"])[:64], "step": s,
                            "prompt_ids": list(r["prompt_token_ids"]), "params": info.get("params") or {}})
    return out


def select(marked: list[dict[str, Any]], request: str | None) -> list[dict[str, Any]]:
    """The marked requests ``request`` names (vLLM's request id, the response id it starts with, or the
    client's label); all marked ones when None.

    Raises:
        InfertraceError: no marked request, or none matching ``request``.
    """
    if not marked:
        raise InfertraceError("collect: the spool has no marked request; mark one with \"vllm_xargs\": {\"infertrace\": \"1\"} "
                              "in the request body")
    if request is None:
        return marked
    got = [m for m in marked if request in (m["vllm_id"], ours(m["vllm_id"]), m["label"]) or m["vllm_id"].startswith(request + "-")]
    if not got:
        names = ", ".join(f"{ours(m['vllm_id'])} ({m['label']})" for m in marked[:5])
        raise InfertraceError(f"collect: --request {request}: no marked request of that id or label; marked: {names}")
    return got


def _params(p: dict[str, Any], max_model_len: int) -> SamplingParams:
    mt = p.get("max_tokens")
    seed = p.get("seed")
    return SamplingParams(temperature=float(p.get("temperature") or 0.0), top_k=max(0, int(p.get("top_k") or 0)),
                          top_p=float(p.get("top_p") or 1.0), min_p=float(p.get("min_p") or 0.0),
                          repetition_penalty=float(p.get("repetition_penalty") or 1.0),
                          seed=int(seed) if isinstance(seed, int) and seed >= 0 else 0,
                          max_new_tokens=int(mt) if isinstance(mt, int) and mt > 0 else max_model_len,
                          ignore_eos=bool(p.get("ignore_eos")))


def rows_of(rec: dict[str, Any], keep: set[str], spec: dict[str, list[int]]) -> dict[str, Any]:
    """The capture ``rec`` cut to the rows of the requests in ``keep`` (vLLM ids): packed tokens, metadata rows,
    logits rows (1 + drafts per request) and samples; ``query_start_loc`` rebuilt over the kept rows."""
    ids = list(rec["req_ids"])
    rows = [i for i, r in enumerate(ids) if r in keep]
    qsl = rec["query_start_loc"]
    tok = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in rows]).astype(np.int64)  # [T kept]
    n_lg = [1 + len(spec.get(r, [])) for r in ids]
    starts = np.concatenate([[0], np.cumsum(n_lg)])
    lrows = np.concatenate([np.arange(starts[i], starts[i] + n_lg[i]) for i in rows]).astype(np.int64)
    if lrows.size and lrows.max() >= rec["logits"].shape[0]:
        raise InfertraceError(f"collect: a capture has {rec['logits'].shape[0]} logits rows for {len(ids)} requests")
    out = {k: v for k, v in rec.items() if not isinstance(v, np.ndarray)}
    for k in _TOKEN_FIELDS:
        if isinstance(rec.get(k), np.ndarray):
            out[k] = rec[k][tok]
    T_i = [int(qsl[i + 1] - qsl[i]) for i in rows]
    out["query_start_loc"] = np.concatenate([[0], np.cumsum(T_i)]).astype(np.int64)  # [R kept + 1]
    for k in ("seq_lens", "block_table", "sampled"):
        out[k] = rec[k][rows]
    out["logits"] = rec["logits"][lrows]  # [R kept (+ drafts), V]
    out["req_ids"] = [ids[i] for i in rows]
    out["num_actual_tokens"] = int(tok.size)
    out["max_query_len"] = max(T_i)
    out["max_seq_len"] = int(out["seq_lens"].max())
    out["num_decode_tokens"] = sum(t for t in T_i if t == 1)
    out["batch"] = rec["batch"] if isinstance(rec.get("batch"), dict) else {  # already cut in the worker: its batch
        "req_ids": ids, "num_actual_tokens": int(rec["num_actual_tokens"]), "max_query_len": rec.get("max_query_len"),
        "num_decode_tokens": rec.get("num_decode_tokens")}
    return out


def _header(sp: Spool, cfg: Any, layer: int) -> dict[str, Any]:
    """``options.vllm`` of the collected trace (what replay and check read), the server's settings under ``served``."""
    h = sp.header
    ranks = [sp.rank_headers[r] for r in sorted(sp.rank_headers)]
    r0 = ranks[0] if ranks else {}
    return {"version": h.get("version"), "backend": r0.get("backend"), "isa": r0.get("isa"), "block_size": h["block_size"],
            "dtype": h.get("dtype"), "cache_dtype": r0.get("cache_dtype"), "num_blocks": h["num_blocks"], "null_block": 0,
            "max_num_batched_tokens": h.get("max_num_batched_tokens"), "max_num_seqs": h.get("max_num_seqs"),
            "max_model_len": h.get("max_model_len"), "long_prefill_token_threshold": h.get("long_prefill_token_threshold"),
            "enable_prefix_caching": bool(h.get("enable_prefix_caching")), "speculative": h.get("speculative"),
            "tensor_parallel_size": h.get("tensor_parallel_size", 1),
            "ranks": [{"tp_rank": r.get("tp_rank"), "num_kv_heads": r.get("num_kv_heads"), "num_heads": r.get("num_heads"),
                       "cache_shape": r.get("cache_shape"), "layer_name": r.get("layer_name")} for r in ranks],
            "kv_cache_layout": "[num_blocks, num_kv_heads, block_size, 2*head_dim]; K half [head_dim, block_size] "
                               "(transposed), V half [block_size, head_dim] (runtimes/vllm/layout.py)",
            "served": {k: v for k, v in h.items() if k != "kind"}}


def check_spool_model(sp: Spool, cfg: Any) -> int:
    """The captured layer, after checking the spool's server against the model given.

    Raises:
        InfertraceError: no rank recorded, ranks missing, a layer / head layout / block size the model or trace cannot hold.
    """
    h = sp.header
    for k in ("block_size", "num_blocks", "max_model_len"):
        if not isinstance(h.get(k), int) or isinstance(h.get(k), bool) or h[k] <= 0:
            raise InfertraceError(f"collect: the spool's header has no valid {k}")
    tp = h.get("tensor_parallel_size", 1)
    if sorted(sp.rank_headers) != list(range(tp if isinstance(tp, int) and 0 < tp <= 64 else 1)):
        raise InfertraceError(f"collect: the spool holds ranks {sorted(sp.rank_headers)} of a tensor-parallel size {tp}; "
                              "every rank's records are needed (was the spool cut or the server started without the plugin?)")
    layers = {r.get("layer") for r in sp.rank_headers.values()}
    hd = {r.get("head_size") for r in sp.rank_headers.values()}
    if len(layers) != 1 or not isinstance(next(iter(layers)), int) or not 0 <= next(iter(layers)) < cfg.n_layer:
        raise InfertraceError(f"collect: the ranks captured layers {sorted(map(str, layers))}; the model has layers 0..{cfg.n_layer - 1}")
    if hd != {cfg.head_dim}:
        raise InfertraceError(f"collect: the server's head size {sorted(map(str, hd))} is not the model's {cfg.head_dim}: pass the "
                              "--model the server was started from")
    return next(iter(layers))


def _requests(chosen: list[dict[str, Any]], first: int, max_model_len: int) -> dict[str, Request]:
    return {ours(m["vllm_id"]): Request(i, list(m["prompt_ids"]), _params(m["params"], max_model_len), m["step"] - first)
            for i, m in enumerate(chosen)}


def _last_step(sp: Spool, ids: set[str], first: int) -> tuple[int, bool]:
    """The step in which the last of ``ids`` finished (or the last recorded step, False when some never finished)."""
    done: dict[str, int] = {}
    for s in sorted(sp.steps):
        if s < first:
            continue
        for vid, o in sp.steps[s]["outputs"].items():
            if vid in ids and isinstance(o, dict) and o.get("finish_reason"):
                done.setdefault(vid, s)
    if len(done) == len(ids):
        return max(done.values()), True
    return max(sp.steps), False


def collect_trace(sp: Spool, loaded: Any, request: str | None = None, tensors: dict | None = None) -> Any:
    """The ``runtime: vllm`` trace of the marked requests of spool ``sp`` (``request``: see :func:`select`).

    Args:
        loaded: the model the server serves (its GGUF; tokenizer and config for the recorder).
        tensors: filled with the kept tensors (layer K/V, logits top-k...), as ``run --save`` does.

    Raises:
        InfertraceError: see :func:`check_spool_model`, :func:`select`; a step missing from the spool (dropped by
            its size limit); a capture that does not line up with the scheduler's record.
    """
    from infertrace.capture.recorder import VARIABLES, Recorder
    from infertrace.runtimes.vllm.engine import FINISH, VllmKV, _idle

    cfg = loaded.config
    layer = check_spool_model(sp, cfg)
    chosen = select(marked_requests(sp), request)
    first = min(m["step"] for m in chosen)
    B, h = sp.header["block_size"], sp.header
    by_id = _requests(chosen, first, h["max_model_len"])
    vids = {m["vllm_id"] for m in chosen}
    last, all_done = _last_step(sp, vids, first)
    rec_ = Recorder(loaded.tokenizer, cfg, layer=layer, show=tuple(VARIABLES), layers=[layer], tensors=tensors)
    kv = VllmKV(cfg, h["num_blocks"], B, layer, cfg.n_head_kv)
    kv.prefix_cache = bool(h.get("enable_prefix_caching"))
    reqs = list(by_id.values())
    facts = _Facts(B, layer)
    freed: list[int] = []  # blocks freed since the previous step of the trace (idle steps included)
    for s in range(first, last + 1):
        core = sp.steps.get(s)
        if core is None:
            raise InfertraceError(f"collect: engine step {s} is missing from the spool (dropped by its size limit?); "
                                  "collect a request recorded whole, or raise INFERTRACE_SPOOL_MB")
        sd = core["sd"]
        mine = {vid for vid, _ in sd["num_scheduled_tokens"] if vid in vids}
        freed += [b for b in core.get("freed") or [] if b not in freed]
        if not mine:
            _idle(rec_, s - first, kv, reqs, 0.0)
            continue
        per_rank = []
        for r in sorted(sp.captures):
            cap = sp.captures[r].get(s)
            if cap is None:
                raise InfertraceError(f"collect: rank {r} has no capture of engine step {s}, where a marked request ran")
            if not mine <= set(cap["req_ids"]):
                raise InfertraceError(f"collect: rank {r}'s capture of step {s} lacks requests the scheduler ran there")
            per_rank.append(rows_of(cap, mine, sd["spec"]))
        _one_step(rec_, facts, s, first, {**core, "freed": freed}, per_rank, by_id, kv, cfg, FINISH)
        freed = []
    return _trace(loaded, sp, rec_, reqs, chosen, layer, all_done, first)


def _one_step(rec_: Any, facts: _Facts, s: int, first: int, core: dict[str, Any], per_rank: list[dict[str, Any]],
              by_id: dict[str, Request], kv: Any, cfg: Any, finish_names: dict[str, str]) -> None:
    from infertrace.runtimes.vllm.tp import merge_ranks

    rec = merge_ranks(per_rank, cfg.n_head_kv)
    batch = rec.pop("batch")
    kv.ref_cnt = {int(b): int(c) for b, c in core["refs"]}
    kv.free_head = list(core["free_head"])
    finished = {}
    for vid, o in core["outputs"].items():
        if ours(vid) in by_id and isinstance(o, dict) and o.get("finish_reason"):
            fr = str(o["finish_reason"])
            finished[by_id[ours(vid)].seq_id] = finish_names.get(fr, fr)
    before = {k: len(r.output_ids) for k, r in by_id.items()}
    # the trace's batch is the marked rows: its scheduler total counts them (the whole batch is in served.batch)
    sd = {**core["sd"], "total_num_scheduled_tokens": int(rec["num_actual_tokens"])}
    served = {"engine_step": s, "time": core.get("time"),
              "batch": [{"request_id": vid, "num_scheduled_tokens": n} for vid, n in core["sd"]["num_scheduled_tokens"]],
              "request_ids": {str(r.seq_id): k for k, r in by_id.items()},
              "captured_batch": batch, "free_blocks": core["free"], "freed_blocks": sorted(core.get("freed") or [])}
    record_step(facts, rec_, s - first, sd, core["free"], rec, by_id, kv, finished, 0.0, served)
    for vid, o in core["outputs"].items():  # the engine core's tokens are the worker's samples
        r = by_id.get(ours(vid))
        if r is not None and isinstance(o, dict) and r.output_ids[before[ours(vid)]:] != list(o.get("new_token_ids") or []):
            raise InfertraceError(f"collect: step {s}: the worker sampled {r.output_ids[before[ours(vid)]:]} for {vid}, the "
                                  f"engine core output {o.get('new_token_ids')}")
    for sid in finished:
        kv.release(sid)


def _foreign_prefix_notes(sp: Spool, chosen: list[dict[str, Any]]) -> list[str]:
    """A note per marked request whose prefix hit reuses blocks no earlier request of the trace computed (their K/V are
    not in the trace: a replay computes them anew, so its floats for that request do not compare)."""
    out = []
    for i, m in enumerate(chosen):
        new = next((r for r in sp.steps[m["step"]]["sd"]["new"] if r["req_id"] == m["vllm_id"]), None)
        hit = int(new["num_computed_tokens"]) if new else 0
        if hit and not any(e["prompt_ids"][:hit] == m["prompt_ids"][:hit] for e in chosen[:i]):
            out.append(f"{m['vllm_id']}: its prefix hit of {hit} tokens reuses blocks a request outside this trace computed; their "
                       "K/V are not in the trace (mark and collect that request too for a replay whose floats compare)")
    return out


def _trace(loaded: Any, sp: Spool, rec_: Any, reqs: list[Request], chosen: list[dict[str, Any]], layer: int,
           all_done: bool, first: int) -> Any:
    from infertrace.capture.recorder import VARIABLES
    from infertrace.runner import model_identity
    from infertrace.trace.records import RunTrace
    from infertrace.runtimes.vllm import ENGINE

    h = sp.header
    vh = _header(sp, loaded.config, layer)
    tok = loaded.tokenizer
    out_reqs = [{"seq_id": r.seq_id, "prompt": tok.decode(r.prompt_ids), "prompt_ids": r.prompt_ids, "output_ids": r.output_ids,
                 "text": tok.decode(r.output_ids), "stop_reason": r.stop_reason, "arrival_step": r.arrival_step,
                 "num_preemptions": r.num_preemptions, "params": r.params.to_dict(),
                 "vllm_request_id": m["vllm_id"], "vllm_label": m["label"]} for r, m in zip(reqs, chosen)]
    opts = EngineOptions(backend="paged", tokens_per_block=h["block_size"], num_blocks=h["num_blocks"],
                         max_batch_tokens=h.get("max_num_batched_tokens") or 512,
                         prefix_cache=bool(h.get("enable_prefix_caching")), ctx_size=h["max_model_len"])
    options = {"backend": "paged", "attention": "vllm", "dtype": h.get("dtype"), "device": h.get("device"),
               "settings": asdict(opts), "layer": layer, "show": list(VARIABLES), "sampler_order": "hf", "vllm": vh}
    notes = [f"served vLLM ({h.get('version')}, {h.get('device')}): collected from the spool of a running server (plugin "
             f"infertrace.runtimes.vllm.plugin), engine steps {first}.. (trace step 0 = engine step {first}); the trace "
             f"holds the marked request(s) {', '.join(m['vllm_id'] for m in chosen)}; every step's whole batch (each "
             "request's vLLM id and scheduled tokens) is in step.vllm.served.batch",
             f"server settings: block {h['block_size']}, {h['num_blocks']} blocks (block 0 is vLLM's null block), prefix caching "
             f"{'on' if h.get('enable_prefix_caching') else 'off'}, async scheduling {'on' if h.get('async_scheduling') else 'off'}, "
             f"attention {vh.get('backend')}, dtype {h.get('dtype')}, tensor parallel {h.get('tensor_parallel_size', 1)}",
             "arrival_step is the step vLLM's scheduler admitted each request (the server's arrival time is not recorded); "
             "prompt is the prompt ids decoded by the model's tokenizer (the engine core receives ids, not the text)",
             "attn_metadata of a step is the marked rows' (query_start_loc rebuilt over them); the whole batch's counts are "
             "in step.vllm.served.captured_batch"] + list(sp.notes)
    notes += _foreign_prefix_notes(sp, chosen)
    if not all_done:
        notes.append("a marked request had not finished when the spool was read: the trace ends at the last recorded step")
    return RunTrace(model=model_identity(loaded.ckpt), config=loaded.config.to_dict(), options=options,
                    notes=list(loaded.ckpt.notes) + notes, steps=list(rec_.steps), requests=out_reqs, runtime=ENGINE)
