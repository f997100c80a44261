"""Speculative decoding on the default model: tokens per target forward and decode tokens/s with
and without it, in one run, as ratios.

    python benchmarks/speculative.py [--model smollm2-135m|PATH] [--tokens 48] [--repeats 3]
        [--k 3] [--draft-layers 20] [--backend cells|paged]

Two scenarios, each against plain greedy decoding of the same prompt:

* ``ngram`` -- prompt lookup on a repetitive prompt (a list the model keeps repeating);
* ``layer-skip`` -- the target's first ``--draft-layers`` layers as the draft model, on a plain prompt.

Decode speed = generated tokens after the first / time after the prefill step; tokens per target
forward = those tokens / decode steps (one target forward each; draft forwards are extra work
inside a step). Contenders alternate run by run (the order flips every repeat) and each ratio is
the median over repeats of the per-repeat ratio (same minute, same machine state). The greedy
outputs of both contenders are compared (lossless). Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.runner import load_model

PROMPTS = {
    "ngram": "Colors: red, green, blue, yellow, red, green, blue, yellow, red, green, blue, yellow, red, green,",
    "layer-skip": "The history of the Roman Empire began when",
}


def run_once(loaded, prompt: str, n: int, backend: str, spec: dict | None) -> dict:
    tok = loaded.tokenizer
    e = Engine(loaded.model, tok, EngineOptions(backend=backend, **(spec or {})))
    e.add_request(tok.encode(prompt), SamplingParams(max_new_tokens=n + 1, ignore_eos=True))
    e.step()  # prefill + first token
    t0 = time.perf_counter()
    steps = 0
    while e.step() is not None:
        steps += 1
    dt = time.perf_counter() - t0
    r = e.requests[0]
    return {"tokens": len(r.output_ids) - 1, "steps": steps, "tps": (len(r.output_ids) - 1) / dt, "out": list(r.output_ids),
            "summary": e.spec.summary() if e.spec is not None else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--draft-layers", type=int, default=20)
    ap.add_argument("--backend", default="cells")
    a = ap.parse_args()
    loaded = load_model(a.model)
    scen = {"ngram": {"speculative": "ngram", "num_spec_tokens": a.k},
            "layer-skip": {"speculative": "draft", "draft_layers": a.draft_layers, "num_spec_tokens": a.k}}
    print(f"model {loaded.config.name} · backend {a.backend} · {a.tokens} decode tokens · K={a.k} · "
          f"draft layers {a.draft_layers}/{loaded.config.n_layer} · {a.repeats} repeats, contenders alternated")
    for name, spec in scen.items():
        ratios_tps, ratios_tpf, plain_tps, spec_tps, tpf, same = [], [], [], [], [], True
        acc = None
        for rep in range(a.repeats):
            order = [None, spec] if rep % 2 == 0 else [spec, None]
            res = {}
            for s in order:
                res["spec" if s else "plain"] = run_once(loaded, PROMPTS[name], a.tokens, a.backend, s)
            p, q = res["plain"], res["spec"]
            same &= p["out"] == q["out"]
            plain_tps.append(p["tps"])
            spec_tps.append(q["tps"])
            tpf.append(q["tokens"] / q["steps"])
            ratios_tps.append(q["tps"] / p["tps"])
            ratios_tpf.append((q["tokens"] / q["steps"]) / (p["tokens"] / p["steps"]))
            acc = q["summary"]["requests"]["0"]["acceptance_by_pos"]
        med = statistics.median
        print(f"{name:10s} tokens/target forward {med(tpf):.2f} (plain 1.00) · ratio {med(ratios_tpf):.2f}x · "
              f"decode tok/s plain {med(plain_tps):.1f} spec {med(spec_tps):.1f} · ratio {med(ratios_tps):.2f}x "
              f"(per repeat {', '.join(f'{r:.2f}' for r in ratios_tps)}) · acceptance by draft position "
              f"{acc} · greedy outputs identical: {same}")


if __name__ == "__main__":
    main()
