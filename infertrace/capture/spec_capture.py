"""A speculative verify step's record for the trace (built by the recorder from the probe's data).

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


def verify_record(T: int, mask: dict[str, Any], rec: dict[str, Any]) -> dict[str, Any]:
    """The trace's per-request ``spec`` record of one verify chunk.

    Args:
        T: the chunk's tokens (root + drafts).
        mask: the verify mask attention consumed, as the probe read it from the step's inputs
            (``AttnInputs.verify_record`` of the first :data:`MAX_MASK_NODES` nodes: cells the chunk's cells
            and ``kq_mask`` block, paged ``spec_decoding_position_offsets`` and the packed mask).
        rec: the engine's verify record (engine/engine.py ``_verify``).
    """
    acc = set(rec["accepted_nodes"])
    out: dict[str, Any] = {
        "parents": list(rec["parents"]), "accepted_nodes": list(rec["accepted_nodes"]),
        "rejected_nodes": [i for i in range(1, T) if i not in acc], "emitted": list(rec["emitted"]),
        "drafted": rec["drafted"], "accepted": rec["accepted"], "rewind": rec.get("rewind"),
    }
    out.update(mask)  # cells: kq_mask block; paged: offsets + packed mask
    if rec.get("mtp"):  # --speculative mtp: the draft's inputs (which hidden state, which token, each row)
        out["mtp"] = rec["mtp"]
    return out
