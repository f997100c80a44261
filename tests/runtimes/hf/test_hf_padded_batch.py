"""``--runtime hf`` on the real SmolLM2: two prompts of known lengths (5 and 2 tokens) as one padded batch,
left and right. Every expected value is hand-worked from HF's rules or computed by HF itself
(``model.generate``, a forward of each prompt alone), never read from infertrace's own output."""

from __future__ import annotations

import json

import pytest
import torch

from infertrace.runtimes.hf.layout import pad_batch
from infertrace.trace.check import check_trace, padding_kv_problem
from tests.helpers.runtime_drive import record

PROMPTS = ("The capital of France is", "Hello there")  # 5 and 2 tokens (asserted below)
NEW = 3
PAD = 2  # SmolLM2's generation_config.pad_token_id (asserted below)


@pytest.fixture(scope="module")
def prompts(smol):
    ids = [smol.tokenizer.encode(p) for p in PROMPTS]
    assert [len(p) for p in ids] == [5, 2]
    return ids


@pytest.fixture(scope="module")
def traces(smol, hf_smol, prompts):
    model = hf_smol[1]
    assert model.generation_config.pad_token_id == PAD
    return {pad: record("hf", smol, prompts, NEW, {"padding": pad}, model=model).to_dict() for pad in ("left", "right")}


# hand-worked: B = 2, T = 5; row 1 holds 2 real tokens, 3 pads; position_ids = cumsum(mask) - 1, pads 0
HAND = {
    "left": {"mask": [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]], "pos": [[0, 1, 2, 3, 4], [0, 0, 0, 0, 1]],
             "ids1": [PAD, PAD, PAD, None, None], "generate_next": [5, 2]},
    "right": {"mask": [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], "pos": [[0, 1, 2, 3, 4], [0, 1, 0, 0, 0]],
              "ids1": [None, None, PAD, PAD, PAD], "generate_next": [5, 1]},  # generate(): last column (a pad, 0) + 1
}


@pytest.mark.parametrize("padding", ["left", "right"])
def test_positions_and_mask_are_the_hand_worked_ones(traces, prompts, padding):
    hand, st0, st1 = HAND[padding], traces[padding]["steps"][0], traces[padding]["steps"][1]
    hf0 = st0["hf"]
    assert hf0["attention_mask"] == hand["mask"] and hf0["position_ids"] == hand["pos"]
    assert [x if h is None else h for x, h in zip(hf0["input_ids"][1], hand["ids1"])] == hf0["input_ids"][1]
    assert [x for x, m in zip(hf0["input_ids"][1], hand["mask"][1]) if m] == prompts[1]
    assert [r["positions"] for r in st0["batch"]] == [[0, 1, 2, 3, 4], [0, 1]]  # real tokens 0..n-1 either way
    # decode step 1: the mask grows by a column of ones; each row's real count is its next position
    assert st1["hf"]["attention_mask"] == [r + [1] for r in hand["mask"]]
    assert st1["hf"]["position_ids"] == [[5], [2]] and [r["positions"] for r in st1["batch"]] == [[5], [2]]
    assert st1["hf"]["generate_position_ids"] == hand["generate_next"]
    assert st1["hf"]["cache_position"] == [5] and st1["hf"]["past_seen_tokens"] == 5
    # HF's own 4-D bool mask, row 1: every real query keeps only real columns at or before it
    rows = hf0["masks"]["full_attention"]["rows"][1]
    real = [j for j, m in enumerate(hand["mask"][1]) if m]
    for i in real:
        assert rows[i] == "".join("1" if (j in real and j <= i) else "0" for j in range(5))
    kv = st0["kv"]["physical"]
    assert kv["rows"][1]["pad_cols"] == ("0..2" if padding == "left" else "2..4")
    assert kv["cache"]["full_attention"] == {"seq_length": 5, "stored": 5}


def test_left_padded_tokens_are_generate_s(traces, hf_smol, prompts):
    """HF itself: ``model.generate`` (greedy) on the same left-padded batch emits the same tokens."""
    model = hf_smol[1]
    ids, am = pad_batch(prompts, "left", PAD)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
    want = out[:, ids.shape[1]:].tolist()
    assert [r["output_ids"] for r in traces["left"]["requests"]] == want
    assert [r["output_ids"] for r in traces["right"]["requests"]] == want  # right padding, positions from the mask


