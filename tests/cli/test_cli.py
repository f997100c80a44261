"""The CLI through ``typer.testing.CliRunner`` on the real SmolLM2-135M GGUF: the worked example
(positions, visible keys, cache, " Paris"), --json round trip, the paged backend, inspect, and
the error policy (one ``error:`` line, exit code 2, no traceback unless --debug).

Each scenario invokes the CLI once (module-scoped fixtures); the model is loaded once per
process (``infertrace.cli.run`` memoises it).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

from infertrace.cli import run as run_mod
from infertrace.cli.app import app
from infertrace.trace.records import RunTrace
from infertrace.present.render import render_run

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"
ENV = {"COLUMNS": "120"}


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env=ENV)


def _ok(res):
    assert res.exit_code == 0, (res.output, res.exception)
    return res


@pytest.fixture(scope="module")
def text_run():
    return _ok(invoke("run", "--prompt", PROMPT, "--max-new-tokens", "8", "--show", "all"))  # the full output


@pytest.fixture(scope="module")
def json_run():
    res = _ok(invoke("run", "--prompt", PROMPT, "--max-new-tokens", "8", "--json"))
    return res, json.loads(res.stdout)


@pytest.fixture(scope="module")
def paged_run():
    return _ok(invoke("run", "--prompt", PROMPT, "--max-new-tokens", "3", "--backend", "paged", "--tokens-per-block", "4",
                        "--show", "mask,kv"))


@pytest.fixture(scope="module")
def two_requests():
    res = _ok(invoke("run", "--show", "mask", "--prompt", "a", "--prompt", "b", "--arrival", "0", "--arrival", "2",
                     "--max-new-tokens", "4", "--json"))
    return json.loads(res.stdout)


# ----------------------------------------------------------------------------- run: the worked example


def test_run_prints_worked_example_and_paris(text_run):
    out = text_run.output
    assert "worked example" in out
    for col in ("step", "phase", "current tokens", "positions", "visible keys", "cache after", "output"):
        assert col in out
    assert "' Paris'" in out
    assert "q0:0" in out and "q4:0..4" in out and "q5:0..5" in out
    for panel in ("hidden · step 0", "positions · step 0", "mask · step 0", "kv · step 0", "decode · step 0"):
        assert panel in out
    assert "inp_pos I32 [5] = [0, 1, 2, 3, 4]" in out
    assert "ne = [n_kv=256, n_tokens_pad=5, 1, n_stream=1]" in out
    assert "V in cache − V projection: max |Δ| = 0 (V is not rotated); K in cache − rotated K: 0" in out
    assert "cached tokens recomputed: 0" in out
    assert out.rstrip().splitlines()[-1].startswith("output seq 0: 'The capital of France is' → ' Paris")
    assert "Traceback" not in out


def test_run_json_positions_visible_cache(json_run):
    _, d = json_run
    s0, s1 = d["steps"][0]["batch"][0], d["steps"][1]["batch"][0]
    assert s0["phase"] == "prefill" and s1["phase"] == "decode"
    assert s0["positions"] == [0, 1, 2, 3, 4]
    assert s1["positions"] == [5]
    assert s0["visible"] == ["0", "0..1", "0..2", "0..3", "0..4"]
    assert s1["visible"] == ["0..5"]
    assert s0["cache_after"] == "0..4" and s1["cache_after"] == "0..5"
    assert d["steps"][0]["decode"]["per_request"][0]["chosen_piece"] == " Paris"
    assert s0["sampled_piece"] == " Paris"
    assert s1["token_ids"] == [s0["sampled"]]  # the sampled token is the next step's input
    assert len(d["steps"]) == 8 and d["requests"][0]["stop_reason"] == "max_new_tokens"


def test_run_json_is_only_json_and_round_trips(json_run, text_run):
    res, d = json_run
    assert res.stdout.lstrip().startswith("{") and res.stdout.count("\n") <= 1
    trace = RunTrace.from_dict(d)
    assert trace.to_dict() == d
    # a saved trace renders exactly like the live run (render is a pure function of the records)
    buf = io.StringIO()
    render_run(Console(file=buf, width=120, highlight=False), trace)
    assert buf.getvalue() == text_run.stdout


def test_run_paged_shows_block_tables(paged_run):
    out = paged_run.output
    assert "backend paged" in out
    assert "block_tables seq 0: [0, 1]" in out  # 5 prompt tokens, 4 tokens per block
    assert "mask_type causal" in out and "no dense mask tensor reaches attention" in out
    assert "slot_mapping" in out and "kv_lens" in out and "cu_seqlens" in out
    assert "' Paris'" in out


def test_run_two_requests_are_isolated(two_requests):
    d = two_requests
    step2 = next(s for s in d["steps"] if s["step"] == 2)
    assert [(b["seq_id"], b["phase"], b["positions"]) for b in step2["batch"]] == [(0, "decode", [2]), (1, "prefill", [0])]
    assert step2["hidden"] is not None and step2["mask"] is not None  # --show mask only displays: --json holds all five
    rows = step2["mask"]["kq_mask"]["rows"]
    pos = step2["mask"]["kq_mask"]["cell_pos"]
    assert rows[0][:4] == ["0", "0", "0", "-inf"]  # seq 0 sees its cells 0..2, not seq 1's cell 3
    assert rows[1][:4] == ["-inf", "-inf", "-inf", "0"]  # seq 1 sees only its own cell
    assert pos[:4] == [0, 1, 2, 0]


def test_run_prompts_file_and_steps(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": PROMPT, "max_new_tokens": 2}) + "\n\n"
                 + json.dumps({"prompt": "Hello", "arrival": 1, "max_new_tokens": 1}) + "\n")
    res = _ok(invoke("run", "--prompts", str(f), "--steps", "1", "--show", "decode"))
    assert "decode · step 1" in res.output and "decode · step 0" not in res.output
    assert "output seq 0" in res.output and "output seq 1" in res.output


# ----------------------------------------------------------------------------- inspect


def test_inspect_real_model(smol_path):
    res = _ok(invoke("inspect", str(smol_path)))
    out = res.output
    assert "llama" in out and "Q4_1" in out and "Q8_0" in out
    assert "n_layer" in out and " 30 " in out and "blk.{0..29}.attn_q.weight" in out
    assert "add_bos" in out and "chat template" in out and "un-permuted" in out
    d = json.loads(_ok(invoke("inspect", str(smol_path), "--json")).stdout)
    assert d["architecture"] == "llama" and d["config"]["n_layer"] == 30
    assert {t["type"] for t in d["totals"]} >= {"Q4_1", "Q8_0", "F32"}


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_inspect_and_run_tiny_checkpoints(tmp_path, fmt):
    """Both checkpoint formats go through inspect and run (random tiny Llama, no download)."""
    from tests.helpers.tiny import make_weights, write_gguf, write_hf

    w, s = make_weights()
    path = write_hf(tmp_path / "hf", w, s) if fmt == "hf" else write_gguf(tmp_path / "tiny.gguf", w, s)
    d = json.loads(_ok(invoke("inspect", str(path), "--json")).stdout)
    assert d["format"] == fmt and d["config"]["n_layer"] == 2 and d["config"]["n_head_kv"] == 2
    assert d["config"]["rope_pairing_in_file"] == ("neox" if fmt == "hf" else "norm")
    out = _ok(invoke("inspect", str(path))).output
    assert "layers.{0..1}" in out or "blk.{0..1}" in out
    res = _ok(invoke("run", "--model", str(path), "--prompt", "hehe", "--max-new-tokens", "2", "--ignore-eos"))
    assert "worked example" in res.output and "output seq 0" in res.output


# ----------------------------------------------------------------------------- errors


def _one_error_line(res, code: int = 2) -> str:
    assert res.exit_code == code, (res.output, res.exception)
    assert "Traceback" not in res.output
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, smol_path):
    import gguf
    import numpy as np

    d = tmp_path_factory.mktemp("bad")
    (d / "truncated.gguf").write_bytes(smol_path.read_bytes()[:1000])
    (d / "x.gguf").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    w = gguf.GGUFWriter(str(d / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (d / "model.bin").write_bytes(b"\x80\x04not really a pickle")
    hf = d / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    (hf / "pytorch_model.bin").write_bytes(b"\x80\x04")
    return d


@pytest.mark.parametrize("name, expect", [
    ("missing.gguf", "model not found"),
    ("truncated.gguf", "truncated or corrupt"),
    ("x.gguf", "not a GGUF file"),
    ("gpt2.gguf", "unsupported architecture 'gpt2'"),
    ("model.bin", "pickle"),
    ("hf", "pickle"),
])
@pytest.mark.parametrize("command", ["run", "inspect"])
def test_bad_model_files(bad_files, name, expect, command):
    path = str(bad_files / name)
    args = ["run", "--model", path, "--prompt", "hi"] if command == "run" else ["inspect", path]
    assert expect in _one_error_line(invoke(*args))


@pytest.mark.parametrize("command", ["run", "inspect"])
def test_unknown_model_name_lists_the_registered_names(tmp_path, monkeypatch, command):
    from infertrace.loading.registry import MODEL_NAMES

    monkeypatch.chdir(tmp_path)  # "gemma3" is neither a registered name nor a path here
    args = ["run", "--model", "gemma3", "--prompt", "hi"] if command == "run" else ["inspect", "gemma3"]
    line = _one_error_line(invoke(*args))
    assert "model not found: gemma3" in line and "registered name (smollm2-135m, gemma3-270m)" in line, line
    assert all(n in line for n in MODEL_NAMES)


@pytest.mark.parametrize("args, expect", [
    (["--ctx-size", "8", "--prompt", "one two three four five six seven eight nine ten"], "context holds 8"),
    (["--prompt", "hi", "--layer", "99"], "--layer: 99 out of range"),
    (["--prompt", "hi", "--show", "bogus"], "unknown variable 'bogus'"),
    (["--prompt", "hi", "--max-new-tokens", "-1"], "--max-new-tokens: must be >= 1"),
    (["--prompt", "hi", "--ctx-size", "0"], "error: --ctx-size: must be >= 1 (got 0)"),
    (["--prompt", "hi", "--temperature", "-0.5"], "--temperature: must be 0 (greedy) or >= 0.001"),
    (["--prompt", "hi", "--backend", "dense"], "infertrace runs the cells or paged convention, not dense; drop --backend dense"),
    (["--prompt", "a", "--prompt", "b", "--arrival", "1"], "one per --prompt"),
    (["--prompt", "hi", "--steps", "3..1"], "is empty"),
    (["--max-new-tokens", "2"], "no prompt given"),
])
def test_bad_options(args, expect):
    assert expect in _one_error_line(invoke("run", *args))


def test_bad_prompts_file_names_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": "x", "top_k": "many"}\n')
    assert "p.jsonl line 2" in _one_error_line(invoke("run", "--prompts", str(f)))
    f.write_text('{"prompt": "ok"}\n\n{"prompt": oops}\n')
    assert "p.jsonl line 3: not valid JSON" in _one_error_line(invoke("run", "--prompts", str(f)))
    f.write_text('{"prompt": "ok", "temperature": -1}\n')
    assert "line 1: 'temperature' must be 0 (greedy) or >= 0.001" in _one_error_line(invoke("run", "--prompts", str(f)))


def test_debug_shows_traceback(bad_files):
    res = invoke("--debug", "run", "--model", str(bad_files / "truncated.gguf"), "--prompt", "hi")
    assert res.exit_code == 2
    assert "Traceback" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: cannot read GGUF truncated.gguf")


def test_unexpected_exception_is_one_line_exit_1(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(run_mod, "load_with_progress", boom)
    line = _one_error_line(invoke("run", "--prompt", "hi"), code=1)
    assert line == "error: internal error: RuntimeError: boom (rerun with --debug for the traceback)"


def test_usage_error_keeps_exit_code_2():
    res = invoke("run", "--max-new-tokens", "abc")
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_python_dash_m_entry_point():
    """The console-script path (``main``) applies the same policy outside CliRunner."""
    p = subprocess.run([sys.executable, "-m", "infertrace", "run", "--prompt", "x", "--show", "bogus"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and p.stderr.startswith("error: unknown variable 'bogus'")
