"""``--audit-kv``: where every cached K/V entry came from, and a from-scratch recomputation that
checks it.

Provenance is kept per (seq_id, position) as a short label: ``prefill``, ``chunk k`` (k-th prefill
chunk of a chunked prompt), ``decode``, ``prefix hit from request r`` (shared or copied from a
cached sequence/block), with suffixes ``shifted by d`` (context shift: K re-rotated), ``after a
shift`` (computed after a context shift of its sequence: its deeper layers attended shifted entries,
whose deeper-layer K/V saw the dropped tokens) and ``kept after rewind`` (the tail after it was
removed with ``seq_rm``).

:func:`audit_kv` recomputes each cached sequence from its token ids in one fresh forward (a new
cells cache, positions ``0..L-1``) and reports the largest ``|Δ|`` of K and V per provenance label,
over all layers and, separately, in layer 0 (whose K/V depend on the token and position only, so a
shifted entry must match there even though deeper layers saw a different context). Silent cache
corruption after prefix hits, chunked prefill or rollback shows up as a large ``|Δ|`` in one row.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from infertrace.kv.base import ChunkSpec, Memory


class Provenance:
    """Per-sequence provenance labels, indexed by cache position."""

    def __init__(self) -> None:
        self.labels: dict[int, list[str]] = {}
        self.chunks: dict[int, int] = {}
        self.shifted: set[int] = set()  # sequences that had a context shift
        self.block_writer: dict[int, int] = {}

    def on_hit(self, seq_id: int, hit: int, src: int | None) -> None:
        """Positions ``0..hit-1`` of ``seq_id`` came from a prefix hit on request ``src``."""
        self.labels[seq_id] = [f"prefix hit from request {src}"] * hit
        self.chunks[seq_id] = 0
        self.shifted.discard(seq_id)

    def on_write(self, seq_id: int, C: int, T: int, phase: str, last: bool, blocks: Sequence[int] = ()) -> None:
        """Tokens ``C..C+T-1`` were computed this step (``phase`` prefill or decode; ``last``: the chunk
        ends the prompt, so a first chunk that is also the last is the whole ``prefill``); ``blocks``:
        the paged blocks they were written to (``Memory.written_blocks``)."""
        if phase == "decode":
            label = "decode"
        else:
            k = self.chunks.get(seq_id, 0)
            self.chunks[seq_id] = k + 1
            label = "prefill" if (k == 0 and last) else f"chunk {k}"
        if seq_id in self.shifted:
            label = f"{label}, after a shift"
        self.labels[seq_id] = self.labels.get(seq_id, [])[:C] + [label] * T
        for b in blocks:
            self.block_writer[int(b)] = seq_id

    def on_shift(self, seq_id: int, n_keep: int, n_discard: int) -> None:
        """Context shift: ``n_keep..n_keep+n_discard-1`` dropped, the rest moved by ``-n_discard``."""
        lab = self.labels.get(seq_id, [])
        self.shifted.add(seq_id)
        self.labels[seq_id] = lab[:n_keep] + [_add(x, f"shifted by {-n_discard}") for x in lab[n_keep + n_discard :]]

    def on_rewind(self, seq_id: int, keep: int) -> None:
        """``seq_rm(seq_id, keep, -1)``: the first ``keep`` positions stay."""
        self.labels[seq_id] = [_add(x, "kept after rewind") for x in self.labels.get(seq_id, [])[:keep]]

    def on_release(self, seq_id: int) -> None:
        self.labels.pop(seq_id, None)
        self.chunks.pop(seq_id, None)
        self.shifted.discard(seq_id)


def _add(label: str, suffix: str) -> str:
    return label if suffix in label else f"{label}, {suffix}"


@torch.inference_mode()
def recompute_kv(model: Any, token_ids: Sequence[int], kv_dtype: torch.dtype | None = None
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K and V of every layer for ``token_ids`` at positions ``0..L-1``, computed from scratch (each
    layer with its own sliding window, as the engine's cache applies it), stored in ``kv_dtype``
    (``--kv-dtype``; default the model dtype) as the engine's cache stores them.

    Returns: per model layer ``[L, n_kv_heads, head_dim]`` K (rotated) and V, in ``kv_dtype`` (the model
    dtype when None); None for a Gated DeltaNet layer of a hybrid model (it keeps a state, no K/V; the
    recurrent state is not audited).
    """
    from infertrace.kv.cells import CellsKV

    cfg = model.cfg
    L = len(token_ids)
    if cfg.is_hybrid:  # the engine's hybrid memory: K/V of the attention layers plus the GDN state
        from infertrace.kv.recurrent import HybridKV, RecurrentState

        attn_layers = [i for i in range(cfg.n_layer) if not cfg.is_linear(i)]
        attn = CellsKV(len(attn_layers), cfg.n_head_kv, cfg.head_dim, L, 1, kv_dtype or model.dtype, model.device,
                       windows=[0] * len(attn_layers))
        state = RecurrentState([i for i in range(cfg.n_layer) if cfg.is_linear(i)], cfg.conv_dim, cfg.ssm_conv_kernel,
                               cfg.ssm_n_v_heads, cfg.ssm_k_head_dim, cfg.ssm_v_head_dim, 1, "cells", model.dtype,
                               model.device)
        kv = HybridKV(attn, state, attn_layers)
        inp = kv.prepare([ChunkSpec(0, 0, L)])
        model.forward(torch.tensor(list(token_ids), dtype=torch.int64), inp, kv, torch.tensor([L - 1]))
        reads = [kv.read(i, 0) if i in attn_layers else (None, None) for i in range(cfg.n_layer)]
        return [k for k, _ in reads], [v for _, v in reads]
    kv = CellsKV(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, L, 1, kv_dtype or model.dtype, model.device,
                 windows=[cfg.layer_window(i) for i in range(cfg.n_layer)])  # each layer's own window (Gemma 3)
    inp = kv.prepare([ChunkSpec(0, 0, L)])
    model.forward(torch.tensor(list(token_ids), dtype=torch.int64), inp, kv, torch.tensor([L - 1]))
    return [kv.k[i][:L] for i in range(cfg.n_layer)], [kv.v[i][:L] for i in range(cfg.n_layer)]


