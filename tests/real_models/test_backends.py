"""``diff-backends``: cells and paged in lockstep are logically identical on the real model (exit 0),
a broken kq_mask is caught and named (exit 1), ``diff-runtimes hf`` agrees with HF transformers, and
``diff-runtimes llama.cpp`` (or its old form ``diff-backends --against llama.cpp``) either runs (when llama-cpp-python is installed) or says how to install it.

Each CLI scenario runs once per module; the model is loaded once per process.
"""

from __future__ import annotations

import builtins
import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.kv.cells import CellsKV
from infertrace.present.render_compare import render_backends_diff

ENV = {"COLUMNS": "120"}
THREE = ["--prompt", "The capital of France is", "--prompt", "def add(a, b):", "--prompt", "Water boils at",
         "--arrival", "0", "--arrival", "1", "--arrival", "3", "--prefill-chunk", "3", "--tokens-per-block", "4",
         "--max-new-tokens", "6"]
TWO = ["--prompt", "The capital of France is", "--prompt", "Water boils at", "--max-new-tokens", "2",
       "--tokens-per-block", "4"]


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env=ENV)


def _one_error_line(res, code: int = 2) -> str:
    assert res.exit_code == code, (res.output, res.exception)
    assert "Traceback" not in res.output and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


# ----------------------------------------------------------------------------- lockstep on the real model


@pytest.fixture(scope="module")
def diff_ok():
    res = invoke("diff-backends", *THREE, "--json")
    assert res.exit_code == 0, (res.output, res.exception)
    return json.loads(res.stdout)


@pytest.mark.model
def test_diff_backends_real_model_identical(diff_ok):
    d = diff_ok
    assert d["identical"] and d["mismatches"] == [] and d["backends"] == ["cells", "paged"]
    assert d["atol"] == 1e-4 and d["dtype"] == "float32"
    sm = d["summary"]
    assert sm["steps"] == len(d["steps"]) >= 8
    for var in ("schedule", "positions", "mask", "kv", "tokens", "logits"):
        assert sm[var]["mismatched_steps"] == [], var
    assert sm["kv"]["max_abs"] < 1e-4 and sm["logits"]["max_abs"] < 1e-4 and sm["logits_rows"] >= 18
    # three requests really were batched, with chunked prefill and mixed prefill/decode steps
    s3 = next(s for s in d["steps"] if s["step"] == 3)
    assert [(b["seq_id"], b["phase"], b["C"], b["T"]) for b in s3["batch"]] == [
        (0, "decode", 6, 1), (1, "prefill", 6, 1), (2, "prefill", 0, 3)]
    # the physical sides differ: cells write to cell indices, paged to slots (B = 4, block tables grow)
    assert s3["physical"]["cells"]["cells"] == {"0": "12", "1": "13", "2": "14..16"}
    assert s3["physical"]["cells"]["kq_mask_ne"] == [256, 5, 1, 1]  # llama.cpp: n_kv padded to 256, rows not padded
    assert s3["physical"]["paged"]["slots"] == {"0": "6", "1": "14", "2": "16..18"}
    assert s3["physical"]["paged"]["kv_lens"] == [7, 7, 3]
    assert d["storage"]["cells"]["shape"] == [2048, 3, 64] and d["storage"]["paged"]["shape"] == [512, 2, 3, 4, 64]
    for r in d["requests"]:
        assert r["output_ids"]["cells"] == r["output_ids"]["paged"] and len(r["output_ids"]["cells"]) == 6


@pytest.mark.model
def test_diff_backends_text_report(diff_ok):
    buf = io.StringIO()
    render_backends_diff(Console(file=buf, width=120, highlight=False), diff_ok)
    out = " ".join(buf.getvalue().split())
    assert "logically identical: 9 steps (0 idle), 3 requests" in out
    assert "LOGICAL (must be equal) | PHYSICAL (expected to differ)" in out
    assert "ne [256,5,1,1]" in out and "kv_lens [7,7,3]" in out
    assert "pool per layer [512, 2, 3, 4, 64]" in out and "k_l, v_l per layer [2048, 3, 64]" in out


def _break_mask(monkeypatch, kind: str):
    """Wrap CellsKV.prepare so that the first query of a chunk also sees a key it must not:
    ``future`` = the next cell of its own sequence, ``foreign`` = a cell of another sequence."""
    orig = CellsKV.prepare

    def prepare(self, chunks):
        inp = orig(self, chunks)
        m, idx = inp.kq_mask, inp.cell_idx
        if kind == "future" and chunks[0].T > 1:
            m[0, 0, 0, int(idx[1])] = 0.0  # query at pos C sees pos C+1 of its own seq
        if kind == "foreign" and len(chunks) > 1:
            other = int(idx[0])  # a cell of chunk 0's sequence ...
            m[0, 0, chunks[0].T, other] = 0.0  # ... seen by chunk 1's first query
        return inp

    monkeypatch.setattr(CellsKV, "prepare", prepare)


