"""What recording costs beside the runtime it records, one runtime per process:

    python benchmarks/recording_overhead.py --runtime llama.cpp [--model smollm2-135m|PATH] [--tokens 64] [--rounds 5]
    python benchmarks/recording_overhead.py --runtime vllm [--dtype float32|bfloat16]
    python benchmarks/recording_overhead.py --runtime ours [--dtype float32|bfloat16]

Contenders per ``--runtime``, on the same model, the same prompt, greedy (the token ids of every
contender are compared and printed; a mismatch is reported, not hidden):

* ``llama.cpp``: llama.cpp alone (llama-cpp-python's ``Llama.generate``, temp 0) against ``run --runtime
  llama.cpp``'s engine (:class:`~infertrace.runtimes.llamacpp.engine.LlamaCppEngine`: our scheduler,
  llama.cpp's forward, the eval callback) with the tracer off and with the default trace (the
  :class:`~infertrace.capture.recorder.Recorder` of ``run``: every variable, layer 0, no ``--save``);
  one thread each (``n_threads = n_threads_batch = 1``, ``torch.set_num_threads(1)``);
  ``--python-ask`` adds the same two with the eval callback's questions answered in Python (before/after
  the C ask filter, in the same alternating rounds).
* ``vllm``: vLLM alone (its own ``LLMEngine.add_request`` / ``step`` on the converted model, no hook
  installed, vLLM's own scheduler) against ``run --runtime vllm``'s driver
  (:func:`~infertrace.runtimes.vllm.engine.drive`: the capture hooks in the worker, the scheduler
  wrapper, one ``EngineCore.step`` per step) with a recorder that records nothing ("trace off") and
  with the default trace; one vLLM engine in this process, the hooks removed for the plain rounds.
* ``ours``: llama.cpp alone (the reference speed) against our engine (:class:`~infertrace.engine.engine.Engine`,
  ``--weights auto``) with the tracer off and with the default trace, one thread each.

Decode speed = tokens after the first / time after the first step (prefill + first token, its record
included), in wall seconds and in this process's CPU seconds (one thread: the CPU figure holds when
other processes share the cores; vLLM's OpenMP threads are counted in its CPU time). Rounds alternate
the contenders (order reversed every other round); each figure is the median over rounds, with min/max,
and each ratio the median of the per-round ratios to the first contender. The load average is printed
before and after. Nothing is asserted: speed is measured, not tested.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

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
    """``(tokens per wall second, tokens per CPU second)`` since ``t0``."""
    w, c = _clocks()
    return k / (w - t0[0]), k / max(1e-9, c - t0[1])


# ---------------------------------------------------------------------------------------------- llama.cpp
def plain_llamacpp(llm: Any, n: int) -> tuple[float, float, list[int]]:
    """llama-cpp-python alone: ``generate`` greedy, ``n`` decode tokens after the first (prefill) one."""
    llm.reset()
    toks = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
    t0, k, out = None, 0, []
    for t in llm.generate(toks, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        out.append(int(t))
        if t0 is None:
            t0 = _clocks()  # the first token: prefill done
            continue
        k += 1
        if k == n:
            break
    return (*_rates(k, t0), out)


def _engine_tps(e: Any, tok: Any, n: int) -> tuple[float, float, list[int]]:
    """Drive an engine of ours (``add_request`` / ``step``): decode steps after the prefill step."""
    req = e.add_request(tok.encode(PROMPT), SamplingParams(max_new_tokens=n + 1, ignore_eos=True))
    e.step()  # prefill + first token
    t0, steps = _clocks(), 0
    while e.step() is not None:
        steps += 1
    out = list(getattr(req, "output_ids", []) or [])
    return (*_rates(steps, t0), out)


def recorded_llamacpp(loaded: Any, n: int, trace: bool, python_ask: bool = False) -> tuple[float, float, list[int]]:
    """``run --runtime llama.cpp``'s engine, one thread (``python_ask``: the eval callback's questions answered
    in Python, ``INFERTRACE_NO_CEXT=1``, instead of by the C filter of ``runtimes/llamacpp/ask_filter.py``)."""
    from infertrace.runtimes.llamacpp import ask_filter
    from infertrace.runtimes.llamacpp.engine import LlamaCppEngine

    os.environ["INFERTRACE_NO_CEXT"] = "1" if python_ask else "0"
    ask_filter._TRIED = False
    tracer = Recorder(loaded.tokenizer, loaded.config, layer=0, layers=[0]) if trace else NULL_TRACER
    e = LlamaCppEngine(loaded, EngineOptions(), tracer, layer=0, n_seq_max=1, n_threads=1)
    try:
        return _engine_tps(e, loaded.tokenizer, n)
    finally:
        e.close()


def ours(loaded: Any, n: int, trace: bool) -> tuple[float, float, list[int]]:
    """Our engine (``run``'s default engine), one torch thread."""
    from infertrace.engine.engine import Engine

    tracer = Recorder(loaded.tokenizer, loaded.config, layer=0, layers=[0]) if trace else NULL_TRACER
    return _engine_tps(Engine(loaded.model, loaded.tokenizer, EngineOptions(), tracer), loaded.tokenizer, n)


# ---------------------------------------------------------------------------------------------- vLLM
class _Off(Recorder):
    """``run --runtime vllm`` with nothing recorded: the capture hooks and the driver run, no step record."""

    enabled = False

    def begin_step(self) -> None:
        return None

    def end_step(self, ctx: Any) -> None:
        return None

    def tap(self, name: str, **tensors: Any) -> None:
        return None


def _detach(worker: Any) -> None:
    """``collective_rpc`` target: remove the capture hooks of ``runtimes/vllm/capture.py`` from the worker."""
    from infertrace.runtimes.vllm.capture import ATTR

    cap = getattr(worker, ATTR, None)
    if cap is not None:
        for h in cap.handles:
            h.remove()
        del cap.attn.impl.do_kv_cache_update  # the instance attribute: vLLM's own method again
        setattr(worker, ATTR, None)


def _timed_steps(step: Callable[[], Any], done: Callable[[], bool]) -> tuple[float, float]:
    """Step until ``done``; returns the clocks after the first step."""
    step()
    t0 = _clocks()
    while not done():
        step()
    return t0


def plain_vllm(run: Any, ids: list[int], n: int, tag: list[int]) -> tuple[float, float, list[int]]:
    """vLLM alone: its engine's own ``add_request`` / ``step`` (no hook, its own scheduler method)."""
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    tag[0] += 1
    rid, out = f"plain{tag[0]}", []
    run.eng.add_request(rid, TokensPrompt(prompt_token_ids=list(ids)),
                        VSP(max_tokens=n + 1, temperature=0.0, ignore_eos=True))
    fin = [False]

    def step() -> None:
        for o in run.eng.step():
            if o.request_id == rid and o.finished:
                fin[0] = True
                out.extend(o.outputs[0].token_ids)

    t0 = _timed_steps(step, lambda: fin[0])
    return (*_rates(n, t0), out)


def recorded_vllm(run: Any, loaded: Any, ids: list[int], n: int, trace: bool) -> tuple[float, float, list[int]]:
    """``run --runtime vllm``'s driver on the shared engine (hooks installed for the call)."""
    from infertrace.engine.request import Request
    from infertrace.runtimes.vllm import engine as veng

    sched, wrapper = run.sched, run._wrapped_schedule
    run.llm.collective_rpc(run.capture.install, args=(run.layer,))
    sched.schedule = wrapper
    tracer = (Recorder if trace else _Off)(loaded.tokenizer, loaded.config, layer=0, layers=[0])
    req = Request(0, list(ids), SamplingParams(max_new_tokens=n + 1, ignore_eos=True).validate(), 0, PROMPT)
    times: list[tuple[float, float]] = []
    real = veng._vllm_step

    def timed(r: Any, step: int) -> Any:
        times.append(_clocks())
        return real(r, step)

    veng._vllm_step = timed
    try:
        veng.drive(run, [req], tracer)
    finally:
        veng._vllm_step = real
        run.llm.collective_rpc(_detach)
        del sched.schedule  # vLLM's own method for the plain rounds
    return (*_rates(n, times[1]), list(req.output_ids))


def vllm_contenders(loaded: Any, path: Any, n: int, dtype: str) -> tuple[list[str], list[Callable[[], Any]], str]:
    from infertrace.runtimes.vllm.convert import hf_dir_for
    from infertrace.runtimes.vllm import vllm_version
    from infertrace.runtimes.vllm.engine import VllmRun

    run = VllmRun(hf_dir_for(path), EngineOptions(), dtype, 0, 1, n_requests=1)
    run._wrapped_schedule = run.sched.schedule  # type: ignore[attr-defined]
    del run.sched.schedule
    run.llm.collective_rpc(_detach)
    ids, tag = loaded.tokenizer.encode(PROMPT), [0]
    names = ["vLLM alone", "--runtime vllm, trace off", "--runtime vllm, default trace"]
    fns = [lambda: plain_vllm(run, ids, n, tag), lambda: recorded_vllm(run, loaded, ids, n, False),
           lambda: recorded_vllm(run, loaded, ids, n, True)]
    return names, fns, f"vLLM {vllm_version()} {dtype}, VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')}"


# ---------------------------------------------------------------------------------------------- main
def _llm(path: Any) -> Any:
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), n_ctx=EngineOptions.ctx_size, n_threads=1, n_threads_batch=1, verbose=False)


