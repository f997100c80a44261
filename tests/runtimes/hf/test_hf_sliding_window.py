"""``--runtime hf`` on the real Gemma 3 270M (HF's Gemma3ForCausalLM on the same GGUF): sliding-window layers as
HF builds them (``DynamicSlidingWindowLayer``), both mask functions captured, the run checked clean on both
paddings. Expected values come from HF's own config and classes."""

from __future__ import annotations

import json

import pytest

from infertrace.trace.check import check_trace, padding_kv_problem
from tests.helpers.runtime_drive import record


@pytest.fixture(scope="module")
def runs(gemma_path, hf_gemma):
    from infertrace.runner import load_model

    loaded = load_model(gemma_path, tensors=False)  # tokenizer and config; HF computes from its own copy
    ids = [loaded.tokenizer.encode("The capital of France is"), loaded.tokenizer.encode("Hello there")]
    return hf_gemma[1], {p: json.loads(json.dumps(record("hf", loaded, ids, 2, {"padding": p}, model=hf_gemma[1]).to_dict()))
                         for p in ("left", "right")}


def test_sliding_layers_as_hf_builds_them(runs):
    model, traces = runs
    types = model.config.layer_types  # HF's own per-layer attention types
    W = model.config.sliding_window
    for tr in traces.values():
        T = tr["options"]["hf"]["padded_len"]
        for k, st in enumerate(tr["steps"]):
            hf = st["hf"]
            assert set(hf["masks"]) == {"full_attention", "sliding_attention"}
            assert hf["masks"]["sliding_attention"]["function"] == "create_sliding_window_causal_mask"
            layers = hf["cache"]["layers"]
            assert [d["is_sliding"] for d in layers] == [t == "sliding_attention" for t in types]
            assert {d["class"] for d, t in zip(layers, types) if t == "sliding_attention"} == {"DynamicSlidingWindowLayer"}
            assert all(d["seq_length"] == T + k and d["stored"] == min(T + k, (W - 1) if d["is_sliding"] else T + k)
                       for d in layers)


def test_gemma_runs_check_clean_and_agree_across_paddings(runs):
    _, traces = runs
    for p, tr in traces.items():
        v, _ = check_trace(tr)
        assert v is None, (p, v.line())
    assert [r["output_ids"] for r in traces["left"]["requests"]] == [r["output_ids"] for r in traces["right"]["requests"]]
    assert padding_kv_problem(traces["left"], traces["right"], atol=1e-4) is None
