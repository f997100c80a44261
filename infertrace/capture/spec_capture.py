"""Capture of a speculative verify step for the trace (read-only; called by the recorder).

Per verify chunk: the draft tree (chunk-local parents, root 0 = the pending token), the
candidates' positions ``C + depth``, which nodes were accepted / rejected, the emitted tokens, the
KV rewind (on a hybrid model with ``rewind.state``: the GDN state snapshot kept and the state's norm /
sum before and after, :meth:`~infertrace.kv.recurrent.RecurrentState.select`), and the verify mask *read back from what attention consumed*: on ``cells`` the rows of
``kq_mask`` over the chunk's own cells (llama.cpp), on ``paged`` the unpacked
``spec_decoding_packed_mask`` rows plus ``spec_decoding_position_offsets`` (TensorRT-LLM).
"""

from __future__ import annotations

from typing import Any

#: verify chunks larger than this keep only the first rows/columns of their masks in the trace
MAX_MASK_NODES = 64


def verify_record(inp: Any, chunk_index: int, row: int, rec: dict[str, Any]) -> dict[str, Any]:
    """The trace's per-request ``spec`` record of one verify chunk.

    Args:
        inp: the step's :class:`~infertrace.kv.base.AttnInputs`.
        chunk_index: index of the chunk in the packed batch; row: its first packed row.
        rec: the engine's verify record (engine/engine.py ``_verify``).
    """
    c = inp.chunks[chunk_index]
    T = min(c.T, MAX_MASK_NODES)
    acc = set(rec["accepted_nodes"])
    out: dict[str, Any] = {
        "parents": list(rec["parents"]), "accepted_nodes": list(rec["accepted_nodes"]),
        "rejected_nodes": [i for i in range(1, c.T) if i not in acc], "emitted": list(rec["emitted"]),
        "drafted": rec["drafted"], "accepted": rec["accepted"], "rewind": rec.get("rewind"),
    }
    out.update(inp.verify_record(chunk_index, row, T))  # cells: kq_mask block; paged: offsets + packed mask
    if rec.get("mtp"):  # --speculative mtp: the draft's inputs (which hidden state, which token, each row)
        out["mtp"] = rec["mtp"]
    return out
