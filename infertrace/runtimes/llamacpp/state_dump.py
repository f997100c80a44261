"""``dump-kv --state FILE``: a parsed llama.cpp slot / sequence state file
(:func:`infertrace.runtimes.llamacpp.state_file.read_state_file`) as one JSON-ready dict, torch-free.

The cells use the ``cells`` vocabulary of :mod:`infertrace.trace.kv_dump` (stretches and character
map from :func:`~infertrace.trace.kv_dump.cells_layout`), the K/V values the ``values`` dict of
:func:`infertrace.capture.kv_views.read_values`, so :func:`infertrace.present.render_kv.render_state_dump` reuses
the dump-kv rendering. One difference is stated wherever cells are shown: the file holds no cell
indices (``state_write_meta`` writes the used cells in cell order, empty cells skipped), so ``cell``
here is the row of the file, not llama.cpp's cell index.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from infertrace.errors import InfertraceError
from infertrace.ranges import ranges_text
from infertrace.runtimes.llamacpp.state_file import SlotState, pools, type_name
from infertrace.trace.kv_dump import N_FIRST, cells_layout


def _types(state: SlotState) -> dict[str, str]:
    """K and V types as ``F16`` (or ``F16, Q8_0`` when layers differ), V layout."""
    ks = sorted({type_name(L.k_type) for s in state.streams for L in s.layers})
    vs = sorted({type_name(L.v_type) for s in state.streams for L in s.layers})
    return {"k": ", ".join(ks) or "-", "v": ", ".join(vs) or "-"}


def _stream_dict(s: Any) -> dict[str, Any]:
    cells = [{"cell": i, "pos": int(p), "seq_ids": list(ids)} for i, (p, ids) in enumerate(zip(s.pos, s.seq_ids))]
    phys = {"size": len(cells), "n_kv": len(cells), "cells": cells}
    seqs: dict[str, dict[str, str]] = {}
    for sid in sorted({x for ids in s.seq_ids for x in ids}):
        rows = [c for c in cells if sid in c["seq_ids"]]
        seqs[str(sid)] = {"cells": ranges_text([c["cell"] for c in rows]), "pos": ranges_text(sorted(c["pos"] for c in rows)),
                          "n": len(rows)}
    return {"pool": s.pool, "stream": s.stream, "n_cells": len(cells), "layers": [L.il for L in s.layers], "v_trans": s.v_trans, "cells": cells, "seqs": seqs,
            "layout": cells_layout(phys)}


def _values(state: SlotState, cfg: Any, head: int, positions: Sequence[int] | None, full: bool) -> dict[str, Any]:
    """The ``values`` dict of :func:`infertrace.capture.kv_views.read_values` from the chosen layer's K/V."""
    if not 0 <= head < cfg.n_head_kv:
        raise InfertraceError(f"--head {head} out of range: the model has kv heads 0..{cfg.n_head_kv - 1}")
    n = cfg.head_dim if full else min(N_FIRST, cfg.head_dim)
    wanted = None if positions is None else set(positions)
    by_seq: dict[int, list[dict[str, Any]]] = {}
    for s in state.streams:
        if s.k is None or s.v is None:  # an iSWA cache: the other pool holds this layer
            continue
        for i, (p, ids) in enumerate(zip(s.pos, s.seq_ids)):
            for sid in ids:
                row = by_seq.setdefault(sid, [])
                if wanted is None or int(p) in wanted:
                    row.append({"pos": int(p), "cell": i, "stream": s.stream, "pool": s.pool,
                                "k": [float(x) for x in np.asarray(s.k[i, head, :n])],
                                "v": [float(x) for x in np.asarray(s.v[i, head, :n])]})
    if positions is not None and by_seq and not any(by_seq.values()):
        raise InfertraceError(f"--positions {ranges_text(list(positions))}: the file holds no cell at those positions")
    reqs = [{"seq_id": sid, "len": len(rows), "rows": sorted(rows, key=lambda r: r["pos"])} for sid, rows in sorted(by_seq.items())]
    pool = next((s.pool for s in state.streams if s.k is not None), None)
    return {"layer": state.layer, "head": head, "full": full, "n_values": n, "source": "state file", "pool": pool,
            "requests": reqs}


def state_dump(state: SlotState, cfg: Any, head: int | None = None, positions: Sequence[int] | None = None,
               full: bool = False) -> dict[str, Any]:
    """The dict ``dump-kv --state`` prints (``--json``) or renders.

    Args:
        state: parsed with ``layer`` set when K/V values are wanted.
        cfg: the model config the file was checked against.
        head, positions, full: which values (kv head, default 0; positions, default all; all
            ``head_dim`` values or the first :data:`~infertrace.trace.kv_dump.N_FIRST`).

    Returns:
        ``{"source": "llama.cpp state file", "file", "bytes", "version", "tokens", "pools": {pool: {"n_stream",
        "n_cells", "layers"}}, "n_layer", "n_kv_heads", "head_dim", "types": {"k", "v"}, "k_order",
        "streams": [{"pool", "stream", "n_cells", "layers", "v_trans", "cells": [{"cell", "pos", "seq_ids"}], "seqs",
        "layout"}], "values": None | {...}, "attn_rot": None | {"k", "v", "LLAMA_ATTN_ROT_DISABLE"}}``
        (``attn_rot``: the Hadamard block sizes undone on K / V, 0 none).

    Raises:
        InfertraceError: ``head`` out of range, no cell at ``positions``.
    """
    values = None
    if state.layer is not None:
        values = _values(state, cfg, head or 0, positions, full)
    norm = getattr(cfg, "rope_pairing_in_file", "norm") == "norm"
    return {"source": "llama.cpp state file", "file": state.path, "bytes": state.size, "version": state.version,
            "tokens": list(state.tokens), "n_layer": cfg.n_layer,
            "pools": {pool: {"n_stream": state.n_stream[pool], "n_cells": state.n_cells(pool), "layers": ranges_text(layers)}
                      for pool, layers in pools(cfg)},
            "n_kv_heads": cfg.n_head_kv, "head_dim": cfg.head_dim, "types": _types(state),
            "k_order": ("half-split (llama.cpp's adjacent-pair rows of this GGUF un-permuted, as traces hold K)"
                        if norm else "as llama.cpp stores it (half-split)"),
            "streams": [_stream_dict(s) for s in state.streams], "values": values,
            "attn_rot": _rotation(state)}


def _rotation(state: SlotState) -> dict[str, Any] | None:
    """The Hadamard rotation undone on the shown layer (None: no values read)."""
    if state.layer is None or not state.streams:
        return None
    rk, rv = next((s.rot for s in state.streams if s.k is not None), (0, 0))
    return {"k": rk, "v": rv, "LLAMA_ATTN_ROT_DISABLE": os.environ.get("LLAMA_ATTN_ROT_DISABLE")}
