"""A hostile or careless user against the Qwen3.5 hybrid family: odd ``config.json`` / GGUF
settings are honoured or refused with one line (exit 2, no traceback); the recurrent (GDN) state
counts in the memory budget before anything is allocated; ``make-qwen35`` never overwrites, never
leaves a partial checkpoint at ``--out``, and reports write failures (no space) in one line."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from typer.testing import CliRunner

from infertrace.cli.app import app
from tests.hostile.test_model_files import _err, deadline
from tests.helpers.tiny_qwen35 import make_weights, write_gguf, write_hf_dir

runner = CliRunner()


@pytest.fixture(scope="module")
def q35_dir(tmp_path_factory):
    w, s = make_weights(seed=5)
    return write_hf_dir(tmp_path_factory.mktemp("q35h") / "hf", w, s)


def _with(d: Path, tmp: Path, edit) -> Path:
    out = tmp / "m"
    shutil.copytree(d, out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _set(**kv):
    return lambda c: c.update(kv)


def _rope(**kv):
    return lambda c: c["rope_parameters"].update(kv)


@pytest.mark.parametrize("edit, expect", [
    (_set(linear_num_value_heads=3), "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
    (_set(linear_num_value_heads=True), "ssm_n_v_heads = True must be an integer"),
    (_set(linear_num_key_heads=0), "ssm_n_k_heads = 0 must be an integer in 1..1048576"),
    (_set(linear_conv_kernel_dim=0), "ssm_conv_kernel = 0 must be an integer"),
    (_set(linear_conv_kernel_dim=1 << 20), "ssm_conv1d has shape [64, 4], the config implies [64, 1048576]"),
    (_rope(partial_rotary_factor=0), "partial_rotary_factor must be a number in (0, 1], got 0"),
    (_rope(partial_rotary_factor=1.5), "partial_rotary_factor must be a number in (0, 1], got 1.5"),
    (_rope(partial_rotary_factor=3 / 16), "gives 3 rotary dims of head_dim 16; must be even"),
    (_set(head_dim=8), "attn_q has shape [128, 32], the config implies [64, 32]"),
    (lambda c: c.update(layer_types=c["layer_types"][:3]), "layer_types must list 4 entries"),
    (lambda c: c["layer_types"].__setitem__(1, "sliding_attention"), "layer_types must list 4 entries"),
    (lambda c: (c.pop("layer_types"), c.update(full_attention_interval=0)), "full_attention_interval must be an integer >= 1"),
    (_rope(mrope_section="abc"), "mrope_section must be a list of small integers"),
    (_set(attn_output_gate=False), "attn_output_gate = False: only the gated attention output"),
    (_set(attention_bias=True), "attention_bias = True: Qwen3.5 attention biases are not implemented"),
    (_set(model_type="qwen3_5", text_config="x"), "text_config must be an object, got str"),
    (_set(layer_types=["linear_attention"] * 4), "every one of the 4 layers is linear_attention"),
])
def test_hostile_hf_config_is_refused_in_one_line(q35_dir, tmp_path, edit, expect):
    line = _err("run", "-m", str(_with(q35_dir, tmp_path, edit)), "-p", "hi", "-n", "1")
    assert expect in line, line


def test_honoured_odd_but_valid_settings_run(q35_dir, tmp_path):
    """partial_rotary_factor 1 (every dim rotates) and a multimodal ``qwen3_5`` layout nesting the text config run."""
    def edit(c):
        c["rope_parameters"]["partial_rotary_factor"] = 1.0
        c.update(model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"], text_config=dict(c))
    with deadline(60):
        res = runner.invoke(app, ["inspect", str(_with(q35_dir, tmp_path, edit))])
    assert res.exit_code == 0, res.output
    assert "RoPE rotates dims 0..15 of each head of 16" in res.output


@pytest.mark.parametrize("drop, extra, expect", [
    ("add_rope_dimension_count", None, "GGUF lacks qwen35.rope.dimension_count"),
    ("add_ssm_state_size", None, "GGUF lacks a qwen35.ssm.* key"),
    (None, {"ssm.inner_size": 33}, "qwen35.ssm.inner_size 33 is not a multiple of ssm.time_step_rank 4"),
])
def test_hostile_gguf_keys(tmp_path, monkeypatch, drop, extra, expect):
    w, s = make_weights(seed=5)
    if drop:
        monkeypatch.setattr(gguf.GGUFWriter, drop, lambda self, *a, **k: None)
    p = write_gguf(tmp_path / "m.gguf", w, s, extra)
    line = _err("run", "-m", str(p), "-p", "hi", "-n", "1")
    assert expect in line, line


def test_gguf_tensor_of_the_wrong_shape(tmp_path):
    w, s = make_weights(seed=5, nv=2)  # n_v == n_k: no head reorder, so a cut tensor reaches the file as it is
    w["model.layers.0.linear_attn.A_log"] = w["model.layers.0.linear_attn.A_log"][:1]
    line = _err("run", "-m", str(write_gguf(tmp_path / "m.gguf", w, s)), "-p", "hi", "-n", "1")
    assert "tensor blk.0.ssm_a has shape [1], the config implies [2]" in line, line


def test_memory_budget_counts_the_recurrent_state(q35_dir, monkeypatch):
    import infertrace.kv.budget as budget
    from infertrace.engine.engine import EngineOptions
    from infertrace.loading.weights import load_checkpoint

    cfg = load_checkpoint(q35_dir).config
    opts = EngineOptions(backend="paged", ctx_size=16, tokens_per_block=4, n_seq_max=1000)
    # by hand: 2 GDN layers (0, 2); per slot conv [64, 3] + recurrent [4, 8, 8] = 192 + 256 = 448 floats;
    # 1000 slots x 2 layers x 448 x 4 B = 3584000 B; KV: 2 attention layers x 2 x 16 tokens x 2 heads x 16 x 4 B = 8192 B
    assert budget.recurrent_state_bytes(cfg, opts, torch.float32) == 3584000
    assert budget.check_kv_budget(cfg, opts, torch.float32) == 3584000 + 8192
    monkeypatch.setattr(budget, "memory_limit_bytes", lambda device="cpu": 1 << 20)  # KV alone would fit
    with pytest.raises(Exception, match=r"3.4 MiB .* \+ 3.4 MiB of GDN state for 1000 sequences\), over the limit of 1.0 MiB"):
        budget.check_kv_budget(cfg, opts, torch.float32)
    # and through the CLI (64 sequences by default: 64 x 2 x 448 x 4 = 229376 B), refused before allocating
    monkeypatch.setattr(budget, "memory_limit_bytes", lambda device="cpu": 200_000)
    line = _err("run", "-m", str(q35_dir), "-p", "hi", "-n", "1", "--backend", "paged", "--ctx-size", "16")
    assert "+ 224.0 KiB of GDN state for 64 sequences" in line, line


# ------------------------------------------------------------------ make-qwen35

SMALL = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_hidden_layers=4,
             intermediate_size=48, vocab_size=300, linear_key_head_dim=8, linear_value_head_dim=8,
             linear_num_key_heads=2, linear_num_value_heads=2)


def test_make_qwen35_never_overwrites(tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert "exists and is not an empty directory" in _err("make-qwen35", "--out", str(full))
    assert [p.name for p in full.iterdir()] == ["keep.txt"] and (full / "keep.txt").read_text() == "mine"
    f = tmp_path / "afile"
    f.write_text("x")
    assert "exists and is not an empty directory" in _err("make-qwen35", "--out", str(f))
    assert f.read_text() == "x"
    assert "cannot create" in _err("make-qwen35", "--out", str(f / "sub"))  # parent is a file
    assert "--seed 18446744073709551616 must be an integer in 0..2^63-1" in _err(
        "make-qwen35", "--out", str(tmp_path / "new"), "--seed", str(1 << 64))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "full"]


def test_make_qwen35_interrupted_leaves_nothing(tmp_path):
    from infertrace.loading.synth import write_qwen35_08b

    def stop(msg):
        if msg == "layer 2":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_qwen35_08b(tmp_path / "m", progress=stop, **SMALL)
    assert list(tmp_path.iterdir()) == []  # no ``m``, no staging directory
    (tmp_path / "empty").mkdir()  # an existing empty directory is filled, and the result loads
    write_qwen35_08b(tmp_path / "empty", **SMALL)
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_make_qwen35_no_space_is_one_line_and_leaves_nothing(tmp_path):
    """A file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes the write fail as a full disk does."""
    code = (
        "import resource, signal, sys\n"
        "from infertrace.loading.synth import write_qwen35_08b\n"
        "from infertrace.errors import InfertraceError\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
        f"try:\n    write_qwen35_08b(sys.argv[1], **{SMALL!r})\n"
        "except InfertraceError as e:\n    print('error:', e.message); sys.exit(2)\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stdout.startswith("error: cannot write the checkpoint to") and "File too large" in res.stdout, res.stdout
    assert "nothing was left there" in res.stdout and list(tmp_path.iterdir()) == []


def test_partial_rotary_factor_in_rope_parameters_wins_over_the_top_level(q35_dir, tmp_path):
    """As HF ``Qwen3_5TextConfig`` (checked with transformers: the top-level value only fills in a missing one)."""
    from transformers import Qwen3_5TextConfig

    hf = Qwen3_5TextConfig(partial_rotary_factor=0.5, head_dim=16,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
    assert hf.rope_parameters["partial_rotary_factor"] == 0.25
    with deadline(60):
        res = runner.invoke(app, ["inspect", str(_with(q35_dir, tmp_path, _set(partial_rotary_factor=0.5)))])
    assert res.exit_code == 0 and "RoPE rotates dims 0..3 of each head of 16" in res.output, res.output


def test_make_qwen35_checkpoint_has_a_name_and_empty_names_are_hidden(tmp_path):
    """The synthesized config names the model; a checkpoint without a name shows no empty ``''``."""
    import json

    from infertrace.loading.synth import write_qwen35_08b

    d = write_qwen35_08b(tmp_path / "m", **SMALL)
    r = CliRunner().invoke(app, ["inspect", str(d)])
    assert r.exit_code == 0, r.output
    assert "'Qwen3.5-0.8B-shaped (random weights)'" in r.stdout and "''" not in r.stdout
    r = CliRunner().invoke(app, ["run", "--model", str(d), "-p", "hi", "-n", "1"])
    assert r.exit_code == 0, r.output
    assert "'Qwen3.5-0.8B-shaped (random weights)'" in r.stdout and "''" not in r.stdout
    cfg = json.loads((d / "config.json").read_text())
    del cfg["_name_or_path"]
    (d / "config.json").write_text(json.dumps(cfg))
    for args in (["inspect", str(d)], ["run", "--model", str(d), "-p", "hi", "-n", "1"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 0, r.output
        assert "''" not in r.stdout, r.stdout
