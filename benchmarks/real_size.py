"""A GGUF traced end to end by ``infertrace run`` beside llama.cpp on the same file (issue 20 goals):
peak RSS against the file size, time to the first token of a 32-token prompt, decode tokens/s.

    python benchmarks/real_size.py --model ~/.cache/infertrace/bench-models/llama-8b-random-Q4_K_M.gguf \\
        [--rounds 3] [--threads 1] [--prompt-tokens 32] [--new 16] [--ctx-size 512]

Contenders, each its own process, in alternating rounds (infertrace, llama.cpp, infertrace, ...):

* **infertrace**: the CLI as a user runs it, ``run -m FILE -p PROMPT -n NEW --dtype bfloat16 --threads T
  --ctx-size C --json`` with the default trace (``--weights auto``: the quantised path). TTFT = the
  trace's step 0 ``time_ms`` (prefill of the prompt and the first token, tracing included); decode
  tok/s = ``NEW - 1`` steps over the sum of steps 1.. ``time_ms``; load = process wall time minus the
  steps (imports, reading and packing the weights, writing the JSON).
* **llama.cpp**: llama-cpp-python on the same file (mmap, ``n_ctx`` = C, ``n_batch`` 512, ``n_threads``
  = T): ``eval`` of the same prompt ids then argmax (TTFT), then ``NEW - 1`` one-token ``eval`` calls.

Peak RSS: the child's ``ru_maxrss`` (``os.wait4``): the whole process, mapped file pages included.
The prompt is a text our tokenizer encodes to exactly ``--prompt-tokens`` ids (BOS included);
llama.cpp is fed those ids. Medians over rounds and the median of the per-round ratio are printed.
Nothing here is asserted: speed is measured, not tested.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the keeper counted ships and wrote each number in the blue ledger before the tide turned at dusk "
         "while gulls circled over the harbour wall").split()

LLAMA_CHILD = r"""
import json, sys, time
import numpy as np
import llama_cpp
path, ids, new, threads, ctx = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
t0 = time.perf_counter()
llm = llama_cpp.Llama(path, n_ctx=ctx, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
t1 = time.perf_counter()
llm.eval(ids)
tok = int(np.argmax(llm.scores[len(ids) - 1]))
t2 = time.perf_counter()
for i in range(new - 1):
    llm.eval([tok])
    tok = int(np.argmax(llm.scores[len(ids) + i]))
t3 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "ttft_s": t2 - t1, "decode_tps": (new - 1) / (t3 - t2)}))
"""


def prompt_text(model: Path, n_tokens: int) -> tuple[str, list[int]]:
    """A text of :data:`WORDS` that our tokenizer encodes to exactly ``n_tokens`` ids, and the ids."""
    sys.path.insert(0, str(ROOT))
    from infertrace.loading.model import load_model

    tok = load_model(model, tensors=False).tokenizer
    words: list[str] = []
    i = 0
    while True:
        words.append(WORDS[i % len(WORDS)])
        i += 1
        text = " ".join(words)
        ids = tok.encode(text)
        if len(ids) == n_tokens:
            return text, ids
        if len(ids) > n_tokens:  # a word added several tokens: trim characters until it fits
            while len(ids) > n_tokens and text:
                text = text[:-1]
                ids = tok.encode(text)
            if len(ids) == n_tokens:
                return text, ids
            raise SystemExit(f"cannot build a {n_tokens}-token prompt for {model.name}")


def run_child(cmd: list[str], env: dict[str, str]) -> tuple[str, float, int]:
    """(stdout, wall seconds, peak RSS in MiB) of one child process."""
    with tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode()
    if p.returncode != 0:
        raise SystemExit(f"{cmd[:4]} exited {p.returncode}")
    return text, wall, ru.ru_maxrss // 1024  # Linux: KiB -> MiB


def infertrace_round(model: Path, text: str, a: argparse.Namespace, env: dict[str, str]) -> dict[str, float]:
    cmd = [sys.executable, "-m", "infertrace.cli.app", "run", "-m", str(model), "-p", text, "-n", str(a.new),
           "--dtype", "bfloat16", "--threads", str(a.threads), "--ctx-size", str(a.ctx_size), "--ignore-eos", "--json"]
    out, wall, rss = run_child(cmd, env)
    tr = json.loads(out)
    ms = [s["time_ms"] for s in tr["steps"]]
    n_prompt = tr["steps"][0]["N"]
    if n_prompt != a.prompt_tokens:
        raise SystemExit(f"infertrace prefilled {n_prompt} tokens, not {a.prompt_tokens}")
    return {"load_s": wall - sum(ms) / 1000, "ttft_s": ms[0] / 1000, "decode_tps": (len(ms) - 1) / (sum(ms[1:]) / 1000),
            "peak_rss_mib": rss, "weights": tr["options"].get("weights", {}).get("weights", "float")}


def llamacpp_round(model: Path, ids: list[int], a: argparse.Namespace, env: dict[str, str]) -> dict[str, float]:
    out, _, rss = run_child([sys.executable, "-c", LLAMA_CHILD, str(model), json.dumps(ids), str(a.new),
                             str(a.threads), str(a.ctx_size)], env)
    return {**json.loads(out.strip().splitlines()[-1]), "peak_rss_mib": rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--ctx-size", type=int, default=512)
    ap.add_argument("--only", choices=("infertrace", "llama.cpp"), default=None)
    a = ap.parse_args()
    model = a.model.expanduser()
    size_mib = model.stat().st_size / 2**20
    text, ids = prompt_text(model, a.prompt_tokens)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    print(f"{model.name}: {size_mib:,.0f} MiB; prompt {len(ids)} tokens; {a.new} new tokens; {a.threads} thread(s) each; "
          f"ctx {a.ctx_size}; load average {os.getloadavg()[0]:.1f}", flush=True)
    rows: dict[str, list[dict]] = {"infertrace": [], "llama.cpp": []}
    for r in range(a.rounds):
        for who in ("infertrace", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "infertrace"):
            if a.only and who != a.only:
                continue
            res = infertrace_round(model, text, a, env) if who == "infertrace" else llamacpp_round(model, ids, a, env)
            rows[who].append(res)
            print(f"round {r} {who:10s} " + " ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items())
                  + f" (peak/file {res['peak_rss_mib'] / size_mib:.2f}x; load average {os.getloadavg()[0]:.1f})", flush=True)
    med = {w: {k: statistics.median(x[k] for x in v) for k in ("load_s", "ttft_s", "decode_tps", "peak_rss_mib")}
           for w, v in rows.items() if v}
    for w, m in med.items():
        print(f"median {w:10s} load {m['load_s']:.1f} s, TTFT {m['ttft_s']:.2f} s, decode {m['decode_tps']:.2f} tok/s, "
              f"peak RSS {m['peak_rss_mib']:,.0f} MiB = {m['peak_rss_mib'] / size_mib:.2f}x the file")
    if len(med) == 2:
        pairs = list(zip(rows["infertrace"], rows["llama.cpp"]))
        dec = statistics.median(i["decode_tps"] / l["decode_tps"] for i, l in pairs)
        ttft = statistics.median(i["ttft_s"] / l["ttft_s"] for i, l in pairs)
        print(f"ratios (median of per-round): decode infertrace/llama.cpp {dec:.2f}x (goal >= 0.5), "
              f"TTFT infertrace/llama.cpp {ttft:.2f}x (goal <= 2)")


if __name__ == "__main__":
    main()
