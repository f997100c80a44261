"""``run --teacher-force DIR`` for every runtime that can emit given tokens (infertrace, llama.cpp, hf): the run
emits DIR's tokens and records which trace it followed (``options.teacher_force``: path and the SHA-256 of its
trace.json), ``check`` does not hold a forced greedy row to its top logit, and ``bisect`` says B followed A.
The reference values are HF's own: its greedy continuation differs from the sampled trace it is forced onto.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app

PROMPT = "Once upon a time"


def _cli(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def sampled(tmp_path_factory, smol):
    d = tmp_path_factory.mktemp("tf") / "a"
    r = _cli("run", "-p", PROMPT, "-n", "6", "--temperature", "0.9", "--seed", "3", "--save", d)
    assert r.exit_code == 0, r.output
    return d


@pytest.mark.hf
def test_hf_follows_a_sampled_trace_and_bisect_compares_every_position(sampled, hf_smol, tmp_path):
    a = json.loads((sampled / "trace.json").read_text())
    b_dir, g_dir = tmp_path / "b", tmp_path / "g"
    assert _cli("run", "--runtime", "hf", "-p", PROMPT, "-n", "6", "--teacher-force", sampled, "--save", b_dir).exit_code == 0
    assert _cli("run", "--runtime", "hf", "-p", PROMPT, "-n", "6", "--save", g_dir).exit_code == 0
    b, g = (json.loads((d / "trace.json").read_text()) for d in (b_dir, g_dir))
    assert b["requests"][0]["output_ids"] == a["requests"][0]["output_ids"]
    assert g["requests"][0]["output_ids"] != a["requests"][0]["output_ids"]  # HF greedy on its own goes elsewhere
    assert b["options"]["teacher_force"]["trace_sha256"] == hashlib.sha256((sampled / "trace.json").read_bytes()).hexdigest()
    assert _cli("check", b_dir).exit_code == 0
    r = _cli("bisect", sampled, b_dir, "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    n = len(a["requests"][0]["prompt_ids"]) + 6
    assert rep["tokens"]["compared_positions"] == n and rep["tokens"]["first_token_differs_at"] is None
    assert any("B was teacher-forced on A" in x for x in rep["notes"])


def test_runtimes_that_sample_their_own_tokens_refuse_in_one_line(sampled):
    r = _cli("run", "--runtime", "vllm", "-p", PROMPT, "-n", "2", "--teacher-force", sampled)
    assert r.exit_code == 2 and r.output.count("\n") == 1
    assert "--teacher-force needs --runtime infertrace or llama.cpp or hf" in r.output
    r = _cli("run", "-p", PROMPT, "-n", "2", "--teacher-force", sampled, "--speculative", "ngram")
    assert r.exit_code == 2 and "does not combine with speculative decoding" in r.output, r.output


def test_ours_forced_on_its_own_sampled_trace_emits_it(sampled, tmp_path):
    d = tmp_path / "o"
    assert _cli("run", "-p", PROMPT, "-n", "6", "--teacher-force", sampled, "--save", d).exit_code == 0
    a, b = (json.loads((x / "trace.json").read_text()) for x in (sampled, d))
    assert b["requests"][0]["output_ids"] == a["requests"][0]["output_ids"]
    assert _cli("check", d).exit_code == 0


def test_bisect_says_which_positions_a_speculative_trace_leaves_out(tmp_path, smol):
    p = "the cat the cat the cat the cat"
    plain, spec = tmp_path / "plain", tmp_path / "spec"
    assert _cli("run", "-p", p, "-n", "8", "--save", plain).exit_code == 0
    assert _cli("run", "-p", p, "-n", "8", "--speculative", "ngram", "--save", spec).exit_code == 0
    m = json.loads((spec / "trace.json").read_text())
    verify = sum(b["T"] for st in m["steps"] for b in st["batch"] if b.get("spec"))
    assert verify > 0  # the n-gram drafter proposed on this repetitive prompt
    r = _cli("bisect", plain, spec, "--json")
    rep = json.loads(r.output)
    assert any(f"ran {verify} row(s)" in x and "not compared" in x for x in rep["notes"]), rep["notes"]
