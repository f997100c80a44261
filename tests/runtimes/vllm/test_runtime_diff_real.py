"""Real llama.cpp and vLLM traces of SmolLM2, the same two identical prompts, vLLM with its prefix cache on
(issue 31 items 2, 3, 4 and 9; the commands of docs/debugging.md).

* `diff LLAMACPP VLLM`: the positions vLLM served from its prefix cache for the second request are compared
  where the first request computed them, said once, and counted consistently (per request = in all);
* the K/V at each (request, position) both traces hold are compared against the noise floor;
* `diff VLLM --seq 0 --seq 1`: what the second identical request read, who wrote it, its block table;
* `run --runtime vllm` names vLLM's own log in one line and keeps its warnings out of the output.

Reference values from the runtimes' own records: vLLM's scheduler output (``vllm.scheduler.new`` ->
``num_computed_tokens``) and attention metadata (``block_table``), llama.cpp's / vLLM's K/V cache tensors.
Worked by hand: the prompt is 40 tokens (HF's tokenizer on the GGUF); vLLM's blocks hold 32, so the second
request finds one full hashed block: a hit of 32 tokens, positions 0..31, and it computes 32..39.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

PROMPT = ("The capital of France is Paris, the capital of Italy is Rome, the capital of Germany is Berlin, the capital "
          "of Portugal is Lisbon, the capital of Austria is Vienna. The capital of Spain is")
RUN = ["-p", PROMPT, "-p", PROMPT, "--arrival", "0", "--arrival", "3", "-n", "4"]


def cli(*args, env=None):
    e = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "infertrace", *map(str, args)], capture_output=True, text=True, timeout=900,
                          env=e)


@pytest.fixture(scope="module")
def traces(tmp_path_factory, llama_cpp):
    pytest.importorskip("vllm", reason="vLLM is installed by make setup-dev (the vllm extra)")
    d = tmp_path_factory.mktemp("rt")
    log = d / "vllm.log"
    v = cli("run", "--runtime", "vllm", *RUN, "--prefix-cache", "on", "--save", d / "vl", env={"INFERTRACE_VLLM_LOG": str(log)})
    assert v.returncode == 0, v.stderr[-3000:]
    lc = cli("run", "--runtime", "llama.cpp", *RUN, "--save", d / "lc")
    assert lc.returncode == 0, lc.stderr[-3000:]
    return d, v, log


def _m(p: Path) -> dict:
    return json.loads((p / "trace.json").read_text())


def test_prompt_is_40_tokens(hf_smol):
    tok, _ = hf_smol
    assert len(tok(PROMPT).input_ids) == 40


def test_vllm_log_is_named_in_one_line(traces):
    d, v, log = traces
    lines = [x for x in v.stderr.splitlines() if "vLLM" in x]
    assert lines == [f"vLLM's own log (its warnings and progress bars): {log}"]
    assert "WARNING" not in v.stdout and "WARNING" not in v.stderr
    assert "WARNING" in log.read_text()  # vLLM's own warnings (e.g. enforce eager disables torch.compile) are there
    assert "per-step panels" in v.stdout.splitlines()[-1]  # the default output: table and summary


def test_prefix_hit_is_compared_where_it_was_computed(traces):
    d, *_ = traces
    vl = _m(d / "vl")
    hit = {e["seq_id"]: e["num_computed_tokens"] for s in vl["steps"] for e in s["vllm"]["scheduler"]["new"]}
    assert hit == {0: 0, 1: 32}  # vLLM's own scheduler: seq 1 starts with 32 computed tokens
    res = cli("diff", d / "lc", d / "vl")
    assert res.returncode == 0, res.stdout[-3000:]
    out = res.stdout
    assert "positions 0..31 served from B's prefix cache (hit 32 tokens at step 3): compared where seq 0 computed them" in out
    assert "not computed" not in out and "logical variables: identical" in out
    js = json.loads(cli("diff", d / "lc", d / "vl", "--json").stdout)
    r1 = next(r for r in js["cross_engine"]["requests"] if r["seq_id"] == 1)
    assert r1["served"]["b"]["count"] == hit[1] and r1["served"]["b"]["by_seq"] == [0]
    assert r1["positions_compared"] == r1["required"] == 40 + 4 - 1


def test_counts_agree_when_a_served_position_differs(traces, tmp_path):
    """Seq 0's token at position 5 changed by hand in vLLM's trace: seq 0 differs there, and seq 1 -- which was
    served position 5 from seq 0's blocks -- differs there too; per-request counts sum to the total."""
    d, *_ = traces
    bad = tmp_path / "vl"
    shutil.copytree(d / "vl", bad)
    m = _m(bad)
    row = next(r for s in m["steps"] for r in s["batch"] if r["seq_id"] == 0 and r["phase"] == "prefill")
    row["token_ids"][5] += 1
    (bad / "trace.json").write_text(json.dumps(m))
    js = json.loads(cli("diff", d / "lc", bad, "--json", "--no-tensors").stdout)
    per = {r["seq_id"]: r["differences"] for r in js["cross_engine"]["requests"]}
    assert per == {0: 1, 1: 1} and js["count"] == 2
    text = cli("diff", d / "lc", bad, "--no-tensors").stdout
    assert "seq 1 · tokens · at[5].token" in text and "served from the prefix cache (computed by seq 0 at step 0)" in text
    assert "logical variables: 2 difference(s)" in text and "seq 0: 43 positions compared (43 required); logits rows 4 " \
        "(same top-1 4); 1 difference(s)" in text


