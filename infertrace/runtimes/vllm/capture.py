"""Hooks on vLLM's stable surfaces, installed in every worker (``collective_rpc``), each step
copying what vLLM itself built. Nothing here changes a value vLLM uses.

========================  =====================================================================
what                      vLLM source (v1)
========================  =====================================================================
request order of rows     ``model_runner.input_batch.req_ids`` (read when the forward starts)
packed ids / positions    the model forward's ``input_ids`` int32 ``[T]`` / ``positions`` int64 ``[T]``
                          (a forward pre-hook on ``model_runner.model``)
attention metadata        ``get_forward_context().attn_metadata[<layer>]`` inside that forward:
                          ``query_start_loc`` ``[R+1]``, ``seq_lens`` ``[R]``, ``block_table``
                          ``[R, max_blocks]``, ``slot_mapping`` ``[T]``, ``num_actual_tokens``,
                          ``max_query_len``, ``max_seq_len``, ``causal``, ``num_decode_tokens``
                          (views of persistent buffers: copied here)
hidden                    output of ``model.model.embed_tokens`` ``[T, H]``
Q/K before/after RoPE     the ``layer``-th call of the rotary embedding (in place on CPU: inputs
                          cloned before, read after)
K/V as written            ``impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)`` of
                          layer ``layer`` (its inputs), and the cache read back at the slots through
                          :mod:`.layout` after the write
layer taps                for ``--keep tensors --layers`` (:meth:`WorkerCapture.set_tap_layers`): forward hooks on
                          ``model.model.layers[i]``: ``hidden_in`` = the layer's input ``hidden_states +
                          residual`` (layer 0: ``hidden_states``), ``attn_out`` = ``self_attn``'s output
                          (sandwich-norm layers, Gemma 3: ``post_attention_layernorm``'s), ``mlp_out`` =
                          ``mlp``'s (Gemma 3: ``post_feedforward_layernorm``'s), ``resid_post`` = the layer's
                          returned ``hidden_states + residual`` (vLLM fuses the residual add into the next
                          layer's RMSNorm and returns the two apart: their sum is the stream the model means);
                          Q/K before / after RoPE from the i-th rotary call; copied inside each hook, before
                          the next fused norm rewrites its inputs in place
logits / sampled ids      ``model_runner.sampler`` (``logits`` ``[R, V]`` float32 in, sampled
                          ``[R, 1]`` out) or ``model_runner.rejection_sampler`` with drafts
                          (logits ``[R + drafts, V]``, sampled ``[R, 1 + k]`` padded with -1)
========================  =====================================================================

Every array is numpy (picklable: with tensor parallelism the workers are other processes and
``collective_rpc`` carries the records back).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from infertrace.runtimes.vllm.layout import read_slots

#: attribute of the worker (or model runner) holding the installed capture
ATTR = "_infertrace_capture"


#: float dtypes numpy holds as they are; any other (bfloat16: numpy has none; float16) is widened to float32
_NUMPY_FLOATS = (torch.float32, torch.float64)


def _np(t: Any) -> np.ndarray:
    """A numpy copy of vLLM tensor ``t`` (any shape). Integer tensors keep their dtype; a bfloat16 or
    float16 tensor (vLLM's compute dtype under ``--dtype bfloat16/float16``; bfloat16 is vLLM's CPU
    default for a float32 checkpoint) is widened to float32 first, exactly (numpy has no bfloat16)."""
    t = t.detach().to("cpu")
    if t.is_floating_point() and t.dtype not in _NUMPY_FLOATS:
        return t.float().numpy()  # .float() copies: no clone needed
    return t.clone().numpy()


class WorkerCapture:
    """The hooks of one worker and the records they produced since the last :meth:`take`.

    Args:
        model_runner: vLLM's (CPU/GPU) model runner of this worker.
        layer: the decoder layer whose Q/K/V and cache are read.
    """

    def __init__(self, model_runner: Any, layer: int):
        self.mr, self.layer = model_runner, layer
        self.records: list[dict[str, Any]] = []
        self.cur: dict[str, Any] | None = None
        self._rope_calls = 0
        self._in_rejection = False
        sfc = model_runner.vllm_config.compilation_config.static_forward_context
        self.attn_names = [n for n, m in sfc.items() if hasattr(m, "impl") and hasattr(m, "kv_cache")]
        self.layer_name = next((n for n in self.attn_names if f".layers.{layer}." in n), None)
        if self.layer_name is None:
            raise ValueError(f"no attention layer {layer} in {self.attn_names[:3]}...")
        self.attn = sfc[self.layer_name]
        model = model_runner.model
        self.handles = [model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)]
        inner = getattr(model, "model", None)
        emb = getattr(inner, "embed_tokens", None)
        if emb is not None:
            self.handles.append(emb.register_forward_hook(self._embed))
        layers = getattr(inner, "layers", None)
        rope = getattr(getattr(layers[layer], "self_attn", None), "rotary_emb", None) if layers is not None else None
        if rope is not None:
            self.handles.append(rope.register_forward_pre_hook(self._rope_pre))
            self.handles.append(rope.register_forward_hook(self._rope_post))
        self.tap_layers: frozenset[int] = frozenset()
        self._tap_handles: list[Any] = []
        self.handles.append(model_runner.sampler.register_forward_pre_hook(self._sampler_pre, with_kwargs=True))
        self.handles.append(model_runner.sampler.register_forward_hook(self._sampler_post))
        rs = getattr(model_runner, "rejection_sampler", None)
        if rs is not None:
            self.handles.append(rs.register_forward_pre_hook(self._rej_pre, with_kwargs=True))
            self.handles.append(rs.register_forward_hook(self._rej_post))
        impl = self.attn.impl
        self._orig_update = impl.do_kv_cache_update
        impl.do_kv_cache_update = self._kv_update  # instance attribute: this layer only
        cache = self.attn.kv_cache[0] if isinstance(self.attn.kv_cache, (list, tuple)) else self.attn.kv_cache
        self.header = {"backend": f"{type(impl).__module__}.{type(impl).__name__}", "isa": str(getattr(self.attn, "isa", "")),
                       "cache_shape": list(cache.shape), "cache_dtype": str(cache.dtype).replace("torch.", ""),
                       "num_kv_heads": int(impl.num_kv_heads), "num_heads": int(impl.num_heads),
                       "head_size": int(impl.head_size), "layer_name": self.layer_name}

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        from vllm.forward_context import get_forward_context

        ids, pos = kwargs.get("input_ids"), kwargs.get("positions")
        md = get_forward_context().attn_metadata
        if isinstance(md, list):  # micro-batches: not used on CPU
            md = md[0]
        m = md.get(self.layer_name) if isinstance(md, dict) else None
        if m is None:  # a warm-up / dummy forward: nothing scheduled
            self.cur = None
            return
        T = int(m.num_actual_tokens)
        R = int(m.query_start_loc.shape[0]) - 1
        self.cur = {
            "req_ids": [str(r) for r in list(self.mr.input_batch.req_ids)[:R]],
            "input_ids": _np(ids[:T]).astype(np.int64) if ids is not None else None,
            "positions": _np(pos[:T]).astype(np.int64) if pos is not None else None,
            "query_start_loc": _np(m.query_start_loc[: R + 1]).astype(np.int64),
            "seq_lens": _np(m.seq_lens[:R]).astype(np.int64),
            "block_table": _np(m.block_table[:R]).astype(np.int64),
            "slot_mapping": _np(m.slot_mapping[:T]).astype(np.int64),
            "num_actual_tokens": T, "max_query_len": int(m.max_query_len), "max_seq_len": int(m.max_seq_len),
            "causal": bool(m.causal) if not isinstance(m.causal, torch.Tensor) else None,
            "num_decode_tokens": int(getattr(m, "num_decode_tokens", 0) or 0),
            "metadata_class": type(m).__name__,
        }
        self._rope_calls = 0

    def _embed(self, module: Any, args: tuple, out: Any) -> None:
        if self.cur is not None and isinstance(out, torch.Tensor):
            self.cur["hidden"] = _np(out[: self.cur["num_actual_tokens"]]).astype(np.float32)  # [T, H]

    def _rope_pre(self, module: Any, args: tuple) -> None:
        if self.cur is None or len(args) < 3:
            return
        T, i = self.cur["num_actual_tokens"], self._rope_calls
        if i == self.layer:
            self.cur["q_pre"], self.cur["k_pre"] = _np(args[1][:T]).astype(np.float32), _np(args[2][:T]).astype(np.float32)
        if i in self.tap_layers:
            self._tap(i, "q_pre_rope", args[1]), self._tap(i, "k_pre_rope", args[2])

    def _rope_post(self, module: Any, args: tuple, out: Any) -> None:
        if self.cur is None:
            return
        if isinstance(out, tuple):
            T, i = self.cur["num_actual_tokens"], self._rope_calls
            if i == self.layer:
                self.cur["q_rot"], self.cur["k_rot"] = _np(out[0][:T]).astype(np.float32), _np(out[1][:T]).astype(np.float32)
            if i in self.tap_layers:
                self._tap(i, "q_post_rope", out[0]), self._tap(i, "k_post_rope", out[1])
        self._rope_calls += 1

    # ------------------------------------------------------------------ layer taps (--keep tensors --layers)
    def set_tap_layers(self, layers: Any) -> None:
        """Hook the decoder layers ``layers`` for the per-layer taps of the module table (none: unhook)."""
        for h in self._tap_handles:
            h.remove()
        self._tap_handles, self.tap_layers = [], frozenset(int(i) for i in layers)
        dec = getattr(self.mr.model, "model", None)
        for il in sorted(self.tap_layers):
            layer = dec.layers[il]
            sandwich = hasattr(layer, "pre_feedforward_layernorm")
            att_src = layer.post_attention_layernorm if sandwich else getattr(layer, "self_attn", None)
            mlp_src = getattr(layer, "post_feedforward_layernorm", None) if sandwich else getattr(layer, "mlp", None)
            self._tap_handles.append(layer.register_forward_pre_hook(
                lambda m, a, kw, _i=il: self._tap_stream(_i, "hidden_in", *_layer_args(a, kw)), with_kwargs=True))
            self._tap_handles.append(layer.register_forward_hook(
                lambda m, a, o, _i=il: self._tap_stream(_i, "resid_post", o[0], o[1]) if isinstance(o, tuple) else None))
            for name, src in (("attn_out", att_src), ("mlp_out", mlp_src)):
                if src is not None:
                    self._tap_handles.append(src.register_forward_hook(
                        lambda m, a, o, _i=il, _n=name: self._tap(_i, _n, o[0] if isinstance(o, tuple) else o)))

    def _tap(self, il: int, name: str, t: Any) -> None:
        """Keep ``t[:T]`` (copied now, float32) as tap ``name`` of layer ``il`` in this step's record."""
        if self.cur is not None and isinstance(t, torch.Tensor):
            self.cur.setdefault("taps", {})[f"{il}/{name}"] = _np(t[: self.cur["num_actual_tokens"]]).astype(np.float32)

    def _tap_stream(self, il: int, name: str, hidden: Any, residual: Any) -> None:
        """The residual stream vLLM carries as two tensors: ``hidden + residual`` (``residual`` None: ``hidden``)."""
        if self.cur is None or not isinstance(hidden, torch.Tensor):
            return
        T = self.cur["num_actual_tokens"]
        x = hidden[:T].float() + (residual[:T].float() if isinstance(residual, torch.Tensor) else 0.0)  # [T, H]
        self.cur.setdefault("taps", {})[f"{il}/{name}"] = _np(x).astype(np.float32)

    def _kv_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
        self._orig_update(layer, key, value, kv_cache, slot_mapping)
        self._kv_copy(layer, key, value, kv_cache, slot_mapping)

    def _kv_copy(self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Copy K/V as written (``[T, nkv, hd]``) and as read back through the cache layout."""
        if self.cur is None:
            return
        T = self.cur["num_actual_tokens"]
        slots = slot_mapping[:T].to(torch.int64)
        self.cur["k_written"] = _np(key[:T]).astype(np.float32)  # [T, nkv, hd]
        self.cur["v_written"] = _np(value[:T]).astype(np.float32)
        try:
            k, v = read_slots(kv_cache, slots, str(getattr(layer, "isa", "")))
            self.cur["k_cache"], self.cur["v_cache"] = k.numpy(), v.numpy()  # [T, nkv, hd] read back
        except ValueError as e:
            self.cur["readback_error"] = str(e)

    def _sampler_pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self.cur is None or self._in_rejection:
            return
        logits = kwargs.get("logits", args[0] if args else None)
        self.cur["logits"] = _np(logits).astype(np.float32)  # [R, V]

    def _sampler_post(self, module: Any, args: tuple, out: Any) -> None:
        if self.cur is None or self._in_rejection:
            return
        self.cur["sampled"] = _np(out.sampled_token_ids).astype(np.int64)  # [R, 1]
        self._finish()

    def _rej_pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self.cur is None:
            return
        self._in_rejection = True
        meta = kwargs.get("metadata", args[0] if args else None)
        logits = kwargs.get("logits", args[2] if len(args) > 2 else None)
        self.cur["logits"] = _np(logits).astype(np.float32)  # [R + drafts, V]
        self.cur["draft_token_ids"] = _np(meta.draft_token_ids).astype(np.int64)
        self.cur["num_draft_tokens"] = [int(x) for x in meta.num_draft_tokens]

    def _rej_post(self, module: Any, args: tuple, out: Any) -> None:
        self._in_rejection = False
        if self.cur is None:
            return
        self.cur["sampled"] = _np(out.sampled_token_ids).astype(np.int64)  # [R, 1 + k], -1 padded
        self._finish()

    def _finish(self) -> None:
        self.records.append(self.cur)
        self.cur = None

    def take(self) -> list[dict[str, Any]]:
        out, self.records = self.records, []
        return out


def _layer_args(a: tuple, kw: dict) -> tuple[Any, Any]:
    """``(hidden_states, residual)`` of a decoder layer's call ``forward(positions, hidden_states, residual)``."""
    hidden = a[1] if len(a) > 1 else kw.get("hidden_states")
    residual = a[2] if len(a) > 2 else kw.get("residual")
    return hidden, residual


def _runner(worker: Any) -> Any:
    w = getattr(worker, "worker", worker)
    return getattr(w, "model_runner", None) or w


def install(worker: Any, layer: int) -> dict[str, Any]:
    """``collective_rpc`` target: install the hooks in this worker; returns the header facts
    (backend class, ISA, cache shape/dtype, heads held by this rank, its TP rank)."""
    mr = _runner(worker)
    cap = WorkerCapture(mr, layer)
    setattr(worker, ATTR, cap)
    rank = 0
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        rank = int(get_tensor_model_parallel_rank())
    except Exception:  # pragma: no cover - no distributed state
        pass
    return {**cap.header, "tp_rank": rank}


def set_taps(worker: Any, layers: list[int]) -> None:
    """``collective_rpc`` target: hook ``layers`` for the per-layer taps of the next runs (``[]``: none)."""
    cap = getattr(worker, ATTR, None)
    if cap is not None:
        cap.set_tap_layers(layers)


def take(worker: Any) -> list[dict[str, Any]]:
    """``collective_rpc`` target: the records of this worker since the last call."""
    cap = getattr(worker, ATTR, None)
    return cap.take() if cap is not None else []
