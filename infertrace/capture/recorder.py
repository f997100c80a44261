"""The tracer: collects tap-point tensors during a step and turns the step into a :class:`StepTrace`.

Passed to the engine explicitly (no globals). Taps are read-only: nothing here changes a
tensor the engine uses. Two halves: :func:`~infertrace.capture.probe.probe` copies what a record
needs out of the live step (the runtime side), :meth:`Recorder.record` builds the record from that
plain :class:`~infertrace.capture.step_data.StepData` alone (it may have crossed a process boundary);
:meth:`Recorder.end_step` is the two in a row. Nothing here imports the memory (:mod:`infertrace.kv`)
or the engine.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from infertrace.capture.hybrid_rec import hybrid_record
from infertrace.capture.probe import TENSOR_NAMES, probe
from infertrace.capture.spec_capture import verify_record
from infertrace.capture.step_data import StepData, Want
from infertrace.model.config import NO_REUSE_REASON
from infertrace.model.rope import inv_freq_table
from infertrace.model.taps import ATTN_IN, ATTN_OUT, EMBED, GATE, K, K_ROT, Q, Q_ROT, QKV, RESID_PRE, SSM_STATE, V, Z
from infertrace.ranges import ranges_text
from infertrace.trace.records import VARIABLES  # noqa: F401 - re-exported (defined torch-free in records)
from infertrace.trace.records import DecodeRec, HiddenRec, KVRec, MaskRec, PositionsRec, ReqStep, RowStat, StepTrace


#: block taps the step record reads (positions evidence of layer ``Recorder.layer``)
EVIDENCE_TAPS = frozenset({RESID_PRE, Q, K, V, Q_ROT, K_ROT})
#: block taps a hybrid model's step record adds (:mod:`infertrace.capture.hybrid_rec`)
HYBRID_TAPS = frozenset({ATTN_IN, QKV, GATE, Z, ATTN_OUT, SSM_STATE})
#: ``--keep tensors``: block tap -> saved name; defined by the probe (:data:`infertrace.capture.probe.TENSOR_NAMES`)
TENSOR_NAMES = TENSOR_NAMES


def _r(x: float, nd: int = 6) -> float:
    return float(round(float(x), nd))


def _dtype(t: torch.Tensor | torch.dtype) -> str:
    d = t if isinstance(t, torch.dtype) else t.dtype
    return str(d).replace("torch.", "")


class Recorder:
    """Records the five variables of every step.

    Args:
        tokenizer: for token pieces.
        config: the model's :class:`ModelConfig`.
        layer: layer whose RoPE evidence and K/V values are captured.
        show: subset of :data:`VARIABLES` to capture.
        n_first: how many leading values of rows/cos/sin/K/V to keep.
        top_k: sampling candidates kept per request.
        mask_rows, mask_cols: size of the kq_mask slice kept.
        layers: layers tapped for tensors (default: ``layer`` only); only used with ``tensors``.
        tensors: when a dict is given, full tensors are copied into it each step (for
            ``run --save --keep tensors``; names in :meth:`_capture`). None (default): no
            tensor is copied, the trace stays summary-sized.
        top_k_tensors: logits kept per logits row in ``tensors`` (values and ids).
        keep_logits: ask the probe for each step's full logits ``[M, V]`` (:attr:`StepData.logits`).
        on_record: called as ``on_record(data, step_trace)`` after each step is recorded, with the
            :class:`StepData` it was built from and the kept :class:`StepTrace` (to keep more of the step
            than the trace does, e.g. ``diff-runtimes vllm``'s full tensors; it must not change either).
    """

    enabled = True

    def __init__(self, tokenizer: Any, config: Any, layer: int = 0, show: tuple[str, ...] = VARIABLES,
                 n_first: int = 4, top_k: int = 5, mask_rows: int = 8, mask_cols: int = 16,
                 layers: Iterable[int] | None = None, tensors: dict[str, torch.Tensor] | None = None,
                 top_k_tensors: int = 20, keep_logits: bool = False,
                 on_record: Callable[[StepData, StepTrace], None] | None = None):
        self.tok = tokenizer
        self.cfg = config
        self.layer = layer
        self.tensors = tensors
        self.tensor_layers = tuple(sorted(set(layers))) if layers is not None else (layer,)
        self.top_k_tensors = top_k_tensors
        if getattr(config, "is_hybrid", False) and config.is_linear(layer):  # a GDN layer has no K/V and no RoPE
            self.layer = layer = next(i for i in range(config.n_layer) if not config.is_linear(i))
        self.layers = frozenset({layer}) | (frozenset(self.tensor_layers) if tensors is not None else frozenset())
        if getattr(config, "is_hybrid", False):  # the first GDN layer taps its state (capture/hybrid_rec.py)
            self.layers |= {next(i for i in range(config.n_layer) if config.is_linear(i))}
        self.taps = (EVIDENCE_TAPS | (HYBRID_TAPS if getattr(config, "is_hybrid", False) else frozenset())
                     | (frozenset(TENSOR_NAMES) if tensors is not None else frozenset()))
        self.show = set(show)
        self.n_first = n_first
        self.top_k = top_k
        self.mask_rows, self.mask_cols = mask_rows, mask_cols
        # the recorded layer's own RoPE (a windowed Gemma 3 layer rotates with base 10000, not the global 1e6)
        swa = bool(config.layer_window(layer)) and config.rope_theta_swa is not None
        self.inv_freq = inv_freq_table(config, swa=swa)
        self.rope_theta = config.rope_theta_swa if swa else config.rope_theta
        self.rope_scaled = not swa or config.rope_scaling_swa
        self.steps: list[StepTrace] = []
        self._taps: dict[tuple[str, int | None], dict[str, Any]] = {}  # (tap name, layer) -> the tap's fields
        self._spec_acc: dict[int, list[int]] = {}  # accepted nodes of this step's verify chunks, by seq_id
        #: what :func:`~infertrace.capture.probe.probe` copies out of each step for this recorder
        self.want = Want(layer=self.layer, show=frozenset(self.show),
                         tensor_layers=self.tensor_layers if tensors is not None else None, top_k_tensors=top_k_tensors,
                         mask_rows=mask_rows, mask_cols=mask_cols, windowed=bool(config.windowed_layers),
                         hybrid=bool(getattr(config, "is_hybrid", False)), logits=keep_logits)
        self.on_record = on_record

    def tap(self, name: str, **fields: Any) -> None:
        """Keep this step's tap ``name`` (of layer ``fields["layer"]``; the embedding tap has none)."""
        self._taps[(name, fields.get("layer"))] = fields

    def _value(self, name: str, layer: int | None = None) -> Any:
        """This step's ``value`` of tap ``name`` at ``layer`` (the evidence layer by default), or None."""
        t = self._taps.get((name, self.layer if layer is None else layer))
        return None if t is None else t["value"]

    def begin_step(self) -> None:
        """Forget the previous step's taps."""
        self._taps = {}

    # ------------------------------------------------------------------ build
    def end_step(self, ctx: Any) -> StepTrace:
        """Build and keep the step record of a live step: :meth:`record` of :func:`~infertrace.capture.probe.probe`.

        ``ctx``: the engine's :class:`~infertrace.engine.step.StepContext` (step, batch,
        inp, kv, attention, logits ``[M, V]``, logits_rows, samples, finished, requests,
        time_ms). An idle step (nothing scheduled) has ``inp`` None and an empty batch: its
        record has ``N = 0``, ``batch = []`` and only the cache state.
        """
        return self.record(probe(ctx, self.want, self._taps))

    def record(self, data: StepData) -> StepTrace:
        """Build and keep the step record from ``data`` alone (what :func:`~infertrace.capture.probe.probe`
        copied out of the step for :attr:`want`; possibly read back by :meth:`StepData.from_wire`).

        Raises:
            InfertraceError: ``data`` lacks what this recorder reads (:meth:`StepData.require`).
        """
        data.require(self.want)
        self._spec_acc = {int(k): v["accepted_nodes"] for k, v in ((data.spec or {}).get("requests") or {}).items()}
        st = StepTrace(step=data.step, backend=data.backend, attention=data.attention, N=data.N, batch=[],
                       preempted=list(data.preempted), admitted=list(data.admitted), time_ms=_r(data.time_ms, 3),
                       vllm=data.vllm)  # the runtime's native section as it handed it (None but for run --runtime vllm)
        if data.idle:  # idle step: nothing scheduled (waiting for arrivals); N = 0, no variables but the cache
            if data.serving:  # e.g. a request stopped because the KV pool is full (kv_full)
                st.serving = data.serving
            if "kv" in self.show:
                st.kv = self._kv(data)
            return self._append(st, data)
        st.batch = reqs = self._reqs(data)
        if data.spec:  # speculative decoding: the step's drafted / accepted / acceptance rate
            st.spec = {k: v for k, v in data.spec.items() if k != "requests"}
        serving = data.serving
        if serving:  # prefix hits / context shifts per request, evictions and audit for the step
            st.serving = serving
            shifts = {op["seq_id"]: op for op in serving.get("ops_before_step", []) if op.get("op") == "context_shift"}
            for r in reqs:
                r.prefix = serving.get("prefix", {}).get(str(r.seq_id))
                r.shift = shifts.get(r.seq_id)
        if "hidden" in self.show and (EMBED, None) in data.taps:
            st.hidden = self._hidden(data, data.taps[(EMBED, None)])
        if "positions" in self.show:
            st.positions = self._positions(data)
        if "mask" in self.show:
            st.mask = self._mask(data, reqs)
        if "kv" in self.show:
            st.kv = self._kv(data)
        if "decode" in self.show:
            st.decode = self._decode(data, reqs)
        if self.tensors is not None:
            self._capture(data)
        return self._append(st, data)

    def _append(self, st: StepTrace, data: StepData) -> StepTrace:
        """The step's last part (the hybrid record), then keep it and tell :attr:`on_record`."""
        self._hybrid(st, data)
        self.steps.append(st)
        if self.on_record is not None:
            self.on_record(data, st)
        return st

    def _reqs(self, data: StepData) -> list[ReqStep]:
        """The per-request records of the step's chunks (packed order)."""
        rows_of, row, logits_row = {}, 0, {}
        for ch in data.chunks:
            rows_of[ch.seq_id] = list(range(row, row + ch.T))
            row += ch.T
        for j, r in enumerate(data.logits_rows):
            logits_row[r] = j
        positions = data.positions
        vrecs = (data.spec or {}).get("requests", {})
        reqs = []
        for ch in data.chunks:
            sid = ch.seq_id
            s = data.samples.get(sid)
            vis = _visible(ch.logical, ch.T)
            vis_swa = _visible(ch.logical_swa, ch.T) if ch.logical_swa is not None else None
            vrec = vrecs.get(str(sid)) if ch.parents is not None else None
            kept = ch.C + len(vrec["accepted_nodes"]) if vrec else ch.C + ch.T  # a verify step rewinds the rejected tail
            last = rows_of[sid][-1]  # the row whose logits chose the sampled token: the last computed token,
            if vrec and vrec["emitted"]:  # in a verify step the accepted path's node that drew the last emitted token
                last = rows_of[sid][vrec["accepted_nodes"][min(len(vrec["emitted"]), len(vrec["accepted_nodes"])) - 1]]
            reqs.append(ReqStep(
                seq_id=sid, phase=ch.phase, C=ch.C, T=ch.T, token_ids=list(ch.token_ids),
                pieces=[self.tok.piece(t) for t in ch.token_ids], positions=positions[rows_of[sid]].tolist(),
                visible=vis, cache_before=ranges_text(range(ch.C)), cache_after=ranges_text(range(kept)),
                rows=rows_of[sid], logits_row=logits_row.get(last) if ch.need_logits else None,
                sampled=s.token if s else None, sampled_piece=self.tok.piece(s.token) if s else None,
                finished=data.finished.get(sid), visible_swa=vis_swa,
                spec=({**verify_record(ch.T, ch.verify or {}, vrec),
                       "emitted_pieces": [self.tok.piece(t) for t in vrec["emitted"]]} if vrec else None),
            ))
        return reqs

    def _hybrid(self, st: StepTrace, data: StepData) -> None:
        """Qwen3.5-style hybrid models: layer map, M-RoPE positions, projections, GDN state (capture/hybrid_rec.py)."""
        if getattr(self.cfg, "is_hybrid", False):
            st.hybrid = hybrid_record(self.cfg, data.positions, data.recurrent, data.taps, data.embed_ids, self.layer,
                                      NO_REUSE_REASON)

    def _capture(self, data: StepData) -> None:
        """Copy this step's tensors into ``self.tensors`` (CPU, contiguous, compute dtype):

        ``step{s}/hidden`` ``[N, H]`` (embedding output); per layer ``l`` in ``tensor_layers``:
        ``step{s}/layer{l}/hidden_in`` ``[N, H]`` (residual stream entering the layer),
        ``q_pre_rope``/``q_post_rope`` ``[N, n_head, hd]``, ``k_pre_rope``/``k_post_rope``/``v``
        ``[N, n_kv, hd]``, ``attn_out``/``mlp_out``/``resid_post`` ``[N, H]`` (the block's branch outputs
        and the stream leaving it; a Gated DeltaNet layer has only the ``[N, H]`` ones), names from the
        taps by :data:`TENSOR_NAMES`; ``seq{id}/k_cache``/``v_cache`` ``[len, n_kv, hd]`` (the cache of every
        request holding one after the step, by position); ``step{s}/logits_topk_values`` float32 and
        ``step{s}/logits_topk_ids`` int64 ``[M, k]`` (rows = ``DecodeRec.logits_rows``).
        """
        def keep(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to("cpu", copy=True).contiguous()

        out, p = self.tensors, f"step{data.step}/"
        if (EMBED, None) in data.taps:
            out[p + "hidden"] = keep(data.taps[(EMBED, None)])
        for il in self.tensor_layers:
            got = {name: data.taps[(tap, il)] for tap, name in TENSOR_NAMES.items() if (tap, il) in data.taps}
            if not got:  # the layer was not computed here (e.g. a captured runtime taps one layer)
                continue
            for name, t in got.items():
                out[f"{p}layer{il}/{name}"] = keep(t)
            for (cl, sid), (k, v) in data.cache.items():  # every request holding cache, computed this step or not
                if cl == il:
                    out[f"{p}layer{il}/seq{sid}/k_cache"] = keep(k)
                    out[f"{p}layer{il}/seq{sid}/v_cache"] = keep(v)
        if data.logits_topk is not None:
            vals, ids = data.logits_topk  # [M, k]
            out[p + "logits_topk_values"], out[p + "logits_topk_ids"] = keep(vals), keep(ids)

    def _hidden(self, data: StepData, x: torch.Tensor) -> HiddenRec:
        xf = x.float()
        rows, r = [], 0
        for ch in data.chunks:
            depth = ch.depths  # 0..T-1; a speculative verify tree: depth(node)
            for j, t in enumerate(ch.token_ids):
                v = xf[r]
                rows.append(RowStat(ch.seq_id, ch.C + depth[j], int(t), self.tok.piece(int(t)), _r(v.mean()), _r(v.std()),
                                    _r(v.min()), _r(v.max()), _r(v.norm()), [_r(a) for a in v[: self.n_first].tolist()]))
                r += 1
        N, H = x.shape
        return HiddenRec([N, H], _dtype(x), [H, N], [N, H], rows, 0)

    def _positions(self, data: StepData) -> PositionsRec:
        cfg = self.cfg
        pos = data.positions.tolist()
        npair = min(3, cfg.rope_dim // 2)
        cs = []
        for p in pos[: 16]:
            ang = [p * float(self.inv_freq[i]) for i in range(npair)]
            cs.append({"pos": p, "cos": [_r(torch.tensor(a).cos()) for a in ang], "sin": [_r(torch.tensor(a).sin()) for a in ang]})
        ev: dict[str, Any] = {"layer": self.layer}
        t = [data.taps.get((n, self.layer)) for n in (Q, K, V, Q_ROT, K_ROT)]
        if all(x is not None for x in t):
            q, k, v, qr, kr = (x.float() for x in t)
            ev["rows"] = [
                {"pos": p, "dq_max": _r((qr[i] - q[i]).abs().max()), "dk_max": _r((kr[i] - k[i]).abs().max()),
                 "q_norm_before": _r(q[i].norm()), "q_norm_after": _r(qr[i].norm())}
                for i, p in enumerate(pos[: 16])
            ]
            # V as stored in the cache equals the un-rotated projection; K equals the rotated one.
            dv, dk_cache = 0.0, 0.0
            r = 0
            for c in data.chunks:
                kc, vc = c.k_rows, c.v_rows  # [n, nkv, hd]: cache rows C.. of the recorded layer
                acc = self._spec_acc.get(c.seq_id) if c.parents is not None else None
                rows = torch.tensor([r + a for a in acc] if acc else list(range(r, r + c.T)))  # verify: accepted nodes
                n = int(rows.numel())
                dv = max(dv, float((vc[:n].float() - v[rows]).abs().max()))
                dk_cache = max(dk_cache, float((kc[:n].float() - kr[rows]).abs().max()))
                r += c.T
            ev["v_cache_minus_v_proj_max"] = _r(dv, 9)
            ev["k_cache_minus_k_rot_max"] = _r(dk_cache, 9)
            ev["q_changed"] = bool(max(e["dq_max"] for e in ev["rows"]) > 0) if ev["rows"] else False
        sc = cfg.rope_scaling
        return PositionsRec(
            inp_pos=pos, position_ids=pos, pairing="neox", pairing_in_file=cfg.rope_pairing_in_file,
            theta=self.rope_theta, theta_is_default=cfg.rope_theta_is_default, rope_dim=cfg.rope_dim, head_dim=cfg.head_dim,
            scaling=({"type": sc.type, "factor": sc.factor, "freq_factors": "rope_freqs.weight" if cfg.rope_freq_factors else None}
                     if self.rope_scaled else {"type": "none", "factor": 1.0, "freq_factors": None}),
            inv_freq_first=[_r(float(x), 9) for x in self.inv_freq[:npair]], cos_sin=cs, evidence=ev,
        )

    def _swa(self, data: StepData, reqs: list[ReqStep]) -> dict[str, Any] | None:
        """The sliding-window side of the mask: which layers, the convention, visible keys per query
        on those layers, and (cells) the slice of llama.cpp's ``kq_mask_swa``."""
        cfg = self.cfg
        win = cfg.windowed_layers
        if not win:
            return None
        W = cfg.sliding_window
        d: dict[str, Any] = {
            "n_swa": W, "layers": win, "global_layers": [i for i in range(cfg.n_layer) if i not in win],
            "convention": f"query at position p sees keys p-W+1..p (W = {W}; HF sliding_window, llama.cpp n_swa with "
                          "LLAMA_SWA_TYPE_STANDARD); global layers see keys 0..p",
            "visible": [{"seq_id": r.seq_id, "queries": [{"pos": p, "keys": v} for p, v in zip(r.positions, r.visible_swa or [])]}
                        for r in reqs],
            "rope_theta_swa": cfg.rope_theta_swa,
        }
        d.update(data.mask_swa or {})  # cells: a kq_mask_swa slice; paged: attention_window
        return d

    def _mask(self, data: StepData, reqs: list[ReqStep]) -> MaskRec:
        vis = [{"seq_id": r.seq_id, "queries": [{"pos": p, "keys": v} for p, v in zip(r.positions, r.visible)]} for r in reqs]
        lg = [c.logical.int().tolist() for c in data.chunks]
        m = data.mask
        rec = MaskRec(m["convention"], m["rule"], vis, m["cells"], m["paged"], lg)
        rec.swa = self._swa(data, reqs)
        return rec

    def _kv(self, data: StepData) -> KVRec:
        cfg = self.cfg
        per, view = [], {"layer": self.layer, "requests": []}
        for c in data.chunks:  # an idle step has none
            kept = c.C + len(self._spec_acc[c.seq_id]) if (c.parents is not None and c.seq_id in self._spec_acc) else c.C + c.T
            d: dict[str, Any] = {"seq_id": c.seq_id, "shape_before": [c.C, cfg.n_head_kv, cfg.head_dim],
                                 "shape_after": [kept, cfg.n_head_kv, cfg.head_dim],  # a verify step: after the rewind
                                 "written_pos": ranges_text(range(c.C, c.C + c.T))}
            if c.placement is not None:  # cells: the cells written; paged: slots and block table
                d.update(c.placement)
            per.append(d)
            k, v = c.k_rows, c.v_rows  # [n, nkv, hd]: rows C .. C+n-1 (a verify step: only the accepted remain)
            view["requests"].append({"seq_id": c.seq_id, "rows": [
                {"pos": c.C + i, "k": [_r(a) for a in k[i, 0, : self.n_first].tolist()],
                 "v": [_r(a) for a in v[i, 0, : self.n_first].tolist()]}
                for i in range(k.shape[0])][:8]})
        mem, snap = data.kv.describe, dict(data.kv.snapshot)  # snapshot with the cells heads before / after the step
        return KVRec(mem["kind"], mem["dtype"], len(mem["kv_layers"]), per, view, snap, mem["physical_shape"])

    def _decode(self, data: StepData, reqs: list[ReqStep]) -> DecodeRec:
        per = []
        for r in reqs:
            s = data.samples.get(r.seq_id)
            if s is None:
                per.append({"seq_id": r.seq_id, "row": None, "note": "prefill chunk: no logits needed"})
                continue
            per.append({
                "seq_id": r.seq_id, "row": r.logits_row, "sampler": dict(s.sampler),
                "top": [{"id": i, "piece": self.tok.piece(i), "logit": _r(lg, 5), "prob": _r(p, 5)} for i, lg, p in s.top[: self.top_k]],
                "chosen": s.token, "chosen_piece": self.tok.piece(s.token),
                "next_input": None if r.finished else s.token,
                "next_pos": None if r.finished else (r.C + len(r.spec["accepted_nodes"]) if r.spec else r.positions[-1] + 1),
                "stop": r.finished,
            })
        return DecodeRec(list(data.logits_shape), data.logits_dtype, list(data.logits_rows), per)


def _visible(m: torch.Tensor, T: int) -> list[str]:
    """Per query row of a ``[T, L]`` bool logical mask, the visible keys as range text."""
    return [ranges_text([j for j in range(m.shape[1]) if bool(m[i, j])]) for i in range(T)]
