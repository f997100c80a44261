"""Compatibility import: the decoder now lives in :mod:`infertrace.model.decoder` (all families)."""

from infertrace.model.decoder import NULL_TRACER, DecoderModel, LlamaModel, NullTracer, Tracer, rms_norm

__all__ = ["NULL_TRACER", "DecoderModel", "LlamaModel", "NullTracer", "Tracer", "rms_norm"]