@pytest.mark.model
@pytest.mark.parametrize("kind", ["future", "foreign"])
def test_diff_backends_catches_wrong_mask(monkeypatch, kind):
    _break_mask(monkeypatch, kind)
    res = invoke("diff-backends", *TWO, "--json")
    assert res.exit_code == 1, (res.output, res.exception)
    d = json.loads(res.stdout)
    assert not d["identical"]
    first = d["mismatches"][0]
    assert (first["step"], first["variable"]) == (0, "mask")
    assert d["steps"][0]["checks"]["mask"]["ok"] is False and d["steps"][0]["checks"]["positions"]["ok"] is True
    if kind == "future":
        assert "seq 0 query pos 0: cells sees 0..1, paged sees 0" in first["detail"]
    else:
        assert "seq 1 query pos 0: cells sees 0 + a key of another sequence, paged sees 0" in first["detail"]
    # the wrong mask changes attention, so logits differ too
    assert any(m["variable"] == "logits" for m in d["mismatches"])


@pytest.mark.model
def test_diff_backends_text_names_step_and_variable(monkeypatch):
    _break_mask(monkeypatch, "future")
    res = invoke("diff-backends", *TWO)
    assert res.exit_code == 1, (res.output, res.exception)
    assert "LOGICAL MISMATCH" in res.stdout and "step 0 · mask: seq 0 query pos 0: cells sees 0..1" in res.stdout


def test_diff_backends_idle_steps_tiny(tmp_path):
    """Lockstep on a tiny random model with an arrival gap: idle steps are compared too."""
    from infertrace.compare.backends import diff_backends
    from infertrace.engine.engine import EngineOptions
    from infertrace.engine.sampler import SamplingParams
    from infertrace.model.decoder import DecoderModel
    from infertrace.loading.weights import load_checkpoint
    from infertrace.runner import Loaded, PromptSpec
    from tests.helpers.tiny import make_weights, write_gguf

    w, s = make_weights(seed=3)
    ck = load_checkpoint(write_gguf(tmp_path / "t.gguf", w, s))
    loaded = Loaded(ck, DecoderModel(ck.config, ck.weights))
    p = SamplingParams(max_new_tokens=3, ignore_eos=True)
    specs = [PromptSpec("", p, 0, ids=[72, 101, 108, 108, 111]), PromptSpec("", p, 6, ids=[33, 34, 35])]
    rep = diff_backends(loaded, specs, EngineOptions(tokens_per_block=2, prefill_chunk=2))
    assert rep["identical"], rep["mismatches"]
    assert [s["step"] for s in rep["steps"] if s["idle"]] == [5]
    assert rep["summary"]["idle_steps"] == 1 and rep["summary"]["steps"] == len(rep["steps"])


# ----------------------------------------------------------------------------- external references


@pytest.mark.model
@pytest.mark.hf
@pytest.mark.slow
def test_against_hf_real_model():
    pytest.importorskip("transformers")
    res = invoke("diff-runtimes", "hf", "--backend", "paged", *THREE, "--json")
    assert res.exit_code == 0, (res.output, res.exception)
    d = json.loads(res.stdout)
    assert d["identical"] and d["against"] == "hf" and d["backend"] == "paged"
    assert len(d["rows"]) == 18 and all(r["ok"] for r in d["rows"])
    assert all(r["tokens_equal"] for r in d["requests"]) and d["max_abs"] < 1e-3
    assert d["rows"][0]["ours"] == d["rows"][0]["ref"] == d["rows"][0]["sampled"]


def _hide_module(monkeypatch, name: str) -> None:
    real = builtins.__import__

    def fake(mod, *a, **k):
        if mod == name or mod.startswith(name + "."):
            raise ImportError(f"No module named {name!r}")
        return real(mod, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)


def test_against_llamacpp_not_installed_message(monkeypatch):
    _hide_module(monkeypatch, "llama_cpp")
    line = _one_error_line(invoke("diff-backends", "--against", "llama.cpp", "--prompt", "hi"))
    assert line == "error: diff-runtimes llama.cpp needs llama-cpp-python: run `make setup-dev` in the infertrace checkout (or `.venv/bin/pip install -e '.[llamacpp]'` there)"


def test_against_hf_without_transformers_message(monkeypatch):
    _hide_module(monkeypatch, "transformers")
    line = _one_error_line(invoke("diff-backends", "--against", "hf", "--prompt", "hi"))
    assert line == "error: diff-runtimes hf needs transformers: run `make setup-dev` in the infertrace checkout (or `.venv/bin/pip install -e '.[dev]'` there)"


def test_against_bad_value():
    assert "--against must be one of hf, llama.cpp, vllm" in _one_error_line(invoke("diff-backends", "--against",
                                                                                     "tensorrt", "--prompt", "hi"))


# diff-runtimes llama.cpp on the real model: tests/runtimes/llamacpp/test_llamacpp.py (fails by name without llama-cpp-python)
