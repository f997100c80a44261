"""``diff-runtimes llama.cpp``: our ``cells`` backend against llama.cpp itself, step by
step, on the same schedule, teacher-forced (llama.cpp consumes the tokens our run chose, so one
numeric divergence cannot cascade).

Three runs of the same requests:

1. ours, ``cells``, float32 (the reference side);
2. llama.cpp through :mod:`infertrace.runtimes.llamacpp.engine` (same ubatches, forced tokens);
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
:mod:`infertrace.compare.metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from infertrace.engine.drive import drive, encode_requests
from infertrace.engine.engine import Engine, EngineOptions
from infertrace.kv.cells import CellsKV
from infertrace.kv.iswa import IswaCellsKV
from infertrace.kv.streams import CellsStreamsKV
from infertrace.compare.metrics import NEAR_TIE_GAP, NEAR_TIE_TOPK, compare_rows
from infertrace.errors import ConfigError, InfertraceError
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


#: ggml-cpu's flash attention takes its tiled F32 path from this many queries in a ubatch on
#: (``GGML_FA_TILE_Q``, ``ggml-cpu/common.h``); below it the one-row kernel with an F16 accumulator
FA_TILE_Q = 64
#: a single query over at least this many cells is split across threads (``use_split_kv_path``)
FA_SPLIT_KV_MIN = 512


def _fa_rows(qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, lo: int,
             hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml-cpu ``ggml_compute_forward_flash_attn_ext_f16_one_chunk`` over cells ``lo..hi-1`` for every
    query row and head at once: online softmax, F16 output accumulator (``ggml_vec_scale_f16`` /
    ``ggml_vec_mad_f16`` round it to F16 after every cell), masked cells skipped.

    Args: ``qh`` ``[nh, N, hd]`` (F16 values), ``k``/``v`` ``[n_kv, nh, hd]`` (heads already repeated
    for GQA), ``mask`` ``[N, n_kv]`` (0 / -inf).
    Returns: ``(M [nh, N], S [nh, N], VKQ [nh, N, hd])`` float32, VKQ not yet divided by S.
    """
    nh, N, hd = qh.shape
    M = torch.full((nh, N), float("-inf"))  # [nh, N]
    S = torch.zeros(nh, N)  # [nh, N]
    acc = torch.zeros(nh, N, hd)  # [nh, N, hd] F16 values
    for c in range(lo, hi):
        act = mask[:, c] != float("-inf")  # [N]
        if not bool(act.any()):
            continue
        s = (qh * k[c][:, None, :]).sum(-1) * scale + torch.where(act, mask[:, c], 0.0)  # [nh, N]
        new = (s > M) & act  # [nh, N]
        ms = torch.where(new, torch.exp(M - s), torch.ones_like(s))  # [nh, N]
        vs = torch.where(new, torch.ones_like(s), torch.exp(s - M))  # [nh, N]
        scaled = torch.where(new[..., None], (acc * ms[..., None]).half().float(), acc)  # [nh, N, hd]
        upd = (scaled + v[c][:, None, :] * vs[..., None]).half().float()  # [nh, N, hd]
        acc = torch.where(act[None, :, None], upd, acc)
        S = torch.where(act[None, :], S * ms + vs, S)
        M = torch.where(new, s, M)
    return M, S, acc


