"""``infertrace check`` / ``show`` on saved ``--runtime hf`` traces of the real SmolLM2, the dense rules catching
planted defects (each mutant breaks one HF rule, named), and the settings HF cannot honour refused in one line."""

from __future__ import annotations

import copy
import json

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.engine.drive import EncodedRequest
from infertrace.engine.options import EngineOptions, SamplingParams
from infertrace.errors import InfertraceError
from infertrace.runtimes.api import RunSettings
from infertrace.trace.check import check_trace
from infertrace.trace.records import RunTrace
from infertrace.trace.store import save_trace
from tests.helpers.runtime_drive import record


@pytest.fixture(scope="module")
def ragged(smol, hf_smol):
    """Left padding, a 5- and a 2-token prompt; the short one stops after 1 token (a finished row kept padded)."""
    ids = [smol.tokenizer.encode("The capital of France is"), smol.tokenizer.encode("Hello there")]
    tr = record("hf", smol, ids, native={"padding": "left"}, model=hf_smol[1],
                params=[SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=1)])
    return tr.to_dict()


def test_a_ragged_run_checks_clean_and_saves(ragged, tmp_path):
    v, _ = check_trace(copy.deepcopy(ragged))
    assert v is None, v.line()
    assert [len(st["batch"]) for st in ragged["steps"]] == [2, 1, 1]
    out = tmp_path / "t"
    save_trace(RunTrace.from_dict(copy.deepcopy(ragged)), out)
    res = CliRunner().invoke(app, ["check", str(out)])
    assert res.exit_code == 0, res.output
    assert "no violation" in res.output
    res = CliRunner().invoke(app, ["show", str(out), "--step", "0,1", "--var", "mask,kv"], env={"COLUMNS": "160"})
    assert res.exit_code == 0, res.output
    assert "dense batch [B=2, q=5]" in res.output and "left padding" in res.output
    assert "create_causal_mask returned bool [2, 1, 5, 5]" in res.output
    assert "(finished: fed pad, mask 1)" in res.output  # step 1: row 1 has stopped


def _pad_col_kept(m):
    hf = m["steps"][0]["hf"]
    row = hf["masks"]["full_attention"]["rows"][1]
    row[4] = "1" + row[4][1:]  # row 1 (left-padded: pads 0..2), its last real query keeps pad column 0


def _pad_position(m):
    m["steps"][0]["hf"]["position_ids"][1][0] = 1  # HF fills pad columns with 0


def _cache_len(m):
    m["steps"][1]["hf"]["cache"]["layers"][3]["seq_length"] = 5  # after decode step 1 every layer holds T + 1 = 6


def _right_layout(m):
    hf = m["steps"][0]["hf"]
    hf["attention_mask"][1] = [1, 1, 0, 0, 0]  # right-padded row in a left-padded trace


def _kv_column(m):
    m["steps"][0]["hf"]["kv_layer"]["rows"][1]["columns"][0]["k"][0] += 0.5


def _logit_column(m):
    m["steps"][0]["hf"]["logits"]["columns"][1][1] = 3  # row 1's last real column is 4


def _no_hf_section(m):
    del m["steps"][1]["hf"]


@pytest.mark.parametrize("mutate, rule", [
    (_pad_col_kept, "pad columns masked"), (_pad_position, "position_ids from the mask"), (_cache_len, "cache lengths"),
    (_right_layout, "dense layout [B, T]"), (_kv_column, "K/V at the row's columns"),
    (_logit_column, "logits at the last real column"), (_no_hf_section, "the runtime named in the header"),
], ids=lambda x: getattr(x, "__name__", x))
def test_check_catches_a_dense_defect(ragged, mutate, rule):
    m = copy.deepcopy(ragged)
    mutate(m)
    v, _ = check_trace(m)
    assert v is not None and v.rule == rule, v and v.line()


