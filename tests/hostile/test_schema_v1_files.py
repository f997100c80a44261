"""Hostile schema 1 traces (``fixtures/traces/v1/`` mutated) still get one clean ``error:`` line: the
upgrade (:func:`infertrace.trace.upgrade.upgrade`) runs before the validator, which then names the field
and says how the schema 1 file spells a renamed one; a schema 2 trace holding a schema 1 name is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.errors import InfertraceError
from infertrace.trace.store import read_manifest

from tests.helpers.v1_traces import ENV, GOLDEN, V1, v1_manifest as _v1, write_trace as _write  # noqa: F401



def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = e.value.message
    assert "\n" not in msg and "Traceback" not in msg
    return msg


HOSTILE_V1 = {
    "unknown runtime": (lambda d: d.update(engine="nope"), "'runtime' must be one of"),
    "engine options not an object": (lambda d: d["options"].update(engine=[1, 2]), "options.settings"),
    "ctx_size huge": (lambda d: d["options"]["engine"].update(ctx_size=2 ** 40), "MAX_CTX"),
    "num_spec_tokens a string": (lambda d: d["options"]["engine"].update(num_spec_tokens="9" * 5000), "options.settings.num_spec_tokens"),
    "runtime not thread facts": (lambda d: d.update(runtime="vllm"), "schema 1 names who computed 'engine'"),
    "both option names": (lambda d: d["options"].update(settings={}), "options.engine and options.settings both given"),
    "options not an object": (lambda d: d.update(options=7), "'options' must be an object"),
}


@pytest.mark.parametrize("case", list(HOSTILE_V1))
def test_hostile_v1_gets_one_line_errors(tmp_path, case):
    edit, want = HOSTILE_V1[case]
    d = _v1("batching-paged")
    edit(d)
    with pytest.raises(InfertraceError) as e:
        read_manifest(_write(tmp_path, d))
    msg = _one_line(e)
    assert want in msg and "trace.json" in msg, msg
    if want.startswith("options.settings"):  # a renamed field's message says how the old file spells it
        assert "its options.engine is options.settings" in msg, msg
    res = CliRunner().invoke(app, ["show", str(tmp_path / "t")], env=ENV)
    assert res.exit_code == 2 and res.output.startswith("error: ") and res.output.count("\n") == 1, res.output


@pytest.mark.parametrize("edit, want", [
    (lambda d: d.update(engine="infertrace"), "'engine' is the schema 1 name of 'runtime'"),
    (lambda d: d["options"].update(engine={}), "'options.engine' is the schema 1 name of 'options.settings'"),
])
def test_v2_refuses_the_v1_names(tmp_path, edit, want):
    d = json.loads((GOLDEN / "batching-paged" / "trace.json").read_text())
    edit(d)
    with pytest.raises(InfertraceError) as e:
        read_manifest(_write(tmp_path, d))
    assert want in _one_line(e)


# ----------------------------------------------------------------------------- breaker: report facts of a hostile trace

UNSAFE = ("\x1b", "\x07", "\u202e")


@pytest.mark.parametrize("src", [V1 / "worked-example-cells", GOLDEN / "worked-example-cells"], ids=["schema1", "schema2"])
def test_report_facts_show_control_and_bidi_characters_of_notes_and_model_file(tmp_path, src):
    """The report's header facts (model file, notes) reached the HTML with raw ESC / BEL / U+202E (only the
    <title> and <h1> went through visible()): an RLO in a note reorders what the reader sees."""
    d = json.loads((src / "trace.json").read_text(encoding="utf-8"))
    evil = "evil\u202egguf.\x1b[31m\x07<b>x</b>"
    d["notes"] = [evil]
    d["model"]["file"] = evil
    t = _write(tmp_path, d)
    out = tmp_path / "r.html"
    res = CliRunner().invoke(app, ["report", str(t), "-o", str(out)], env=ENV)
    assert res.exit_code == 0, res.output
    html = out.read_text(encoding="utf-8")
    assert not [c for c in UNSAFE if c in html]
    assert "evil\\u202egguf.\\x1b[31m\\x07&lt;b&gt;x&lt;/b&gt;" in html


def test_a_huge_schema_version_is_cut_in_the_message(tmp_path):
    """schema_version 10**400 printed all 401 digits in the one line (a number the file controls, unbounded up to
    Python's 4300-digit parse limit)."""
    d = json.loads((GOLDEN / "worked-example-cells" / "trace.json").read_text(encoding="utf-8"))
    d["schema_version"] = 10 ** 400
    with pytest.raises(InfertraceError) as e:
        read_manifest(_write(tmp_path, d))
    msg = _one_line(e)
    assert len(msg) < 200 and "(401 digits)" in msg and "upgrade infertrace" in msg, msg
