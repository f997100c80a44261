"""What a trace shows of one step's attention inputs (the mask record, its sliding-window part, the
physical summary for ``diff-backends``): views of the inputs' data, kept out of the inputs classes.

The inputs (:mod:`infertrace.kv.base`: llama.cpp ``llm_graph_input_attn_kv``'s ``kq_mask`` and cells;
vLLM / TensorRT-LLM's lengths and block tables) are the data one step's attention reads, the
counterpart of llama.cpp's ``llama_memory_context_i``. Which convention a step's inputs follow is read
from the data: ``backend == "paged"`` (lengths and block tables, no dense mask), a ``streams`` field
(llama.cpp's non-unified cache: one mask block per stream), a ``swa`` field (llama.cpp's iSWA cache:
``kq_mask_swa`` over the SWA pool), else one unified cell pool. Nothing here imports the memory.
"""

from __future__ import annotations

from typing import Any

from infertrace.ranges import ranges_text


def _kind(inp: Any) -> str:
    if inp.backend == "paged":
        return "paged"
    if hasattr(inp, "streams"):
        return "streams"
    return "iswa" if hasattr(inp, "swa") else "cells"


def _dtype(t: Any) -> str:
    return str(t.dtype).replace("torch.", "")


def _rows(sl: Any) -> list[list[str]]:
    """A mask slice's rows as the trace writes them: ``"0"`` kept, ``"-inf"`` masked."""
    return [["0" if x == 0 else "-inf" for x in row] for row in sl.tolist()]


def mask_record(inp: Any, max_rows: int, max_cols: int) -> tuple[str, str, dict[str, Any] | None, dict[str, Any] | None]:
    """``(convention, rule, cells part, paged part)`` of the trace's mask record.

    cells: a slice of ``kq_mask`` (at most ``max_rows`` x ``max_cols``) with the cells' pos / seq_ids
    (streams: the first stream's slice at the top, every ubatch stream in ``streams``); paged: no dense
    mask, the lengths and block tables attention reads."""
    kind = _kind(inp)
    if kind == "paged":
        return ("paged", "mask_type causal: query at position p of request r sees keys 0..p of r's block-table row", None,
                {"mask_type": inp.mask_type, "seq_lens": inp.seq_lens.tolist(), "kv_lens": inp.kv_lens.tolist(),
                 "cu_seqlens": inp.cu_seqlens.tolist(), "request_types": list(inp.request_types),
                 "num_contexts": inp.num_contexts, "request_ids": [c.seq_id for c in inp.chunks],
                 "block_tables": inp.block_tables.tolist(), "dense_mask_tensor": None})
    if kind == "streams":
        return _streams_mask_record(inp, max_rows, max_cols)
    m, n_kv = inp.kq_mask, inp.n_kv  # [1, 1, n_pad, n_kv]
    sl = m[0, 0, : min(inp.n_tokens, max_rows), : min(n_kv, max_cols)]
    cells = {"ne": [n_kv, inp.n_tokens_pad, 1, 1], "torch_shape": list(m.shape), "dtype": _dtype(m), "n_kv": n_kv,
             "n_tokens": inp.n_tokens, "cell_pos": inp.cell_pos[:max_cols].tolist(),
             "cell_seq": [row.nonzero().flatten().tolist() for row in inp.cell_seq[:max_cols]], "rows": _rows(sl)}
    return "cells", "keep iff cell holds the query's seq_id and cell.pos <= query pos", cells, None


def _streams_mask_record(inp: Any, max_rows: int, max_cols: int) -> tuple[str, str, dict[str, Any], None]:
    """:func:`mask_record` of a non-unified step (``StreamsInputs``): ``kq_mask`` ``[ns, 1, n_tps, n_kv]``."""
    m, n_kv = inp.kq_mask, inp.n_kv  # [ns, 1, n_tps, n_kv]
    per = []
    for j, s in enumerate(inp.streams):
        sl = m[j, 0, : min(inp.n_tps, max_rows), : min(n_kv, max_cols)]
        per.append({"stream": s, "seq_ids": [int(x) for x in inp.seq_ids[j * inp.n_tps : (j + 1) * inp.n_tps].unique().tolist()],
                    "head_before": inp.head_before[j], "head_after": inp.head_after[j],
                    "cell_pos": inp.cell_pos[j, :max_cols].tolist(),
                    "cell_seq": [row.nonzero().flatten().tolist() for row in inp.cell_seq[j, :max_cols]], "rows": _rows(sl)})
    first = per[0] if per else {"cell_pos": [], "cell_seq": [], "rows": []}
    cells = {"ne": inp.ne, "torch_shape": list(m.shape), "dtype": _dtype(m), "n_kv": n_kv, "n_tokens": inp.n_tps,
             "cell_pos": first["cell_pos"], "cell_seq": first["cell_seq"], "rows": first["rows"],
             "n_stream": inp.n_stream, "stream_size": inp.stream_size, "streams": per}
    return ("cells", "keep iff cell of the query's own stream holds the query's seq_id and cell.pos <= query pos "
            "(non-unified: one stream per sequence)", cells, None)


