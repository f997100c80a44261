"""Recorded runtimes, each in its own package: the runtime computes, infertrace reads its own
objects at every step and writes an ordinary trace (``engine: <runtime>``).

* :mod:`infertrace.runtimes.vllm`: vLLM (``run --engine vllm``).

llama.cpp (``engine/llamacpp_*.py``) is to move here as ``runtimes/llamacpp``.
"""
