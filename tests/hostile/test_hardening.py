"""Bad input found by adversarial testing: each gives one line, exit 2, and loses nothing."""

import json

import pytest
import torch
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.errors import InfertraceError
from infertrace.loading.weights import load_checkpoint
from tests.helpers.tiny import make_weights, write_gguf, write_hf

runner = CliRunner()


def _err(*args):
    res = runner.invoke(app, list(args))
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in res.output, res.output
    return lines[0]


def test_tensor_shape_disagreeing_with_config(tmp_path):
    w, s = make_weights()
    w["model.layers.0.mlp.down_proj.weight"] = w["model.layers.0.mlp.down_proj.weight"][:, :40]
    msg = _err("run", "-m", str(write_gguf(tmp_path / "m.gguf", w, s)), "-p", "hi")
    assert "blk.0.ffn_down has shape [32, 40], the config implies [32, 48]" in msg


def test_extra_layers_and_untied_head_shape(tmp_path):
    w, s = make_weights(tie=False)
    w["lm_head.weight"] = w["lm_head.weight"][:10]
    d = write_hf(tmp_path / "hf", w, s)
    assert "tensor output has shape [10, 32]" in _err("run", "-m", str(d), "-p", "hi")
    w, s = make_weights(n_layer=2)
    cfg = json.loads((write_hf(tmp_path / "hf2", w, s) / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (tmp_path / "hf2" / "config.json").write_text(json.dumps(cfg))
    assert "tensors for layer 1 but the config says 1 layers" in _err("run", "-m", str(tmp_path / "hf2"), "-p", "hi")


def test_gguf_version_and_bad_config_values(tmp_path):
    w, s = make_weights()
    p = write_gguf(tmp_path / "m.gguf", w, s)
    raw = bytearray(p.read_bytes())
    raw[4:8] = (99).to_bytes(4, "little")
    (tmp_path / "v99.gguf").write_bytes(bytes(raw))
    assert "GGUF version 99, which is not supported" in _err("inspect", str(tmp_path / "v99.gguf"))
    d = write_hf(tmp_path / "hf", w, s)
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_size"] = "abc"
    (d / "config.json").write_text(json.dumps(cfg))
    assert "config.json has an invalid value" in _err("run", "-m", str(d), "-p", "hi")


def test_non_finite_logits_are_reported(tmp_path):
    w, s = make_weights()
    w["model.norm.weight"] = torch.full_like(w["model.norm.weight"], float("nan"))
    assert "NaN/inf logits at step 0" in _err("run", "-m", str(write_gguf(tmp_path / "m.gguf", w, s)), "-p", "hi")


@pytest.mark.parametrize("args,msg", [
    (["--temperature", "nan"], "--temperature: must be a finite number"),
    (["--temperature", "1e-300"], "--temperature: must be 0 (greedy) or >= 0.001"),
    (["--repetition-penalty", "1e-300"], "--repetition-penalty: must be in [0.01, 100]"),
    (["--seed", "99999999999999999999"], "--seed: must be in 0..2^63-1"),
    (["--save", "s", "--layers", "0..99999999999"], "out of range"),
])
def test_option_ranges(tmp_path, monkeypatch, args, msg):
    monkeypatch.chdir(tmp_path)
    assert msg in _err("run", "-p", "hi", *args)


def test_save_and_report_never_overwrite(tmp_path):
    w, s = make_weights()
    m = str(write_gguf(tmp_path / "m.gguf", w, s))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert "not empty" in _err("run", "-m", m, "-p", "hi", "-n", "1", "--save", str(tmp_path / "mine"))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    (tmp_path / "afile").write_text("x")
    assert "a file of that name exists" in _err("run", "-m", m, "-p", "hi", "--save", str(tmp_path / "afile"))
    res = runner.invoke(app, ["run", "-m", m, "-p", "hi", "-n", "1", "--save", str(tmp_path / "t")])
    assert res.exit_code == 0, res.output
    before = (tmp_path / "t" / "trace.json").read_bytes()
    assert "a file of the trace itself" in _err("report", str(tmp_path / "t"), "-o", str(tmp_path / "t" / "trace.json"))
    assert (tmp_path / "t" / "trace.json").read_bytes() == before
    (tmp_path / "old.html").write_text("mine")
    assert "exists; pass --force" in _err("report", str(tmp_path / "t"), "-o", str(tmp_path / "old.html"))
    assert (tmp_path / "old.html").read_text() == "mine"
    assert runner.invoke(app, ["report", str(tmp_path / "t"), "-o", str(tmp_path / "old.html"), "--force"]).exit_code == 0


def test_dump_kv_positions_range_is_bounded():
    assert "beyond any context" in _err("dump-kv", "--step", "0", "-p", "hi", "--layer", "0", "--positions", "0..99999999999")


def test_long_idle_wait_is_fast_forwarded(tmp_path):
    w, s = make_weights()
    res = runner.invoke(app, ["run", "-m", str(write_gguf(tmp_path / "m.gguf", w, s)), "-p", "hi", "--arrival", "100000",
                              "-n", "1", "--json"])
    assert res.exit_code == 0, res.output
    steps = json.loads(res.stdout)["steps"]
    assert [s["N"] for s in steps] == [0, 2] and steps[1]["step"] == 100000
