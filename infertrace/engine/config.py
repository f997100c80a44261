"""Typed, torch-free engine configs, each checking itself once: :class:`CacheConfig`,
:class:`SchedulerConfig`, :class:`SpeculativeConfig`, :class:`ServingConfig`.

vLLM splits its engine arguments the same way (``vllm/config/cache.py`` ``CacheConfig``,
``vllm/config/scheduler.py`` ``SchedulerConfig``, ``vllm/config/speculative.py``
``SpeculativeConfig``); llama.cpp keeps the same settings in ``llama_context_params`` and
``common_params``. :class:`~infertrace.engine.options.EngineOptions` stays the flat record a trace
holds (``options["settings"]``) and hands out these as views (``opts.cache`` ...); its ``validate()``
calls each one's.

A bad value raises :class:`ConfigError`: ``field`` names the config field (``cache.tokens_per_block``)
and the message says what is wrong in the library's words; a front end names its own option from
``field`` (the CLI: :data:`infertrace.cli.run_options.CONFIG_FLAGS`).
"""

from __future__ import annotations

from dataclasses import dataclass

from infertrace.errors import ConfigError  # noqa: F401 - re-exported: the configs' error
from infertrace.limits import LIMITS

#: the largest context, pool or token budget in tokens (the trace format's ``MAX_CTX``)
MAX_CTX = LIMITS["MAX_CTX"]
#: the largest block in slots (the trace format's ``MAX_TOKENS_PER_BLOCK``)
MAX_TOKENS_PER_BLOCK = LIMITS["MAX_TOKENS_PER_BLOCK"]
#: K/V cache storage types (llama.cpp ``--cache-type-k/v`` names)
KV_DTYPES = ("f32", "f16", "bf16")
#: ``dense``: HF transformers' own static padded cache (runtimes/hf)
BACKENDS = ("cells", "paged", "dense")
SPEC_METHODS = ("ngram", "draft", "mtp")
#: most draft tokens per step (:data:`infertrace.engine.speculative.MAX_DRAFT`; a test checks they agree)
MAX_DRAFT = 64
#: the n-gram drafter's longest suffix
MAX_NGRAM = 16


def _at_least(field: str, value: int | None, lo: int, hi: int | None = None, unit: str = "tokens") -> None:
    """ConfigError unless ``value`` is None or in ``lo..hi``."""
    if value is None:
        return
    if value < lo:
        raise ConfigError(field, f"must be >= {lo} (got {value})")
    if hi is not None and value > hi:
        raise ConfigError(field, f"{value} is over the limit of {hi} {unit}")


@dataclass(frozen=True)
class CacheConfig:
    """The K/V memory: which convention, how big, stored how.

    backend: ``cells`` (llama.cpp ``llama_kv_cache`` cells), ``paged`` (vLLM ``KVCacheManager`` blocks) or ``dense`` (HF).
    ctx_size: tokens, 1..MAX_CTX: the cells' count and the per-request context limit (llama.cpp ``n_ctx``;
        vLLM ``max_model_len``); the paged pool's default size.
    num_blocks: blocks in the paged pool, >= 1 (vLLM ``num_gpu_blocks``); None = ceil(ctx_size / tokens_per_block).
    tokens_per_block: slots per block, 1..MAX_TOKENS_PER_BLOCK (vLLM ``block_size``, TensorRT-LLM
        ``tokens_per_block``); ``num_blocks x tokens_per_block`` at most MAX_CTX.
    n_seq_max: sequences the cache holds at once, >= 1 (llama.cpp ``n_seq_max``).
    kv_unified: llama.cpp ``kv_unified``: False (one stream per sequence) is the cells convention only and
        needs ``ctx_size >= n_seq_max``.
    kv_dtype: one of :data:`KV_DTYPES` or None (the model dtype) (llama.cpp ``type_k``/``type_v``, vLLM
        ``cache_dtype``).
    """

    backend: str = "cells"
    ctx_size: int = 2048
    num_blocks: int | None = None
    tokens_per_block: int = 32
    n_seq_max: int = 64
    kv_unified: bool = True
    kv_dtype: str | None = None

    def validate(self) -> "CacheConfig":
        """Return self, or raise :class:`ConfigError` naming the first bad field."""
        if self.backend not in BACKENDS:
            raise ConfigError("cache.backend", f"must be one of {', '.join(BACKENDS)} (got {self.backend!r})")
        _at_least("cache.ctx_size", self.ctx_size, 1, MAX_CTX)
        _at_least("cache.tokens_per_block", self.tokens_per_block, 1, MAX_TOKENS_PER_BLOCK, "slots per block")
        _at_least("cache.num_blocks", self.num_blocks, 1)
        if self.num_blocks is not None and self.num_blocks * self.tokens_per_block > MAX_CTX:
            raise ConfigError("cache.num_blocks", f"{self.num_blocks} blocks of {self.tokens_per_block} tokens are over "
                                                  f"the limit of {MAX_CTX} tokens")
        _at_least("cache.n_seq_max", self.n_seq_max, 1)
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ConfigError("cache.kv_dtype", f"must be one of {', '.join(KV_DTYPES)} (got {self.kv_dtype!r})")
        if not self.kv_unified and self.backend != "cells":
            raise ConfigError("cache.kv_unified", "off (one stream per sequence) is llama.cpp's cells convention; "
                                                  "it needs backend cells")
        if not self.kv_unified and self.ctx_size < self.n_seq_max:
            raise ConfigError("cache.ctx_size", f"{self.ctx_size} cells leave no cell per stream for {self.n_seq_max} "
                                                "streams (kv_unified off: one per sequence); raise it")
        return self


