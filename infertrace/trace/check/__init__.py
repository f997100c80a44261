"""``infertrace check``: invariants every trace must satisfy, whoever produced it (our engine on
either backend, or llama.cpp through ``run --runtime llama.cpp``).

Checked per step, in this order (the first violation is reported with its step, seq_id and
variable):

1. **positions** -- each request's positions are ``C .. C+T-1``, continuing where its previous
   chunk stopped (restarting at 0 only after a preemption); ``inp_pos`` is the packed
   concatenation of them. Serving events move the start: a prefix-cache hit at admission
   (``ReqStep.prefix``: the chunk starts where the hit ends, ``0 <= hit < prompt_len``, vLLM /
   llama.cpp server recompute at least the last prompt token) and a context shift before the step
   (``serving.ops_before_step``: it shifts the ``n_past`` positions the sequence held, drops
   ``n_discard >= 1`` after ``n_keep``, and positions continue at ``n_past_after = n_past - n_discard``;
   its ``removed`` / ``moved`` ranges are the ones ``n_keep`` / ``n_discard`` imply, and a request's
   copy of the shift equals the step's op).
2. **positions (RoPE)** -- every recorded ``cos``/``sin`` is ``cos(pos * inv_freq[i])`` /
   ``sin(...)`` for its position (1e-5: values are stored rounded to 6 digits; plus the float32
   rounding of the angle, ``|pos * inv_freq| * 2^-23``, which far positions make visible).
3. **mask (causality)** -- no query sees a later position, and each query sees its own.
4. **mask (isolation)** -- in the kq_mask slice (cells), a kept entry (0) lies on a cell that
   holds the query's seq_id at a position <= the query's; the materialised logical mask has
   no leak column.
5. **kv (ownership)** -- cells: no two cells hold the same (seq, pos); the cells written this
   step were free or released before (finished, preempted, past the sequence's cached length, or
   dropped by a context shift); a sequence joins a cell only by writing it or through its prefix
   hit (``seq_cp`` of a cell the hit's source held at that position); a cell a sequence keeps
   without writing it keeps its position (or moves by ``-n_discard`` in the step's context shift);
   a finished sequence is in no cell unless the cache lists it as retained (prefix cache: llama.cpp
   server keeps a finished slot's cells for reuse; a retained id is a sequence already computed, not
   one running); after the step each computed request owns exactly
   positions ``0 .. C+T-1`` (after a speculative verify: ``0 .. C + accepted path - 1``, and the
   verify row's positions are ``C + depth(node)`` of its draft tree); a finished request owns nothing later. paged: a block belongs to
   one request, unless it is a shared prefix block (vLLM automatic prefix caching: in every
   table at the same index, with ``ref`` = the number of tables, joined only through a prefix hit's
   ``shared_blocks``); the slot mapping is ``table[p // B] * B + p % B``; a finished request has no
   table later. llama.cpp traces: ``llama_memory_seq_pos_min/max`` agree with the cells.
6. **spec** -- a speculative verify row agrees with its tree (:func:`verify_row_problem`: counts,
   emitted tokens, every recorded verify-mask form); the run's summary is consistent
   (:func:`run_spec_problem`).

7. **window** -- recomputed from positions, seq ids and the config's window (``sliding_window`` on
   the layers ``swa_layers`` marks): a query at p sees exactly keys 0..p (``visible``) and p-W+1..p on
   the windowed layers (``visible_swa``); ``mask.swa`` names that window and those layers, its
   ``kq_mask_swa`` slice keeps exactly the cells of the query's sequence inside the window.
8. **verify cells, display fields, pool, hybrid** -- a verify row's ``spec.cells`` are T distinct cells,
   the ones written, holding the nodes' positions, the accepted path's after the rewind;
   ``cache_before``/``cache_after`` are 0..C-1 / 0..kept-1; ``hidden.rows`` are the packed tokens; the
   KV pool is the one the options configure; a hybrid step's layer map is ``config.layer_types``.
9. **tensors** (:func:`check_tensors`, ``--keep tensors``) -- names, shapes and quoted values agree.

Before the steps: the layers every record names exist (:func:`layers_problem`) and the options agree
with the steps (:func:`options_problem`: verify rows only with ``speculative`` set, ``draft_layers <
n_layer``); ``position_ids`` (and a hybrid step's M-RoPE ``inp_pos`` / ``position_ids``) are the packed
positions. After them, **decode** (:func:`decode_loop_problem`): greedy picks the top logit, the chosen
token is ``next_input`` and is fed next at ``next_pos``, each row's tokens are ``prompt_ids + output_ids``
at its positions, ``output_ids`` are the emitted tokens in order, every id is below ``vocab_size``.

Every field is validated before use: a malformed trace is a violation of "schema", not a crash.

Newer sections, each recomputed from the facts it summarises:

* **streams** (``--kv-unified off``, llama.cpp ``kv_unified = false``): ``n_stream = kv_unified ? 1 :
  n_seq_max`` and ``seq_to_stream[s] = s`` (``llama_kv_cache`` constructor), so each cell holding
  sequence s lies in stream s (``cell // stream_size == s``); a stream's ``used`` / ``used_max_p1`` count
  its own cells; ``kq_mask`` ``ne[3]`` is the ubatch's streams, block j's rows are queries of the
  sequence of stream j and keep only that sequence's cells.
* **SWA pool** (llama.cpp ``llama_kv_cache_iswa``, kv/iswa.py): one entry per cell, one cell per
  (seq, pos), ``used`` = the cells listed; it holds positions the base pool holds, at least the window
  the next query reads (``p - W + 1 .. p``).
* **MTP** (``--speculative mtp``, engine/drafters.py ``MTPDrafter``, a chain): MTP row k embeds the
  verify row's token k (node k - 1 at position C - 1 + k) and its greedy ``argmax`` is draft k, the
  token verified at node k + 1 (the first T - 1 drafts: a request near its token limit verifies fewer); ``spec.mtp.drafts`` lists them; a trace with MTP rows ran
  ``options.settings.speculative = mtp`` on a model with ``config.mtp_layers >= 1``.
* **kv.dtype** is ``options.settings.kv_dtype`` (f32 / f16 / bf16 -> float32 / float16 / bfloat16),
  else the compute dtype ``options.dtype`` (our engine); llama.cpp's ``options.llama_cpp.type_k``.
* **quant kernels**: each ``options.weights.kernels`` entry is a kernel that
  :func:`infertrace.quant.source.choose_kernel` can return for that GGUF type and ``options.dtype``
  (its rule, :mod:`infertrace.quant.choice`, is torch-free).
* **paged tables**: a request's ``kv.per_request`` block table (the one its slots were written
  through) is ``kv.physical.requests`` 's table (after a verify rewind: that table is its prefix), which
  covers ``len`` = the positions the request holds after the step.
* **prefix hits**: the row's copy of a hit is ``serving.prefix`` 's; its ``computed`` range starts at
  the hit; paged ``shared_blocks`` are the table's first ``hit // B`` blocks (the full blocks the hit covers).
* **vllm** (``run --runtime vllm``, vLLM v1 ``GPUModelRunner._prepare_inputs``): with B =
  ``options.vllm.block_size``, for batch row i at positions p: ``query_start_loc`` = cumulative T,
  ``seq_lens`` = C + T (vLLM's seq_lens are kv lengths), ``slot_mapping`` = ``block_table[i][p // B] * B
  + p % B``, ``block_table`` = the request's table; ``logits_indices`` = the last ``1 + drafts`` rows of each
  request (``query_start_loc[i + 1] - 1`` without drafts), inside ``0..N-1``; the scheduler's per-request
  ``num_scheduled_tokens`` / ``num_computed_tokens`` are T / C and ``total_num_scheduled_tokens`` = N;
  ``sampled_token_ids`` of a row whose sample is kept are its emitted tokens; ``free_blocks`` is the
  pool's and at most ``num_blocks - 1`` (block 0 is vLLM's null block); ``new_block_ids`` are blocks of the
  sequence's own table; ``tp_ranks`` one per rank of ``tensor_parallel_size``; a ``vllm`` section only in
  a trace whose header names the runtime ``vllm`` (and every computed step of such a trace has one).

* **dense** (``run --runtime hf``, HF transformers' padded ``[B, T]`` batch; :mod:`infertrace.trace.check.dense`):
  the first forward is ``[B, T]`` with T = the longest prompt, each row's prompt at its left- or right-padded
  columns and ``attention_mask`` 0 exactly at the pads; every later forward ``[B, 1]`` with the mask one column
  wider; ``position_ids = cumsum(mask) - 1`` (pads 0), so real tokens sit at 0..n-1 whatever the padding and
  each request's positions are HF's at its columns; every mask HF built keeps, for each real query, exactly the
  real key columns at or before it (sliding layers: inside the window) and no pad column (``none: is_causal``
  only without pads); every layer's cache length is ``T + decode steps`` (a sliding layer stores at most
  ``sliding_window - 1``); ``kv.layer_view`` equals HF's K/V at the mapped column; each row samples its last
  real column. :func:`padding_kv_problem` compares two traces of the same prompts (left vs right padding).

The package, one module per convention (each rule written once): ``positions`` (rules 1-2, serving
events, prefix hits), ``mask`` (3, 4, 7), ``swa`` (``kq_mask_swa``, the SWA pool), ``streams``
(``--kv-unified off``), ``cells`` (5 cells, 8), ``paged`` (5 paged, block tables), ``speculative`` (6, 8,
MTP), ``options`` (options, layers, kernels, kv dtype), ``decode`` (the decode loop), ``tensors`` (9),
``vllm`` (the per-step ``vllm`` section), ``dense`` (the per-step ``hf`` section, ``--runtime hf``), ``base`` (shared pieces, the header's facts) and ``checker``
(the pass over the steps). The rule-mixin methods and ``*_rules`` functions take the running checker
(``fail`` / ``need`` / ``n_checks``) and raise through ``fail`` on the first violation.
"""

from __future__ import annotations

from infertrace.ranges import parse_ranges, ranges_text  # the range grammar lives in ranges.py (still importable from here)
from infertrace.trace.check.base import Violation, config_problem, intervals, intervals_of, kept_len, run_facts
from infertrace.trace.check.checker import check_trace, iter_rules
from infertrace.trace.check.decode import decode_loop_problem
from infertrace.trace.check.dense import padding_kv_problem
from infertrace.trace.check.options import kernels_problem, layers_problem, options_problem
from infertrace.trace.check.speculative import run_spec_problem, verify_row_problem
from infertrace.trace.check.tensors import check_tensors

__all__ = ["Violation", "check_tensors", "check_trace", "config_problem", "decode_loop_problem", "intervals", "intervals_of",
           "iter_rules", "kept_len", "kernels_problem", "layers_problem", "options_problem", "padding_kv_problem", "parse_ranges", "ranges_text",
           "run_facts", "run_spec_problem", "verify_row_problem"]
