"""A real ``vllm serve`` (vLLM 0.32 CPU, multiprocessing on: API server, engine core and a worker process;
prefix caching on, ``--enable-prompt-tokens-details``, KV events on a ZMQ publisher on 127.0.0.1) recorded
by infertrace's plugin, driven by the real ``openai`` client, collected with ``infertrace collect``, and
held to what vLLM itself answers: the response's ``cached_tokens``, its tokens and logprobs, the
``BlockStored`` events it publishes. One server for the module (start ~70-120 s on this machine).

The requests (SmolLM2-135M, greedy, 5 tokens): ``first`` = P (41 tokens, marked), then at once: P again
(marked ``repeat``: hits ``first``'s full block, 32 tokens), two unmarked ones (one streaming), and one
streaming marked request; the fault test runs last (it turns recording off in the worker).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
from pathlib import Path

import pytest

from tests.helpers.vllm_served import KvEvents, Server, cli, free_port

pytestmark = [pytest.mark.model, pytest.mark.vllm, pytest.mark.needs_vllm]

P = "The quick brown fox jumps over the lazy dog. " * 4
LAYER = 3
B = 32


def _complete(c, prompt: str, label: str | None, stream: bool = False) -> dict:
    """One completion through the openai client: vLLM's own token ids (``return_tokens_as_token_ids``), logprobs,
    usage (cached tokens) and response id."""
    xb = {"return_tokens_as_token_ids": True}
    if label:
        xb["vllm_xargs"] = {"infertrace": label}
    kw = dict(model="smol", prompt=prompt, max_tokens=5, temperature=0, logprobs=1, extra_body=xb)
    if not stream:
        r = c.completions.create(**kw)
        lp = r.choices[0].logprobs
        return {"id": r.id, "tokens": [int(t.split(":")[1]) for t in lp.tokens], "logprobs": list(lp.token_logprobs),
                "cached": r.usage.prompt_tokens_details.cached_tokens, "text": r.choices[0].text}
    toks, lps, rid, cached = [], [], None, None
    for ch in c.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        rid = ch.id
        if ch.choices and ch.choices[0].logprobs is not None:
            toks += [int(t.split(":")[1]) for t in ch.choices[0].logprobs.tokens]
            lps += list(ch.choices[0].logprobs.token_logprobs)
        if ch.usage is not None:
            cached = ch.usage.prompt_tokens_details.cached_tokens if ch.usage.prompt_tokens_details else None
    return {"id": rid, "tokens": toks, "logprobs": lps, "cached": cached}


@pytest.fixture(scope="module")
def served(tmp_path_factory, smol_path, vllm_mod):
    """The server, the spool it wrote, the responses and the KV events; stopped whatever happens."""
    from infertrace.runtimes.vllm.convert import hf_dir_for

    d = tmp_path_factory.mktemp("served1")
    spool, ev_port = d / "spool", free_port()
    kv_cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{ev_port}",
                         "topic": "kv"})
    args = ["--dtype", "float32", "--max-model-len", "256", "--block-size", str(B), "--enable-prefix-caching",
            "--enable-prompt-tokens-details", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
            "--kv-events-config", kv_cfg] + os.environ.get("INFERTRACE_SERVED_ARGS", "").split()  # gpu_check.sh: CUDA flags
    ev = KvEvents(ev_port)  # bound first: vLLM's publisher connects to a non-wildcard endpoint
    srv = Server(hf_dir_for(smol_path), args, {"INFERTRACE_SPOOL": str(spool), "INFERTRACE_LAYER": str(LAYER),
                                               "INFERTRACE_FAULT": "worker"}, d / "server.log")
    try:
        start_s = srv.wait(600)
        c = srv.client()
        _complete(c, "warm up", None)  # the subscriber has joined before the requests that matter
        ev.drain(1.0)
        ev.events.clear()
        out = {"first": _complete(c, P, "first")}
        jobs = {"repeat": (P, "repeat", False), "plain": ("Count to five:", None, False),
                "plain_stream": ("Once upon a time", None, True), "marked_stream": ("def add(a, b):", "mstream", True)}
        with cf.ThreadPoolExecutor(len(jobs)) as ex:
            futs = {k: ex.submit(_complete, c, *v) for k, v in jobs.items()}
            out.update({k: f.result() for k, f in futs.items()})
        events = list(ev.drain(3.0))
        yield {"srv": srv, "spool": spool, "out": out, "events": events, "dir": d, "start_s": start_s, "client": c}
    finally:
        srv.stop()
        ev.close()


@pytest.fixture(scope="module")
def collected(served, smol_path):
    """``infertrace collect`` of every marked request and of ``repeat`` alone."""
    d = served["dir"]
    r = cli("collect", str(served["spool"]), "--model", str(smol_path), "--save", str(d / "all"))
    assert r.returncode == 0, r.stderr[-2000:]
    r = cli("collect", str(served["spool"]), "--model", str(smol_path), "--save", str(d / "repeat"),
            "--request", served["out"]["repeat"]["id"])
    assert r.returncode == 0, r.stderr[-2000:]
    return {k: json.loads((d / k / "trace.json").read_text()) for k in ("all", "repeat")}


def _by_label(m: dict) -> dict[str, dict]:
    return {q["vllm_label"]: q for q in m["requests"]}


def test_server_started_and_answered(served) -> None:
    """Every request answered with 5 tokens; the start time is printed for the report."""
    print(f"vllm serve start: {served['start_s']:.1f} s")
    assert all(len(o["tokens"]) == 5 for o in served["out"].values())


def test_prefix_hit_equals_vllm_cached_tokens(served, collected) -> None:
    """vLLM's ``usage.prompt_tokens_details.cached_tokens`` of ``repeat`` (32: one full block of ``first``) is the
    collected trace's prefix hit, with the matched block ids; ``first`` had none."""
    out = served["out"]
    assert out["repeat"]["cached"] == 32 and out["first"]["cached"] == 0
    m = collected["repeat"]
    assert [q["vllm_label"] for q in m["requests"]] == ["repeat"]
    rows = [b for s in m["steps"] for b in s["batch"] if b.get("prefix")]
    assert len(rows) == 1 and rows[0]["prefix"]["hit"] == out["repeat"]["cached"]
    assert rows[0]["C"] == 32 and len(rows[0]["prefix"]["shared_blocks"]) == 1
    # the shared block is the one first was given at its admission (scheduler's new_block_ids in the other trace)
    a = collected["all"]
    first_seq = _by_label(a)["first"]["seq_id"]
    first_blocks = next(s["vllm"]["scheduler"]["new_block_ids"][str(first_seq)] for s in a["steps"]
                        if s.get("vllm") and str(first_seq) in s["vllm"]["scheduler"]["new_block_ids"])
    assert rows[0]["prefix"]["shared_blocks"] == first_blocks[:1]