def test_kv_compared_against_the_noise_floor(traces):
    from infertrace.trace.kv_rows import compare_kv, kv_floor, kv_rows
    from infertrace.trace.store import load_tensors, read_manifest

    d, *_ = traces
    ma, mb = read_manifest(d / "lc"), read_manifest(d / "vl")
    ta, tb = load_tensors(d / "lc", ma), load_tensors(d / "vl", mb)
    # independently: each runtime's own cache of seq 1 after its last step, layer 0, by position
    ka = np.asarray(ta.array("step6/layer0/seq1/k_cache"), np.float32)  # llama.cpp F16 cache, [43, 3, 64]
    kb = np.asarray(tb.array("step6/layer0/seq1/k_cache"), np.float32)  # vLLM float32 cache
    assert ka.shape == kb.shape == (43, 3, 64)
    js = json.loads(cli("diff", d / "lc", d / "vl", "--json").stdout)
    kv = js["cross_engine"]["kv"]
    assert kv["positions"] == 86 and kv["n_over"] == 0 and kv["sources"] == ["kept tensors"]
    mk = max(float(np.abs(np.asarray(ta.array(f"step{s}/layer0/seq{q}/k_cache"), np.float32)
                          - np.asarray(tb.array(f"step{s}/layer0/seq{q}/k_cache"), np.float32)).max()) for s, q in ((3, 0), (6, 1)))
    assert kv["max_abs_k"] == pytest.approx(mk) and kv["max_abs_k"] == pytest.approx(float(np.abs(ka - kb).max()))
    assert 1e-4 < kv["max_abs_k"]  # Q4_1 + F16 (llama.cpp) vs float32 (vLLM): really different, inside the floor
    rel, how = kv_floor(ma, mb)
    assert "f16 cache" in how and "8-bit activations" in how
    # the floor separates numerics from a real error: the K/V one position off (RoPE at the wrong position) is far over
    ra, _ = kv_rows(ma, ta, 1)
    rb, _ = kv_rows(mb, tb, 1)
    off = compare_kv(ra, rb, [(j, j + 1) for j in range(42)], rel)
    assert off["n_over"] == 42
    assert "K/V (layer 0, kept tensors): 86 (request, position) pairs" in cli("diff", d / "lc", d / "vl").stdout


def test_second_identical_request_inside_the_vllm_trace(traces):
    d, *_ = traces
    vl = _m(d / "vl")
    tables = {}
    for s in vl["steps"]:
        qsl = s["vllm"]["attn_metadata"]["query_start_loc"]
        for i, r in enumerate(s["batch"]):
            tables[r["seq_id"]] = (s["vllm"]["attn_metadata"]["block_table"][i], s["step"])
    res = cli("diff", d / "vl", "--seq", "0", "--seq", "1")
    assert res.returncode == 0, res.stdout
    out = res.stdout
    assert "served from the prefix cache for seq 1: positions 0..31 (32), computed by seq 0 at step 0" in out
    shared = [b for b in tables[0][0] if b in tables[1][0]]
    assert shared == tables[1][0][:1]  # vLLM's own tables: the hit's one full block is shared
    assert (f"blocks read (last chunk): seq 0 {tables[0][0]} (step {tables[0][1]}) · seq 1 {tables[1][0]} "
            f"(step {tables[1][1]}) · shared {shared}") in out
    js = json.loads(cli("diff", d / "vl", "--seq", "0", "--seq", "1", "--json").stdout)
    assert js["kv"]["positions"] == 43 and js["kv"]["max_abs_k"] == 0.0  # served = the same slots; the rest recomputed equal
    assert js["logits"]["rows"] == 4 and js["logits"]["same_top"] == 4


def test_report_of_the_vllm_run_names_the_hit(traces, tmp_path):
    d, *_ = traces
    vl = _m(d / "vl")
    p = next(p for s in vl["steps"] for sid, p in ((s.get("serving") or {}).get("prefix") or {}).items() if sid == "1")
    blocks = vl["steps"][3]["vllm"]["attn_metadata"]["block_table"][1][:1]  # vLLM's table of seq 1: its hit block
    assert p["hit"] == 32 and p["shared_blocks"] == blocks
    out = tmp_path / "r.html"
    assert cli("report", d / "vl", "-o", out).returncode == 0
    import html

    page = html.unescape(out.read_text(encoding="utf-8"))
    assert f"seq 1 at step 3: 32 of 40 tokens, blocks {blocks} shared" in page and "hit 0..31" in page
