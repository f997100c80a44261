"""What both KV-cache backends share: the per-step attention inputs and the protocol.

A backend owns the physical K/V storage of every layer. Each step the engine calls
``prepare(chunks)`` (choose where the current tokens' K/V go and build the attention
inputs), then per layer ``write`` and ``attend``, then ``release`` for finished requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from infertrace.kv.chunk import ChunkSpec  # noqa: F401 - re-exported (kv/chunk.py)
from infertrace.ranges import ranges_text  # noqa: F401 - torch-free home; re-exported for old imports


@dataclass
class AttnInputs:
    """Per-step attention inputs common to every memory (a batch of one is still a batch).

    ``chunks`` (packed order), ``positions`` ``[N]`` int64, ``seq_ids`` ``[N]`` int64, ``backend``
    (the convention: ``cells`` / ``paged``); ``state_indices`` ``[num_seqs]``: the recurrent-state
    slot of each chunk (hybrid memories only, TensorRT-LLM ``state_indices`` / llama.cpp ``s_copy``);
    ``native``: what a captured runtime adds to its step, as that runtime's own frozen dataclass
    (llama.cpp: :class:`~infertrace.runtimes.llamacpp.native.LlamaCppStepNative`: ``kq_mask_ne``,
    ``out_ids``, ``memory_seq_pos`` ...), never read by the memory; None for our engine. Each
    convention's inputs are a subclass: :class:`CellsInputs`, :class:`PagedInputs`.
    """

    chunks: list[ChunkSpec]
    positions: torch.Tensor
    seq_ids: torch.Tensor
    backend: str
    state_indices: list[int] | None = field(default=None, kw_only=True)
    native: Any = field(default=None, kw_only=True)

    @property
    def n_tokens(self) -> int:
        return int(self.positions.shape[0])


@dataclass(frozen=True)
class SwaPoolStep:
    """What llama.cpp's iSWA SWA pool did in one step (``llama_kv_cache::apply_ubatch`` on the pool,
    :meth:`~infertrace.kv.iswa.SwaCellsPool.apply_ubatch`): ``reused`` the cells taken over from
    tokens that left every window, ``purged`` the positions removed because of it (range text, ``-``
    for none), ``pool_size`` the pool's cells."""

    reused: str = "-"
    purged: str = "-"
    pool_size: int = 0


@dataclass
class CellsInputs(AttnInputs):
    """llama.cpp cells inputs (``llm_graph_input_attn_kv``): ``cell_idx`` ``[N]`` int64 where each
    token's K/V goes (``k_idxs``), ``n_kv`` cells the graph reads, ``kq_mask``
    ``[n_stream, 1, n_tokens_pad, n_kv]`` float32 (ggml ``ne = [n_kv, n_tokens_pad, 1, n_stream]``),
    ``head_before`` / ``head_after``, the cells' ``cell_pos`` ``[n_kv]`` / ``cell_seq``
    ``[n_kv, n_seq_max]`` when the mask was filled; models with windowed layers add ``kq_mask_swa``
    (same shape), ``n_swa`` and ``swa_layers``; the inputs of llama.cpp's SWA pool add ``swa_pool``
    (:class:`SwaPoolStep`)."""

    cell_idx: torch.Tensor = field(kw_only=True)
    n_kv: int = field(kw_only=True)
    kq_mask: torch.Tensor = field(kw_only=True)
    n_tokens_pad: int = field(kw_only=True)
    head_before: int = field(kw_only=True)
    head_after: int = field(kw_only=True)
    cell_pos: torch.Tensor = field(kw_only=True)
    cell_seq: torch.Tensor = field(kw_only=True)
    kq_mask_swa: torch.Tensor | None = field(default=None, kw_only=True)
    n_swa: int = field(default=0, kw_only=True)
    swa_layers: list[int] = field(default_factory=list, kw_only=True)
    swa_pool: SwaPoolStep | None = field(default=None, kw_only=True)

    def mask(self, swa: bool = False) -> torch.Tensor:
        """``kq_mask_swa`` when ``swa`` and the model has windowed layers, else ``kq_mask``."""
        return self.kq_mask_swa if (swa and self.kq_mask_swa is not None) else self.kq_mask

    # --- a verify chunk's mask as a trace shows it (the other views: infertrace.capture.mask_views) ---
    def verify_record(self, chunk_index: int, row: int, T: int) -> dict[str, Any]:
        """A speculative verify chunk's mask: the chunk's cells and the ``[T, T]`` block of ``kq_mask``
        over them (llama.cpp has no tree metadata: the verify mask is rows of ``kq_mask``)."""
        cells = self.cell_idx[row : row + T]  # [T]
        block = self.kq_mask[0, 0, row : row + T][:, cells]  # [T, T] the verify block of kq_mask
        return {"cells": cells.tolist(), "kq_mask_block": [["0" if x == 0 else "-inf" for x in r] for r in block.tolist()],
                "verify_mask": ["".join("1" if x == 0 else "0" for x in r) for r in block.tolist()]}


