"""llama.cpp's per-layer taps (``run --runtime llama.cpp --keep tensors --layers``): ``attn_out`` / ``mlp_out`` /
``resid_post`` read from its graph nodes (``attn_out-N``, ``ffn_out-N``, ``l_out-N``), held to HF transformers'
own forward hooks on the same GGUF (dequantised, fp32). llama.cpp multiplies Q4_1 weights by Q8_0-quantised
activations, so its rows differ from HF's by a few percent; measured on this prompt (2026-12-02): largest
relative L2 0.088 (attn_out), 0.065 (mlp_out), 0.021 (resid_post) over layers 0..28, and for every one of the 87
taps HF's closest (layer, tap) is the same layer and tap (a wrong node, or rows shifted by a layer, would not be).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app

PROMPT = "The capital of France is"
TAPS = ("attn_out", "mlp_out", "resid_post")
LIMIT = {"attn_out": 0.15, "mlp_out": 0.15, "resid_post": 0.05}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, smol_path, llama_cpp):
    d = tmp_path_factory.mktemp("lc_taps") / "t"
    r = CliRunner().invoke(app, ["run", "--runtime", "llama.cpp", "-m", str(smol_path), "-p", PROMPT, "-n", "2",
                                 "--save", str(d), "--keep", "tensors", "--layers", "all"])
    assert r.exit_code == 0, r.output
    from safetensors.numpy import load_file

    return json.loads((d / "trace.json").read_text()), load_file(str(d / "tensors.safetensors")), d


@pytest.fixture(scope="module")
def hf_rows(hf_smol, saved):
    """HF's hooks on the prompt (step 0) and on prompt + the first generated token (its last row = step 1)."""
    import torch

    from tests.helpers.hf_taps import hf_taps

    tok, model = hf_smol
    req = saved[0]["requests"][0]
    ids = req["prompt_ids"] + req["output_ids"][:1]
    got = hf_taps(model, torch.tensor([ids]))  # [1, T, ...] per (layer, tap)
    return {k: v[0].numpy() for k, v in got.items() if k[1] in TAPS}, len(req["prompt_ids"])


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def test_every_layer_tap_is_hfs_same_layer_and_tap(saved, hf_rows):
    m, t, _ = saved
    hf, n_prompt = hf_rows
    n_layer = m["config"]["n_layer"]
    for il in range(n_layer - 1):
        for tap in TAPS:
            lc = t[f"step0/layer{il}/{tap}"]  # [N, H]: the prompt rows
            assert lc.shape == (n_prompt, m["config"]["n_embd"])
            errs = {k: _rel(v[:n_prompt], lc) for k, v in hf.items()}
            assert errs[(il, tap)] < LIMIT[tap], (il, tap, errs[(il, tap)])
            assert min(errs, key=errs.get) == (il, tap), (il, tap, min(errs, key=errs.get))


def test_last_layer_ffn_is_saved_only_where_every_row_has_logits(saved, hf_rows):
    """llama.cpp applies inp_out_ids before the last layer's FFN: at the prefill its ffn_out / l_out hold one
    row of five, so they are not saved; at the decode step (one row, with logits) they are, and match HF's last row."""
    m, t, _ = saved
    hf, n_prompt = hf_rows
    last = m["config"]["n_layer"] - 1
    assert f"step0/layer{last}/attn_out" in t  # attention still runs on every row
    assert f"step0/layer{last}/mlp_out" not in t and f"step0/layer{last}/resid_post" not in t
    assert any("the last" in n and "output rows only" in n for n in m["notes"])
    for tap in TAPS:
        lc = t[f"step1/layer{last}/{tap}"]  # [1, H]: position n_prompt, the first generated token
        assert _rel(hf[(last, tap)][n_prompt:n_prompt + 1], lc) < LIMIT[tap], tap


def test_tap_sources_name_the_graph_nodes_and_check_passes(saved):
    m, _, d = saved
    src = m["options"]["tap_sources"]
    assert "l_out-N" in src["resid_post"] and "ffn_out-N" in src["mlp_out"] and "attn_out-N" in src["attn_out"]
    r = CliRunner().invoke(app, ["check", str(d)])
    assert r.exit_code == 0, r.output


def test_default_trace_asks_for_no_layer_tap_node(smol_path, llama_cpp):
    """Without --keep tensors no block-output node is asked for (the default trace's cost is unchanged)."""
    from infertrace.runtimes.llamacpp.capture import LlamaCppContext

    ctx = LlamaCppContext(smol_path, 256, 64, 1, layer=3)
    try:
        assert not any(n.startswith(("l_out", "ffn_out", "attn_out")) for n in ctx._want_layer)
    finally:
        ctx.close()


def test_gemma3_taps_are_after_its_post_norms(gemma_path, hf_gemma, llama_cpp, tmp_path):
    """Gemma 3: llama.cpp's attn_post_norm-N / ffn_post_norm-N nodes hold the post-normed branch outputs, as HF's
    post-norm modules (measured worst 0.056 / 0.071 / 0.013 on layers 0, 8, 16); its last layer gathers the output
    rows before the attention post-norm, so at the prefill that layer keeps only the nodes computed for every row."""
    import torch
    from safetensors.numpy import load_file

    d = tmp_path / "g"
    r = CliRunner().invoke(app, ["run", "--runtime", "llama.cpp", "-m", str(gemma_path), "-p", PROMPT, "-n", "1",
                                 "--save", str(d), "--layers", "0,8,16,17"])
    assert r.exit_code == 0, r.output
    m, t = json.loads((d / "trace.json").read_text()), load_file(str(d / "tensors.safetensors"))
    last = m["config"]["n_layer"] - 1
    assert last == 17
    from tests.helpers.hf_taps import hf_taps

    hf = {k: v[0].numpy() for k, v in hf_taps(hf_gemma[1], torch.tensor([m["requests"][0]["prompt_ids"]]), sandwich=True).items()}
    for il in (0, 8, 16):
        for tap in TAPS:
            rel = _rel(hf[(il, tap)], t[f"step0/layer{il}/{tap}"])
            assert rel < LIMIT[tap], (il, tap, rel)
    assert not any(k.startswith(f"step0/layer{last}/{tap}") for tap in TAPS for k in t)
    src = m["options"]["tap_sources"]
    assert "attn_post_norm-N" in src["attn_out"] and "ffn_post_norm-N" in src["mlp_out"]


def test_c_filter_and_python_path_keep_the_same_tensors(smol_path, llama_cpp, tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    from infertrace.runtimes.llamacpp import ask_filter

    assert ask_filter.load() is not None, "no C compiler here: the filter cannot be tested"
    got = {}
    for name in ("c", "py"):
        if name == "py":
            monkeypatch.setenv("INFERTRACE_NO_CEXT", "1")
        d = tmp_path / name
        r = CliRunner().invoke(app, ["run", "--runtime", "llama.cpp", "-m", str(smol_path), "-p", PROMPT, "-n", "2",
                                     "--save", str(d), "--layers", "0,3,29"])
        assert r.exit_code == 0, r.output
        got[name] = load_file(str(d / "tensors.safetensors"))
    assert sorted(got["c"]) == sorted(got["py"]) and "step0/layer3/mlp_out" in got["c"]
    for k, v in got["c"].items():
        assert (v == got["py"][k]).all(), k
