"""Shared test helpers: tiny random checkpoints (tiny, tiny_qwen35), hostile payloads (hostile, hostile_gguf), llama.cpp MTP bindings (llama_mtp)."""
