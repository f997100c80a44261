"""Decode tokens/s on the default model: engine (tracing off), engine (default trace), and HF
transformers on the same GGUF, in one run, printed with ratios; then decode beside one competing
busy process, with torch's default thread count ("before") and infertrace's policy ("after").

    python benchmarks/decode.py [--model smollm2-135m|gemma3-270m|PATH] [--tokens 64] [--repeats 3] [--dtype float32]
        [--skip-hf] [--skip-fp16] [--skip-load]

Decode speed = generated tokens after the first / time spent after prefill. This machine's speed
drifts by 2x within minutes, so contenders are not timed in blocks: every repeat runs each
contender once, in turn, and each ratio is the median over repeats of the per-repeat ratio
(same minute, same machine state); absolute figures are medians too.

Under load: per repeat, one quiet run and one run beside a busy process (a Python loop spinning
on one core, started before the thread count is chosen, as a user's next command would meet it),
alternating; retention = median of loaded / quiet per pair. "default" keeps torch's thread count;
"policy" applies :func:`infertrace.threads.choose_threads` before each run. Nothing here is
asserted: speed is measured, not tested.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.model.taps import NULL_TRACER
from infertrace.loading.registry import resolve_model
from infertrace.runner import load_model
from infertrace.threads import choose_threads
from infertrace.capture.recorder import Recorder

PROMPT = "The capital of France is"


def engine_decode_tps(loaded, n: int, trace: bool, backend: str) -> float:
    tok = loaded.tokenizer
    tracer = Recorder(tok, loaded.config) if trace else NULL_TRACER
    e = Engine(loaded.model, tok, EngineOptions(backend=backend), tracer)
    e.add_request(tok.encode(PROMPT), SamplingParams(max_new_tokens=n + 1, ignore_eos=True))
    e.step()  # prefill + first token
    t0 = time.perf_counter()
    steps = 0
    while e.step() is not None:
        steps += 1
    return steps / (time.perf_counter() - t0)


class HF:
    """HF transformers on the same GGUF (float32), loaded once."""

    def __init__(self, p) -> None:
        import transformers

        self.tok = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                                       dtype=torch.float32).eval()
        self.ids = self.tok(PROMPT, return_tensors="pt").input_ids
        self._gen(2)

    def _gen(self, k: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            self.model.generate(self.ids, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                pad_token_id=self.tok.eos_token_id)
        return time.perf_counter() - t0

    def decode_tps(self, n: int) -> float:
        t_prefill = self._gen(1)
        t_all = self._gen(n + 1)
        return n / max(1e-9, t_all - t_prefill)


def busy_process() -> subprocess.Popen:
    """One competing process spinning a Python loop (one core), until killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def under_load(loaded, a, policy: bool, default_threads: int) -> tuple[list[float], list[float], list[int], list[int]]:
    """Alternating quiet / loaded runs; returns tok/s lists and the thread counts used."""
    quiet, busy, th_q, th_b = [], [], [], []
    for _ in range(a.repeats):
        for loaded_run in (False, True):
            p = busy_process() if loaded_run else None
            try:
                if p is not None:
                    time.sleep(0.5)  # the busy loop is running before the thread count is chosen
                n = choose_threads().n if policy else default_threads
                torch.set_num_threads(n)
                v = engine_decode_tps(loaded, a.tokens, False, a.backend)
            finally:
                if p is not None:
                    p.kill()
                    p.wait()
            (busy if loaded_run else quiet).append(v)
            (th_b if loaded_run else th_q).append(n)
    torch.set_num_threads(default_threads)
    return quiet, busy, th_q, th_b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", help="engine weight dtype (float32, float16, bfloat16)")
    ap.add_argument("--backend", default="cells")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--model", default=None, help="model name (smollm2-135m, gemma3-270m) or path; default smollm2-135m")
    ap.add_argument("--skip-fp16", action="store_true", help="do not also measure the engine in float16")
    ap.add_argument("--skip-load", action="store_true", help="skip the runs beside a busy process")
    ap.add_argument("--threads", type=int, default=None, help="threads for the first table (default: the policy)")
    a = ap.parse_args()
    path = resolve_model(a.model)
    default_threads = torch.get_num_threads()
    choice = choose_threads(a.threads)
    torch.set_num_threads(choice.n)
    print(f"torch {torch.__version__}, default threads {default_threads}, first table on {choice.n} ({choice.reason}), "
          f"model {path.name}, {a.tokens} decode tokens, {a.repeats} alternating repeats")
    models = {dtype: load_model(path, dtype=dtype) for dtype in dict.fromkeys([a.dtype] + ([] if a.skip_fp16 else ["float16"]))}
    for loaded in models.values():
        engine_decode_tps(loaded, 4, False, a.backend)  # warm-up
    hf = None if a.skip_hf else HF(path)
    contenders = [(f"infertrace {a.backend} {dt}, trace {'default' if tr else 'off'}", dt, tr)
                  for dt in models for tr in (False, True)]
    results: dict[str, list[float]] = {name: [] for name, _, _ in contenders}
    results["HF transformers float32 (same GGUF)"] = []
    for _ in range(a.repeats):  # one of each per repeat, in turn
        for name, dt, tr in contenders:
            results[name].append(engine_decode_tps(models[dt], a.tokens, tr, a.backend))
        if hf is not None:
            results["HF transformers float32 (same GGUF)"].append(hf.decode_tps(a.tokens))
    hf_runs = results["HF transformers float32 (same GGUF)"]
    w = max(len(n) for n in results)
    print(f"\n{'decode tokens/s':<{w}}  {'median':>7}  {'min':>6}  {'max':>6}  {'vs HF (median of pairs)':>24}")
    for name, runs in results.items():
        if not runs:
            continue
        ratio = f"{statistics.median(x / y for x, y in zip(runs, hf_runs)):.2f}x" if hf_runs else "-"
        print(f"{name:<{w}}  {statistics.median(runs):7.1f}  {min(runs):6.1f}  {max(runs):6.1f}  {ratio:>24}")
    for dt in models:
        off, on = results[f"infertrace {a.backend} {dt}, trace off"], results[f"infertrace {a.backend} {dt}, trace default"]
        over = statistics.median(1 - y / x for x, y in zip(off, on))
        print(f"tracing overhead ({dt}, median of pairs): {100 * over:.1f}% slower with the default trace")
    if a.skip_load:
        return
    print(f"\ndecode beside one busy process (engine {a.backend} {a.dtype}, trace off; quiet/loaded alternating)")
    print(f"{'threads':<34}  {'quiet tok/s':>11}  {'loaded tok/s':>12}  {'kept (median of pairs)':>22}")
    for label, policy in ((f"torch default ({default_threads}), before", False), ("infertrace policy, after", True)):
        q, b, tq, tb = under_load(models[a.dtype], a, policy, default_threads)
        kept = statistics.median(y / x for x, y in zip(q, b))
        used = f"{label} [{','.join(map(str, tq))} | {','.join(map(str, tb))}]"
        print(f"{used:<34}  {statistics.median(q):11.1f}  {statistics.median(b):12.1f}  {100 * kept:21.0f}%"
              f"{'  (goal >= 40%: met)' if kept >= 0.4 else '  (goal >= 40%: not met)'}")


if __name__ == "__main__":
    main()