@dataclass(frozen=True)
class SchedulerConfig:
    """How each step's batch is cut (vLLM ``SchedulerConfig``; llama.cpp ``n_batch`` / ``n_ubatch``).

    max_batch_tokens: tokens a step computes, 1..MAX_CTX (vLLM ``max_num_batched_tokens``).
    prefill_chunk: prompt tokens per request per step, 1..MAX_CTX, None = the budget (chunked prefill,
        vLLM ``long_prefill_token_threshold``).
    """

    max_batch_tokens: int = 2048
    prefill_chunk: int | None = None

    def validate(self) -> "SchedulerConfig":
        """Return self, or raise :class:`ConfigError` naming the bad field."""
        _at_least("scheduler.max_batch_tokens", self.max_batch_tokens, 1, MAX_CTX)
        _at_least("scheduler.prefill_chunk", self.prefill_chunk, 1, MAX_CTX)
        return self


def tree_is_chain(parents: tuple[int, ...]) -> bool:
    """Whether parent indices ``-1, 0, 1, ...`` make a chain (no branch)."""
    return list(parents) == list(range(-1, len(parents) - 1))


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM ``SpeculativeConfig``; llama.cpp ``common_params_speculative``).

    method: None (off), ``ngram`` (prompt lookup), ``draft`` (a draft model) or ``mtp`` (the model's MTP head).
    num_spec_tokens: K drafts per step as a chain, 1..MAX_DRAFT (vLLM ``num_speculative_tokens``); unused with a tree.
    spec_tree: parent index of each draft node (-1 = the last accepted token; each parent an earlier node),
        1..MAX_DRAFT nodes, instead of a chain (vLLM ``speculative_token_tree``).
    draft_model / draft_layers: with ``draft``, exactly one: a model path, or the target's first k >= 1 layers.
    ngram_min / ngram_max: suffix lengths the lookup tries, 1 <= min <= max <= 16 (vLLM ``prompt_lookup_min/max``).
    The draft options need a method; ``ngram_min``/``ngram_max`` belong to ``ngram``, the draft model to ``draft``.
    """

    method: str | None = None
    num_spec_tokens: int = 3
    spec_tree: tuple[int, ...] | None = None
    draft_model: str | None = None
    draft_layers: int | None = None
    ngram_min: int = 1
    ngram_max: int = 3

    def validate(self) -> "SpeculativeConfig":
        """Return self, or raise :class:`ConfigError` naming the first bad field."""
        d = SpeculativeConfig()
        if self.method is None:
            for name in ("num_spec_tokens", "spec_tree", "draft_model", "draft_layers", "ngram_min", "ngram_max"):
                if getattr(self, name) != getattr(d, name):
                    raise ConfigError(f"speculative.{name}", "sets speculative decoding, which is off; choose a method "
                                                             f"({', '.join(SPEC_METHODS)})")
            return self
        if self.method not in SPEC_METHODS:
            raise ConfigError("speculative.method", f"must be one of {', '.join(SPEC_METHODS)} (got {self.method!r})")
        _at_least("speculative.num_spec_tokens", self.num_spec_tokens, 1, MAX_DRAFT, "drafts")
        if self.spec_tree is not None:
            self._check_tree()
        if not 1 <= self.ngram_min <= self.ngram_max <= MAX_NGRAM:
            raise ConfigError("speculative.ngram_min", f"ngram_min and ngram_max must satisfy 1 <= min <= max <= "
                                                       f"{MAX_NGRAM} (got {self.ngram_min}, {self.ngram_max})")
        if self.method != "ngram" and (self.ngram_min, self.ngram_max) != (d.ngram_min, d.ngram_max):
            raise ConfigError("speculative.ngram_min", "ngram_min / ngram_max set the n-gram drafter; they need method ngram")
        self._check_draft()
        return self

    def _check_tree(self) -> None:
        tree = tuple(self.spec_tree or ())
        if not 1 <= len(tree) <= MAX_DRAFT:
            raise ConfigError("speculative.spec_tree", f"must have 1..{MAX_DRAFT} nodes (got {len(tree)})")
        for i, p in enumerate(tree):
            if not -1 <= p < i:
                raise ConfigError("speculative.spec_tree", f"node {i} has parent {p}: a parent must be -1 (the last "
                                                           "token) or an earlier node")

    def _check_draft(self) -> None:
        given = self.draft_model is not None or self.draft_layers is not None
        if self.method != "draft" and given:
            raise ConfigError("speculative.draft_model" if self.draft_model is not None else "speculative.draft_layers",
                              "names a draft model; it needs method draft")
        if self.method == "draft" and (self.draft_model is None) == (self.draft_layers is None):
            raise ConfigError("speculative.method", "draft needs exactly one of draft_model (a path) or draft_layers (k)")
        _at_least("speculative.draft_layers", self.draft_layers, 1)


@dataclass(frozen=True)
class ServingConfig:
    """The serving mechanisms (engine/serving.py): prefix reuse, context shift, the K/V audit.

    prefix_cache: reuse cached K/V of a shared prompt prefix (vLLM ``CacheConfig.enable_prefix_caching``;
        llama.cpp server ``cache_prompt``).
    context_shift / n_keep / n_discard: llama.cpp server's context shift: keep ``n_keep`` tokens (-1 = the
        whole prompt, 0..MAX_CTX-1), drop ``n_discard`` (0 = half the rest, 0..MAX_CTX-1). ``n_keep`` /
        ``n_discard`` need ``context_shift``.
    audit_kv: record each cached entry's provenance and recompute the cache every step.
    """

    prefix_cache: bool = False
    context_shift: bool = False
    n_keep: int = 0
    n_discard: int = 0
    audit_kv: bool = False

    def validate(self) -> "ServingConfig":
        """Return self, or raise :class:`ConfigError` naming the bad field."""
        _at_least("serving.n_keep", self.n_keep, -1, MAX_CTX - 1)
        _at_least("serving.n_discard", self.n_discard, 0, MAX_CTX - 1)
        if (self.n_keep or self.n_discard) and not self.context_shift:
            raise ConfigError("serving.n_keep" if self.n_keep else "serving.n_discard",
                              "sets how a context shift works; it needs context_shift on")
        return self

    def check_shift(self, ctx_size: int) -> None:
        """A shift of a ``ctx_size`` context must keep ``n_keep`` tokens and one more, and at most ``ctx_size - 4``
        (llama.cpp's server clamps ``n_keep`` + BOS to ``n_ctx - 4``). Raises :class:`ConfigError`."""
        if not self.context_shift:
            return
        most = max(ctx_size - 2 - max(self.n_keep, 0), 0)
        if self.n_discard > most:
            raise ConfigError("serving.n_discard", f"{self.n_discard} is more than a context shift of {ctx_size} tokens "
                                                   f"can drop (at most ctx_size - 2 - n_keep = {most})")
        if self.n_keep > ctx_size - 4:
            raise ConfigError("serving.n_keep", f"{self.n_keep} leaves nothing to shift in a context of {ctx_size} tokens "
                                                f"(a shift keeps at most n_ctx - 4 = {max(ctx_size - 4, 0)}, BOS "
                                                "included, as llama.cpp's server)")