def test_tokens_and_logprobs_equal_the_trace(served, collected) -> None:
    """Each marked response's token ids are the trace's samples; its logprobs (vLLM's raw log-softmax) equal
    log(prob) of the sampled token in the trace's logits rows (as captured at vLLM's sampler input)."""
    m = collected["all"]
    reqs = _by_label(m)
    assert set(reqs) == {"first", "repeat", "mstream"}
    for label, key in (("first", "first"), ("repeat", "repeat"), ("mstream", "marked_stream")):
        q, o = reqs[label], served["out"][key]
        assert q["output_ids"] == o["tokens"], label
        assert q["vllm_request_id"].startswith(o["id"] + "-")  # vLLM's request id kept beside the seq id
        lps = []
        for s in m["steps"]:
            for pr in (s.get("decode") or {}).get("per_request", []):
                if pr["seq_id"] == q["seq_id"] and pr.get("chosen") is not None:
                    top = next(t for t in pr["top"] if t["id"] == pr["chosen"])
                    lps.append(math.log(top["prob"]))
        assert lps == pytest.approx(o["logprobs"], abs=1e-4), label


def test_kv_events_name_the_cached_block_tokens(served, collected) -> None:
    """vLLM's ``BlockStored`` events (its ZMQ publisher) hold a block whose token ids are exactly the prompt tokens
    of the block the trace says ``repeat`` hit; no event names a block of ``repeat``'s uncached tail."""
    from vllm.distributed.kv_events import BlockStored

    stored = [tuple(e.token_ids) for e in served["events"] if isinstance(e, BlockStored)]
    assert stored, "no BlockStored event received"
    q = _by_label(collected["repeat"])["repeat"]
    hit = next(b["prefix"]["hit"] for s in collected["repeat"]["steps"] for b in s["batch"] if b.get("prefix"))
    blocks = [tuple(q["prompt_ids"][i:i + B]) for i in range(0, hit, B)]
    assert blocks and all(stored.count(b) == 1 for b in blocks)  # stored once (by first), reused by repeat


