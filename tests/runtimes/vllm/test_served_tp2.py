"""A real ``vllm serve --tensor-parallel-size 2`` (two worker processes, one core each, vLLM's ``mp``
executor) recorded by the plugin in each worker: per-rank KV heads and cache shards, the same metadata on
both ranks, vLLM's cached-token count and tokens, ``check`` and the paged replay. The model is a tiny
random Llama whose heads divide by 2 (4 heads, 2 KV heads; SmolLM2's 9 heads do not, vLLM refuses TP=2
for it). ``--distributed-executor-backend ray`` is refused by vLLM's CPU build itself (``current platform cpu does not
support ray``, vllm/v1/executor/ray_utils.py; docs/runtimes/vllm-serve.md)."""

from __future__ import annotations

import concurrent.futures as cf
import json
from pathlib import Path

import pytest

from tests.helpers.vllm_served import Server, cli

pytestmark = [pytest.mark.model, pytest.mark.vllm, pytest.mark.needs_vllm]

B = 32
P = "abcdefgh " * 8  # byte-level tiny tokenizer: ~72 tokens, two full blocks


def _complete(c, prompt: str, label: str | None) -> dict:
    xb = {"return_tokens_as_token_ids": True, **({"vllm_xargs": {"infertrace": label}} if label else {})}
    r = c.completions.create(model="smol", prompt=prompt, max_tokens=4, temperature=0, logprobs=1, extra_body=xb)
    return {"id": r.id, "tokens": [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens],
            "cached": r.usage.prompt_tokens_details.cached_tokens}


@pytest.fixture(scope="module")
def served2(tmp_path_factory, vllm_mod):
    from tests.helpers.tiny import make_weights, write_hf

    d = tmp_path_factory.mktemp("served2")
    w, s = make_weights(n_layer=2, H=256, n_head=4, n_kv=2, head_dim=64, ff=512, seed=1)
    model = write_hf(d / "tiny", w, s)
    args = ["--dtype", "float32", "--max-model-len", "256", "--block-size", str(B), "--enable-prefix-caching",
            "--enable-prompt-tokens-details", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
            "--tensor-parallel-size", "2"]
    srv = Server(model, args, {"INFERTRACE_SPOOL": str(d / "spool"), "INFERTRACE_LAYER": "1",
                               "VLLM_CPU_OMP_THREADS_BIND": "0|1"}, d / "server.log")
    try:
        start_s = srv.wait(600)
        c = srv.client()
        out = {"first": _complete(c, P, "first")}
        with cf.ThreadPoolExecutor(2) as ex:
            fr, fp = ex.submit(_complete, c, P, "repeat"), ex.submit(_complete, c, "zz top", None)
            out["repeat"], out["plain"] = fr.result(), fp.result()
        yield {"dir": d, "model": model, "out": out, "start_s": start_s}
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def trace2(served2):
    d = served2["dir"]
    r = cli("collect", str(d / "spool"), "--model", str(served2["model"]), "--save", str(d / "all"))
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads((d / "all" / "trace.json").read_text())


def test_per_rank_kv_heads_and_equal_metadata(served2, trace2) -> None:
    """vLLM's split (linear.py QKVParallelLinear): 2 KV heads over 2 ranks, rank r holds head r, each rank's cache
    [blocks, 1, 32, 128]; every step's metadata is equal on both ranks and K/V read back exactly."""
    print(f"vllm serve TP=2 start: {served2['start_s']:.1f} s")
    ranks = trace2["options"]["vllm"]["ranks"]
    assert [(x["tp_rank"], x["num_kv_heads"], x["num_heads"]) for x in ranks] == [(0, 1, 2), (1, 1, 2)]
    assert all(x["cache_shape"][1:] == [1, 32, 128] for x in ranks)
    steps = [st for st in trace2["steps"] if st["batch"]]
    assert steps and all(st["vllm"]["tp_ranks"] == [
        {"tp_rank": 0, "kv_heads_held": 1, "kv_heads": [0], "kv_equals_first_holder": True, "metadata_equals_rank0": True},
        {"tp_rank": 1, "kv_heads_held": 1, "kv_heads": [1], "kv_equals_first_holder": True, "metadata_equals_rank0": True}]
        for st in steps)
    assert all(st["vllm"]["kv_readback"] == {"k_max_abs": 0.0, "v_max_abs": 0.0} for st in steps)
    assert trace2["options"]["vllm"]["served"]["tensor_parallel_size"] == 2


def test_cached_tokens_and_tokens_equal_vllm(served2, trace2) -> None:
    out = served2["out"]
    reqs = {q["vllm_label"]: q for q in trace2["requests"]}
    assert out["repeat"]["cached"] > 0
    hit = next(b["prefix"]["hit"] for st in trace2["steps"] for b in st["batch"]
               if b.get("prefix") and b["seq_id"] == reqs["repeat"]["seq_id"])
    assert hit == out["repeat"]["cached"]
    for k in ("first", "repeat"):
        assert reqs[k]["output_ids"] == out[k]["tokens"]


def test_check_and_replay(served2, trace2) -> None:
    d = served2["dir"]
    r = cli("check", str(d / "all"))
    assert r.returncode == 0 and "no violation" in r.stdout, r.stdout[-1500:]
    args = []
    for q in trace2["requests"]:
        args += ["--prompt", q["prompt"], "--arrival", str(q["arrival_step"])]
    r = cli("run", "--model", str(served2["model"]), *args, "-n", "4", "--layer", "1", "--backend", "paged",
            "--tokens-per-block", str(B), "--ctx-size", "256", "--replay", str(d / "all"), "--save", str(d / "rp"), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    r = cli("diff", str(d / "all"), str(d / "rp"))
    assert "structure: identical" in r.stdout, r.stdout[-2500:]
