"""Checkpoints in: GGUF and HF directories read, validated against their own sizes, dequantised or kept
quantised, and turned into engine-named weights plus a ModelConfig; the --model registry."""