@torch.inference_mode()
def layer0_k(model: Any, token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """Layer-0 K of ``token_ids`` at ``positions`` computed fresh, which depends on nothing else: the
    reference for a K-shift. The decoder's own steps for layer 0: embedding (x the family's embedding
    scale) -> ``attn_norm`` -> K projection (+ bias) -> per-head K-norm (QK-norm families) -> layer 0's
    RoPE exactly as the decoder applies it (:func:`~infertrace.model.rope.layer_ropes`: its base,
    scaling, partial rotary and YaRN's cos/sin factor).

    Returns:
        ``[L, n_kv_heads, head_dim]`` in the model dtype.

    Raises:
        InfertraceError: layer 0 has no K (a Gated DeltaNet layer of a hybrid model).
    """
    from infertrace.errors import InfertraceError
    from infertrace.model.layers import rms_norm
    from infertrace.model.rope import apply_rope_neox, layer_ropes

    cfg, L0 = model.cfg, model.layers[0]
    rope = layer_ropes(cfg)[0]
    if rope is None:
        raise InfertraceError("layer 0 is a Gated DeltaNet layer: it has no K to check a K-shift against")
    nh, nkv, hd = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=model.device)  # [L]
    x = model.embed(ids)  # [L, H] (x the family's embedding scale, as the decoder embeds)
    h = rms_norm(x, L0.attn_norm, cfg.rms_eps)  # [L, H]
    A = L0.mixer
    k0 = nh * (2 if A.gated else 1) * hd  # first K row of the fused projection ([Q (| gate) | K | V])
    if isinstance(A.wqkv, torch.Tensor):
        bk = A.bqkv[k0 : k0 + nkv * hd] if A.bqkv is not None else None  # [nkv*hd]
        k = torch.nn.functional.linear(h, A.wqkv[k0 : k0 + nkv * hd], bk).view(-1, nkv, hd)  # [L, nkv, hd]
    else:  # a weight object (quantised): the whole projection through the model's linear op, K rows taken
        k = model.ops.linear(h, A.wqkv, A.bqkv)[:, k0 : k0 + nkv * hd].reshape(-1, nkv, hd)  # [L, nkv, hd]
    if A.k_norm is not None:
        k = rms_norm(k, A.k_norm, cfg.rms_eps)  # [L, nkv, hd]
    pos = torch.tensor(list(positions), dtype=torch.int64, device=model.device)  # [L]
    cos, sin = rope.cos_sin(pos, model.dtype)  # [L, rope_dim/2] each
    return apply_rope_neox(k, cos, sin)  # [L, nkv, hd]


