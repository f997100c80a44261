"""What `run` prints and what `--save` records (issue 31, items 1 and 9).

* The default `run` prints the header, the worked-example table, the outputs and a one-line summary;
  `--show VAR` adds VAR's panel for each step, `--show all` is the full output (every panel).
* `--show` is display only: `--save` records all five variables unless `--keep` says otherwise, and the
  trace lists the variables it recorded (`options.show`).
* `diff` of a full trace and one saved with `--keep mask` says in one line which variables B lacks and
  compares the rest; no rate is ever printed over zero rows.

Reference values: SmolLM2-135M greedy continues "The capital of France is" with " Paris" (HF transformers on
the same GGUF, tests/real_models/test_real_model.py); the prompt is 5 tokens, so 3 new tokens take 3 steps and 7 tokens.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app

pytestmark = pytest.mark.model

PROMPT = "The capital of France is"
ENV = {"COLUMNS": "120"}
PANELS = ("hidden · step", "positions · step", "mask · step", "kv · step", "decode · step")
VARS = ["hidden", "positions", "mask", "kv", "decode"]


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def _ok(res):
    assert res.exit_code == 0, (res.output, res.exception)
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs")
    base = ("run", "-p", PROMPT, "-n", "3")
    default = _ok(invoke(*base, "--save", d / "full"))
    full = _ok(invoke(*base, "--show", "all"))
    mask_shown = _ok(invoke(*base, "--show", "mask", "--save", d / "shown", "--keep", "summary"))
    kept = _ok(invoke(*base, "--save", d / "kept", "--keep", "summary,mask"))
    return d, default, full, mask_shown, kept


def test_default_run_is_the_table_and_a_summary(runs):
    _, default, full, _, _ = runs
    out = default.stdout
    assert "worked example" in out and "' Paris'" in out
    assert not any(p in out for p in PANELS)  # no per-step panel by default
    last = out.rstrip().splitlines()
    assert last[-2].startswith("output seq 0: 'The capital of France is' → ' Paris")
    # 3 steps (prefill + 2 decodes), 5 + 1 + 1 tokens computed, 3 generated
    assert last[-1].startswith("3 steps · 7 tokens computed · 3 generated · per-step panels: --show")
    assert len(out.splitlines()) < 40
    # --show all is the former full output: every panel of every step, and the default's lines around them
    for p in PANELS:
        assert full.stdout.count(p) == 3, p
    head = out.split("\noutput seq 0")[0].rsplit("\n", 1)[0]  # header and table (before the rule above the outputs)
    assert full.stdout.startswith(head) and full.stdout.split("\noutput seq 0")[1] == out.split("\noutput seq 0")[1].rsplit("\n", 2)[0] + "\n"
    assert len(full.stdout.splitlines()) > 5 * len(out.splitlines())


def test_show_is_display_only_keep_chooses_what_is_recorded(runs):
    d, _, _, mask_shown, _ = runs
    assert "mask · step 0" in mask_shown.stdout and "kv · step 0" not in mask_shown.stdout
    shown = json.loads((d / "shown" / "trace.json").read_text())
    assert shown["options"]["show"] == VARS  # --show mask: all five recorded
    assert all(shown["steps"][0][v] is not None for v in VARS)
    kept = json.loads((d / "kept" / "trace.json").read_text())
    assert kept["options"]["show"] == ["mask"]  # --keep summary,mask: the trace says what it kept
    assert kept["steps"][0]["mask"] is not None and kept["steps"][0]["kv"] is None and kept["steps"][0]["hidden"] is None
    assert not (d / "kept" / "tensors.safetensors").exists()


def test_show_of_an_unkept_variable_is_one_note(tmp_path):
    res = _ok(invoke("run", "-p", PROMPT, "-n", "1", "--save", tmp_path / "t", "--keep", "summary,mask", "--show", "kv,mask"))
    notes = [x for x in res.stderr.splitlines() if x.startswith("note:")]
    assert notes == ["note: --show kv: not recorded (--keep summary,mask); no panel for it"]
    assert "mask · step 0" in res.stdout and "kv · step 0" not in res.stdout


def test_diff_names_the_unrecorded_variables_in_one_line(runs):
    d, *_ = runs
    res = invoke("diff", d / "full", d / "kept")
    lines = res.stdout.splitlines()
    why = [x for x in lines if "was saved without" in x]
    assert why == [f"{d / 'kept'} was saved without hidden, positions, kv, decode (run --save --keep mask): they are not compared"]
    assert "0/0" not in res.stdout and "(100.0%)" not in res.stdout
    # the same run: what both hold (the schedule, the mask, the requests) is identical
    assert res.exit_code == 0, res.stdout
    assert "no difference between" in lines[-1]
    js = json.loads(invoke("diff", d / "full", d / "kept", "--json").stdout)
    assert js["equal"] is True and js["not_compared"]["variables"] == ["hidden", "positions", "kv", "decode"]
    # show names the variable the trace lacks, and --var errors name --var
    miss = invoke("show", d / "kept", "--var", "kv")
    assert miss.exit_code == 2 and "keeping only mask" in miss.stderr
    bad = invoke("show", d / "kept", "--var", "foo")
    assert bad.exit_code == 2 and "unknown variable 'foo' in --var" in bad.stderr


def test_a_rate_over_zero_rows_is_never_printed():
    from infertrace.present.render_llamacpp import rate_text
    from infertrace.present.render_runtimes import logical_lines
    from infertrace.trace.diff import DiffResult
    from infertrace.trace.engine_diff import floats

    f = floats({"steps": [{"step": 0}]}, {"steps": [{"step": 0}]})  # no decode record on either side
    assert f["rows"] == 0 and f["same_top_rate"] is None
    assert rate_text("same top token", f) == "same top token: not compared (no logits row in both traces)"
    assert rate_text("same top token", {"rows": 4, "same_top": 3, "same_top_rate": 0.75}) == "same top token 3/4 (75.0%)"
    info = {"engines": ["llama.cpp", "vllm"], "conventions": ["cells", "paged"], "note": "n", "requests": [],
            "next_token": {"rows": 0, "same_top": 0, "same_top_rate": None, "topk_overlap_mean": None, "max_abs_logit": 0.0,
                           "rows_only_a": 0, "rows_only_b": 0, "disagreements": []}}
    text = "\n".join(logical_lines(DiffResult(None, 0, 0.0, 0.0), info))
    assert "next token: not compared" in text and "%" not in text
