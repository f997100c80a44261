"""Run options as torch-free dataclasses: :class:`SamplingParams` (per request) and
:class:`EngineOptions` (per run). The CLI builds its option defaults from them without importing
the engine; :mod:`infertrace.engine.sampler` and :mod:`infertrace.engine.engine` re-export them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from infertrace.engine.config import (KV_DTYPES, CacheConfig, ConfigError, SchedulerConfig, ServingConfig,  # noqa: F401
                                      SpeculativeConfig, tree_is_chain)
from infertrace.errors import InfertraceError

#: slots per block of the paged pool (vLLM ``block_size``, TensorRT-LLM ``tokens_per_block``);
#: :data:`infertrace.kv.paged.DEFAULT_TOKENS_PER_BLOCK` is the same value (a test checks)
DEFAULT_TOKENS_PER_BLOCK = 32
#: :data:`KV_DTYPES` (engine/config.py): the K/V cache storage type, llama.cpp's cache type names
#: (``--cache-type-k/v``; llama.cpp's default is ``f16``). None = the model's compute dtype


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    temperature 0 = greedy; top_k 0 = off; top_p 1 = off; min_p 0 = off;
    repetition_penalty 1 = off; ``seed`` seeds the request's generator.

    Penalties (llama.cpp ``llama_sampler_init_penalties``; :func:`~infertrace.engine.sampler.apply_penalties`):
    ``penalty_last_n`` = how many of the last tokens seen (prompt included) are penalised: ``-1`` the
    whole context, ``0`` none, ``None`` the order's default (:func:`penalty_window`: 64 in the
    llama.cpp order, as ``common_params_sampling``; the whole context in the hf order, as HF
    ``RepetitionPenaltyLogitsProcessor``); ``frequency_penalty`` / ``presence_penalty`` (0 = off)
    subtract ``count * frequency + presence`` from each such token's logit (llama.cpp order only).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    max_new_tokens: int = 16
    ignore_eos: bool = False
    penalty_last_n: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def validate(self) -> "SamplingParams":
        """Check every field's range.

        Raises:
            ConfigError: ``sampling.<field>`` out of range or not finite (the CLI names its flag, a
                ``--prompts`` file its key).
        """
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            val = getattr(self, name)
            if isinstance(val, int) and not isinstance(val, bool) and abs(val) > 1e300:  # isfinite() would overflow
                raise ConfigError(f"sampling.{name}", f"must be a finite number (got an integer of {len(str(abs(val)))} digits)")
            if not math.isfinite(val):
                raise ConfigError(f"sampling.{name}", f"must be a finite number (got {val})")
        if self.temperature < 0 or 0 < self.temperature < 1e-3:
            raise ConfigError("sampling.temperature", f"must be 0 (greedy) or >= 0.001 (got {self.temperature})")
        if not 0 <= self.seed < 2**63:
            raise ConfigError("sampling.seed", f"must be in 0..2^63-1 (got {self.seed})")
        if self.top_k < 0:
            raise ConfigError("sampling.top_k", f"must be >= 0 (got {self.top_k})")
        if not 1e-6 <= self.top_p <= 1:
            raise ConfigError("sampling.top_p", f"must be in [1e-6, 1] (got {self.top_p})")
        if not 0 <= self.min_p < 1:
            raise ConfigError("sampling.min_p", f"must be in [0, 1) (got {self.min_p})")
        if not 0.01 <= self.repetition_penalty <= 100:
            raise ConfigError("sampling.repetition_penalty", f"must be in [0.01, 100] (got {self.repetition_penalty})")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -100 <= getattr(self, name) <= 100:
                raise ConfigError(f"sampling.{name}", f"must be in [-100, 100] (got {getattr(self, name)})")
        if self.penalty_last_n is not None and not -1 <= self.penalty_last_n <= MAX_PENALTY_LAST_N:
            raise ConfigError("sampling.penalty_last_n", f"must be -1 (whole context), 0 (off) or up to {MAX_PENALTY_LAST_N} "
                                                         f"(got {self.penalty_last_n})")
        if self.max_new_tokens < 1:
            raise ConfigError("sampling.max_new_tokens", f"must be >= 1 (got {self.max_new_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the penalties sampler changes anything (llama.cpp ``llama_sampler_penalties::is_disabled``
        negated; a window of 0 is checked where the window is resolved)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def to_dict(self) -> dict:
        """All fields; the penalty window and the frequency / presence penalties only when a penalty is
        on (a trace without penalties reads as before they existed)."""
        d = asdict(self)
        if not self.penalized:
            for k in ("penalty_last_n", "frequency_penalty", "presence_penalty"):
                d.pop(k)
        return d


#: llama.cpp's default window (``common_params_sampling::penalty_last_n``)
LLAMACPP_PENALTY_LAST_N = 64
#: the largest window accepted (any longer window is the whole context of every run here)
MAX_PENALTY_LAST_N = 1 << 24


def check_penalties(params: SamplingParams, order: str) -> None:
    """Refuse penalties the ``order`` does not have.

    Raises:
        ConfigError: frequency / presence penalty in the ``hf`` order (vLLM counts output tokens
            only for them; not implemented here).
    """
    if order == "hf" and (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0):
        name = "frequency_penalty" if params.frequency_penalty != 0.0 else "presence_penalty"
        raise ConfigError(f"sampling.{name}", "follows llama.cpp's penalties sampler: it needs the llama.cpp sampler order "
                                              "(vLLM's output-only counts in the hf order are not implemented)")


def penalty_window(params: SamplingParams, order: str) -> int:
    """The penalty window a request runs with: its own ``penalty_last_n``, or the order's default
    (``llama.cpp``: 64, ``common_params_sampling``; ``hf``: -1, the whole context as HF and vLLM)."""
    if params.penalty_last_n is not None:
        return params.penalty_last_n
    return LLAMACPP_PENALTY_LAST_N if order == "llama.cpp" else -1



@dataclass
class EngineOptions:
    """Run-time options (CLI flags of ``run``).

    backend: ``cells`` (llama.cpp) or ``paged`` (TensorRT-LLM/vLLM).
    ctx_size: KV capacity in tokens (cells: number of cells; paged: default pool size)
        and the per-request context limit.
    num_blocks / tokens_per_block: paged pool (num_blocks None = ctx_size / tokens_per_block).
    max_batch_tokens / prefill_chunk: scheduler budget and chunked prefill.
    attention: ``torch``, ``triton`` or ``auto``.
    sampler_order: ``hf`` or ``llama.cpp`` (None: the backend's runtime, see
        :func:`~infertrace.engine.sampler.default_order`).
    prefix_cache: reuse cached K/V of a shared prompt prefix (kv/prefix_cache.py).
    context_shift / n_keep / n_discard: when a request fills ``ctx_size``, keep the first
        ``n_keep`` cached tokens (-1: the whole prompt, llama.cpp's ``--keep -1``), drop the next
        ``n_discard`` (0 = half of the rest) and continue
        (llama.cpp server); off: the request stops with ``ctx_full``.
    audit_kv: record each cached entry's provenance and recompute the cache every step.
    kv_dtype: K/V cache storage type, one of :data:`KV_DTYPES` (None = the model dtype); attention reads
        the stored values back in the compute dtype (llama.cpp ``type_k`` / ``type_v``, vLLM ``kv_cache_dtype``).
    speculative: ``None`` (off), ``ngram`` (prompt lookup) or ``draft`` (a draft model: ``draft_model``
        path, or the target's first ``draft_layers`` layers); ``num_spec_tokens`` K drafts per step
        (a chain); ``spec_tree``: parent index of each draft node (-1 = the last accepted token)
        instead of a chain; ``ngram_min``/``ngram_max``: suffix lengths the lookup tries.
    kv_unified: cells backend, llama.cpp ``kv_unified``: True = one cell stream shared by every
        sequence; False = one stream of ``n_ctx_seq`` cells per sequence (``pad256(pad256(ctx_size) // n_seq_max)``, as llama.cpp) (kv/streams.py),
        each step cut to one ``split_equal`` ubatch.
    """

    backend: str = "cells"
    ctx_size: int = 2048
    num_blocks: int | None = None
    tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK
    max_batch_tokens: int = 2048
    prefill_chunk: int | None = None
    attention: str = "auto"
    n_seq_max: int = 64
    sampler_order: str | None = None
    prefix_cache: bool = False
    context_shift: bool = False
    n_keep: int = 0
    n_discard: int = 0
    audit_kv: bool = False
    speculative: str | None = None
    num_spec_tokens: int = 3
    spec_tree: tuple[int, ...] | None = None
    draft_model: str | None = None
    draft_layers: int | None = None
    ngram_min: int = 1
    ngram_max: int = 3
    kv_dtype: str | None = None
    kv_unified: bool = True

    # typed views (engine/config.py); the trace records the flat fields above (asdict), unchanged

    @property
    def cache(self) -> CacheConfig:
        """The K/V memory settings as a :class:`~infertrace.engine.config.CacheConfig`."""
        return CacheConfig(self.backend, self.ctx_size, self.num_blocks, self.tokens_per_block, self.n_seq_max,
                           self.kv_unified, self.kv_dtype)

    @property
    def scheduler(self) -> SchedulerConfig:
        """The batch budget as a :class:`~infertrace.engine.config.SchedulerConfig`."""
        return SchedulerConfig(self.max_batch_tokens, self.prefill_chunk)

    @property
    def speculative_config(self) -> SpeculativeConfig:
        """Speculative decoding as a :class:`~infertrace.engine.config.SpeculativeConfig`."""
        tree = tuple(self.spec_tree) if self.spec_tree is not None else None
        return SpeculativeConfig(self.speculative, self.num_spec_tokens, tree, self.draft_model, self.draft_layers,
                                 self.ngram_min, self.ngram_max)

    @property
    def serving(self) -> ServingConfig:
        """The serving mechanisms as a :class:`~infertrace.engine.config.ServingConfig`."""
        return ServingConfig(self.prefix_cache, self.context_shift, self.n_keep, self.n_discard, self.audit_kv)

    def validate(self) -> "EngineOptions":
        """Check each config, then the rules that span two of them; return self.

        Raises:
            ConfigError: the first bad field (``field`` names it, e.g. ``cache.tokens_per_block``).
        """
        cache, spec, serving = self.cache.validate(), self.speculative_config.validate(), self.serving.validate()
        self.scheduler.validate()
        serving.check_shift(cache.ctx_size)
        if self.attention not in ("torch", "triton", "auto"):
            raise ConfigError("attention", f"must be one of torch, triton, auto (got {self.attention!r})")
        if self.sampler_order not in (None, "hf", "llama.cpp"):
            raise ConfigError("sampler_order", f"must be one of hf, llama.cpp (got {self.sampler_order!r})")
        if self.attention == "triton" and cache.backend == "cells":
            raise ConfigError("attention", "triton reads the paged pool; it needs backend paged")
        if not cache.kv_unified and serving.prefix_cache:
            raise ConfigError("serving.prefix_cache", "needs kv_unified on: across streams llama.cpp's seq_cp copies "
                                                      "whole streams, which the cells prefix reuse does not do")
        if spec.method is not None:
            if not cache.kv_unified:
                raise ConfigError("speculative.method", "is not implemented with kv_unified off")
            if spec.spec_tree is not None and not tree_is_chain(spec.spec_tree) and self.attention == "triton":
                raise ConfigError("speculative.spec_tree", "with branches needs the torch attention (the Triton kernel "
                                                           "reads causal lengths only)")
        return self