def audit_kv(model: Any, kv: Memory, seqs: dict[int, Sequence[int]], prov: Provenance) -> dict[str, Any]:
    """Recompute every cached sequence and compare with the cache.

    Args:
        model: the engine's model.
        kv: the backend (``read(layer, seq_id)`` gives the cached K/V by position).
        seqs: seq_id -> token ids of its cached positions ``0..L-1``.
        prov: the provenance labels.

    Returns:
        ``{"seqs": {seq_id: n}, "by_provenance": [{"provenance", "entries", "max_abs_k", "max_abs_v",
        "max_abs_layer0"}], "max_abs": float, "max_abs_exact": float, "worst": {seq_id, pos, provenance, layer}}``;
        ``max_abs_exact`` covers what must match (all layers of entries untouched by a shift, layer 0 of
        shifted ones and of those computed after a shift).
    """
    groups: dict[str, dict[str, Any]] = {}
    worst = {"delta": 0.0}
    for sid, ids in sorted(seqs.items()):
        L = len(ids)
        if L == 0:
            continue
        fk, fv = recompute_kv(model, ids, kv.read(kv.kv_layers[0], sid)[0].dtype)  # in the cache's dtype (--kv-dtype)
        labels = (prov.labels.get(sid, []) + ["unknown"] * L)[:L]
        dk_all = torch.zeros(L)
        dv_all = torch.zeros(L)
        d0 = torch.zeros(L)
        worst_layer = torch.zeros(L, dtype=torch.int64)
        first = next(i for i, k in enumerate(fk) if k is not None)  # layer 0, or a hybrid's first attention layer
        for layer in range(len(fk)):
            if fk[layer] is None:  # a Gated DeltaNet layer: no K/V
                continue
            ck, cv = kv.read(layer, sid)  # [L, n_kv_heads, hd] each
            dk = (ck[:L].float() - fk[layer].float()).abs().flatten(1).amax(1)  # [L]
            dv = (cv[:L].float() - fv[layer].float()).abs().flatten(1).amax(1)  # [L]
            if layer == first:
                d0 = torch.maximum(dk, dv)
            worst_layer = torch.where(torch.maximum(dk, dv) > torch.maximum(dk_all, dv_all), layer, worst_layer)
            dk_all, dv_all = torch.maximum(dk_all, dk), torch.maximum(dv_all, dv)
        for p in range(L):
            g = groups.setdefault(labels[p], {"provenance": labels[p], "entries": 0, "max_abs_k": 0.0, "max_abs_v": 0.0,
                                              "max_abs_layer0": 0.0})
            g["entries"] += 1
            g["max_abs_k"] = max(g["max_abs_k"], float(dk_all[p]))
            g["max_abs_v"] = max(g["max_abs_v"], float(dv_all[p]))
            g["max_abs_layer0"] = max(g["max_abs_layer0"], float(d0[p]))
            d = max(float(dk_all[p]), float(dv_all[p]))
            if d > worst["delta"]:
                worst = {"delta": d, "seq_id": sid, "pos": p, "provenance": labels[p], "layer": int(worst_layer[p])}
    rows = sorted(groups.values(), key=lambda g: g["provenance"])
    # what must match exactly: every layer of entries untouched by a shift; layer 0 of shifted ones and of those
    # computed after a shift (deeper layers saw the dropped tokens, directly or through the shifted entries' K/V,
    # so a from-scratch recomputation legitimately differs there)
    exact = max([g["max_abs_layer0"] if "shift" in g["provenance"] else max(g["max_abs_k"], g["max_abs_v"])
                 for g in rows] or [0.0])
    for g in rows:
        for k in ("max_abs_k", "max_abs_v", "max_abs_layer0"):
            g[k] = float(f"{g[k]:.3g}")
    return {"seqs": {str(s): len(ids) for s, ids in sorted(seqs.items())}, "by_provenance": rows,
            "max_abs": float(f"{worst['delta']:.3g}"), "max_abs_exact": float(f"{exact:.3g}"),
            "worst": worst if worst["delta"] > 0 else None}
