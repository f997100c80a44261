#!/usr/bin/env bash
# One-shot GPU check for the Triton paged-attention kernels, meant to run once on a lent
# CUDA machine (about 5 minutes): the parity tests natively on CUDA (no interpreter),
# then the decode/prefill benchmark and a small decode launch-config sweep.
#
#   bash benchmarks/gpu_check.sh            # from the repository root (or anywhere)
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
#
# Output also goes to $OUT/gpu_check.log when $OUT is set. Exit status: the first
# failing step's (tests first), 0 when all pass.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
unset TRITON_INTERPRET  # native kernels
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"  # triton 3.9 warns when unset
LOG="${OUT:-}"
if [ -n "$LOG" ]; then mkdir -p "$LOG"; exec > >(tee "$LOG/gpu_check.log") 2>&1; fi

"$PY" - <<'PYEOF' || exit 3
import torch, sys
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton; print("triton", triton.__version__)
except ImportError as e:
    sys.exit(f"triton missing: {e}")
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible")
print("device", torch.cuda.get_device_name())
PYEOF

rc=0
step() {  # step <timeout_s> <label> cmd...
    local t="$1" label="$2"; shift 2
    echo; echo "=== $label ==="
    local start=$SECONDS
    timeout "$t" "$@"; local r=$?
    echo "=== $label: rc=$r ($((SECONDS - start)) s) ==="
    if [ $r -ne 0 ] && [ $rc -eq 0 ]; then rc=$r; fi
}

step 240 "pytest tests/unit/attention/test_triton_paged.py (CUDA, native)" \
    "$PY" -m pytest tests/unit/attention/test_triton_paged.py -q -x -p no:cacheprovider --durations=5
step 200 "benchmark (quick)" "$PY" benchmarks/attention.py --quick --iters 10
step 120 "decode config sweep" "$PY" benchmarks/attention.py --sweep --iters 10
# the served-vLLM trace test (tests/runtimes/vllm/test_served_tp1.py) on a CUDA vLLM when one is installed:
# block size, attention backend and CUDA graphs are recorded in the trace header; async scheduling (on by
# default on CUDA) is turned off so check holds the synchronous schedule rules
if "$PY" -c "import vllm, torch; assert torch.cuda.is_available()" 2>/dev/null; then
    INFERTRACE_SERVED_ARGS="--no-async-scheduling" step 600 "served vLLM trace (CUDA)" \
        "$PY" -m pytest tests/runtimes/vllm/test_served_tp1.py -q -x -p no:cacheprovider
else
    echo "=== served vLLM trace: skipped (no CUDA vLLM importable) ==="
fi
exit $rc