def contenders(a: Any, path: Any) -> tuple[list[str], list[Callable[[], Any]], str]:
    n = a.tokens
    if a.runtime == "vllm":
        return vllm_contenders(load_model(path, tensors=False), path, n, a.dtype)
    import llama_cpp

    llm = _llm(path)
    base = f"llama-cpp-python {llama_cpp.__version__}, one thread each"
    if a.runtime == "llama.cpp":
        loaded = load_model(path, tensors=False)
        names = ["llama.cpp alone", "--runtime llama.cpp, trace off", "--runtime llama.cpp, default trace"]
        fns = [lambda: plain_llamacpp(llm, n), lambda: recorded_llamacpp(loaded, n, False),
               lambda: recorded_llamacpp(loaded, n, True)]
        if a.python_ask:
            names += ["  same, Python ask path, trace off", "  same, Python ask path, default trace"]
            fns += [lambda: recorded_llamacpp(loaded, n, False, True), lambda: recorded_llamacpp(loaded, n, True, True)]
        return names, fns, base
    from infertrace.loading.model import resolve_weights

    w = resolve_weights("auto", path, a.dtype, "cpu")
    loaded = load_model(path, dtype=a.dtype, weights=w)
    names = ["llama.cpp alone", f"ours {a.dtype} ({w}), trace off", f"ours {a.dtype} ({w}), default trace"]
    return names, [lambda: plain_llamacpp(llm, n), lambda: ours(loaded, n, False), lambda: ours(loaded, n, True)], base