def ggml_cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                       flash_attn: bool, n_threads: int = 1) -> torch.Tensor:
    """llama.cpp's CPU attention numerics for one ubatch (the K/V cache already F16-rounded).

    * ``flash_attn`` off (``build_attn_mha``: ``kq = mul_mat(k, q)``, ``soft_max_ext``,
      ``kqv = mul_mat(v, kq)``): Q rounded to F16 for the F16 K dot products, the softmax output
      rounded to F16 for the F16 V product, F32 accumulation.
    * on, ``N >= 64`` queries (``ggml_compute_forward_flash_attn_ext_tiled``): F32 Q, K/V widened to
      F32, F32 accumulators: the float32 reference.
    * on, fewer queries (``..._f16_one_chunk``, :func:`_fa_rows`): Q rounded to F16, F16 output
      accumulator; a single query over >= 512 cells is split into ``n_threads`` chunks of cells,
      merged in F32 (``ggml_flash_attn_ext_reduce_partials``).

    Args:
        q: ``[N, n_head, hd]`` float32; k, v: ``[n_kv, n_kv_heads, hd]``; mask ``[N, n_kv]`` 0 / -inf.
        scale: softmax scale; n_threads: llama.cpp's threads (the split-KV chunks).

    Returns:
        ``[N, n_head, hd]`` float32.
    """
    from infertrace.attention.reference import attention_with_kq_mask

    N, nh, hd = q.shape
    n_kv = k.shape[0]
    if not flash_attn:
        qh = q.half().float()  # [N, nh, hd] src1 of mul_mat(k F16, q) converted to F16
        group = nh // k.shape[1]
        qg = qh.view(N, k.shape[1], group, hd).permute(1, 2, 0, 3)  # [nkv, g, N, hd]
        sc = torch.einsum("hgnd,khd->hgnk", qg, k.float()) * scale + mask  # [nkv, g, N, n_kv]
        p = torch.softmax(sc, dim=-1).half().float()  # [nkv, g, N, n_kv] kq converted to F16 for mul_mat(v, kq)
        o = torch.einsum("hgnk,khd->hgnd", p, v.float())  # [nkv, g, N, hd]
        return o.permute(2, 0, 1, 3).reshape(N, nh, hd)
    if N >= FA_TILE_Q:
        return attention_with_kq_mask(q.float(), k.float(), v.float(), mask, scale)
    group = nh // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)  # [n_kv, nh, hd]
    vv = v.float().repeat_interleave(group, dim=1)  # [n_kv, nh, hd]
    qh = q.half().float().permute(1, 0, 2)  # [nh, N, hd]
    if N == 1 and n_kv >= FA_SPLIT_KV_MIN and n_threads > 1:
        size = -(-n_kv // n_threads)
        Mf, Sf = torch.full((nh, N), float("-inf")), torch.zeros(nh, N)
        acc = torch.zeros(nh, N, hd)
        for lo in range(0, n_kv, size):
            Mc, Sc, Vc = _fa_rows(qh, kk, vv, mask, scale, lo, min(lo + size, n_kv))
            use = Sc != 0  # [nh, N]
            Mn = torch.maximum(Mf, Mc)
            so = torch.where(use, torch.exp(Mf - Mn), torch.ones_like(Mf))
            sn = torch.where(use, torch.exp(Mc - Mn), torch.zeros_like(Mc))
            acc = acc * so[..., None] + Vc * sn[..., None]
            Sf = Sf * so + Sc * sn
            Mf = torch.where(use, Mn, Mf)
        M, S = Mf, Sf
    else:
        M, S, acc = _fa_rows(qh, kk, vv, mask, scale, 0, n_kv)
    out = acc * torch.where(S == 0, torch.zeros_like(S), 1.0 / S)[..., None]  # [nh, N, hd] V /= S
    return out.permute(1, 0, 2).contiguous()  # [N, nh, hd]


class GgmlAttentionKV:
    """Mixin for :class:`~infertrace.kv.cells.CellsKV`: attention with llama.cpp's CPU numerics
    (:func:`ggml_cpu_attention`); ``flash_attn`` / ``n_threads`` are set on the class."""

    flash_attn = True
    n_threads = 1

    def attend(self, layer: int, q: torch.Tensor, inp: Any, scale: float) -> torch.Tensor:  # type: ignore[override]
        # iSWA (kv/iswa.py): a windowed layer reads the SWA pool with kq_mask_swa
        pool, pinp = self.pool_for(layer, inp) if hasattr(self, "pool_for") else (self, inp)  # type: ignore[attr-defined]
        n_kv, N = int(pinp.n_kv), q.shape[0]  # CellsInputs fields
        mask = pinp.mask(bool(self.windows[layer]))[0, 0, :N].to(q.device).float()  # type: ignore[attr-defined]  # [N, n_kv]
        k, v = pool.k[layer][:n_kv].float(), pool.v[layer][:n_kv].float()  # type: ignore[attr-defined]  # [n_kv, nkv, hd]
        return ggml_cpu_attention(q.float(), k, v, mask, scale, self.flash_attn, self.n_threads).to(q.dtype)


class GgmlAttentionStreamsKV:
    """Mixin for :class:`~infertrace.kv.streams.CellsStreamsKV`: :func:`ggml_cpu_attention` per ubatch
    stream (its ``n_tps`` queries over its own cells; llama.cpp's 4-D stream view)."""

    flash_attn = True
    n_threads = 1

    def attend(self, layer: int, q: torch.Tensor, inp: Any, scale: float) -> torch.Tensor:  # type: ignore[override]
        t, n_kv = inp.n_tps, int(inp.n_kv)
        m = inp.mask(bool(self.windows[layer]))  # type: ignore[attr-defined]  # [ns, 1, n_tps, n_kv]
        out = []
        for j, s in enumerate(inp.streams):
            st = self.streams[s]  # type: ignore[attr-defined]
            k, v = st.k[layer][:n_kv].float(), st.v[layer][:n_kv].float()  # [n_kv, nkv, hd]
            out.append(ggml_cpu_attention(q[j * t : (j + 1) * t].float(), k, v, m[j, 0].float(), scale, self.flash_attn,
                                          self.n_threads).to(q.dtype))  # [n_tps, nh, hd]
        return torch.cat(out)  # [N, nh, hd]


def _native(inp: Any, name: str) -> Any:
    """Field ``name`` of what a captured runtime added to ``inp`` (``inp.native``; llama.cpp's
    :class:`~infertrace.runtimes.llamacpp.native.LlamaCppStepNative`), None for our own engine's inputs."""
    return getattr(inp.native, name, None)


class GgmlCellsKV(GgmlAttentionKV, F16CacheKV, CellsKV):
    """The unified cells cache, F16 K/V, ggml-cpu attention."""


class GgmlCellsF32KV(GgmlAttentionKV, CellsKV):
    """The unified cells cache in the model dtype, ggml-cpu attention (benchmarks/kv_dtype_llamacpp.py)."""


class GgmlIswaKV(GgmlAttentionKV, F16CacheKV, IswaCellsKV):
    """llama.cpp's iSWA cache, F16 K/V, ggml-cpu attention."""


class GgmlStreamsKV(GgmlAttentionStreamsKV, F16CacheKV, CellsStreamsKV):
    """The non-unified cache, F16 K/V, ggml-cpu attention per stream."""


#: the emulating memories by (layout, K/V rounded to F16)
GGML_KINDS: dict[tuple[str, bool], type] = {("cells", True): GgmlCellsKV, ("cells", False): GgmlCellsF32KV,
                                            ("iswa", True): GgmlIswaKV, ("streams", True): GgmlStreamsKV}


def _stream_tap(inp: Any) -> dict[str, Any]:
    """A non-unified step's mask for :class:`StepTap`: the stream blocks stacked in packed order
    (``[N, n_kv]``), ``ne`` with the ubatch's streams, and per stream block its cells' pos / seq_ids
    (``row_block``: the block of each packed row)."""
    return {"ne": list(_native(inp, "kq_mask_ne") or inp.ne), "mask": inp.flat_mask().float().clone(),  # [N, n_kv]
            "cell_pos": inp.cell_pos.tolist(),  # [ns][n_kv]
            "cell_seq": [[frozenset(r.nonzero().flatten().tolist()) for r in blk] for blk in inp.cell_seq],
            "row_block": [i // inp.n_tps for i in range(inp.n_tokens)], "streams": list(inp.streams)}


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
        N = inp.n_tokens
        n_kv = int(inp.n_kv)
        mask = inp.kq_mask  # [n_stream, 1, rows, n_kv]
        own = {}
        for sid in sorted(ctx["requests"]):
            cells = kv.cells_of(sid)
            if cells:
                own[sid] = [p for _, p in cells]
        d = {
            "step": ctx["step"], "idle": False,
            "chunks": [(c.seq_id, c.C, c.T) for c in inp.chunks],
            "positions": inp.positions.tolist(), "n_kv": n_kv,
            "ne": list(_native(inp, "kq_mask_ne") or [n_kv, int(inp.n_tokens_pad), 1, 1]),
            "mask_dtype": _native(inp, "kq_mask_dtype") or str(mask.dtype).replace("torch.", ""),
            "mask": mask[0, 0, :N, :n_kv].float().clone(),  # [N, n_kv]
            "cell_idx": inp.cell_idx.tolist(), "cell_pos": inp.cell_pos.tolist(),
            "cell_seq": [frozenset(r.nonzero().flatten().tolist()) for r in inp.cell_seq],
            "head": (inp.head_before, inp.head_after), "logits_rows": list(ctx["logits_rows"]),
            "out_ids": _native(inp, "out_ids"), "memory_seq_pos": _native(inp, "memory_seq_pos"), "own": own,
            "logits": ctx["logits"].float().clone(), **self._t,
        }
        if hasattr(inp, "streams"):  # non-unified KV: one mask block per stream
            d.update(_stream_tap(inp))
        sw = swa_step(inp, kv, ctx["requests"])
        if sw is not None:
            d["swa"] = sw
        self.steps.append(d)  # the step's record complete before it is kept (tests/unit/test_layering.py)


def swa_step(inp: Any, kv: Any, requests: Any) -> dict[str, Any] | None:
    """The SWA pool's side of a step (llama.cpp's iSWA cache, kv/iswa.py) for :func:`structural_diff`:
    ``n_kv``, ``ne``, ``kq_mask_swa`` ``[N, n_kv]``, the step's cells (``k_idxs_swa``), the cells' pos /
    seq_ids, heads, cells reused / positions purged and per sequence its positions in the pool;
    None without a SWA pool."""
    s, pool = getattr(inp, "swa", None), getattr(kv, "swa", None)
    if s is None or pool is None:
        return None
    N, n_kv = inp.n_tokens, int(s.n_kv)
    own = {}
    for sid in sorted(requests):
        cells = pool.cells_of(sid)
        if cells:
            own[sid] = [p for _, p in cells]
    sp = s.swa_pool  # what the pool's apply_ubatch reused / purged (kv.base.SwaPoolStep; None: nothing recorded)
    return {"n_kv": n_kv, "ne": list(_native(s, "kq_mask_ne") or [n_kv, int(s.n_tokens_pad), 1, 1]),
            "mask": s.kq_mask_swa[0, 0, :N, :n_kv].float().clone(),  # [N, n_kv]
            "cell_idx": s.cell_idx.tolist(), "cell_pos": s.cell_pos.tolist(),
            "cell_seq": [frozenset(r.nonzero().flatten().tolist()) for r in s.cell_seq],
            "head": (s.head_before, s.head_after), "reused": getattr(sp, "reused", "-"),
            "purged": getattr(sp, "purged", "-"), "size": pool.size, "own": own}


def swa_diff(x: dict[str, Any], y: dict[str, Any], bad: Any, name_b: str = "llama.cpp") -> int:
    """Exact comparison of the SWA pool's side of one step (:func:`swa_step`) of ours ``x`` and ``name_b``'s
    ``y``: pool size, ``n_kv``, ``kq_mask_swa`` ``ne``, the cells each token went to, heads, cells reused,
    per sequence its positions in the pool, and ``kq_mask_swa`` cell for cell (placement identical) or
    per query row as visible (pos, seq_ids). ``bad(step, variable, detail)`` records a difference.
    Returns the number of checks made."""
    a, b, s = x.get("swa"), y.get("swa"), x["step"]
    if a is None and b is None:
        return 0
    if a is None or b is None:
        bad(s, "swa", f"only {'ours' if b is None else name_b} has a separate SWA pool")
        return 1
    n = 0
    for what, u, v in (("SWA pool size", a["size"], b["size"]), ("n_kv_swa", a["n_kv"], b["n_kv"]),
                       ("kq_mask_swa ne", a["ne"], b["ne"]), ("k_idxs_swa (SWA-pool cell of each token)", a["cell_idx"], b["cell_idx"]),
                       ("SWA pool head before/after", a["head"], b["head"]), ("SWA cells reused", a["reused"], b["reused"]),
                       ("SWA pool positions per seq after the step", a["own"], b["own"])):
        n += 1
        if u != v:
            bad(s, "swa", f"{what}: ours {str(u)[:120]} vs {name_b} {str(v)[:120]}")
    n += 1
    if a["cell_idx"] == b["cell_idx"] and a["mask"].shape == b["mask"].shape:
        d = ((a["mask"] == 0) != (b["mask"] == 0)).nonzero().tolist()
        if d:
            r, c = d[0]
            bad(s, "swa", f"kq_mask_swa[{r}][{c}] (query pos {x['positions'][r]}, SWA cell {c}) differs ({len(d)} cells)")
    else:
        for r in range(len(x["positions"])):
            if _visible(a, r) != _visible(b, r):
                bad(s, "swa", f"kq_mask_swa query row {r} (pos {x['positions'][r]}): visible (pos, seqs) differ")
                break
    return n


def forced_engine(model: Any, tok: Any, opts: EngineOptions, tracer: Any, forced: dict[int, list[int]],
                  memory: Any = None) -> Engine:
    """Our engine emitting ``forced`` tokens (:class:`~infertrace.engine.parts.ForcedSampler`; its own choice
    stays in ``top``), its memory from ``memory`` (a cache config; None: the options' own)."""
    from infertrace.engine.parts import ForcedSampler

    return Engine(model, tok, opts, tracer, sampler=ForcedSampler(forced), memory=memory)


def _run_ours(model: Any, tok: Any, prompts: list[Any], opts: EngineOptions, layer: int,
              forced: dict[int, list[int]] | None) -> tuple[Engine, StepTap]:
    tap = StepTap(layer)
    eng = forced_engine(model, tok, opts, tap, forced or {})
    drive(eng, encode_requests(tok, prompts))
    return eng, tap


def _run_emulated(loaded: Any, prompts: list[Any], opts: EngineOptions, layer: int,
                  forced: dict[int, list[int]], flash_attn: bool = True, n_threads: int = 1) -> StepTap:
    """Our engine, float32, with llama.cpp's CPU numerics emulated (see :func:`quantize_q8_blocks`,
    :class:`F16CacheKV`, and :func:`ggml_cpu_attention` with the flash-attention setting llama.cpp
    ran with; matmul inputs through :class:`Q8ActivationOps`), forced to ``forced``."""
    tap = StepTap(layer)
    eng = forced_engine(loaded.model.with_ops(Q8ActivationOps()), loaded.tokenizer, opts, tap, forced,
                        memory=GgmlNumericsCache(flash_attn, n_threads))
    drive(eng, encode_requests(loaded.tokenizer, prompts))
    return tap


@dataclass(frozen=True)
class GgmlNumericsCache:
    """The cache config of the emulated run (:class:`~infertrace.engine.parts.MemoryConfig`): the cells cache as
    the cells backend builds it (unified, iSWA for windowed layers, or one stream per sequence), with llama.cpp's
    CPU numerics: K/V rounded to F16 (:class:`F16CacheKV`), attention through :func:`ggml_cpu_attention`.

    Attributes:
        flash_attn: llama.cpp ran flash attention; f16_cache: round K/V to F16 as llama.cpp's cache;
        n_threads: its threads (the accumulation order of the attention rows); kv_dtype: the storage dtype
            (None: the model's).
    """

    flash_attn: bool = True
    n_threads: int = 1
    f16_cache: bool = True
    kv_dtype: Any = None

    def build(self, model: Any, opts: EngineOptions, attn_impl: str) -> Any:
        """The emulating memory for ``model`` under ``opts``.

        Raises:
            InfertraceError: ``f16_cache`` off with a layout other than the unified cells cache.
        """
        from infertrace.kv.streams import n_ctx_seq

        cfg, dt = model.cfg, self.kv_dtype or model.dtype
        windows = [cfg.layer_window(i) for i in range(cfg.n_layer)]
        layout = "streams" if not opts.kv_unified else "iswa" if any(windows) else "cells"
        kind = GGML_KINDS.get((layout, self.f16_cache))
        if kind is None:
            raise InfertraceError(f"the llama.cpp numerics emulation keeps K/V in F16 with the {layout} cache")
        if layout == "streams":  # non-unified KV: the same numerics per stream
            kv = kind(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, n_ctx_seq(opts.ctx_size, opts.n_seq_max), opts.n_seq_max,
                      dt, model.device)
        elif layout == "iswa":  # llama.cpp's iSWA cache, as the cells backend builds it (engine.make_kv)
            kv = kind(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, opts.ctx_size, opts.n_seq_max, dt, model.device,
                      windows=windows, n_ubatch=max(1, min(opts.max_batch_tokens, opts.ctx_size)))
        else:
            kv = kind(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, opts.ctx_size, opts.n_seq_max, dt, model.device)
        kv.flash_attn, kv.n_threads = self.flash_attn, self.n_threads  # this run's setting, on this memory only
        return kv


def _visible(st: dict[str, Any], row: int) -> set[tuple[int, frozenset]]:
    """Row ``row`` of the mask as the set of (pos, seq_ids) of the cells it keeps (placement-free)."""
    keep = (st["mask"][row] == 0).nonzero().flatten().tolist()
    if st.get("row_block") is not None:  # non-unified: the cells of the row's own stream
        j = st["row_block"][row]
        return {(st["cell_pos"][j][c], st["cell_seq"][j][c]) for c in keep}
    return {(st["cell_pos"][c], st["cell_seq"][c]) for c in keep}


def structural_diff(a: list[dict[str, Any]], b: list[dict[str, Any]], name_b: str = "llama.cpp") -> dict[str, Any]:
    """Exact comparison of two :class:`StepTap` step lists (``a`` ours, ``b`` the other engine).

    Returns:
        ``{"checked": int, "swa_checked": int (of which on the iSWA SWA pool, :func:`swa_diff`),
        "mismatches": [{"step", "variable", "detail"}], "placement": text, "mask_dtype": {"ours", name_b}}``.
    """
    mism, n, placement_same, n_swa = [], 0, True, 0
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
        k = swa_diff(x, y, bad, name_b)
        n, n_swa = n + k, n_swa + k
        if y.get("memory_seq_pos"):
            for sid, (lo, hi) in y["memory_seq_pos"].items():
                n += 1
                own = (x.get("swa") or x)["own"].get(int(sid), [])  # iSWA: llama.cpp answers from the SWA pool
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
    return {"checked": n, "swa_checked": n_swa, "mismatches": mism, "placement": placement,
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
                          floor_dtype: str = "llama.cpp-numerics", flash_attn: str = "auto") -> dict[str, Any]:
    """The three runs of the module docstring and their comparison. ``flash_attn``: llama.cpp's
    ``flash_attn_type`` (``auto`` | ``on`` | ``off``); the emulated floor follows what ran, and the
    report names llama.cpp's context settings (``"llama_cpp"``, :meth:`LlamaCppContext.settings`).

    Returns:
        ``{"against": "llama.cpp", "structural": structural_diff(...), "next_token": compare_rows(...),
        "max_abs": {var: float}, "floor": {"how", "dtype", "max_abs": {var: float}, "next_token": {...}},
        "first_exceeding": {"step", "layer", "variable", "value", "floor"} | None, "requests": [...],
        "identical": bool, "mismatches": [...]}``.

    Raises:
        InfertraceError: llama-cpp-python missing, non-GGUF model, engine errors.
    """
    from infertrace.runtimes.llamacpp.engine import run_llamacpp

    o = replace(opts, backend="cells", attention="torch")
    if getattr(loaded.config, "windowed_layers", None):  # the SWA pool's size depends on n_seq_max: llama.cpp's (one per request)
        o = replace(o, n_seq_max=max(1, len(prompts)))
    if getattr(loaded.config, "is_hybrid", False):
        raise InfertraceError("diff-runtimes llama.cpp reads per-layer K/V from llama.cpp's graph, which this comparison does not "
                              "do yet for hybrid (GDN) models; use diff-runtimes hf (tests compare llama.cpp's logits directly)")
    if not 0 <= layer < loaded.config.n_layer:
        raise ConfigError("run.layer", f"{layer} out of range: the model has layers 0..{loaded.config.n_layer - 1}")
    eng, ours = _run_ours(loaded.model, loaded.tokenizer, prompts, o, layer, None)
    forced = {sid: list(r.output_ids) for sid, r in eng.requests.items()}
    ltap = StepTap(layer)
    leng, notes = run_llamacpp(loaded, prompts, o, ltap, layer, forced, flash_attn=flash_attn)
    settings = leng.lctx.settings()
    leng.close()
    floor, how = _noise_floor(loaded, prompts, o, layer, forced, floor_dtype, settings)

    struct = structural_diff(ours.steps, ltap.steps)
    spread, floor_spread = float_spread(ours.steps, ltap.steps), float_spread(ours.steps, floor.steps)
    fmax = {v: max((d.get(v, 0.0) for d in floor_spread), default=0.0) for v in FLOAT_VARS}
    lmax = {v: max((d.get(v, 0.0) for d in spread), default=0.0) for v in FLOAT_VARS}
    first = _first_exceeding(spread, fmax, layer)

    base, labels = _logit_rows(ours.steps)
    lrows, _ = _logit_rows(ltap.steps)
    frows, _ = _logit_rows(floor.steps)
    nt = compare_rows(base, lrows, labels)
    nt_floor = compare_rows(base, frows, labels)
    nt_floor.pop("disagreements")
    reqs = [{"seq_id": sid, "prompt": r.prompt_text, "tokens": list(r.output_ids),
             "text": loaded.tokenizer.decode(r.output_ids)} for sid, r in sorted(eng.requests.items())]
    mism = _mismatches(struct, first, nt)
    return {"against": "llama.cpp", "backend": "cells", "layer": layer, "llama_cpp": settings, "structural": struct,
            "next_token": nt,
            "max_abs": lmax, "per_step": spread,
            "floor": {"dtype": floor_dtype, "max_abs": fmax, "next_token": nt_floor, "how": how, "factor": FLOOR_FACTOR},
            "near_tie_rule": f"the other side's choice is in both top-{NEAR_TIE_TOPK} and within {NEAR_TIE_GAP} nats of the top log-probability in both",
            "first_exceeding": first, "requests": reqs, "notes": notes, "mismatches": mism, "identical": not mism}


def _noise_floor(loaded: Any, prompts: list[Any], o: EngineOptions, layer: int, forced: dict[int, list[int]],
                 floor_dtype: str, settings: dict[str, Any]) -> tuple[StepTap, str]:
    """Run 3 of the module docstring: ours forced to ``forced``, with llama.cpp's numerics emulated
    (``floor_dtype = "llama.cpp-numerics"``, its flash-attention setting and threads from ``settings``)
    or in ``floor_dtype``. Returns its steps and the sentence saying how the floor was measured."""
    fa_on = settings["flash_attn"] == "on"
    if floor_dtype == "llama.cpp-numerics":
        floor = _run_emulated(loaded, prompts, o, layer, forced, flash_attn=fa_on, n_threads=settings["n_threads"])
        att = ("flash attention on as llama.cpp ran it (Q and the output accumulator in F16 below 64 queries)" if fa_on else
               "flash attention off as llama.cpp ran it (Q and the softmax output rounded to F16)")
        how = ("ours float32 vs ours with llama.cpp's numerics emulated (matmul inputs quantised to 8-bit blocks of 32 "
               f"as ggml-cpu's Q8_0/Q8_1 vec_dot, K/V rounded to F16 as the cache, attention with {att}) on the same "
               f"forced tokens: max |Δ| per variable over all steps; tolerance = {FLOOR_FACTOR:g} x floor")
        return floor, how
    from infertrace.loading.model import load_model

    low = load_model(loaded.ckpt.path, dtype=floor_dtype)
    _, floor = _run_ours(low.model, low.tokenizer, prompts, o, layer, forced)
    how = (f"ours float32 vs ours {floor_dtype} on the same forced tokens: max |Δ| per variable over all steps; "
           f"tolerance = {FLOOR_FACTOR:g} x floor")
    return floor, how


def _first_exceeding(spread: list[dict[str, Any]], fmax: dict[str, float], layer: int) -> dict[str, Any] | None:
    """The first step and variable, in the order the forward pass produces them, whose max |Δ| from
    llama.cpp exceeds :data:`FLOOR_FACTOR` x the floor; None when none does."""
    order = ("hidden", "k", "v", "logits")  # the order the forward pass produces them
    for d in spread:
        for v in order:
            if d.get(v, 0.0) > FLOOR_FACTOR * fmax[v]:
                return {"step": d["step"], "layer": layer if v in ("k", "v") else (-1 if v == "hidden" else "output"),
                        "variable": v, "value": d[v], "floor": fmax[v], "tolerance": FLOOR_FACTOR * fmax[v]}
    return None


def _logit_rows(steps: list[dict[str, Any]]) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Every logits row of a :class:`StepTap` step list, ``[M, V]``, with its ``{step, seq_id, pos}``."""
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


def _mismatches(struct: dict[str, Any], first: dict[str, Any] | None, nt: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's mismatches: structural ones, the first float beyond the floor, and every next-token
    disagreement that is not a near tie."""
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
    return mism
