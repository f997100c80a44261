"""What is injected into :class:`~infertrace.engine.engine.Engine` instead of subclassing it: the memory
from a cache config, the tokens from a sampler (and a speculative verify's outcome, when it is forced).

Mirrors vLLM v1, where the ``KVCacheConfig`` built from the model and settings is handed to the
worker (the memory is never swapped after construction), and llama.cpp's ``common_sampler`` chain
(a sampler is a value the loop calls, not a method a subclass overrides).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

from infertrace.engine.sampler import SampleResult, sample


class MemoryConfig(Protocol):
    """A typed cache config: builds the engine's memory once, at construction.

    Implementations: the default (:func:`~infertrace.engine.engine.make_kv` from ``EngineOptions``),
    llama.cpp's read-back cache (``runtimes/llamacpp/engine.py``), the replayed vLLM pool
    (``runtimes/vllm/replay.py``), llama.cpp's numerics emulated (``compare/llamacpp.py``).
    """

    def build(self, model: Any, opts: Any, attn_impl: str) -> Any:
        """The memory for ``model`` under ``opts`` (``attn_impl``: the attention that reads it).

        Raises:
            InfertraceError: sizes or settings the memory cannot hold.
        """
        ...


def sample_request(logits: Any, req: Any, order: str) -> SampleResult:
    """The next token of ``req`` from its logits row ``[V]`` float32 (:func:`~infertrace.engine.sampler.sample`
    with the request's settings, seen tokens and generator)."""
    return sample(logits, req.params, req.all_ids, req.generator, order=order)


@dataclass(frozen=True)
class ForcedSampler:
    """Teacher forcing: the i-th generated token of request ``seq_id`` is ``forced[seq_id][i]`` (while the
    list lasts); the sampler's own choice is kept in ``top`` so the trace shows what it would have chosen.

    A speculative verify chunk's outcome can be forced too (a replayed vLLM trace: vLLM's rejection
    sampler decided which drafts were accepted): :meth:`verify` answers it for ``(seq_id, step)`` in
    ``verified``, and :func:`~infertrace.engine.speculative.verify_chunk` takes it instead of walking
    the draft tree.

    Attributes:
        forced: ``{seq_id: [token, ...]}``, in output order.
        verified: ``{(seq_id, step): (emitted tokens, accepted nodes)}``: the chain's first
            ``accepted`` nodes (root included, so ``accepted >= 1``) are kept and ``emitted`` appended.
    """

    forced: Mapping[int, Sequence[int]] = field(default_factory=dict)
    verified: Mapping[tuple[int, int], tuple[Sequence[int], int]] = field(default_factory=dict)

    def __call__(self, logits: Any, req: Any, order: str) -> SampleResult:
        res = sample_request(logits, req, order)
        f = self.forced.get(req.seq_id)
        i = len(req.output_ids)
        if f is not None and i < len(f):
            return SampleResult(int(f[i]), res.top)
        return res

    def verify(self, logits: Any, chunk: Any, order: str, step: int) -> tuple[list[SampleResult], list[int]] | None:
        """The forced outcome of verify chunk ``chunk`` at ``step``, or None (not forced: walk the tree).

        Args:
            logits: ``[T, V]`` float32, one row per candidate of the chunk (chunk-local order).
        Returns:
            ``([SampleResult(emitted token, our own top at that node)], accepted nodes 0..accepted-1)``;
            our candidates are drawn at the request's tokens before the step (vLLM's outcome is a chain).
        """
        got = self.verified.get((chunk.req.seq_id, step))
        if got is None:
            return None
        emitted, n_accepted = got
        req = chunk.req
        tops = [sample(logits[a], req.params, req.all_ids, req.generator, order=order).top  # each row [V]
                for a in range(len(emitted))]
        return [SampleResult(int(t), top) for t, top in zip(emitted, tops)], list(range(n_accepted))