def test_check_passes_and_commands_read_it(served, collected) -> None:
    d = served["dir"]
    for k in ("all", "repeat"):
        r = cli("check", str(d / k))
        assert r.returncode == 0 and "no violation" in r.stdout, r.stdout[-1500:] + r.stderr[-1500:]
    for cmd in (["show", str(d / "all"), "--steps", "0"], ["dump-kv", str(d / "all"), "--step", "0"],
                ["report", str(d / "all"), "-o", str(d / "r.html")]):
        r = cli(*cmd)
        assert r.returncode == 0, (cmd, r.stdout[-1000:], r.stderr[-1000:])


def test_every_step_has_the_whole_batch(served, collected) -> None:
    """The engine core recorded every step: the steps where ``repeat`` ran list the other requests of the batch
    (vLLM ids and scheduled tokens) beside it."""
    m = collected["all"]
    batches = [s["vllm"]["served"]["batch"] for s in m["steps"] if s.get("vllm")]
    # the concurrent requests shared steps (how many overlap depends on the machine's load: at least two did)
    assert max(len(b) for b in batches) >= 2
    ids = {x["request_id"].rsplit("-", 2)[0] for b in batches for x in b}
    assert {served["out"][k]["id"] for k in ("plain", "plain_stream")} <= ids
    # a finished request's blocks go back to vLLM's pool: first's own (uncached tail) block is freed the step after it
    # finished; the free count rises by the freed blocks no other table holds
    first = _by_label(m)["first"]
    new = next(s["vllm"]["scheduler"]["new_block_ids"][str(first["seq_id"])] for s in m["steps"]
               if s.get("vllm") and str(first["seq_id"]) in s["vllm"]["scheduler"]["new_block_ids"])
    freed = {b for s in m["steps"] if s.get("vllm") for b in s["vllm"]["served"]["freed_blocks"]}
    assert set(new[1:]) <= freed  # block 0 of first is shared with repeat (prefix hit), the rest is first's alone


def test_replay_diffs_with_zero_structural_differences(served, collected, smol_path) -> None:
    """``run --backend paged --replay`` of the collected ``first`` + ``repeat`` + ``mstream`` trace: ``diff``
    finds the structure identical (schedule, positions, block tables, slots, masks, ownership)."""
    d = served["dir"]
    m = collected["all"]
    args = []
    for q in m["requests"]:
        args += ["--prompt", q["prompt"], "--arrival", str(q["arrival_step"])]
    r = cli("run", "--model", str(smol_path), *args, "-n", "5", "--layer", str(LAYER), "--backend", "paged",
            "--tokens-per-block", str(B), "--ctx-size", "256", "--replay", str(d / "all"), "--save", str(d / "replayed"), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    r = cli("diff", str(d / "all"), str(d / "replayed"))
    assert "structure: identical" in r.stdout, r.stdout[-2500:]


def test_an_exception_in_capture_leaves_the_server_serving(served) -> None:
    """A request marked ``inject-fault`` makes the worker's sampler hook raise (``INFERTRACE_FAULT=worker``): the
    plugin logs one line, recording stops in that process, and the server answers it and the next one."""
    c = served["client"]
    o = _complete(c, "Fault here:", "inject-fault")
    assert len(o["tokens"]) == 5
    assert len(_complete(c, "And after:", "after")["tokens"]) == 5
    log = served["srv"].tail(200_000)
    lines = [ln for ln in log.splitlines() if "infertrace: recording disabled" in ln]
    assert len(lines) == 1 and "fault injected" in lines[0]