def report(names: list[str], runs: dict[str, list[tuple[float, float, list[int]]]]) -> None:
    base = runs[names[0]]
    print(f"{'decode tokens/s':<40} {'wall median':>11} {'min':>6} {'max':>6} {'ratio':>6}   "
          f"{'CPU median':>10} {'min':>6} {'max':>6} {'ratio':>6}")
    for nm in names:
        cols = []
        for j in (0, 1):  # wall, CPU
            xs = [r[j] for r in runs[nm]]
            ratio = statistics.median(r[j] / b[j] for r, b in zip(runs[nm], base))
            cols.append(f"{statistics.median(xs):{11 - j}.1f} {min(xs):6.1f} {max(xs):6.1f} {ratio:5.2f}x")
        print(f"{nm:<40} {cols[0]}   {cols[1]}")
    toks = {nm: runs[nm][-1][2] for nm in names}
    ref = toks[names[0]]
    for nm in names[1:]:
        m = min(len(ref), len(toks[nm]))
        same = next((i for i in range(m) if ref[i] != toks[nm][i]), m)
        print(f"greedy tokens, {nm} vs {names[0]}: {'identical' if same == m and m else f'first {same} of {m} equal'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime", choices=("llama.cpp", "vllm", "ours"), default="llama.cpp")
    ap.add_argument("--model", default=None, help="model name or GGUF path (default smollm2-135m)")
    ap.add_argument("--dtype", default="float32", help="vllm / ours: compute dtype (float32, bfloat16)")
    ap.add_argument("--python-ask", action="store_true",
                    help="llama.cpp: also the Python ask path (INFERTRACE_NO_CEXT=1), the code before the C filter")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    path = resolve_model(a.model)
    load0 = os.getloadavg()
    names, fns, what = contenders(a, path)
    for f in fns:  # warm-up
        f()
    runs: dict[str, list[Any]] = {nm: [] for nm in names}
    for r in range(a.rounds):
        order = list(range(len(names))) if r % 2 == 0 else list(reversed(range(len(names))))
        for i in order:
            runs[names[i]].append(fns[i]())
    load1 = os.getloadavg()
    print(f"model {path.name}, {a.tokens} decode tokens, {a.rounds} alternating rounds, {what}; load average "
          f"{load0[0]:.1f} before, {load1[0]:.1f} after ({load1[1]:.1f} over 5 min)")
    report(names, runs)


if __name__ == "__main__":
    main()
