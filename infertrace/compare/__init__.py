"""Agreement between backends and runtimes: structure compared exactly, floats against a noise floor.
backends.py (diff-backends: two engines in lockstep), hf.py (HF transformers as reference), llamacpp.py
(diff-runtimes llama.cpp: the llama.cpp-numerics floor), metrics.py (KL, top-1 agreement, near ties)."""
