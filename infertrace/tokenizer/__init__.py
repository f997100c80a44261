"""Vocabularies from GGUF metadata or HF tokenizer files (vocab.py) and chat templates rendered in a
sandbox (chat_env.py, template_limits.py)."""