@pytest.mark.parametrize("native, opts, msg", [
    ({"padding": "middle"}, {}, "padding must be left or right (got 'middle')"),
    ({"paddding": "left"}, {}, "does not know the setting 'paddding'"),
    ({}, {"prefix_cache": True}, "no prefix cache"),
    ({}, {"speculative": "ngram"}, "no speculative decoding"),
], ids=["unknown-padding", "misspelt-key", "prefix-cache", "speculative"])
def test_bad_settings_are_one_line_refusals(smol, native, opts, msg):
    from infertrace.runtimes.hf.runtime import HfRuntime

    with pytest.raises(InfertraceError) as e:
        HfRuntime.check(RunSettings(opts=EngineOptions(**opts), native=native), smol.config)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_a_late_arrival_is_refused(smol, hf_smol):
    from infertrace.runtimes.hf.runtime import HfRuntime

    rt = HfRuntime(smol, RunSettings(opts=EngineOptions()), model=hf_smol[1])
    with pytest.raises(InfertraceError, match="every request arrives at step 0"):
        rt.add_request(EncodedRequest([1, 2], SamplingParams(), 2, ""))
    rt.add_request(EncodedRequest([1, 2], SamplingParams(max_new_tokens=1), 0, ""))
    rt.step()
    with pytest.raises(InfertraceError, match="every request is added before the first step"):
        rt.add_request(EncodedRequest([1, 2], SamplingParams(), 0, ""))


def test_a_saved_trace_naming_an_unknown_runtime_is_refused(ragged, tmp_path):
    out = tmp_path / "t"
    save_trace(RunTrace.from_dict(copy.deepcopy(ragged)), out)
    m = json.loads((out / "trace.json").read_text())
    m["runtime"] = "hf2"
    (out / "trace.json").write_text(json.dumps(m))
    res = CliRunner().invoke(app, ["check", str(out)])
    assert res.exit_code == 2 and "'runtime' must be one of infertrace, llama.cpp, vllm, hf" in res.output


def test_no_pad_column_means_sdpa_runs_is_causal(smol, hf_smol):
    """Two prompts of the same length: no pad column, so HF's create_causal_mask returns None under sdpa (its
    ``_ignore_causal_mask_sdpa``) and the trace says ``none: is_causal``; the run checks clean, and the same
    record with a pad column planted in the mask is a violation (nothing would drop it)."""
    ids = [smol.tokenizer.encode("The capital of France is"), smol.tokenizer.encode("One two three four five")]
    assert len(ids[0]) == len(ids[1])
    m = record("hf", smol, ids, 2, {"padding": "left"}, model=hf_smol[1]).to_dict()
    assert hf_smol[1].config._attn_implementation == "sdpa"
    assert [st["hf"]["masks"]["full_attention"]["returned"] for st in m["steps"]] == ["none: is_causal"] * 2
    v, _ = check_trace(copy.deepcopy(m))
    assert v is None, v.line()
    m["steps"][0]["hf"]["attention_mask"][1][0] = 0
    v, _ = check_trace(m)
    assert v is not None and v.rule in ("dense layout [B, T]", "pad columns masked")


@pytest.mark.parametrize("mutate, phrase", [
    (_pad_position, "row 1: position_ids [1, 0, 0, 0, 1]"),  # left-padded "Hello there": pads 0..2, real 3..4
    (_right_layout, "row 1 (left padding, prompt of 2 tokens in T = 5)"),
], ids=lambda x: getattr(x, "__name__", "phrase"))
def test_show_refuses_a_dense_trace_that_breaks_a_dense_rule(ragged, tmp_path, mutate, phrase):
    """show draws HF's dense batch (input_ids / attention_mask / position_ids) as fact; a saved trace whose hf
    section breaks a dense rule (variable hf) is refused in one line, as a broken mask or kv is."""
    out = tmp_path / "t"
    save_trace(RunTrace.from_dict(copy.deepcopy(ragged)), out)
    m = json.loads((out / "trace.json").read_text())
    mutate(m)
    v, _ = check_trace(copy.deepcopy(m))
    assert v is not None and v.variable == "hf", v and v.line()
    (out / "trace.json").write_text(json.dumps(m))
    res = CliRunner().invoke(app, ["show", str(out)], env={"COLUMNS": "160"})
    text = res.output.strip()
    assert res.exit_code == 2 and len(text.splitlines()) == 1, text
    assert "inconsistent trace, not shown" in text and phrase in text, text