@dataclass
class PagedInputs(AttnInputs):
    """vLLM / TensorRT-LLM paged inputs: ``slot_mapping`` ``[N]`` int64, ``block_tables``
    ``[num_seqs, max_blocks]`` int32 (-1 padded), ``seq_lens`` / ``kv_lens`` ``[num_seqs]`` int32,
    ``cu_seqlens`` ``[num_seqs+1]`` int32, ``request_types``, ``num_contexts``, ``mask_type``,
    ``tokens_per_block``, ``attention_window`` (layer -> W); a verify step adds TensorRT-LLM's
    ``spec_decoding_*`` tensors and, for a branching tree, ``spec_tree_mask`` ``[S, T_max, T_max]``
    bool and ``spec_q_pos`` ``[S, T_max]`` int64 (:func:`~infertrace.kv.spec_meta.spec_metadata`)."""

    slot_mapping: torch.Tensor = field(kw_only=True)
    block_tables: torch.Tensor = field(kw_only=True)
    seq_lens: torch.Tensor = field(kw_only=True)
    kv_lens: torch.Tensor = field(kw_only=True)
    cu_seqlens: torch.Tensor = field(kw_only=True)
    request_types: list[str] = field(kw_only=True)
    num_contexts: int = field(kw_only=True)
    mask_type: str = field(default="causal", kw_only=True)
    tokens_per_block: int = field(kw_only=True)
    attention_window: dict[int, int] = field(default_factory=dict, kw_only=True)
    spec_decoding_generation_lengths: torch.Tensor | None = field(default=None, kw_only=True)
    spec_decoding_position_offsets: torch.Tensor | None = field(default=None, kw_only=True)
    spec_decoding_packed_mask: torch.Tensor | None = field(default=None, kw_only=True)
    spec_tree_mask: torch.Tensor | None = field(default=None, kw_only=True)
    spec_q_pos: torch.Tensor | None = field(default=None, kw_only=True)
    #: the five index tensors on the pool's device, made once per step by the first layer
    dev: dict[str, torch.Tensor] | None = field(default=None, kw_only=True, repr=False)

    # --- a verify chunk's mask as a trace shows it (the other views: infertrace.capture.mask_views) ---
    def verify_record(self, chunk_index: int, row: int, T: int) -> dict[str, Any]:
        """A speculative verify chunk's metadata: TensorRT-LLM's position offsets and packed tree mask."""
        from infertrace.kv.spec_meta import unpack_mask

        packed = self.spec_decoding_packed_mask[chunk_index, :T]  # [T, W] int32
        rows = unpack_mask(packed, T)  # [T, T]
        return {"position_offsets": self.spec_decoding_position_offsets[chunk_index, :T].tolist(),
                "packed_mask": packed.tolist(),
                "verify_mask": ["".join("1" if x else "0" for x in r) for r in rows.tolist()]}


class MemOp(dict):
    """What a memory operation did: a JSON-ready dict (the engine puts it in the step trace) that is
    also the operation's answer, as llama.cpp's ``bool llama_memory_seq_rm``: true when done, false
    when this memory cannot do it (then ``{"op", "refused": reason}`` and nothing was changed)."""

    ok: bool = True

    def __bool__(self) -> bool:
        return self.ok

    @classmethod
    def refused(cls, op: str, reason: str, **fields: Any) -> "MemOp":
        """A "cannot" answer: nothing changed; ``reason`` says why in one line."""
        out = cls({"op": op, "refused": reason, **fields})
        out.ok = False
        return out


