"""GGUF weights that stay quantised (issue 20): block decoding (``blocks``), the kernels
(``linear``), the file-backed weight objects (``source``) and the decoder's linear-op point for
them (``ops``, which needs :mod:`infertrace.model.ops`)."""
