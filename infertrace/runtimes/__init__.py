"""Recorded real runtimes, one package each: they run the same request specs as the engine, read the
runtime's own tensors and objects, and emit ordinary trace records (``engine: llama.cpp`` / ``vllm``)."""
