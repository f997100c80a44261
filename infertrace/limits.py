"""The bounds a trace's size and a run's size share, torch-free: the trace schema checks a saved
trace against them (:mod:`infertrace.trace.schema`) and the memories size themselves by them
(:mod:`infertrace.kv.budget`, :mod:`infertrace.kv.cells`), so neither layer imports the other.
"""

from __future__ import annotations

#: bounds on what a trace may ask a consumer to loop over or allocate (name -> value)
LIMITS = {
    "MAX_STEPS": 1 << 20,          # steps in one trace
    "MAX_LIST": 1 << 22,           # items in any one list
    "MAX_STR": 1 << 20,            # characters in any one string
    "MAX_CTX": 1 << 24,            # ctx_size, cells, positions, C + T
    "MAX_BLOCKS": 1 << 24,         # num_blocks, block ids
    "MAX_TOKENS_PER_BLOCK": 1 << 16,
    "MAX_SEQ_ID": 1 << 31,
    "MAX_ID": 1 << 31,             # token ids, vocab sizes
    "MAX_DIM": 1 << 24,            # layers, heads, hidden sizes, tensor dims
    "MAX_DEPTH": 32,               # nesting of the open sections
    "MAX_RANGE_ITEMS": 1 << 24,    # integers one range text such as "0..3,7" may stand for
}
#: the cache padding of n_kv: llama.cpp ``get_n_kv`` pads used_max_p1 to a multiple of 256, at least 256, at most
#: the cache size (older llama.cpp padded to 32 without flash attention, which this bound also admits)
N_KV_PAD_MAX = 256
