"""llama.cpp through llama-cpp-python: capture.py reads its graph inputs and memory (eval callback, ggml
tensors, memory API); engine.py is ``--runtime llama.cpp`` (our scheduler, llama.cpp's forward and cells)."""