class Memory(Protocol):
    """The one memory protocol every memory kind implements as methods (cells, paged, recurrent state
    and their hybrid): llama.cpp ``src/llama-memory.h`` ``llama_memory_i`` (``seq_rm`` returning
    false when it cannot, ``seq_cp``, ``seq_keep``, ``seq_add``, ``seq_div``, ``seq_pos_min/max``,
    batch preparation, state read) plus what serving and speculative decoding need (context shift,
    verify rewind, prefix lookup), each with a "not supported" answer where a kind has none, so no
    caller asks which kind it holds.

    Positions follow llama.cpp: ``p0 < 0`` means 0, ``p1 < 0`` means "to the end". Sequence
    operations return a :class:`MemOp` (false: refused, nothing changed).

    Only the memory's operations and its state as data (``snapshot``, ``describe``) are here; what a
    trace, ``dump-kv`` or ``diff-backends`` shows of one step (placement, heads, the physical
    summary, K/V values) is read from the state by :mod:`infertrace.capture.kv_views`, by ``layout``.
    ``tests/unit/kv/test_memory_layering.py`` holds this protocol's method list.
    """

    kind: str
    layout: str  # storage layout the views read: cells, cells_iswa, cells_streams, paged, hybrid
    capacity_tokens: int

    # --- batch preparation and the forward (llama_memory_i::init_batch / the graph inputs) -----------
    def can_fit(self, plan: list[tuple[int, int]]) -> bool:
        """Whether all ``(seq_id, n_new)`` of ``plan`` fit at once."""

    def prepare(self, chunks: Sequence[ChunkSpec]) -> AttnInputs:
        """Reserve storage for the current tokens and build the convention's attention inputs."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, inp: AttnInputs) -> None:
        """Store current K/V ``[N, n_kv_heads, head_dim]`` of model layer ``layer``."""

    def attend(self, layer: int, q: torch.Tensor, inp: AttnInputs, scale: float) -> torch.Tensor:
        """Attention output ``[N, n_head, head_dim]`` for queries ``q`` of model layer ``layer``."""

    def release(self, seq_id: int) -> None:
        """Free everything ``seq_id`` owns (``seq_rm(seq_id, -1, -1)``); a prefix-caching memory may
        keep it for reuse."""

    def forget(self, seq_id: int) -> None:
        """Free ``seq_id`` without keeping anything for reuse (an admission undone: a prefix-caching memory
        must not retain what the trace never showed); :meth:`release` where nothing is retained."""

    # --- sequence operations (llama_memory_i) -----------------------------------------------------------
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> MemOp:
        """Remove ``seq_id``'s positions ``[p0, p1)``; false when this memory cannot (recurrent: a part
        of a sequence; paged: anything but a tail)."""

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> MemOp:
        """Let ``dst`` hold ``src``'s positions ``[p0, p1)``."""

    def seq_keep(self, seq_id: int) -> MemOp:
        """Drop every sequence but ``seq_id``."""

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int, ropes: Sequence[Any]) -> MemOp:
        """Move positions ``[p0, p1)`` by ``delta``, cached K re-rotated with each layer's RoPE."""

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int, ropes: Sequence[Any]) -> MemOp:
        """Divide positions ``[p0, p1)`` by ``d`` (llama.cpp self-extend), K re-rotated."""

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest cached position of ``seq_id`` (-1 when it holds none)."""

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest cached position of ``seq_id`` (-1 when it holds none)."""

    def shift_out(self, seq_id: int, p0: int, p1: int, ropes: Sequence[Any]) -> MemOp:
        """Context shift: drop ``[p0, p1)`` and move the rest down by ``p1 - p0`` (llama.cpp server's
        ``seq_rm`` + ``seq_add``)."""

    def checkpoint(self, seq_id: int) -> dict[str, Any] | None:
        """A copy of what ``seq_id``'s ``seq_rm`` could not undo (a recurrent state), for a later
        :meth:`restore` (llama.cpp server's speculative checkpoint); None when nothing needs saving."""

    def restore(self, seq_id: int, ckpt: dict[str, Any]) -> MemOp:
        """Back to a :meth:`checkpoint`; false when this memory keeps none."""

    def rewind(self, seq_id: int, C: int, T: int, accepted: Sequence[int], inp: AttnInputs, row: int,
               is_chain: bool) -> MemOp:
        """After a speculative verify chunk (``C``, ``T``, rows ``row..row+T-1`` of ``inp``): keep the
        accepted candidates, free the rest."""

    # --- prefix reuse ------------------------------------------------------------------------------------
    def lookup(self, seq_id: int, prompt: Sequence[int]) -> dict[str, Any]:
        """Attach the longest cached prefix of ``prompt`` to ``seq_id``; ``{"hit": n, ...}``."""

    def note_tokens(self, seq_id: int, C: int, token_ids: Sequence[int], all_ids: Sequence[int]) -> None:
        """Record the token ids just written for ``seq_id`` (what later lookups match)."""

    def note_rewind(self, seq_id: int, ids: Sequence[int]) -> None:
        """``seq_id`` now holds exactly ``ids`` (after a rewind)."""

    def take_events(self) -> list[dict[str, Any]]:
        """Cache events since the last call (evictions), oldest first."""

    # --- state read --------------------------------------------------------------------------------------
    def seq_len(self, seq_id: int) -> int:
        """Tokens of ``seq_id`` currently cached."""

    def read(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical K, V of ``seq_id`` in model layer ``layer`` ordered by position:
        ``[L, n_kv_heads, head_dim]`` each."""

    def logical_mask(self, inp: AttnInputs, swa: bool = False) -> list[torch.Tensor]:
        """Per chunk, bool ``[T, C+T]``: query i may see key position j."""

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready description of the physical state, as data (for traces and ``dump-kv``)."""

    def describe(self) -> dict[str, Any]:
        """Shape of the memory: ``kind``, ``dtype``, ``n_layer`` (physical K/V layers), ``kv_layers`` (model
        layers with K/V), ``n_kv_heads``, ``head_dim``, ``block_size`` (0 = cells), ``n_seq_max`` (None =
        unbounded), ``physical_shape`` (per layer); its one-line conventions for a reader are
        :func:`infertrace.capture.kv_views.conventions`."""

    kv_layers: list[int]  # model layers holding K/V (a hybrid's attention layers)

    def phys_layer(self, il: int) -> int:
        """Physical K/V layer of model layer ``il`` (raises for a layer without K/V)."""

    def holds_values(self, il: int) -> bool:
        """True when :meth:`read` returns model layer ``il``'s K/V (a read-back memory may hold one layer's)."""

    def recurrent_state(self) -> Any:
        """The recurrent part (:class:`~infertrace.kv.recurrent.RecurrentState`), None without one."""

    def written_blocks(self, inp: AttnInputs, row: int, T: int) -> list[int]:
        """Blocks the step's rows ``row..row+T-1`` went to (paged; ``[]`` for cells)."""


#: the name before the protocol grew sequence operations; same protocol.
KVBackend = Memory


class MemoryDefaults:
    """The "not supported" answers of the :class:`Memory` protocol, for a memory kind without the
    operation (a kind overrides what it has): no prefix reuse (a lookup hits nothing), no cache
    events, no ``seq_div``."""

    kind: str

    def holds_values(self, il: int) -> bool:
        """Every K/V layer's values are held (``read`` answers for each layer in ``kv_layers``)."""
        return il in self.kv_layers  # type: ignore[attr-defined]

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int, ropes: Sequence[Any]) -> MemOp:
        return MemOp.refused("seq_div", f"seq_div is not supported by the {self.kind} memory")

    def lookup(self, seq_id: int, prompt: Sequence[int]) -> dict[str, Any]:
        return {"hit": 0, "refused": f"prefix reuse is not enabled on this {self.kind} memory"}

    def checkpoint(self, seq_id: int) -> dict[str, Any] | None:
        """Nothing to save: a memory without recurrent state drops any tail with ``seq_rm`` (llama.cpp
        server checkpoints only contexts whose memory cannot); the hybrid memory overrides it."""
        return None

    def restore(self, seq_id: int, ckpt: dict[str, Any]) -> MemOp:
        return MemOp.refused("restore", f"the {self.kind} memory keeps no state checkpoints")

    def note_tokens(self, seq_id: int, C: int, token_ids: Sequence[int], all_ids: Sequence[int]) -> None:
        return None

    def note_rewind(self, seq_id: int, ids: Sequence[int]) -> None:
        return None

    def forget(self, seq_id: int) -> None:
        """Free ``seq_id``: :meth:`release` (a memory that retains released sequences overrides this)."""
        self.release(seq_id)

    def take_events(self) -> list[dict[str, Any]]:
        return []

    def written_blocks(self, inp: AttnInputs, row: int, T: int) -> list[int]:
        """Blocks the step's rows ``row..row+T-1`` were written to (none: this memory has no blocks)."""
        return []

    def recurrent_state(self) -> Any:
        """The recurrent part of a hybrid memory (llama.cpp ``get_mem_recr``); None: no recurrent state."""
        return None

    def phys_layer(self, il: int) -> int:
        """Physical KV layer of model layer ``il`` (every layer holds K/V here)."""
        return il
