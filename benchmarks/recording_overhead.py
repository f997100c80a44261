"""What recording costs beside the runtime it records: llama.cpp alone (llama-cpp-python's own
``Llama.generate``) against ``run --engine llama.cpp`` (infertrace's scheduler driving llama.cpp,
the eval callback capturing, the recorder building each step's record), one thread each.

    python benchmarks/recording_overhead.py [--model smollm2-135m|PATH] [--tokens 64] [--rounds 5]

Contenders, on the same GGUF, greedy, one CPU thread each (``n_threads = n_threads_batch = 1``,
``torch.set_num_threads(1)``):

* ``llama.cpp alone``: ``llama_cpp.Llama(...).generate`` (temp 0), decode tokens after the first;
* ``--engine llama.cpp, trace off``: :class:`~infertrace.runtimes.llamacpp.engine.LlamaCppEngine`
  with the no-op tracer — the eval callback and our scheduler/sampler, no records;
* ``--engine llama.cpp, default trace``: the same with the :class:`~infertrace.capture.recorder.Recorder`
  of ``run --engine llama.cpp`` (every variable, layer 0, no ``--save``).

Decode speed = tokens after the first / time after prefill, in wall seconds and in this process's CPU
seconds (one thread: the CPU figure is the one that holds when other processes share the cores). Rounds
alternate the contenders
(this machine's speed drifts within minutes); each figure is the median over rounds and each ratio
the median of the per-round ratios. Nothing is asserted: speed is measured, not tested.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from infertrace.capture.recorder import Recorder
from infertrace.engine.options import EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.loading.registry import resolve_model
from infertrace.model.taps import NULL_TRACER
from infertrace.runner import load_model

PROMPT = "The capital of France is"


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _rates(k: int, t0: tuple[float, float]) -> tuple[float, float]:
    """``(tokens per wall second, tokens per CPU second)`` since ``t0`` (one thread: CPU time is the
    process's, the figure that holds when other processes share the cores)."""
    w, c = _clocks()
    return k / (w - t0[0]), k / max(1e-9, c - t0[1])


def plain_tps(llm, n: int) -> tuple[float, float]:
    """llama-cpp-python alone: ``generate`` greedy, ``n`` decode tokens after the first (prefill) one."""
    llm.reset()
    toks = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
    t0, k = None, 0
    for _ in llm.generate(toks, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        if t0 is None:
            t0 = _clocks()  # the first token: prefill done
            continue
        k += 1
        if k == n:
            break
    return _rates(k, t0)


def recorded_tps(loaded, n: int, trace: bool) -> tuple[float, float]:
    """``run --engine llama.cpp``'s engine, one thread: decode steps after the prefill step."""
    from infertrace.runtimes.llamacpp.engine import LlamaCppEngine

    tok = loaded.tokenizer
    tracer = Recorder(tok, loaded.config, layer=0, layers=[0]) if trace else NULL_TRACER
    e = LlamaCppEngine(loaded, EngineOptions(), tracer, layer=0, n_seq_max=1, n_threads=1)
    try:
        e.add_request(tok.encode(PROMPT), SamplingParams(max_new_tokens=n + 1, ignore_eos=True))
        e.step()  # prefill + first token
        t0, steps = _clocks(), 0
        while e.step() is not None:
            steps += 1
        return _rates(steps, t0)
    finally:
        e.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model name or GGUF path (default smollm2-135m)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    import llama_cpp

    torch.set_num_threads(1)
    path = resolve_model(a.model)
    loaded = load_model(path)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=EngineOptions.ctx_size, n_threads=1, n_threads_batch=1,
                          verbose=False)
    names = ["llama.cpp alone", "--engine llama.cpp, trace off", "--engine llama.cpp, default trace"]
    fns = [lambda: plain_tps(llm, a.tokens), lambda: recorded_tps(loaded, a.tokens, False),
           lambda: recorded_tps(loaded, a.tokens, True)]
    for f in fns:  # warm-up
        f()
    runs: dict[str, list[tuple[float, float]]] = {nm: [] for nm in names}
    for r in range(a.rounds):
        order = list(range(len(names))) if r % 2 == 0 else list(reversed(range(len(names))))
        for i in order:
            runs[names[i]].append(fns[i]())
    print(f"model {path.name}, {a.tokens} decode tokens, {a.rounds} alternating rounds, one thread each, "
          f"llama-cpp-python {llama_cpp.__version__}")
    base = runs[names[0]]
    print(f"{'decode tokens/s':<36} {'wall median':>11} {'min':>6} {'max':>6} {'ratio':>6}   "
          f"{'CPU median':>10} {'min':>6} {'max':>6} {'ratio':>6}")
    for nm in names:
        cols = []
        for j in (0, 1):  # wall, CPU
            xs = [r[j] for r in runs[nm]]
            ratio = statistics.median(r[j] / b[j] for r, b in zip(runs[nm], base))
            cols.append(f"{statistics.median(xs):{11 - j}.1f} {min(xs):6.1f} {max(xs):6.1f} {ratio:5.2f}x")
        print(f"{nm:<36} {cols[0]}   {cols[1]}")


if __name__ == "__main__":
    main()