def test_logits_rows_equal_hf_forward_of_each_prompt_alone(traces, hf_smol):
    """Padding invariance as HF gives it: every recorded top logit equals HF's forward of that request alone
    (no padding, no cache) at the same position within 1e-4 (fp32 sdpa with and without a bool mask; the trace
    rounds logits to 5 decimals). Measured: 1.6e-5 on this machine."""
    model = hf_smol[1]
    for padding, tr in traces.items():
        for st in tr["steps"]:
            for b, d in zip(st["batch"], st["decode"]["per_request"]):
                r = tr["requests"][b["seq_id"]]
                ids = (r["prompt_ids"] + r["output_ids"])[: b["positions"][-1] + 1]
                with torch.no_grad():
                    alone = model(torch.tensor([ids])).logits[0, -1]  # [V]
                assert d["top"][0]["id"] == int(alone.argmax()), (padding, st["step"], b["seq_id"])
                for t in d["top"]:
                    assert abs(t["logit"] - float(alone[t["id"]])) < 1e-4, (padding, st["step"], b["seq_id"], t)


def test_right_padding_under_generate_reads_a_pad_column(hf_smol, prompts):
    """Why the runtime samples each row at its last real column: under right padding, generate()'s
    ``logits[:, -1]`` of the short row is a pad column's, far from the real last token's (HF's own numbers)."""
    model = hf_smol[1]
    ids, am = pad_batch(prompts, "right", PAD)
    with torch.no_grad():
        g = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=1, do_sample=False, pad_token_id=PAD,
                           output_logits=True, return_dict_in_generate=True)
        alone = model(torch.tensor([prompts[1]])).logits[0, -1]
    assert float((g.logits[0][1] - alone).abs().max()) > 1.0


@pytest.mark.parametrize("padding", ["left", "right"])
def test_check_passes(traces, padding):
    v, n = check_trace(json.loads(json.dumps(traces[padding])))
    assert v is None, v.line()
    assert n > 300


def test_real_tokens_kv_equal_across_paddings_and_hf_alone(traces, hf_smol, prompts):
    """K/V of real tokens: left == right (padding_kv_problem), and both equal HF's cache of the prompt alone."""
    from transformers import DynamicCache

    assert padding_kv_problem(traces["left"], traces["right"], atol=1e-4) is None
    model = hf_smol[1]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([prompts[1]]), past_key_values=cache, use_cache=True)
    k0 = cache.layers[0].keys[0, 0]  # [n, head_dim] layer 0, kv head 0
    for tr in traces.values():
        rows = {e["pos"]: e for rv in tr["steps"][0]["kv"]["layer_view"]["requests"] if rv["seq_id"] == 1 for e in rv["rows"]}
        for p in range(2):
            assert rows[p]["k"] == pytest.approx(k0[p, :4].tolist(), abs=1e-4)


def test_a_finished_row_stays_in_the_batch_fed_pad(smol, hf_smol, prompts):
    """One request stops after 1 token, the other runs 3: the finished row is fed pad_token_id with mask 1 (as
    generate()), is no request of later steps, and the cache still grows for every row (T + decode steps)."""
    from infertrace.engine.drive import EncodedRequest
    from infertrace.engine.options import EngineOptions, SamplingParams
    from infertrace.runtimes.api import RunSettings
    from infertrace.runtimes.hf.runtime import HfRuntime

    rt = HfRuntime(smol, RunSettings(opts=EngineOptions(), show=("kv", "decode")), model=hf_smol[1])
    rt.add_request(EncodedRequest(prompts[0], SamplingParams(max_new_tokens=1), 0, ""))
    rt.add_request(EncodedRequest(prompts[1], SamplingParams(max_new_tokens=3), 0, ""))
    recs = []
    while (r := rt.step()) is not None:
        recs.append(r)
    assert len(recs) == 3
    assert [[b.seq_id for b in r.trace.batch] for r in recs] == [[0, 1], [1], [1]]
    assert recs[0].native["next_tokens"][0] == PAD and recs[1].native["input_ids"][0] == [PAD]
    assert recs[2].native["attention_mask"][0] == [1] * 5 + [1, 1]
    assert [r.trace.kv.physical["cache"]["full_attention"]["seq_length"] for r in recs] == [5, 6, 7]
    assert recs[2].trace.kv.physical["rows"][0]["fed_pad_cols"] == "5..6"
    assert rt.requests()[0]["stop_reason"] == "max_new_tokens" and len(rt.requests()[1]["output_ids"]) == 3
