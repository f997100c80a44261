"""Padded vocabulary (case T3): an HF checkpoint whose ``vocab_size`` (264) exceeds its tokenizer (259
tokens), with lm head row 263 the argmax. No abort: the rows past the tokenizer are masked out of
sampling (vLLM's serving behaviour), everywhere logits become tokens — greedy, sampling in both
sampler orders, speculative drafts and verify, GGUF as HF — and the trace says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from infertrace.cli.app import app
from tests.helpers.tiny import VOCAB, make_weights, write_gguf, write_hf

ROWS = 264  # the checkpoint's vocab_size; the tokenizer has VOCAB = 259 tokens
PROMPT = "Hello"


def _final_hidden(path: Path, ids: list[int]) -> torch.Tensor:
    """The final normed hidden state ``[H]`` at the last prompt position (the lm head replaced by I)."""
    from infertrace.kv.base import ChunkSpec
    from infertrace.kv.cells import CellsKV
    from infertrace.runner import load_model

    m = load_model(path).model
    cfg = m.cfg
    m.output = torch.eye(cfg.n_embd)  # logits := normed hidden
    kv = CellsKV(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, 64, 1, m.dtype, m.device, windows=[0] * cfg.n_layer)
    inp = kv.prepare([ChunkSpec(0, 0, len(ids))])
    return m.forward(torch.tensor(ids), inp, kv, torch.tensor([len(ids) - 1]))[0]  # [H]


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """(HF dir, GGUF file): vocab_size 264, tokenizer 259 tokens, row 263 the argmax after the prompt
    (its logit 4 above the best real token), rows 259..262 small."""
    assert VOCAB == 259
    d = tmp_path_factory.mktemp("padded")
    w, s = make_weights(vocab=ROWS, tie=False, seed=3)
    w["lm_head.weight"][VOCAB:] *= 0.01
    hf = write_hf(d / "hf", w, s)
    ids = [72, 101, 108, 108, 111]  # "Hello", byte-level
    h = _final_hidden(hf, ids)
    best = float((w["lm_head.weight"][:VOCAB] @ h).max())
    w["lm_head.weight"][ROWS - 1] = (best + 4.0) * h / float(h @ h)  # logit of row 263 = best + 4
    hf = write_hf(d / "hf", w, s)
    return hf, write_gguf(d / "m.gguf", w, s)


def _run(*args: str) -> str:
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 0, r.output
    return r.output


def _trace(d: Path) -> dict:
    return json.loads((d / "trace.json").read_text(encoding="utf-8"))


def test_hf_reference_argmax_is_a_padded_row(padded):
    """HF transformers on the checkpoint: the argmax over all 264 rows is 263, which its tokenizer
    decodes to '' (no such token); the argmax over the 259 real tokens is what we must emit."""
    transformers = pytest.importorskip("transformers")
    hf, _ = padded
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), torch_dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert ids[0].tolist() == [72, 101, 108, 108, 111]
    with torch.no_grad():
        logits = model(ids).logits[0, -1]  # [264]
    assert logits.shape[0] == ROWS and int(logits.argmax()) == ROWS - 1
    assert tok.decode([ROWS - 1]) == ""
    want = int(logits[:VOCAB].argmax())
    for m in padded:  # HF directory and GGUF of the same weights
        out = json.loads(_run("run", "-m", str(m), "-p", PROMPT, "-n", "1", "--ignore-eos", "--json", "--show", "decode"))
        dec = out["steps"][0]["decode"]
        assert dec["per_request"][0]["chosen"] == want
        assert abs(dec["per_request"][0]["top"][0]["logit"] - float(logits[want])) < 1e-4


@pytest.mark.parametrize("which", [0, 1], ids=["hf", "gguf"])
def test_padded_rows_are_masked_and_the_trace_says_so(padded, tmp_path, which):
    m = str(padded[which])
    d = tmp_path / "t"
    out = _run("run", "-m", m, "-p", PROMPT, "-n", "4", "--ignore-eos", "--save", str(d))  # main: token id 263 out of range
    assert "padded vocabulary: the lm head has 264 rows, the tokenizer 259 tokens; rows 259..263 masked out of sampling" in out
    t = _trace(d)
    assert t["options"]["padded_vocab"] == {"rows": 264, "tokens": 259, "policy": "masked", "masked": "259..263"}
    assert any("padded vocabulary" in n for n in t["notes"])
    out_ids = t["requests"][0]["output_ids"]
    assert len(out_ids) == 4 and max(out_ids) < VOCAB
    st0 = t["steps"][0]
    assert st0["decode"]["logits_shape"][-1] == ROWS  # the logits keep every row; the padded ones are -inf
    assert all(e["id"] < VOCAB for e in st0["decode"]["per_request"][0]["top"])
    assert _run("check", str(d)).startswith("ok: ")
    _run("show", str(d))


def test_tracing_off_and_sampling_in_both_orders(padded):
    from infertrace.engine.options import EngineOptions
    from infertrace.engine.sampler import SamplingParams
    from infertrace.runner import PromptSpec, load_model, run_requests

    loaded = load_model(padded[0])
    for order in ("hf", "llama.cpp"):
        # temperature 1 over logits where row 263 is 4 above the rest: unmasked it would be drawn ~half the time
        specs = [PromptSpec(PROMPT, params=SamplingParams(max_new_tokens=8, temperature=1.0, seed=k, ignore_eos=True))
                 for k in range(6)]
        tr = run_requests(loaded, specs, EngineOptions(sampler_order=order), trace=False)
        ids = [t for r in tr.requests for t in r["output_ids"]]
        assert len(ids) == 48 and max(ids) < VOCAB, order


def test_speculative_drafts_never_propose_padded_rows(padded, tmp_path):
    """The draft model (the target's first layer) has the padded rows too: masked like the target's,
    so greedy speculative output equals plain greedy."""
    m = str(padded[0])
    plain, spec = tmp_path / "plain", tmp_path / "spec"
    _run("run", "-m", m, "-p", PROMPT, "-n", "6", "--ignore-eos", "--save", str(plain))
    _run("run", "-m", m, "-p", PROMPT, "-n", "6", "--ignore-eos", "--speculative", "draft", "--draft-layers", "1",
         "--num-spec-tokens", "3", "--save", str(spec))
    a, b = _trace(plain)["requests"][0]["output_ids"], _trace(spec)["requests"][0]["output_ids"]
    assert a == b and max(a) < VOCAB


def test_against_hf_compares_the_tokenizer_rows(padded):
    """``diff-runtimes hf``: HF's own argmax is the padded row 263; compared over the 259 real
    rows (ours are -inf past them) the logits agree and the greedy tokens are equal (exit 0)."""
    pytest.importorskip("transformers")
    out = _run("diff-runtimes", "hf", "-m", str(padded[0]), "-p", PROMPT, "-n", "3", "--ignore-eos")
    assert "logically identical to hf" in out and "greedy tokens equal" in out


def test_tokenizer_larger_than_the_embedding_refuses_such_a_prompt(tmp_path):
    """The other way round (256 embedding rows, 259 tokens): a prompt with token 256 (the merge "he")
    has no embedding row: one line, exit 2, instead of an IndexError; prompts inside the rows run."""
    w, s = make_weights(vocab=256, tie=True, seed=3)
    m = str(write_hf(tmp_path / "hf", w, s))
    r = CliRunner().invoke(app, ["run", "-m", m, "-p", "hehe", "-n", "1"])
    assert r.exit_code == 2 and r.output.strip() == (
        "error: prompt token id 256 is outside the model's embedding rows 0..255 (its tokenizer has 259 tokens); "
        "use the tokenizer the model was trained with"), r.output
    _run("run", "-m", m, "-p", "abc", "-n", "1")