def swa_record(inp: Any, max_rows: int, max_cols: int) -> dict[str, Any]:
    """The sliding-window part of the mask record: cells, a slice of ``kq_mask_swa`` around the first
    query's window edge (iSWA: over the SWA pool, with the pool's ``size``, ``n_kv``, ``k_idxs``, heads,
    cells reused and positions purged; streams: the first stream's slice); paged, each windowed layer's
    W (attention metadata). Empty when the model has no windowed layer."""
    kind = _kind(inp)
    if kind == "paged":
        return {"attention_window": {str(i): w for i, w in inp.attention_window.items()}}
    if kind == "iswa":
        return _iswa_swa_record(inp, max_rows, max_cols)
    if inp.kq_mask_swa is None:
        return {}
    m, n_kv = inp.kq_mask_swa, inp.n_kv
    if kind == "streams":  # [ns, 1, n_tps, n_kv]
        sl = m[0, 0, : min(inp.n_tps, max_rows), : min(n_kv, max_cols)]
        return {"kq_mask_swa": {"ne": inp.ne, "dtype": _dtype(m), "col_start": 0, "cell_pos": inp.cell_pos[0, :max_cols].tolist(),
                                "rows": _rows(sl)}}
    keep0 = (m[0, 0, 0, :n_kv] == 0).nonzero().flatten()  # cells the first query sees
    c0 = int(keep0[0]) if keep0.numel() else 0
    start = max(0, min(c0 - max_cols // 2, n_kv - max_cols))  # window edge in view
    sl = m[0, 0, : min(inp.n_tokens, max_rows), start : start + max_cols]
    return {"kq_mask_swa": {"ne": [n_kv, inp.n_tokens_pad, 1, 1], "dtype": _dtype(m), "col_start": start,
                            "cell_pos": inp.cell_pos[start : start + max_cols].tolist(), "rows": _rows(sl)}}


def _iswa_swa_record(inp: Any, max_rows: int, max_cols: int) -> dict[str, Any]:
    """:func:`swa_record` of llama.cpp's iSWA step (``IswaInputs``): ``kq_mask_swa`` over the SWA pool."""
    s = inp.swa
    if s is None:
        return {}
    m, n_kv = s.kq_mask_swa, s.n_kv  # [1, 1, n_pad, n_kv_swa]
    keep0 = (m[0, 0, 0, :n_kv] == 0).nonzero().flatten()  # cells the first query sees
    # the window edge: the kept cell of smallest pos (after reuse the pool is not in position order)
    c0 = int(keep0[s.cell_pos[keep0].argmin()]) if keep0.numel() else 0
    start = max(0, min(c0 - max_cols // 2, n_kv - max_cols))
    sl = m[0, 0, : min(inp.n_tokens, max_rows), start : start + max_cols]
    sp = s.swa_pool  # what the pool's apply_ubatch reused / purged (kv.base.SwaPoolStep)
    return {"kq_mask_swa": {"ne": [n_kv, s.n_tokens_pad, 1, 1], "dtype": _dtype(m), "col_start": start,
                            "cell_pos": s.cell_pos[start : start + max_cols].tolist(), "rows": _rows(sl)},
            "pool": {"size": sp.pool_size if sp is not None else 0, "n_kv": n_kv, "k_idxs": ranges_text(s.cell_idx.tolist()),
                     "head_before": s.head_before, "head_after": s.head_after,
                     "reused": sp.reused if sp is not None else "-", "purged": sp.purged if sp is not None else "-"}}


def inputs_summary(inp: Any) -> dict[str, Any]:
    """What attention got this step, for the backend diff: cells, the ``kq_mask`` shape, ``n_kv``,
    ``head_before`` (streams: per stream, and the ubatch's streams; iSWA: the SWA pool's too); paged,
    the lengths and the mask type."""
    kind = _kind(inp)
    if kind == "paged":
        return {"seq_lens": inp.seq_lens.tolist(), "kv_lens": inp.kv_lens.tolist(), "cu_seqlens": inp.cu_seqlens.tolist(),
                "num_contexts": inp.num_contexts, "mask_type": inp.mask_type}
    if kind == "streams":
        return {"kq_mask_ne": inp.ne, "n_kv": inp.n_kv, "head_before": list(inp.head_before), "streams": list(inp.streams)}
    d = {"kq_mask_ne": [inp.n_kv, inp.n_tokens_pad, 1, 1], "n_kv": inp.n_kv, "head_before": inp.head_before}
    if kind == "iswa" and inp.swa is not None:
        d.update({"kq_mask_swa_ne": [inp.swa.n_kv, inp.swa.n_tokens_pad, 1, 1], "n_kv_swa": inp.swa.n_kv,
                  "head_before_swa": inp.swa.head_before})
    return d
