"""What a captured llama.cpp step adds to the attention inputs our memory would have built: the
runtime's own facts, typed (``AttnInputs.native``), read by the llama.cpp comparison and never by
the memory.

Mirrors what ``llama_decode`` fed its graph (``src/llama-graph.cpp`` inputs, as captured by
:mod:`infertrace.runtimes.llamacpp.capture`) and the memory API read after it
(``llama_memory_seq_pos_min/max``, ``src/llama-memory.h``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class LlamaCppStepNative:
    """One captured ubatch of llama.cpp, beside the cells inputs it was read into.

    Fields (None when the graph did not have it):
        kq_mask_ne: ggml ``ne`` of ``attn_inp_kq_mask`` (or ``attn_inp_kq_mask_swa`` for the SWA
            pool's inputs): ``[n_kv, n_tokens, 1, n_stream]``.
        kq_mask_dtype: the mask's ggml type name (``f32`` / ``f16``).
        out_ids: ``out_ids`` ``[n_outputs]``: the rows llama.cpp computed logits for.
        inp_tokens: ``inp_tokens`` ``[N]`` token ids.
        llama_rs: hybrid models: per ubatch llama.cpp's recurrent cells (``head``, ``n_rs``, ``rs_z``, ``s_copy``).
        memory_seq_pos: per sequence ``[llama_memory_seq_pos_min, llama_memory_seq_pos_max]`` after the ubatch.
        n_kv_read_back: the SWA pool's ``n_kv`` as our read-back pool computes it (``get_n_kv``).
    """

    kq_mask_ne: list[int] | None = None
    kq_mask_dtype: str | None = None
    out_ids: list[int] | None = None
    inp_tokens: list[int] | None = None
    llama_rs: list[dict[str, Any]] | None = None
    memory_seq_pos: dict[str, list[int]] | None = None
    n_kv_read_back: int | None = None


def add_native(inp: Any, **fields: Any) -> None:
    """Set ``fields`` of ``inp.native`` (a new :class:`LlamaCppStepNative`, the others kept)."""
    inp.native = replace(inp.native if isinstance(inp.native, LlamaCppStepNative) else LlamaCppStepNative(), **fields)
