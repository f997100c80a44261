"""The study's appendix B (Qwen3.5-0.8B, TensorRT-LLM convention) from a run: ``make-qwen35`` writes
the 0.8B configuration with random bf16 weights (1.4 GiB in a temp dir), ``run`` on the study's
8-token example (paged, bfloat16) prints the tables, and every shape / dtype of them is asserted
from the saved trace (measured in the run, not derived from the config).

Cost measured on the 2-core dev machine: ~10 s to write the checkpoint, ~5 s to load and run.
"""

import json

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app

runner = CliRunner()


@pytest.fixture(scope="module")
def run08(tmp_path_factory):
    root = tmp_path_factory.mktemp("q08")
    ck = root / "ckpt"
    r = runner.invoke(app, ["make-qwen35", "--out", str(ck)])
    assert r.exit_code == 0, r.output
    assert "random weights" in r.output and "the tokens are not the real model's" in r.output
    r = runner.invoke(app, ["run", "--model", str(ck), "--prompt", "Hi Qwen!", "--max-new-tokens", "2", "--backend", "paged",
                            "--dtype", "bfloat16", "--save", str(root / "trace")])
    assert r.exit_code == 0, r.output
    trace = json.loads((root / "trace" / "trace.json").read_text())
    return r.output, trace, root


def test_appendix_b_prefill_values_measured(run08):
    out, tr, _ = run08
    st = tr["steps"][0]
    h = st["hybrid"]
    assert [b["T"] for b in st["batch"]] == [8] and st["batch"][0]["C"] == 0  # the study's 8-token prompt
    assert h["input_ids"]["shape"] == [8]
    assert h["hidden"] == {"shape": [8, 1024], "dtype": "BF16"}
    assert h["positions"]["position_ids_shape"] == [3, 1, 8] and h["positions"]["position_ids"] == [list(range(8))] * 3
    assert h["positions"]["inp_pos_len"] == 32  # llama.cpp: n_tokens x n_pos_per_embd (4)
    assert st["mask"]["metadata"]["kv_lens"] == [8] and st["mask"]["kq_mask"] is None  # no dense mask on paged
    assert st["kv"]["per_request"][0]["shape_after"] == [8, 2, 256] and st["kv"]["dtype"] == "bfloat16"
    assert st["kv"]["physical_shape"][1:] == [2, 2, 32, 256]  # [pages, 2, kv heads, tokens_per_block, head_dim]
    s = h["state"]
    assert s["conv_shape"] == [6144, 3] and s["rec_shape"] == [16, 128, 128] and s["dtype"] == "BF16"
    assert s["n_layers"] == 18 and len(h["layer_map"]["full_attention"]) == 6
    assert h["layer_map"]["full_attention"] == [3, 7, 11, 15, 19, 23]
    assert st["decode"]["logits_shape"] == [1, 248320] and st["decode"]["logits_dtype"] == "float32"
    assert "layer map (18 GDN + 6 full-attention)" in out and "Prefill (T = 8, C = 0)" in out


def test_appendix_b_decode_step_1_values_measured(run08):
    out, tr, _ = run08
    st0, st = tr["steps"][0], tr["steps"][1]
    h = st["hybrid"]
    assert st["batch"][0]["phase"] == "decode" and st["batch"][0]["positions"] == [8]
    assert h["positions"]["position_ids_shape"] == [3, 1, 1] and h["positions"]["position_ids"][0] == [8]
    p = h["projection"]
    assert p["h"]["shape"] == [1, 1024] and p["qkv"]["shape"] == [1, 5120] and p["qkv"]["dtype"] == "BF16"
    assert p["q"]["shape"] == [1, 2048] and p["gate"]["shape"] == [1, 2048]
    assert p["k"]["shape"] == [1, 512] and p["v"]["shape"] == [1, 512] and p["heads"] == [8, 2, 256]
    assert p["attn_out"]["shape"] == [1, 2048] and p["o_proj"]["shape"] == [1, 1024]
    assert st["mask"]["metadata"]["kv_lens"] == [9]
    kv = st["kv"]["per_request"][0]
    assert kv["shape_before"] == [8, 2, 256] and kv["shape_after"] == [9, 2, 256]
    assert st["decode"]["logits_shape"] == [1, 248320]
    # the state keeps its shape and moves its values; K/V grew by one row
    s0, s1 = st0["hybrid"]["state"], h["state"]
    assert s0["rec_shape"] == s1["rec_shape"] and s0["conv_shape"] == s1["conv_shape"]
    a, b = s0["per_seq"][0]["layers"][0], s1["per_seq"][0]["layers"][0]
    assert a["rec_sum"] != b["rec_sum"] and a["conv_sum"] != b["conv_sum"]
    assert "Decode step (T = 1, C = 8, position = 8)" in out and "[1, 248320] F32" in out


def test_saved_hybrid_trace_round_trips_and_checks(run08):
    _, tr, root = run08
    r = runner.invoke(app, ["check", str(root / "trace")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["show", str(root / "trace"), "--steps", "1"])
    assert r.exit_code == 0, r.output
    assert "hybrid state" in r.output and "[16, 128, 128]" in r.output
