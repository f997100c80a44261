"""The one in-process vLLM engine the vLLM tests share (tests/conftest.py: session fixtures ``vllm_mod``,
``vllm_run``), and its settings: SmolLM2-135M, block 32, a pool of 6 blocks (block 0 is vLLM's null
block: 160 usable slots), prefix caching and n-gram speculation (3 drafts) on, token budget 64,
``long_prefill_token_threshold`` 8, at most 4 requests at once. vLLM init takes 10-50 s: one engine
per test session."""

from __future__ import annotations

from infertrace.engine.options import EngineOptions

LAYER = 3
OPTS = EngineOptions(backend="paged", tokens_per_block=32, num_blocks=6, max_batch_tokens=64, prefill_chunk=8,
                     prefix_cache=True, speculative="ngram", num_spec_tokens=3, ctx_size=160, n_seq_max=4)
