"""The one schema check of a saved ``trace.json`` (types, ranges, sizes, cross-field consistency).

Every consumer of a saved trace (``show``, ``diff``, ``report``, ``dump-kv DIR``, the pytest
snapshot plugin) reads it through :func:`infertrace.trace.store.read_manifest`, which calls
:func:`validate_trace` before anything else looks at a value. After it passes:

* every field the renderers read exists and has its type (int is an int, never a bool or a
  string; a float is a JSON number; strings are bounded);
* every size a loop or an allocation depends on is bounded by a named limit (:data:`LIMITS`):
  ``ctx_size``, ``num_blocks``, ``tokens_per_block``, cell indices, positions, list lengths,
  range texts such as ``"0..3"``;
* the records agree with each other: per request ``T = len(token_ids) = len(positions) = …``,
  ``positions = C..C+T-1``, ``N = ΣT``, packed rows inside ``0..N-1``, the paged metadata's
  ``seq_lens``/``kv_lens``/``cu_seqlens`` equal ``T``/``C+T``/prefix sums, the logical masks are
  ``[T][C+T]`` of 0/1, cells lie inside the cache, block tables cover their lengths, step numbers
  increase.

A problem is an :class:`InfertraceError` (exit 2) naming the file, the field path and what was
expected. Unknown keys inside records are refused (``cls(**obj)`` would fail on them); the open
sections (``model``, ``config``, ``options``) may hold extra keys, bounded in size and depth.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

from infertrace.errors import InfertraceError
from infertrace.fmt import clip
from infertrace.limits import LIMITS, N_KV_PAD_MAX  # noqa: F401 - shared with the memories (torch-free); re-exported
from infertrace.ranges import range_count as _range_count
from infertrace.safe_text import visible

L = LIMITS
_NUM_ABS = 1e300  # ints stored where a float is expected must convert to a finite float


class Bad(Exception):
    """A schema violation at ``path`` (turned into one InfertraceError line by :func:`validate_trace`)."""

    def __init__(self, path: str, msg: str):
        super().__init__(f"{path}: {msg}")
        self.path, self.msg = path, msg


def _short(v: Any) -> str:
    """An offending value for a schema message: containers by type name, huge integers by their
    digit count, else ``repr`` :func:`~infertrace.fmt.clip`-ped to 40 characters, escaped."""
    if isinstance(v, (dict, list)):
        return type(v).__name__
    s = repr(v) if not isinstance(v, int) or abs(v) < 10 ** 30 else f"an integer of {len(str(abs(v)))} digits"
    return visible(clip(s, 40))


# ----------------------------------------------------------------------------- primitive specs
Spec = Callable[[Any, str], None]


def Int(lo: int = 0, hi: int = L["MAX_ID"], null: bool = False, limit: str = "") -> Spec:
    def check(v: Any, p: str) -> None:
        if v is None and null:
            return
        if not isinstance(v, int) or isinstance(v, bool):
            raise Bad(p, f"expected an integer, got {_short(v)}")
        if not lo <= v <= hi:
            lim = f" (limit {limit} = {hi})" if limit and v > hi else ""
            raise Bad(p, f"{_short(v)} is outside {lo}..{hi}{lim}")
    return check


def Num(null: bool = False, lo: float = -math.inf, hi: float = math.inf) -> Spec:
    """A JSON number (float or int, never bool); NaN/inf allowed unless ``lo``/``hi`` exclude them."""
    def check(v: Any, p: str) -> None:
        if v is None and null:
            return
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise Bad(p, f"expected a number, got {_short(v)}")
        if isinstance(v, int) and abs(v) > _NUM_ABS:
            raise Bad(p, f"number {_short(v)} is too large")
        if (lo > -math.inf or hi < math.inf) and not (lo <= v <= hi):
            raise Bad(p, f"{_short(v)} is outside {lo:g}..{hi:g}")
    return check


def Str(null: bool = False, choices: tuple[str, ...] | None = None, max_len: int = L["MAX_STR"]) -> Spec:
    def check(v: Any, p: str) -> None:
        if v is None and null:
            return
        if not isinstance(v, str):
            raise Bad(p, f"expected a string, got {_short(v)}")
        if len(v) > max_len:
            raise Bad(p, f"string of {len(v)} characters exceeds the limit {max_len}")
        if choices is not None and v not in choices:
            raise Bad(p, f"{_short(v)} is not one of {', '.join(choices)}")
    return check


def Bool(null: bool = False) -> Spec:
    def check(v: Any, p: str) -> None:
        if not (isinstance(v, bool) or (v is None and null)):
            raise Bad(p, f"expected true or false, got {_short(v)}")
    return check


def List(item: Spec, max_len: int = L["MAX_LIST"], null: bool = False, length: int | None = None) -> Spec:
    def check(v: Any, p: str) -> None:
        if v is None and null:
            return
        if not isinstance(v, list):
            raise Bad(p, f"expected a list, got {_short(v)}")
        if len(v) > max_len:
            raise Bad(p, f"list of {len(v)} items exceeds the limit {max_len}")
        if length is not None and len(v) != length:
            raise Bad(p, f"expected {length} items, got {len(v)}")
        for i, x in enumerate(v):
            item(x, f"{p}[{i}]")
    return check


def Obj(req: dict[str, Spec], opt: dict[str, Spec] | None = None, extra: bool = False, null: bool = False) -> Spec:
    """A JSON object with required keys ``req``, optional keys ``opt``; other keys refused unless
    ``extra`` (then any bounded JSON value)."""
    opt = opt or {}

    def check(v: Any, p: str) -> None:
        if v is None and null:
            return
        if not isinstance(v, dict):
            raise Bad(p, f"expected an object, got {_short(v)}")
        for k, spec in req.items():
            if k not in v:
                raise Bad(p, f"missing key {k!r}")
            spec(v[k], f"{p}.{k}")
        for k, x in v.items():
            if k in req:
                continue
            if k in opt:
                opt[k](x, f"{p}.{k}")
            elif extra:
                Any_(x, f"{p}.{visible(k)[:40]}")
            else:
                raise Bad(p, f"unknown key {_short(k)} (written by a different infertrace?)")
    check.keys = (frozenset(req), frozenset(opt), extra)  # type: ignore[attr-defined]  # read by tests/unit/trace/test_format_once.py
    return check


def Map(value: Spec, key_int: bool = True, max_len: int = L["MAX_LIST"]) -> Spec:
    """An object keyed by decimal seq_ids (``{"0": …}``) or free strings."""
    def check(v: Any, p: str) -> None:
        if not isinstance(v, dict):
            raise Bad(p, f"expected an object, got {_short(v)}")
        if len(v) > max_len:
            raise Bad(p, f"object of {len(v)} keys exceeds the limit {max_len}")
        for k, x in v.items():
            if key_int and not (re.fullmatch(r"0|[1-9][0-9]{0,9}", k) and int(k) <= L["MAX_SEQ_ID"]):
                raise Bad(p, f"key {_short(k)} is not a seq_id")
            Str(max_len=4096)(k, p)
            value(x, f"{p}.{visible(k)[:40]}")
    return check


def Any_(v: Any, p: str, depth: int = 0) -> None:
    """Any JSON value, bounded: depth <= MAX_DEPTH, strings and lists bounded, numbers finite-sized."""
    if depth > L["MAX_DEPTH"]:
        raise Bad(p, f"nested deeper than the limit MAX_DEPTH = {L['MAX_DEPTH']}")
    if v is None or isinstance(v, (bool, float)):
        return
    if isinstance(v, int):
        Num()(v, p)
    elif isinstance(v, str):
        Str()(v, p)
    elif isinstance(v, list):
        if len(v) > L["MAX_LIST"]:
            raise Bad(p, f"list of {len(v)} items exceeds the limit {L['MAX_LIST']}")
        for i, x in enumerate(v):
            Any_(x, f"{p}[{i}]", depth + 1)
    elif isinstance(v, dict):
        for k, x in v.items():
            Str(max_len=4096)(k, p)
            Any_(x, f"{p}.{visible(k)[:40]}", depth + 1)
    else:  # pragma: no cover - json.loads makes nothing else
        raise Bad(p, f"unexpected value {_short(v)}")


def range_count(text: str) -> int:
    """How many integers a range text (``"0..2,5"``, ``"-"``) stands for; -1 when malformed
    (:func:`infertrace.ranges.range_count` with values below MAX_CTX, at most MAX_STR characters)."""
    return _range_count(text, L["MAX_CTX"], L["MAX_STR"])


def Range(null: bool = False) -> Spec:
    """A range text as :func:`infertrace.ranges.ranges_text` writes it, values below MAX_CTX."""
    def check(v: Any, p: str) -> None:
        if v is None and null:
            return
        Str()(v, p)
        n = range_count(v)
        if n < 0:
            raise Bad(p, f"{_short(v)} is not a range text such as 0..3,7 with values below MAX_CTX = {L['MAX_CTX']}")
        if n > L["MAX_RANGE_ITEMS"]:
            raise Bad(p, f"range text stands for {n} integers, more than the limit MAX_RANGE_ITEMS")
    return check


# ----------------------------------------------------------------------------- the trace
#: the KV conventions a trace may name: llama.cpp cells, vLLM / TensorRT-LLM pages, HF's dense padded batch
BACKENDS = ("cells", "paged", "dense")
I, U = Int(), Int(0, L["MAX_ID"])
POS = Int(0, L["MAX_CTX"] - 1, limit="MAX_CTX")
DIM = Int(0, L["MAX_DIM"], limit="MAX_DIM")
SEQ = Int(0, L["MAX_SEQ_ID"], limit="MAX_SEQ_ID")
SHAPE = List(DIM, 8)
S = Str()
F = Num()
SAMPLER = Obj({}, {"temperature": F, "top_k": Int(0, L["MAX_ID"]), "top_p": F, "min_p": F, "repetition_penalty": F,
                   "seed": Int(0, 2 ** 64), "max_new_tokens": Int(0, L["MAX_CTX"]), "ignore_eos": Bool(),
                   "penalty_last_n": Int(-1, 1 << 24, null=True), "frequency_penalty": F, "presence_penalty": F}, extra=True)

# serving mechanisms (engine/serving.py): prefix-cache lookups, context shifts, evictions, KV audit
OPT_RANGE = Range(null=True)
BLK = Int(0, L["MAX_BLOCKS"])
PREFIX = Obj({}, {"hit": Int(0, L["MAX_CTX"]), "prompt_len": Int(0, L["MAX_CTX"]), "src": Int(0, L["MAX_SEQ_ID"], null=True),
                  "src_state": Str(null=True), "shared_blocks": List(BLK), "ref_cnt": List(Int(0, L["MAX_SEQ_ID"])),
                  "hashes": List(Str(max_len=64)),
                  "copied": Obj({}, {"block": BLK, "from_block": BLK, "tokens": Int(0, L["MAX_TOKENS_PER_BLOCK"])}, null=True),
                  "cells": OPT_RANGE, "computed": OPT_RANGE, "stop": Str(null=True)}, extra=True, null=True)
SHIFT_OP = Obj({}, {"op": S, "seq_id": SEQ, "n_past": POS, "n_keep": POS, "n_discard": POS, "removed": OPT_RANGE,
                    "moved": Str(null=True), "n_past_after": POS, "k_shift_max_abs_layer0": Num(null=True)}, extra=True, null=True)
EVICTION = Obj({}, {"block": BLK, "hash": Str(null=True, max_len=64), "seq_id": SEQ, "freed": OPT_RANGE,
                    "still_shared": OPT_RANGE}, extra=True)
AUDIT = Obj({}, {"seqs": Map(Int(0, L["MAX_CTX"] * 64)), "max_abs": Num(null=True), "max_abs_exact": Num(null=True),
                 "by_provenance": List(Obj({}, {"provenance": S, "entries": Int(0, L["MAX_LIST"] * 64),
                                                "max_abs_k": Num(null=True), "max_abs_v": Num(null=True),
                                                "max_abs_layer0": Num(null=True)}, extra=True))}, extra=True, null=True)
SERVING = Obj({}, {"prefix": Map(PREFIX), "ops_before_step": List(SHIFT_OP), "evictions": List(EVICTION),
                   "stopped": Map(Str()), "pool_tokens": Int(0, L["MAX_CTX"] * 64, null=True), "audit": AUDIT},
              extra=True, null=True)
# speculative decoding (engine/speculative.py, trace/spec_capture.py): per verify chunk, per step, per run
NODE = Int(0, L["MAX_LIST"])
#: a hybrid model's verify: which GDN state snapshot was kept (kv/recurrent.py RecurrentState.select) and the
#: state's L2 norm / sum before (the state before the chunk) and after (the kept snapshot), per shown GDN layer
STATE_STATS = Obj({"conv_norm": Num(lo=0), "conv_sum": F, "rec_norm": Num(lo=0), "rec_sum": F})
SPEC_STATE = Obj({"convention": Str(choices=("cells", "paged")), "slot": DIM, "snapshots": Int(1, 4096),
                  "kept_node": Int(0, 4095), "kept_snapshot": Int(0, 4095),
                  "index_name": Str(choices=("rs_idx", "node", "num_accepted_draft_tokens", "accepted_leaf_positions")),
                  "dropped_nodes": List(Int(0, 4095), 4096),
                  "layers": List(Obj({"layer": DIM, "before": STATE_STATS, "after": STATE_STATS}), 3)})
SPEC_REWIND = Obj({}, {"op": S, "seq_id": SEQ, "kept_pos": OPT_RANGE, "n_removed": NODE, "range": Str(null=True),
                       "removed_pos": OPT_RANGE, "freed": OPT_RANGE, "freed_blocks": List(BLK),
                       "moved_slots": List(List(Int(0, L["MAX_BLOCKS"] * L["MAX_TOKENS_PER_BLOCK"]), length=2)),
                       "state": SPEC_STATE},
                  extra=True, null=True)
#: --speculative mtp: what each MTP row read (engine/drafters.py MTPDrafter: position, token, which hidden state)
MTP_ROW = Obj({"node": Int(-1, 4096), "position": Int(-1, L["MAX_CTX"] - 1), "token": U,
               "hidden_from": Str(choices=("target", "mtp")), "hidden_position": Int(-1, L["MAX_CTX"] - 1),
               "hidden_norm": S, "hidden": S, "hidden_l2": F, "argmax": U, "logit_max": F})
SPEC_MTP = Obj({"rows": List(MTP_ROW, 4096)},
               {"catch_up": Obj({"positions": List(POS, length=2), "tokens": List(U, 8), "hidden": S}),
                "drafts": List(Int(0, L["MAX_ID"], null=True), 4096)})
SPEC_REQ = Obj({"parents": List(Int(-1, L["MAX_LIST"]), 4096), "accepted_nodes": List(NODE, 4096), "emitted": List(U, 4096),
                "drafted": NODE, "accepted": NODE},
               {"rejected_nodes": List(NODE, 4096), "rewind": SPEC_REWIND, "cells": List(POS, 4096),
                "kq_mask_block": List(List(Str(choices=("0", "-inf")), 4096), 4096),
                "verify_mask": List(Str(max_len=4096), 4096), "position_offsets": List(Int(0, 4096), 4096),
                "packed_mask": List(List(Int(-(2 ** 31), 2 ** 31 - 1), 128), 4096), "emitted_pieces": List(S, 4096),
                "mtp": SPEC_MTP}, null=True)
SPEC_STEP = Obj({}, {"drafted": NODE, "accepted": NODE, "acceptance_rate": Num(null=True, lo=0, hi=1)}, null=True)
SPEC_RUN = Obj({}, {"method": S, "tree": List(Int(-1, 4096), 4096), "target_forwards": Int(0, L["MAX_STEPS"]),
                    "draft_kv": Obj({"kind": S, "cells": Int(0, L["MAX_CTX"] * 64)},
                                    {"bytes": Int(0, 2 ** 62, null=True), "mtp_forwards": Int(0, L["MAX_STEPS"] * 4096)}),
                    "decode_tokens": Int(0, L["MAX_CTX"] * 64), "tokens_per_target_forward": Num(null=True),
                    "requests": Map(Obj({}, {"drafted_by_pos": List(Int(0, L["MAX_STEPS"]), 4096),
                                             "accepted_by_pos": List(Int(0, L["MAX_STEPS"]), 4096),
                                             "acceptance_by_pos": List(Num(null=True, lo=0, hi=1), 4096),
                                             "verify_forwards": Int(0, L["MAX_STEPS"]), "tokens": Int(0, L["MAX_CTX"] * 64),
                                             "tokens_per_forward": Num(null=True)}))}, null=True)
REQ_STEP = Obj({"seq_id": SEQ, "phase": Str(choices=("prefill", "decode")), "C": POS, "T": Int(0, L["MAX_CTX"]),
                "token_ids": List(U), "pieces": List(S), "positions": List(POS), "visible": List(S),
                "cache_before": S, "cache_after": S, "rows": List(Int(0, L["MAX_LIST"]))},
               {"logits_row": Int(0, L["MAX_LIST"], null=True), "sampled": Int(0, L["MAX_ID"], null=True),
                "sampled_piece": Str(null=True), "finished": Str(null=True),
                "prefix": PREFIX, "shift": SHIFT_OP, "visible_swa": List(S, null=True), "spec": SPEC_REQ})
ROW_STAT = Obj({"seq_id": SEQ, "pos": POS, "token_id": U, "piece": S, "mean": F, "std": F, "min": F, "max": F, "l2": F,
                "first": List(F, 4096)})
HIDDEN = Obj({"logical_shape": SHAPE, "dtype": S, "ggml_ne": SHAPE, "packed_shape": List(Int(0, L["MAX_DIM"]), 2, length=2),
              "rows": List(ROW_STAT), "cached_tokens_recomputed": Int(0, L["MAX_CTX"])}, null=True)
POSITIONS = Obj({"inp_pos": List(POS), "position_ids": List(POS), "pairing": S, "pairing_in_file": S, "theta": F,
                 "theta_is_default": Bool(), "rope_dim": Int(0, L["MAX_DIM"]), "head_dim": Int(0, L["MAX_DIM"]),
                 "scaling": Obj({}, {"type": S, "factor": F}, extra=True), "inv_freq_first": List(F, 4096),
                 "cos_sin": List(Obj({"pos": POS, "cos": List(F, 4096), "sin": List(F, 4096)})),
                 "evidence": Obj({}, {"layer": DIM, "rows": List(Obj({"pos": POS}, {
                     "dq_max": F, "dk_max": F, "q_norm_before": F, "q_norm_after": F}, extra=True)),
                     "v_cache_minus_v_proj_max": F, "k_cache_minus_k_rot_max": F}, extra=True)}, null=True)
#: non-unified KV (``--kv-unified off``): at most this many streams are described (llama.cpp LLAMA_MAX_SEQ is 256)
MAX_STREAMS = 4096
#: one stream of a non-unified kq_mask (llama.cpp ``kv_unified = false``): its block of rows and its cells
KQ_STREAM = Obj({"stream": Int(0, MAX_STREAMS - 1), "seq_ids": List(SEQ, MAX_STREAMS), "head_before": POS, "head_after": POS,
                 "cell_pos": List(Int(-1, L["MAX_CTX"] - 1)), "cell_seq": List(List(SEQ)),
                 "rows": List(List(Str(choices=("0", "-inf")), 4096), 4096)})
KQ_MASK = Obj({"ne": List(DIM, 4, length=4), "torch_shape": SHAPE, "dtype": S, "n_kv": Int(0, L["MAX_CTX"]),
               "rows": List(List(Str(choices=("0", "-inf")), 4096), 4096)},
              {"n_tokens": Int(0, L["MAX_CTX"]), "cell_pos": List(Int(-1, L["MAX_CTX"] - 1)), "cell_seq": List(List(SEQ)),
               "n_stream": Int(1, MAX_STREAMS), "stream_size": Int(1, L["MAX_CTX"]), "streams": List(KQ_STREAM, MAX_STREAMS)},
              null=True)
METADATA = Obj({"mask_type": S, "seq_lens": List(Int(0, L["MAX_CTX"])), "kv_lens": List(Int(0, L["MAX_CTX"])),
                "cu_seqlens": List(Int(0, L["MAX_LIST"])), "request_ids": List(SEQ)},
               {"request_types": List(S), "num_contexts": Int(0, L["MAX_LIST"]),
                "block_tables": List(List(Int(-1, L["MAX_BLOCKS"]))), "dense_mask_tensor": Any_}, null=True)
VISIBLE = List(Obj({"seq_id": SEQ, "queries": List(Obj({"pos": POS, "keys": S}))}))
#: sliding-window side of the mask (model families with windowed layers, e.g. Gemma 3)
SWA = Obj({}, {"n_swa": Int(0, L["MAX_CTX"]), "layers": List(DIM), "global_layers": List(DIM), "convention": S,
               "visible": VISIBLE, "rope_theta_swa": Num(null=True),
               "kq_mask_swa": Obj({"ne": List(DIM, 4, length=4), "dtype": S,
                                   "rows": List(List(Str(choices=("0", "-inf")), 4096), 4096)},
                                  {"col_start": Int(0, L["MAX_CTX"]), "cell_pos": List(Int(-1, L["MAX_CTX"] - 1))}),
               "attention_window": Map(Int(0, L["MAX_CTX"]), key_int=False),
               # llama.cpp's iSWA cache (kv/iswa.py): the SWA pool kq_mask_swa is built over
               "pool": Obj({"size": Int(1, L["MAX_CTX"]), "n_kv": Int(0, L["MAX_CTX"])},
                           {"k_idxs": Range(), "head_before": POS, "head_after": Int(0, L["MAX_CTX"]), "reused": Range(),
                            "purged": Str(max_len=4096)})}, extra=True, null=True)
MASK = Obj({"backend": S, "rule": S, "visible": VISIBLE,
            "kq_mask": KQ_MASK, "metadata": METADATA, "logical": List(List(List(Int(0, 1))))}, {"swa": SWA}, null=True)
CELL = Obj({"cell": POS, "pos": POS, "seq_ids": List(SEQ, 4096)}, {"ref": Int(0, L["MAX_SEQ_ID"])})
#: llama.cpp's iSWA SWA pool (kv/iswa.py SwaCellsPool.pool_record); head may equal size (apply_ubatch does not wrap it)
SWA_POOL = Obj({"size": Int(1, L["MAX_CTX"]), "head": Int(0, L["MAX_CTX"]), "used": Int(0, L["MAX_CTX"]),
                "n_kv": Int(0, L["MAX_CTX"]), "cells": List(CELL)},
               {"k_idxs": Range(), "head_before": Int(0, L["MAX_CTX"]), "head_after": Int(0, L["MAX_CTX"]), "reused": Range(),
                "purged": Str(max_len=4096)})
#: llama.cpp's recurrent cells of one ubatch (hybrid models, --runtime llama.cpp: capture.py LlamaCppContext._rs_meta)
RS_CELLS = Obj({"ubatch": Int(0, L["MAX_LIST"]), "rs_z": Int(-1, L["MAX_SEQ_ID"]),
                "s_copy": List(Int(0, L["MAX_SEQ_ID"] * 64), 4096)},
               {"n_rs": Int(0, 4096), "head": Int(0, L["MAX_SEQ_ID"])})
PHYS_CELLS = Obj({"kind": Str(choices=("cells",)), "size": Int(1, L["MAX_CTX"], limit="MAX_CTX"), "used": Int(0, L["MAX_CTX"]),
                  "n_kv": Int(0, L["MAX_CTX"]), "cells": List(CELL)},
                 {"head": POS, "head_before": POS, "head_after": POS,
                  "seqs": Map(Obj({"cells": Range(), "pos": Range()})),
                  "prefix_cache": Bool(), "retained": List(SEQ), "n_swa": Int(0, L["MAX_CTX"]), "swa_layers": List(DIM),
                  "llama_memory_seq_pos": Map(List(Int(-1, L["MAX_CTX"]), 2, length=2)),
                  "n_stream": Int(1, MAX_STREAMS), "stream_size": Int(1, L["MAX_CTX"]),
                  "streams": List(Obj({"stream": Int(0, MAX_STREAMS - 1), "head": POS, "used": Int(0, L["MAX_CTX"]),
                                       "used_max_p1": Int(0, L["MAX_CTX"]), "n_kv": Int(0, L["MAX_CTX"]),
                                       "seq_ids": List(SEQ, MAX_STREAMS)}), MAX_STREAMS),
                  "swa_pool": SWA_POOL, "recurrent_cells": List(RS_CELLS, 64)})
PHYS_PAGED = Obj({"kind": Str(choices=("paged",)), "num_blocks": Int(1, L["MAX_BLOCKS"], limit="MAX_BLOCKS"),
                  "tokens_per_block": Int(1, L["MAX_TOKENS_PER_BLOCK"], limit="MAX_TOKENS_PER_BLOCK"),
                  "used_blocks": Int(0, L["MAX_BLOCKS"]), "free_blocks": Int(0, L["MAX_BLOCKS"]),
                  "free_list_head": List(Int(0, L["MAX_BLOCKS"]), 4096),
                  "requests": Map(Obj({"block_table": List(Int(0, L["MAX_BLOCKS"])), "len": Int(0, L["MAX_CTX"])},
                                      {"blocks": List(Obj({"block": Int(0, L["MAX_BLOCKS"]), "pos": Range()},
                                                                         {"ref": Int(0, L["MAX_SEQ_ID"]),
                                                                          "hash": Str(max_len=64)}))}))},
                 {"prefix_cache": Bool(), "cached_blocks": Int(0, L["MAX_BLOCKS"]),
                  "attention_window": Map(Int(0, L["MAX_CTX"]), key_int=False),
                  "cached_free_blocks": Int(0, L["MAX_BLOCKS"])})


#: ``--runtime hf`` (runtimes/hf/record.py ``dense_physical``): the padded ``[B, L]`` grid after the step, per batch
#: row its real / pad columns (range texts over columns), and each layer type's cache length and stored columns
PHYS_DENSE = Obj({"kind": Str(choices=("dense",)), "batch_size": Int(1, L["MAX_SEQ_ID"]), "padded_len": Int(0, L["MAX_CTX"]),
                  "columns": Int(0, L["MAX_CTX"]), "padding": Str(choices=("left", "right")),
                  "rows": List(Obj({"row": DIM, "seq_id": SEQ, "real_cols": Range(), "pad_cols": Range(),
                                    "len": Int(0, L["MAX_CTX"]), "finished": Bool()}, {"fed_pad_cols": Range()})),
                  "cache": Map(Obj({"seq_length": Int(0, L["MAX_CTX"]), "stored": Int(0, L["MAX_CTX"])}), key_int=False, max_len=8)})


def _physical(v: Any, p: str) -> None:
    kind = v.get("kind") if isinstance(v, dict) else None
    (PHYS_CELLS if kind == "cells" else PHYS_DENSE if kind == "dense" else PHYS_PAGED)(v, p)


KV = Obj({"backend": Str(choices=BACKENDS), "dtype": S, "layers": DIM,
          "per_request": List(Obj({"seq_id": SEQ, "shape_before": SHAPE, "shape_after": SHAPE, "written_pos": Range()},
                                  {"cells": Range(), "stream": Int(0, MAX_STREAMS - 1), "slot_mapping": List(Int(0, L["MAX_BLOCKS"] * L["MAX_TOKENS_PER_BLOCK"])),
                                   "block_table": List(Int(0, L["MAX_BLOCKS"])),
                                   "row": DIM, "columns": Range()})),  # dense: the batch row and the cache columns written
          "layer_view": Obj({}, {"layer": DIM, "requests": List(Obj({"seq_id": SEQ, "rows": List(Obj(
              {"pos": POS, "k": List(F, 1 << 16), "v": List(F, 1 << 16)}))}))}),
          "physical": _physical, "physical_shape": SHAPE}, null=True)
TOP = Obj({"id": U, "piece": Str(null=True), "logit": F, "prob": F})
DECODE = Obj({"logits_shape": SHAPE, "logits_dtype": S, "logits_rows": List(Int(0, L["MAX_LIST"])),
              "per_request": List(Obj({"seq_id": SEQ}, {
                  "row": Int(0, L["MAX_LIST"], null=True), "note": S, "sampler": SAMPLER, "top": List(TOP, 1 << 16),
                  "chosen": Int(0, L["MAX_ID"], null=True), "chosen_piece": Str(null=True), "next_input": Int(0, L["MAX_ID"], null=True),
                  "next_pos": Int(0, L["MAX_CTX"], null=True), "stop": Str(null=True)}))}, null=True)
#: hybrid models (Qwen3.5: GDN + full attention; capture/hybrid_rec.py): layer map, M-RoPE positions, state
TSHAPE = Obj({"shape": List(DIM, 8), "dtype": S})
HYBRID = Obj({"layer_map": Obj({"linear_attention": List(DIM), "full_attention": List(DIM),
                                "types": List(Str(choices=("GDN", "attn")))}),
              "prefix_reuse": S, "layer": DIM},
             {"input_ids": TSHAPE, "hidden": TSHAPE,
              "positions": Obj({"position_ids_shape": List(DIM, 3, length=3), "position_ids": List(List(POS, 16), 3),
                                "dtype": S, "n_pos_per_embd": DIM, "inp_pos_len": Int(0, L["MAX_LIST"]),
                                "inp_pos": List(POS, 64), "consumers": List(DIM), "ignored_by": List(DIM),
                                "rope_dim": DIM, "head_dim": DIM, "sections": List(DIM, 8)}),
              "projection": Obj({"layer": DIM, "h": TSHAPE, "qkv": TSHAPE, "q": TSHAPE, "gate": TSHAPE, "k": TSHAPE,
                                 "v": TSHAPE, "heads": List(DIM, 3, length=3)},
                                {"attn_out": TSHAPE, "gated": TSHAPE, "o_proj": TSHAPE}),
              "state": Obj({"convention": Str(choices=("cells", "paged")), "n_slots": DIM, "n_layers": DIM,
                            "conv_shape": List(DIM, 2, length=2), "rec_shape": List(DIM, 3, length=3), "dtype": S,
                            "state_indices": List(DIM), "rs_z": Int(-1, L["MAX_DIM"]), "free": List(DIM, 64),
                            "per_seq": List(Obj({"seq_id": SEQ, "slot": DIM, "layers": List(Obj(
                                {"layer": DIM, "conv_norm": F, "conv_sum": F, "rec_norm": F, "rec_sum": F}), 3)})),
                            "bytes_per_seq": Int(0, 1 << 50)},
                           {"gdn_layer": DIM, "qkv": TSHAPE, "snapshots_per_slot": Int(1, 4096),
                            "snapshot_bytes_per_seq": Int(0, 1 << 50)})}, null=True)
#: run --runtime vllm (runtimes/vllm/engine.py): vLLM's scheduler output and attention metadata as vLLM built them
#: (vLLM's names: seq_lens = kv length, query_start_loc = cu_seqlens; block 0 is its null block)
SLOT = Int(0, L["MAX_BLOCKS"] * L["MAX_TOKENS_PER_BLOCK"])
VLLM_STEP = Obj({"scheduler": Obj({"scheduled": List(Obj({"seq_id": SEQ, "num_scheduled_tokens": Int(0, L["MAX_CTX"]),
                                                          "num_computed_tokens": Int(0, L["MAX_CTX"]),
                                                          "phase": Str(choices=("prefill", "decode"))},
                                                         # -1: vLLM's placeholder draft (scheduler.py pad_spec_decode)
                                                         {"spec_tokens": List(Int(-1, L["MAX_ID"]), 4096)})),
                                   "free_blocks": Int(0, L["MAX_BLOCKS"], null=True)},
                                  {"new": List(Obj({"seq_id": SEQ, "num_computed_tokens": Int(0, L["MAX_CTX"])})),
                                   "resumed": List(Obj({"seq_id": SEQ, "num_computed_tokens": Int(0, L["MAX_CTX"])})),
                                   "new_block_ids": Map(List(BLK)), "preempted": List(SEQ),
                                   "finished_before_step": List(SEQ),
                                   "total_num_scheduled_tokens": Int(0, L["MAX_LIST"])}),
                 "attn_metadata": Obj({"query_start_loc": List(Int(0, L["MAX_LIST"])), "seq_lens": List(Int(0, L["MAX_CTX"])),
                                       "block_table": List(List(BLK)), "slot_mapping": List(SLOT),
                                       "num_actual_tokens": Int(0, L["MAX_LIST"])},
                                      {"class": Str(max_len=200), "block_table_width": Int(0, L["MAX_BLOCKS"]),
                                       "max_query_len": Int(0, L["MAX_CTX"]), "max_seq_len": Int(0, L["MAX_CTX"]),
                                       "causal": Bool(null=True), "num_decode_tokens": Int(0, L["MAX_LIST"])})},
                {"logits_indices": List(Int(0, L["MAX_LIST"])), "logits_shape": SHAPE,
                 "sampled_token_ids": List(List(Int(-1, L["MAX_ID"]), 4096)),
                 "kv_readback": Obj({"k_max_abs": F, "v_max_abs": F}, null=True),
                 "tp_ranks": List(Obj({"tp_rank": DIM, "kv_heads_held": Int(0, L["MAX_DIM"], null=True),
                                       "metadata_equals_rank0": Bool()},
                                      {"kv_heads": List(DIM, 4096), "kv_equals_first_holder": Bool()}), 4096),
                 # infertrace collect (runtimes/vllm/collect.py): the served step's whole batch, of which the trace keeps
                 # the marked requests' rows
                 "served": Obj({"engine_step": Int(0, L["MAX_STEPS"] * 1024), "batch": List(Obj(
                     {"request_id": Str(max_len=256), "num_scheduled_tokens": Int(0, L["MAX_LIST"])}), 4096)},
                     {"time": F, "request_ids": Map(Str(max_len=256)), "free_blocks": Int(0, L["MAX_BLOCKS"], null=True),
                      "freed_blocks": List(BLK),
                      "captured_batch": Obj({"req_ids": List(Str(max_len=256), 4096), "num_actual_tokens": Int(0, L["MAX_LIST"])},
                                            {"max_query_len": Int(0, L["MAX_CTX"], null=True),
                                             "num_decode_tokens": Int(0, L["MAX_LIST"], null=True)})})}, null=True)
#: ``--runtime hf`` (runtimes/hf/record.py ``hf_section``): the step in HF's names: the forward's inputs as fed, each
#: layer type's mask as its mask function returned it (per batch row, per query, "1" keep / "0" drop over the key
#: columns), the DynamicCache's per-layer lengths, K/V of the recorded layer by column, the logits' shape
MASK_ROW = Str(max_len=4096)
HF_STEP = Obj({"padding": Str(choices=("left", "right")), "input_ids": List(List(U)), "attention_mask": List(List(Int(0, 1))),
               "position_ids": List(List(Int(0, L["MAX_CTX"]))), "cache_position": List(POS), "past_seen_tokens": Int(0, L["MAX_CTX"]),
               "masks": Map(Obj({"function": Str(max_len=200), "returned": Str(max_len=200), "shape": List(DIM, 8, null=True)},
                                {"kv_offset": Int(0, L["MAX_CTX"]), "rows": List(List(MASK_ROW, 256)), "truncated": Bool()}),
                            key_int=False, max_len=8),
               "cache": Obj({"class": Str(max_len=200), "layers": List(Obj(
                   {"layer": DIM, "class": Str(max_len=200), "is_sliding": Bool(), "seq_length": Int(0, L["MAX_CTX"]),
                    "stored": Int(0, L["MAX_CTX"])}, {"sliding_window": Int(0, L["MAX_CTX"])}), L["MAX_DIM"])}),
               "kv_layer": Obj({"layer": DIM, "rows": List(Obj({"row": DIM, "columns": List(Obj(
                   {"col": POS, "k": List(F, 1 << 16), "v": List(F, 1 << 16)}), 64)}))}),
               "logits": Obj({"shape": SHAPE, "columns": List(List(Int(0, L["MAX_CTX"]), length=2))})},
              {"attn_implementation": Str(max_len=64), "pad_token_id": U, "row_seq_ids": List(SEQ),
               "finished_rows": List(Obj({"row": DIM, "fed_pad_from_col": POS})),
               "generate_position_ids": List(Int(0, L["MAX_CTX"]), null=True), "next_tokens": List(U, null=True)}, null=True)
#: ``--runtime hf``: HF's own run facts (runtimes/hf/runtime.py HfRuntime.header)
HF_HEADER = Obj({}, {"version": Str(max_len=200), "model_class": Str(max_len=200), "attn_implementation": Str(max_len=64),
                     "dtype": Str(max_len=32), "padding": Str(choices=("left", "right")), "pad_token_id": U,
                     "batch_size": Int(0, L["MAX_SEQ_ID"]), "padded_len": Int(0, L["MAX_CTX"])}, extra=True)
STEP = Obj({"step": Int(0, L["MAX_STEPS"], limit="MAX_STEPS"), "backend": Str(choices=BACKENDS), "attention": S,
            "N": Int(0, L["MAX_LIST"]), "batch": List(REQ_STEP)},
           {"hidden": HIDDEN, "positions": POSITIONS, "mask": MASK, "kv": KV, "decode": DECODE,
            "preempted": List(SEQ), "admitted": List(SEQ), "time_ms": F, "serving": SERVING, "spec": SPEC_STEP, "hybrid": HYBRID,
            "vllm": VLLM_STEP, "hf": HF_STEP})
REQUEST = Obj({"seq_id": SEQ}, {"prompt": S, "prompt_ids": List(U), "output_ids": List(U), "text": S, "stop_reason": Str(null=True),
                                "arrival_step": Int(0, L["MAX_STEPS"]), "num_preemptions": Int(0, L["MAX_STEPS"]),
                                "params": SAMPLER}, extra=True)
#: a finite JSON number (NaN and the infinities refused): every option and config value that is a number
FIN = Num(lo=-_NUM_ABS, hi=_NUM_ABS)
FIN_OR_NULL = Num(null=True, lo=-_NUM_ABS, hi=_NUM_ABS)
#: ``options.settings``: the run's EngineOptions (engine/options.py) as the runtimes record them: every field typed
#: and bounded (speculative.py MAX_DRAFT = 64 drafts; a tree of at most 4096 nodes, as SPEC_REQ)
SETTINGS = Obj({}, {"backend": Str(choices=BACKENDS), "ctx_size": Int(1, L["MAX_CTX"], null=True, limit="MAX_CTX"),
                  "num_blocks": Int(1, L["MAX_BLOCKS"], null=True, limit="MAX_BLOCKS"),
                  "tokens_per_block": Int(1, L["MAX_TOKENS_PER_BLOCK"], null=True, limit="MAX_TOKENS_PER_BLOCK"),
                  "max_batch_tokens": Int(1, L["MAX_CTX"], null=True), "prefill_chunk": Int(1, L["MAX_CTX"], null=True),
                  "n_seq_max": Int(0, L["MAX_SEQ_ID"], null=True), "attention": Str(max_len=64),
                  "kv_dtype": Str(null=True, choices=("f32", "f16", "bf16")), "kv_unified": Bool(),
                  "sampler_order": Str(null=True, choices=("hf", "llama.cpp")), "prefix_cache": Bool(),
                  "context_shift": Bool(), "n_keep": Int(-1, L["MAX_CTX"]), "n_discard": Int(0, L["MAX_CTX"]),
                  "audit_kv": Bool(), "speculative": Str(null=True, choices=("ngram", "draft", "mtp")),
                  "num_spec_tokens": Int(1, 64), "spec_tree": List(Int(-1, 4095), 4096, null=True),
                  "draft_model": Str(null=True, max_len=4096), "draft_layers": Int(1, L["MAX_DIM"], null=True),
                  "ngram_min": Int(1, 4096), "ngram_max": Int(1, 4096)}, extra=True)  # engine.options.KV_DTYPES; absent in older traces: the model dtype
#: ``run --runtime llama.cpp``: the llama.cpp context settings that change its numbers (runtimes/llamacpp/capture.py)
N_THREADS = Int(0, 1 << 16)
LLAMA_CPP = Obj({}, {"version": S, "flash_attn": Str(null=True, choices=("on", "off")),
                     "flash_attn_type": Str(choices=("auto", "on", "off")), "type_k": Str(max_len=32),
                     "type_v": Str(max_len=32), "n_ctx": Int(0, 2 * L["MAX_CTX"]), "n_batch": Int(0, 2 * L["MAX_CTX"]),
                     "n_ubatch": Int(0, 2 * L["MAX_CTX"]), "n_seq_max": Int(0, L["MAX_SEQ_ID"] + 1),
                     "n_threads": N_THREADS, "n_threads_batch": N_THREADS, "kv_unified": Bool(), "offload_kqv": Bool(),
                     "n_ctx_seq": Int(0, 2 * L["MAX_CTX"]), "op_offload": Bool(), "swa_full": Bool(), "n_gpu_layers": Int(-(2 ** 31), 2 ** 31 - 1),
                     "gpu_offload": Bool(), "use_extra_bufts": Bool(), "system_info": Str(max_len=4096), "teacher_forced": Bool()}, extra=True)
#: ``--weights``: which path computed the linear layers and, when quantised, the kernel per GGUF tensor type
#: (loading/model.py ``Loaded.weights``; quant/linear.py kernel names; ``stack(...)`` for a mixed fused matrix)
KERNEL = Str(max_len=128)
WEIGHTS = Obj({"weights": Str(choices=("float", "quant", "none"))},
              {"kernels": Map(KERNEL, key_int=False, max_len=64)}, extra=True)
#: ``run --runtime vllm``: vLLM's own run facts (runtimes/vllm/engine.py VllmRun.header)
VLLM_HEADER = Obj({}, {"version": Str(max_len=200), "backend": Str(max_len=400), "isa": Str(max_len=64),
                       "block_size": Int(1, L["MAX_TOKENS_PER_BLOCK"]), "dtype": Str(max_len=32), "cache_dtype": Str(max_len=32),
                       "num_blocks": Int(1, L["MAX_BLOCKS"]), "null_block": Int(0, L["MAX_BLOCKS"]),
                       "max_num_batched_tokens": Int(1, L["MAX_CTX"] * 64, null=True),
                       "long_prefill_token_threshold": Int(0, L["MAX_CTX"] * 64, null=True), "enable_prefix_caching": Bool(),
                       "speculative": Any_, "tensor_parallel_size": Int(1, 4096),
                       "ranks": List(Obj({}, {"tp_rank": DIM, "num_kv_heads": DIM, "num_heads": DIM, "cache_shape": SHAPE,
                                              "layer_name": Str(max_len=400)}, extra=True), 4096),
                       "kv_cache_layout": Str(max_len=4096)}, extra=True)
PADDED_VOCAB = Obj({"rows": U, "tokens": U}, {"policy": Str(max_len=64), "masked": Range()}, extra=True)
#: where each saved per-layer tap came from in the runtime that computed it (``options.tap_sources``):
#: saved tap name (``attn_out``, ``mlp_out``, ``resid_post``, ``q_pre_rope`` ...) -> one line naming the runtime's own
#: tensor (a llama.cpp graph node, a vLLM / HF module's forward hook, our decoder's tap point)
TAP_SOURCES = Map(Str(max_len=400), key_int=False, max_len=64)
OPTIONS = Obj({}, {"backend": Str(choices=BACKENDS), "attention": Str(max_len=64), "device": Str(max_len=64),
                   "dtype": Str(choices=("float32", "bfloat16", "float16")), "layer": DIM,
                   "show": List(Str(choices=("hidden", "positions", "mask", "kv", "decode")), 64), "settings": SETTINGS,
                   "llama_cpp": LLAMA_CPP, "weights": WEIGHTS, "sampler_order": Str(null=True, choices=("hf", "llama.cpp")),
                   "vllm": VLLM_HEADER, "hf": HF_HEADER, "padded_vocab": PADDED_VOCAB,
                   "tap_sources": TAP_SOURCES,
                   # run --teacher-force DIR: the followed trace (as given) and the SHA-256 of its trace.json
                   "teacher_force": Obj({"trace": Str(max_len=400), "trace_sha256": Str(max_len=64)})}, extra=True)
MODEL = Obj({}, {"file": S, "name": Str(null=True), "size": Int(0, 1 << 62), "source": S, "metadata_sha256": Str(null=True)},
            extra=True)
ROPE_SCALING = Obj({}, {"type": Str(max_len=64), "factor": FIN, "low_freq_factor": FIN, "high_freq_factor": FIN,
                        "original_max_position_embeddings": Int(0, 1 << 40), "beta_fast": FIN, "beta_slow": FIN,
                        "attn_factor": FIN_OR_NULL, "mscale": FIN, "mscale_all_dim": FIN, "truncate": Bool()}, extra=True)
#: ModelConfig.to_dict (model/config.py): every field typed; ``settings`` the (key, value, status, note) table
CONFIG = Obj({}, {"arch": Str(max_len=200), "name": Str(null=True, max_len=4096), "source": Str(max_len=64), "n_layer": DIM,
                  "n_embd": DIM, "n_head": DIM, "n_head_kv": DIM, "head_dim": DIM, "n_ff": DIM, "vocab_size": U,
                  "n_ctx_train": Int(0, 1 << 40), "rope_theta": FIN, "rope_theta_is_default": Bool(), "rope_dim": DIM, "rms_eps": FIN,
                  "rope_pairing_in_file": Str(max_len=64), "tie_embeddings": Bool(), "rope_scaling": ROPE_SCALING,
                  "rope_freq_factors": List(FIN, L["MAX_DIM"], null=True),
                  "family": Str(max_len=64), "attn_bias": Bool(), "attn_out_bias": Bool(), "mlp_bias": Bool(), "qk_norm": Bool(),
                  "post_norms": Bool(), "act": Str(max_len=64), "embed_scale": FIN_OR_NULL, "attn_scale": FIN_OR_NULL,
                  "final_logit_softcap": FIN_OR_NULL, "rope_theta_swa": FIN_OR_NULL, "rope_scaling_swa": Bool(),
                  # windowed layers (ModelConfig.sliding_window / swa_layers) and hybrid mixers (layer_types)
                  "sliding_window": Int(0, L["MAX_CTX"], limit="MAX_CTX"), "swa_layers": List(Bool(), L["MAX_DIM"]),
                  "layer_types": List(Str(choices=("linear_attention", "full_attention")), L["MAX_DIM"]),
                  "attn_output_gate": Bool(), "norm_mul_f32": Bool(), "ssm_conv_kernel": DIM, "ssm_n_k_heads": DIM,
                  "ssm_n_v_heads": DIM, "ssm_k_head_dim": DIM, "ssm_v_head_dim": DIM, "mrope_sections": List(DIM, 8),
                  "mtp_layers": Int(0, 64),
                  "settings": List(Obj({"key": Str(max_len=4096), "value": Str(max_len=4096), "status": Str(max_len=64),
                                        "note": Str(max_len=4096)}), 1 << 16)}, extra=True)
TENSOR_ENTRY = Obj({"dtype": Str(choices=("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                                          "uint8", "bool")), "shape": SHAPE})
#: tensor names as the recorder writes them: step3/hidden, step3/layer0/q_pre_rope, step3/layer0/seq1/k_cache
TENSOR_NAME = re.compile(r"step[0-9]{1,7}/(?:layer[0-9]{1,5}/(?:seq[0-9]{1,10}/)?)?[a-z][a-z0-9_]{0,40}")


def _tensor_index(v: Any, p: str) -> None:
    Map(TENSOR_ENTRY, key_int=False)(v, p)
    for k in v:
        if not TENSOR_NAME.fullmatch(k):
            raise Bad(p, f"tensor name {_short(k)} is not stepN/[layerL/[seqS/]]name")


STORE = Obj({}, {"keep": Str(choices=("summary", "tensors")), "tensor_layers": List(DIM, 1 << 16),
                 "tensors": _tensor_index})
#: the required top-level keys are checked first (with their historical messages)
TOP_LEVEL = Obj({"schema_version": Int(1, 1 << 30), "model": MODEL, "config": CONFIG, "options": OPTIONS,
                 "steps": List(STEP, L["MAX_STEPS"]), "requests": List(REQUEST, L["MAX_LIST"])},
                {"notes": List(S), "store": STORE, "spec": SPEC_RUN}, extra=True)


# ----------------------------------------------------------------------------- cross-field consistency


def _consistent(d: dict[str, Any]) -> None:
    cfg = d["config"]
    n_layer = cfg.get("n_layer")
    for k in ("swa_layers", "layer_types"):  # one entry per layer (swa_layers: empty when no layer is windowed)
        v = cfg.get(k)
        if v and n_layer is not None and len(v) != n_layer:
            raise Bad(f"config.{k}", f"has {len(v)} entries but n_layer = {n_layer}")
    eng = d["options"].get("settings") or {}
    B = eng.get("tokens_per_block") or 32
    nb = eng.get("num_blocks")
    if nb is not None and nb * B > L["MAX_CTX"] * 4:
        raise Bad("options.settings", f"num_blocks × tokens_per_block = {nb * B} exceeds 4 × MAX_CTX")
    prev = -1
    for i, st in enumerate(d["steps"]):
        p = f"steps[{i}]"
        if st["step"] <= prev:
            raise Bad(f"{p}.step", f"step numbers must increase (got {st['step']} after {prev})")
        prev = st["step"]
        n = 0
        for j, r in enumerate(st["batch"]):
            q = f"{p}.batch[{j}]"
            T = r["T"]
            for k in ("token_ids", "pieces", "positions", "visible", "rows", "visible_swa"):
                if r.get(k) is not None and len(r[k]) != T:
                    raise Bad(f"{q}.{k}", f"has {len(r[k])} items but T = {T}")
            cells = (r.get("spec") or {}).get("cells")
            if cells is not None and (len(cells) != T or len(set(cells)) != T):
                raise Bad(f"{q}.spec.cells", f"must be T = {T} distinct cells, one per node of the verify tree")
            if r["C"] + T > L["MAX_CTX"]:
                raise Bad(q, f"C + T = {r['C'] + T} exceeds MAX_CTX = {L['MAX_CTX']}")
            if r["positions"] != spec_positions(r, q):
                raise Bad(f"{q}.positions", f"must be C..C+T-1 = {r['C']}..{r['C'] + T - 1}" if not r.get("spec")
                          else "must be C + depth(node) of the verify tree")
            n += T
        if n != st["N"]:
            raise Bad(f"{p}.N", f"N = {st['N']} but the batch holds {n} tokens")
        for j, r in enumerate(st["batch"]):
            if any(x >= n for x in r["rows"]) or (r.get("logits_row") is not None and r["logits_row"] >= n):
                raise Bad(f"{p}.batch[{j}].rows", f"packed rows must lie in 0..N-1 (N = {n})")
        _spec_step_consistent(st.get("spec"), p)
        _mask_consistent(st, p)
        _swa_consistent(st, p, n_layer)
        _kv_consistent(st, p)
        _hybrid_consistent(st, p, n_layer, cfg.get("layer_types"))
        h = st.get("hidden")
        if h is not None and len(h["rows"]) > max(n, 0):
            raise Bad(f"{p}.hidden.rows", f"{len(h['rows'])} rows for N = {n} tokens")
    seen: set[int] = set()
    for j, r in enumerate(d.get("requests") or []):
        sid = r.get("seq_id") if isinstance(r, dict) else None
        if sid in seen:
            raise Bad(f"requests[{j}].seq_id", f"seq_id {sid} appears twice; each request has its own seq_id")
        seen.add(sid)
    store = d.get("store") or {}
    if (store.get("keep", "summary") == "summary") and store.get("tensors"):
        raise Bad("store.tensors", "a keep summary trace lists tensors")


def _spec_step_consistent(sp: dict[str, Any] | None, p: str) -> None:
    """A step's speculative totals as the engine writes them (``Engine._spec_record``, vLLM replay):
    ``accepted <= drafted``, ``acceptance_rate = round(accepted / drafted, 4)``, None when nothing was drafted."""
    if not sp:
        return
    d, a, rate = sp.get("drafted"), sp.get("accepted"), sp.get("acceptance_rate")
    if not isinstance(d, int) or not isinstance(a, int):
        return
    if a > d:
        raise Bad(f"{p}.spec.accepted", f"{a} draft tokens accepted but only {d} drafted")
    want = round(a / d, 4) if d else None
    if (want is None) != (rate is None) or (want is not None and abs(rate - want) > 1e-4):
        raise Bad(f"{p}.spec.acceptance_rate", f"{_short(rate)} but accepted / drafted = {a} / {d}")


def _swa_consistent(st: dict[str, Any], p: str, n_layer: int | None) -> None:
    """The sliding-window section agrees with itself (as the recorder's ``_swa`` writes it): a window
    of at least one token; ``layers`` / ``global_layers`` ascending, disjoint, together the model's
    layers; the ``kq_mask_swa`` slice rectangular, inside its tensor (``col_start`` + width <= ``ne[0]``,
    rows <= N and ``ne[1]``), one ``cell_pos`` per column; kv.physical's windowed layers inside the model."""
    layers_all = list(range(n_layer)) if n_layer is not None else None
    ph = (st.get("kv") or {}).get("physical") or {}
    for key in ("swa_layers",):
        if ph.get(key) and layers_all is not None and any(x >= n_layer for x in ph[key]):
            raise Bad(f"{p}.kv.physical.{key}", f"names a layer outside 0..{n_layer - 1} (config.n_layer = {n_layer})")
    sw = (st.get("mask") or {}).get("swa")
    if sw is None:
        return
    q = f"{p}.mask.swa"
    if "n_swa" in sw and sw["n_swa"] < 1:
        raise Bad(f"{q}.n_swa", f"{sw['n_swa']}: a sliding window covers at least the query itself (n_swa >= 1)")
    lay, glob = sw.get("layers"), sw.get("global_layers")
    for k, v in (("layers", lay), ("global_layers", glob)):
        if v is not None and (v != sorted(set(v)) or (layers_all is not None and any(x >= n_layer for x in v))):
            raise Bad(f"{q}.{k}", f"must be ascending distinct layers inside 0..{(n_layer or 0) - 1} (config.n_layer = {n_layer})")
    if lay is not None and glob is not None and layers_all is not None and sorted(lay + glob) != layers_all:
        raise Bad(q, f"layers and global_layers must split the model's {n_layer} layers between them")
    kq = sw.get("kq_mask_swa")
    if kq is None:
        return
    rows, ne, start = kq["rows"], kq["ne"], kq.get("col_start", 0)
    w = len(rows[0]) if rows else 0
    if any(len(r) != w for r in rows) or start + w > ne[0] or len(rows) > min(st["N"], ne[1]):
        raise Bad(f"{q}.kq_mask_swa.rows", f"must be a rectangular slice of the [{ne[0]} cells x {ne[1]} tokens] tensor: "
                  f"at most N = {st['N']} rows, col_start + width <= {ne[0]}")
    if "cell_pos" in kq and len(kq["cell_pos"]) != w:
        raise Bad(f"{q}.kq_mask_swa.cell_pos", f"has {len(kq['cell_pos'])} entries for {w} columns")


def _hybrid_consistent(st: dict[str, Any], p: str, n_layer: int | None, layer_types: list[str] | None = None) -> None:
    """The hybrid section agrees with itself, with its step and with the config (as
    :mod:`infertrace.capture.hybrid_rec` writes it): the layer map is ``config.layer_types`` (GDN =
    linear_attention, attn = full_attention) and partitions the layers, positions cover the step's N
    tokens, every slot index lies below ``n_slots``, listed layers are of the right kind."""
    h = st.get("hybrid")
    if h is None:
        return
    q = f"{p}.hybrid"
    lm = h["layer_map"]
    types = lm["types"]
    if n_layer is not None and len(types) != n_layer:
        raise Bad(f"{q}.layer_map.types", f"has {len(types)} layers but config.n_layer = {n_layer}")
    if layer_types and types != [{"linear_attention": "GDN"}.get(t, "attn") for t in layer_types]:
        raise Bad(f"{q}.layer_map.types", "must be config.layer_types (GDN = linear_attention, attn = full_attention)")
    lin = [i for i, t in enumerate(types) if t == "GDN"]
    full = [i for i, t in enumerate(types) if t == "attn"]
    if lm["linear_attention"] != lin or lm["full_attention"] != full:
        raise Bad(f"{q}.layer_map", "linear_attention / full_attention must list the GDN / attn entries of types")
    lin_s, full_s = set(lin), set(full)
    if full and h["layer"] not in full_s:
        raise Bad(f"{q}.layer", f"{h['layer']} is not a full-attention layer")
    pos = h.get("positions")
    if pos is not None:
        N = st["N"]
        if pos["position_ids_shape"] != [3, 1, N] or any(len(r) != min(N, 16) for r in pos["position_ids"]):
            raise Bad(f"{q}.positions", f"position_ids must be [3, 1, N = {N}] (first 16 listed per axis)")
        if pos["inp_pos_len"] != N * pos["n_pos_per_embd"] or pos["rope_dim"] > pos["head_dim"]:
            raise Bad(f"{q}.positions", "inp_pos_len must be N × n_pos_per_embd and rope_dim <= head_dim")
        if pos["consumers"] != full or pos["ignored_by"] != lin:
            raise Bad(f"{q}.positions", "consumers / ignored_by must be the full-attention / GDN layers")
    pr = h.get("projection")
    if pr is not None and pr["layer"] not in full_s:
        raise Bad(f"{q}.projection.layer", f"{pr['layer']} is not a full-attention layer")
    sd = h.get("state")
    if sd is None:
        return
    ns, qs = sd["n_slots"], f"{q}.state"
    if sd["n_layers"] != len(lin):
        raise Bad(f"{qs}.n_layers", f"{sd['n_layers']} but the layer map lists {len(lin)} GDN layers")
    if sd["state_indices"] and len(sd["state_indices"]) != len(st["batch"]):
        raise Bad(f"{qs}.state_indices", f"{len(sd['state_indices'])} indices for {len(st['batch'])} batch entries")
    slots = [r["slot"] for r in sd["per_seq"]]
    if any(x >= ns for x in sd["state_indices"] + sd["free"] + slots) or sd["rs_z"] >= ns or len(set(slots)) != len(slots):
        raise Bad(qs, f"slot indices must be distinct per sequence and lie in 0..n_slots-1 (n_slots = {ns})")
    if any(lr["layer"] not in lin_s for r in sd["per_seq"] for lr in r["layers"]) or \
            ("gdn_layer" in sd and sd["gdn_layer"] not in lin_s):
        raise Bad(qs, "state rows must name GDN layers")


def spec_positions(r: dict[str, Any], q: str = "") -> list[int]:
    """The positions a batch row must have: ``C..C+T-1``, or ``C + depth(node)`` for a speculative
    verify row (its ``spec.parents``: -1 first, then each parent an earlier node; accepted nodes
    a root-first path of the tree).

    Raises:
        Bad: a malformed tree.
    """
    C, T, sp = r["C"], r["T"], r.get("spec")
    if not sp:
        return list(range(C, C + T))
    par, acc = sp["parents"], sp["accepted_nodes"]
    if len(par) != T or not par or par[0] != -1 or any(not 0 <= x < i for i, x in enumerate(par) if i):
        raise Bad(f"{q}.spec.parents", f"must be {T} parent indices: -1, then each an earlier node")
    if not acc or acc[0] != 0 or any(a >= T or par[a] != b for a, b in zip(acc[1:], acc)):
        raise Bad(f"{q}.spec.accepted_nodes", "must be a path from the root (node 0) down the tree")
    depth: list[int] = []
    for x in par:
        depth.append(0 if x < 0 else depth[x] + 1)
    return [C + d for d in depth]


def _mask_consistent(st: dict[str, Any], p: str) -> None:
    m = st.get("mask")
    if m is None:
        return
    b = st["batch"]
    if len(m["logical"]) != len(b) and m["logical"]:
        raise Bad(f"{p}.mask.logical", f"{len(m['logical'])} matrices for {len(b)} requests")
    for j, (r, lg) in enumerate(zip(b, m["logical"])):
        if len(lg) != r["T"] or any(len(row) != r["C"] + r["T"] for row in lg):
            raise Bad(f"{p}.mask.logical[{j}]", f"must be [T={r['T']}][C+T={r['C'] + r['T']}]")
    md = m.get("metadata")
    if md is not None:
        T = [r["T"] for r in b]
        K = [r["C"] + r["T"] for r in b]
        cu = [0]
        for t in T:
            cu.append(cu[-1] + t)
        for k, want in (("seq_lens", T), ("kv_lens", K), ("cu_seqlens", cu), ("request_ids", [r["seq_id"] for r in b])):
            if md[k] != want:
                raise Bad(f"{p}.mask.metadata.{k}", f"must be {want if len(want) < 20 else 'consistent with the batch'}")
    kq = m.get("kq_mask")
    if kq is not None and kq["rows"]:
        w = len(kq["rows"][0])
        if any(len(r) != w for r in kq["rows"]) or w > kq["n_kv"]:
            raise Bad(f"{p}.mask.kq_mask.rows", "rows must have equal length, at most n_kv")


def _kv_consistent(st: dict[str, Any], p: str) -> None:
    kv = st.get("kv")
    if kv is None:
        return
    ph = kv["physical"]
    if ph["kind"] != kv["backend"]:
        raise Bad(f"{p}.kv.physical.kind", f"{ph['kind']!r} but the record's backend is {kv['backend']!r}")
    shape = kv["physical_shape"]
    if ph["kind"] == "dense":  # HF DynamicCache keys [B, n_kv_heads, stored columns, head_dim]
        if len(shape) != 4 or shape[0] != ph["batch_size"] or shape[2] > ph["columns"]:
            raise Bad(f"{p}.kv.physical_shape", f"{shape} does not match the dense storage [batch_size = {ph['batch_size']}, "
                      f"n_kv_heads, columns <= {ph['columns']}, head_dim]")
        if any(r["row"] >= ph["batch_size"] for r in ph["rows"]) or len(ph["rows"]) > ph["batch_size"]:
            raise Bad(f"{p}.kv.physical.rows", f"batch rows must lie in 0..{ph['batch_size'] - 1}")
        return
    want = [ph["size"], None, None] if ph["kind"] == "cells" else [ph["num_blocks"], 2, None, ph["tokens_per_block"], None]
    if len(shape) != len(want) or any(w is not None and x != w for x, w in zip(shape, want)):
        raise Bad(f"{p}.kv.physical_shape", f"{shape} does not match the {ph['kind']} storage "
                  + ("[size, n_kv_heads, head_dim]" if ph["kind"] == "cells" else "[num_blocks, 2, n_kv_heads, tokens_per_block, head_dim]"))
    if ph["kind"] == "cells":
        size = ph["size"]
        if "streams" in ph or "n_stream" in ph:
            _streams_consistent(ph, f"{p}.kv.physical")
        if ph["n_kv"] > size or ph["used"] > size or len(ph["cells"]) > size:
            raise Bad(f"{p}.kv.physical", f"n_kv, used and the cells listed must not exceed size = {size}")
        used_max_p1 = 0
        for c in ph["cells"]:
            if c["cell"] >= size:
                raise Bad(f"{p}.kv.physical.cells", f"cell {c['cell']} outside the cache of size {size}")
            used_max_p1 = max(used_max_p1, c["cell"] + 1)
        pad = max(N_KV_PAD_MAX, -(-used_max_p1 // N_KV_PAD_MAX) * N_KV_PAD_MAX)
        if ph["n_kv"] > pad:  # llama.cpp: n_kv = used_max_p1 padded (get_padding), never more
            raise Bad(f"{p}.kv.physical.n_kv", f"{ph['n_kv']} but the cells used end at {used_max_p1} (padded: {pad})")
        sp = ph.get("swa_pool")
        if sp is not None:  # the iSWA SWA pool: never larger than the base pool, its cells inside it
            if sp["size"] > size or sp["n_kv"] > sp["size"] or sp["used"] > sp["size"] or sp["head"] > sp["size"]:
                raise Bad(f"{p}.kv.physical.swa_pool", f"size must not exceed the base pool ({size}); n_kv, used, head not its size")
            if any(c["cell"] >= sp["size"] for c in sp["cells"]) or len(sp["cells"]) > sp["size"]:
                raise Bad(f"{p}.kv.physical.swa_pool.cells", f"cells must lie inside the SWA pool of size {sp['size']}")
        for j, r in enumerate(ph.get("recurrent_cells") or []):
            if "n_rs" in r and len(r["s_copy"]) != r["n_rs"]:
                raise Bad(f"{p}.kv.physical.recurrent_cells[{j}]", f"s_copy has {len(r['s_copy'])} entries, n_rs says {r['n_rs']}")
        return
    B, nb = ph["tokens_per_block"], ph["num_blocks"]
    if nb * B > L["MAX_CTX"] * 4:
        raise Bad(f"{p}.kv.physical", f"num_blocks × tokens_per_block = {nb * B} exceeds 4 × MAX_CTX")
    for s, r in ph["requests"].items():
        if any(b >= nb for b in r["block_table"]) or r["len"] > len(r["block_table"]) * B:
            raise Bad(f"{p}.kv.physical.requests.{s}", f"block table must cover len with blocks below num_blocks = {nb}")
    for j, d in enumerate(kv["per_request"]):
        if any(b >= nb for b in d.get("block_table", [])) or any(x >= nb * B for x in d.get("slot_mapping", [])):
            raise Bad(f"{p}.kv.per_request[{j}]", f"blocks and slots must lie inside the pool ({nb} blocks of {B})")


def _streams_consistent(ph: dict[str, Any], p: str) -> None:
    """A non-unified cells snapshot: ``size = n_stream * stream_size`` (global rows), every stream's head,
    used and n_kv inside ``stream_size``, stream ids below ``n_stream``."""
    n, ss = ph.get("n_stream"), ph.get("stream_size")
    if n is None or ss is None or n * ss != ph["size"]:
        raise Bad(p, "a non-unified cache needs n_stream and stream_size with size = n_stream × stream_size")
    for j, st in enumerate(ph.get("streams", [])):
        if st["stream"] >= n or st["head"] > ss or st["used"] > ss or st["used_max_p1"] > ss or st["n_kv"] > ss:
            raise Bad(f"{p}.streams[{j}]", f"stream, head, used, used_max_p1 and n_kv must lie inside the {n} streams of {ss} cells")


def validate_trace(d: Any, where: str, consistency: bool = True) -> None:
    """Check a parsed ``trace.json`` completely (see the module docstring).

    Args:
        d: what ``json.loads`` returned.
        where: the file, for the message.
        consistency: also check the cross-field consistency (positions = C..C+T-1, packed rows,
            lens, mask shapes, cells); ``infertrace check`` reports those as violations instead.

    Raises:
        InfertraceError: one line ``<where>: <field path>: <what is wrong> (limit NAME = N)``.
    """
    try:
        TOP_LEVEL(d, "$")
        if consistency:
            _consistent(d)
    except Bad as e:
        path = e.path[2:] if e.path.startswith("$.") else e.path.lstrip("$")
        raise InfertraceError(f"{where}: {path + ': ' if path else ''}{e.msg}") from None
    except RecursionError:
        raise InfertraceError(f"{where}: nested too deeply") from None
