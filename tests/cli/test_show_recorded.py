"""`show DIR --var V` on a trace saved without V (`run --save --keep mask`: --keep chooses what is recorded,
--show only displays): V is named as not recorded on one line (exit 2 when nothing asked was recorded; the
rest rendered otherwise)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from infertrace.cli.app import app


def test_show_var_not_recorded_says_so_in_one_line(tmp_path):
    from tests.helpers.tiny import make_weights, write_gguf

    w, s = make_weights(seed=5)
    gguf = write_gguf(tmp_path / "m.gguf", w, s)
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["run", "--model", str(gguf), "-p", "abcd", "-n", "2", "--keep", "mask", "--save", str(out)])
    assert r.exit_code == 0, r.output
    d = json.loads((out / "trace.json").read_text())
    assert d["options"]["show"] == ["mask"] and d["steps"][0]["kv"] is None  # kv was not kept, so not recorded
    bad = CliRunner().invoke(app, ["show", str(out), "--var", "kv"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert len(bad.output.strip().splitlines()) == 1 and "kv not recorded" in bad.output and "keeping only mask" in bad.output
    both = CliRunner().invoke(app, ["show", str(out), "--var", "mask,kv"])
    assert both.exit_code == 0 and "kv not recorded" in both.output and "kq_mask" in both.output
