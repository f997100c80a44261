"""`diff DIR --seq 0 --seq 1` (two requests of one trace) and `diff CELLS PAGED` of this engine's saved traces
(the logical comparison diff-backends runs), issue 31 items 4 and 5.

Reference values, worked by hand: the prompt "The capital of France is Paris, and the capital of Italy is" is
13 SmolLM2 tokens; with 4 tokens per block its first 12 tokens fill 3 full blocks, which the paged prefix cache
hashes, so the identical second request arriving later hits 12 tokens (block ids 0, 1, 2 shared) and computes
only token 12. Its served positions 0..11 are the slots seq 0 wrote at step 0 (its prefill), so their K/V are
the same numbers (|Δ| = 0); greedy decoding of both gives " Rome." (HF transformers on the same GGUF).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app

pytestmark = pytest.mark.model

PROMPT = "The capital of France is Paris, and the capital of Italy is"


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "120"})


@pytest.fixture(scope="module")
def hit(tmp_path_factory):
    d = tmp_path_factory.mktemp("hit") / "t"
    r = invoke("run", "-p", PROMPT, "-p", PROMPT, "--arrival", "0", "--arrival", "3", "--backend", "paged",
               "--prefix-cache", "on", "--tokens-per-block", "4", "-n", "4", "--save", d)
    assert r.exit_code == 0, r.output
    return d


def test_two_requests_of_one_trace_with_a_prefix_hit(hit):
    res = invoke("diff", hit, "--seq", "0", "--seq", "1")
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "prompt: identical (13 ids)" in out and "output: identical (4 ids)" in out
    assert "positions 0..15 (16 of the 16 both fed): token ids, position ids and visible keys identical" in out
    assert "served from the prefix cache for seq 0: none (computed itself)" in out
    assert "served from the prefix cache for seq 1: positions 0..11 (12), computed by seq 0 at step 0" in out
    assert "· shared [0, 1, 2]" in out
    js = json.loads(invoke("diff", hit, "--seq", "0", "--seq", "1", "--json").stdout)
    assert js["reads"]["shared"] == [0, 1, 2] and js["served"]["b"]["count"] == 12 and js["served"]["a"] is None
    assert js["logits"]["rows"] == 4 and js["logits"]["same_top"] == 4
    assert js["kv"]["positions"] == 16 and js["kv"]["n_over"] == 0
    assert js["kv"]["source"].startswith("kept tensors")


def test_served_positions_hold_the_writers_kv_exactly(hit):
    """Independent of diff: read both requests' cache tensors and compare the 12 served rows directly."""
    import numpy as np

    from infertrace.trace.store import load_tensors, read_manifest

    m = read_manifest(hit)
    t = load_tensors(hit, m)
    last = {sid: max(int(n.split("/")[0][4:]) for n in t.names() if n.endswith(f"seq{sid}/k_cache")) for sid in (0, 1)}
    k0 = np.asarray(t.array(f"step{last[0]}/layer0/seq0/k_cache"))
    k1 = np.asarray(t.array(f"step{last[1]}/layer0/seq1/k_cache"))
    assert np.array_equal(k0[:12], k1[:12])  # the same slots: bitwise
    from infertrace.trace.seq_diff import compare_seqs

    r = compare_seqs(m, 0, m, 1, t, t)
    assert r["kv"]["max_abs_k"] == pytest.approx(float(np.abs(k0[:16] - k1[:16]).max()), abs=0)


def test_seq_errors_are_one_line(hit):
    for args, msg in ((["--seq", "0"], "got 1 --seq"), (["--seq", "0", "--seq", "7"], "has no request 7 (seq ids [0, 1])"),
                      ([], "diff needs two traces (diff A B) or two requests")):
        r = invoke("diff", hit, *args)
        assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, r.output


def test_different_prompts_differ(tmp_path):
    d = tmp_path / "t"
    assert invoke("run", "-p", "The capital of France is", "-p", "The capital of Spain is", "--save", d, "-n", "2",
                  "--keep", "summary").exit_code == 0
    res = invoke("diff", d, "--seq", "0", "--seq", "1")
    assert res.exit_code == 1
    # HF transformers' tokenizer on the same GGUF: ' France' is 4649, ' Spain' 7476
    assert "prompt: first differs at prompt_ids[3]: 4649 vs 7476" in res.stdout


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    d = tmp_path_factory.mktemp("be")
    for be in ("cells", "paged"):
        r = invoke("run", "-p", "The capital of France is", "-p", "Hello", "--arrival", "0", "--arrival", "1",
                   "--backend", be, "-n", "3", "--save", d / be)
        assert r.exit_code == 0, r.output
    return d


def test_saved_cells_and_paged_compare_logically(backends):
    res = invoke("diff", backends / "cells", backends / "paged")
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "the logical comparison diff-backends runs" in out and "options.backend" not in out
    for var in ("schedule", "positions", "mask", "kv", "tokens", "logits"):
        assert any(x.strip().startswith(var) and x.endswith("identical") for x in out.splitlines()), var
    assert "A cells: kq_mask ne [256, 5, 1, 1]" in out and "B paged: block_tables [[0]]" in out
    js = json.loads(invoke("diff", backends / "cells", backends / "paged", "--json").stdout)
    assert js["equal"] is True and js["cross_engine"]["summary"]["kv"]["source"] == ["tensors"]
    assert js["cross_engine"]["summary"]["kv"]["compared"] == 4


def test_saved_backends_agree_with_live_diff_backends(backends):
    """The live diff-backends on the same requests gives the same verdict and a logits |Δ| of the same size."""
    live = CliRunner().invoke(app, ["diff-backends", "-p", "The capital of France is", "-p", "Hello", "--arrival", "0",
                                    "--arrival", "1", "-n", "3", "--json"])
    assert live.exit_code == 0, live.output
    rep = json.loads(live.stdout)
    js = json.loads(invoke("diff", backends / "cells", backends / "paged", "--json").stdout)
    assert rep["identical"] is True and js["equal"] is True
    assert rep["summary"]["steps"] == js["cross_engine"]["summary"]["schedule"]["compared"]
    assert js["cross_engine"]["summary"]["logits"]["max_abs"] <= max(rep["summary"]["logits"]["max_abs"], 1e-5) + 1e-5


def test_a_changed_visible_set_is_a_mask_difference(backends, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(backends / "paged", bad)
    d = json.loads((bad / "trace.json").read_text())
    d["steps"][1]["batch"][0]["visible"][0] = "0..2"  # hand-made: query 5 of seq 0 'sees' only 0..2
    (bad / "trace.json").write_text(json.dumps(d))
    res = invoke("diff", backends / "cells", bad, "--no-tensors")
    assert res.exit_code == 1
    assert "mask      4 steps compared: differs at step(s) [1]" in res.stdout
