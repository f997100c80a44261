"""Schema 1 traces still read: ``fixtures/traces/v1/`` holds goldens saved before schema 2 (copies of
``fixtures/golden/*/trace.json`` as they were), which ``read_manifest`` upgrades in memory
(:func:`infertrace.trace.upgrade.upgrade`) to exactly the regenerated schema 2 goldens; ``check``, ``show``
and ``diff`` treat the two the same (hostile schema 1 input: tests/hostile/test_schema_v1_files.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.trace.records import SCHEMA_VERSION
from infertrace.trace.store import load_trace, read_manifest, save_trace
from infertrace.trace.upgrade import upgrade

from tests.helpers.v1_traces import ENV, GOLDEN, V1, v1_manifest as _v1, write_trace as _write  # noqa: F401

NAMES = ["batching-paged", "worked-example-cells"]


@pytest.mark.parametrize("name", NAMES)
def test_v1_fixture_reads_as_its_v2_regeneration(name):
    raw = _v1(name)
    assert raw["schema_version"] == 1 and "engine" in raw and "engine" in raw["options"]  # really the old format
    m = read_manifest(V1 / name)
    assert SCHEMA_VERSION == 2 and m["schema_version"] == 2
    assert m == read_manifest(GOLDEN / name)  # the renamed keys are the only difference
    assert "engine" not in m and m["runtime"] == "infertrace" and "engine" not in m["options"]
    assert m["options"]["settings"] == raw["options"]["engine"]
    tr = load_trace(V1 / name)
    assert tr.runtime == "infertrace" and tr.schema_version == 2 and tr.options["settings"]["backend"] == raw["options"]["backend"]


def test_upgrade_is_pure():
    raw = _v1("batching-paged")
    before = copy.deepcopy(raw)
    up = upgrade(raw)
    assert raw == before and up is not raw
    assert upgrade(up) is up  # the current schema comes back as is
    assert set(raw) ^ set(up) == {"engine", "runtime"}


@pytest.mark.parametrize("name", NAMES)
def test_check_show_and_diff_agree_on_v1_and_v2(name):
    r = CliRunner()
    ok = r.invoke(app, ["check", str(V1 / name), "--json"], env=ENV)
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["ok"] and json.loads(ok.stdout)["runtime"] == "infertrace"
    a, b = (r.invoke(app, ["show", str(d / name)], env=ENV) for d in (V1, GOLDEN))
    assert a.exit_code == b.exit_code == 0, a.output + b.output
    assert a.stdout == b.stdout
    d = r.invoke(app, ["diff", str(V1 / name), str(GOLDEN / name), "--json"], env=ENV)
    assert d.exit_code == 0 and json.loads(d.stdout)["equal"] is True, d.output


def test_saving_a_v1_trace_writes_v2(tmp_path):
    tr = load_trace(V1 / "worked-example-cells")
    save_trace(tr, tmp_path / "again")
    m = json.loads((tmp_path / "again" / "trace.json").read_text())
    assert m["schema_version"] == 2 and m["runtime"] == "infertrace" and "settings" in m["options"]
    assert "engine" not in m and "engine" not in m["options"]


def test_v1_timing_thread_facts_still_read(tmp_path):
    t = _write(tmp_path, _v1("worked-example-cells"))
    (t / "timing.json").write_text(json.dumps({"steps": [{"step": 0, "time_ms": 1.5}],
                                               "runtime": {"threads": 3, "threads_reason": "--threads"}}))
    tr = load_trace(t)
    assert tr.threads == {"n": 3, "reason": "--threads"} and tr.steps[0].time_ms == 1.5
