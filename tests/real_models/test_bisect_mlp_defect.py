"""``bisect`` names the MLP on a planted truth: the default SmolLM2 GGUF with layer 5's ``ffn_down.weight``
perturbed (tests/helpers/planted.py), run by our engine and by llama.cpp (each loads the file itself), every
layer's taps saved. The truth comes from HF transformers loading both GGUFs: its forward hooks say layers 0..4
and layer 5's attention are untouched, layer 5's MLP output changes. ``bisect`` must name layer 5 ``mlp_out`` for
ours<->ours, ours<->llama.cpp and llama.cpp<->llama.cpp (floors measured on the clean file).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app

PROMPT = "The capital of France is"
LAYER = 5


def _cli(*args: str) -> CliRunner:
    return CliRunner().invoke(app, [str(a) for a in args])


def _bisect(*args: str) -> tuple[int, dict]:
    r = _cli("bisect", *args, "--json")
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, json.loads(r.output)


@pytest.fixture(scope="module")
def files(smol_path, tmp_path_factory):
    from tests.helpers.planted import perturbed_gguf

    root = tmp_path_factory.mktemp("planted_mlp")
    return {"clean": smol_path, "bad": perturbed_gguf(smol_path, root / "bad_down5.gguf", f"blk.{LAYER}.ffn_down.weight"),
            "root": root}


@pytest.fixture(scope="module")
def hf_truth(files, hf_smol):
    """Per (layer, tap): HF's relative L2 between the clean and the planted file, on the last prompt row."""
    from tests.helpers.hf_taps import planted_truth

    return planted_truth(hf_smol, files["bad"], PROMPT)


def _run(files, engine: str, which: str) -> str:
    d = files["root"] / f"{engine}_{which}"
    if not d.exists():
        r = _cli("run", "--runtime", engine, "-m", files[which], "-p", PROMPT, "-n", "2", "--save", d,
                 "--keep", "tensors", "--layers", "all")
        assert r.exit_code == 0, r.output
    return str(d)


def test_hf_says_layer_5_mlp_changes_first(hf_truth):
    assert all(v == 0.0 for (i, _), v in hf_truth.items() if i < LAYER)
    assert hf_truth[(LAYER, "attn_out")] == 0.0 and hf_truth[(LAYER, "q_pre_rope")] == 0.0
    assert hf_truth[(LAYER, "mlp_out")] > 0.2


def _assert_names_mlp5(rep: dict, hf_truth: dict) -> None:
    assert rep["diverged"]
    assert (rep["first_tap"]["layer"], rep["first_tap"]["tap"]) == (LAYER, "mlp_out"), rep["first_tap"]
    assert rep["first_tap"]["branch"] == "MLP"
    assert rep["first_tap"]["layers_not_compared_before"] == []
    at = {(e["layer"], e["tap"]): e for e in rep["taps"]}
    assert not at[(LAYER, "attn_out")]["above"]
    assert all(not e["above"] for e in rep["taps"] if e["layer"] < LAYER)
    assert rep["first_tap"]["rel_l2"] == pytest.approx(hf_truth[(LAYER, "mlp_out")], rel=0.25)  # HF's own error


def test_ours_against_ours(files, hf_truth):
    rc, rep = _bisect(_run(files, "infertrace", "clean"), _run(files, "infertrace", "bad"))
    assert rc == 1
    _assert_names_mlp5(rep, hf_truth)
    assert rep["first_tap"]["rel_l2"] == pytest.approx(hf_truth[(LAYER, "mlp_out")], rel=2e-2)


@pytest.mark.needs_llamacpp
def test_ours_against_llamacpp_and_llamacpp_against_itself(files, hf_truth, llama_cpp):
    oc, lc, lb = _run(files, "infertrace", "clean"), _run(files, "llama.cpp", "clean"), _run(files, "llama.cpp", "bad")
    rc, rep = _bisect(oc, lb, "--floor-from", oc, lc)
    assert rc == 1 and rep["floor"]["source"].startswith("measured from --floor-from")
    _assert_names_mlp5(rep, hf_truth)
    # what only one side saved is said, not silently skipped: llama.cpp names no layer-input node, and its last
    # layer's FFN ran for the logits row only at the prefill
    assert any("saved by" in n and "hidden_in (30 layers)" in n and "mlp_out (layer 29)" in n for n in rep["notes"]), rep["notes"]
    rc, rep = _bisect(lc, lb)  # one runtime, one kernel set: the layers before 5 agree bit for bit
    assert rc == 1
    _assert_names_mlp5(rep, hf_truth)
    assert all(e["rel_l2"] == 0.0 for e in rep["taps"] if e["layer"] < LAYER)


def _run_vllm(files, which: str) -> str:
    """vLLM in its own process (a second in-process vLLM engine beside the shared one is not reliable)."""
    import subprocess
    import sys

    d = files["root"] / f"vllm_{which}"
    if not d.exists():
        r = subprocess.run([sys.executable, "-m", "infertrace", "run", "--runtime", "vllm", "-m", str(files[which]), "-p",
                            PROMPT, "-n", "2", "--save", str(d), "--keep", "tensors", "--layers", "all"],
                           capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, r.stderr[-2000:]
    return str(d)


@pytest.mark.needs_vllm
@pytest.mark.slow
def test_ours_against_vllm_and_vllm_against_llamacpp(files, hf_truth, vllm_mod, llama_cpp):
    oc, vc, vb = _run(files, "infertrace", "clean"), _run_vllm(files, "clean"), _run_vllm(files, "bad")
    rc, rep = _bisect(oc, vb, "--floor-from", oc, vc)
    assert rc == 1
    _assert_names_mlp5(rep, hf_truth)
    lc = _run(files, "llama.cpp", "clean")
    rc, rep = _bisect(lc, vb, "--floor-from", lc, vc)
    assert rc == 1
    _assert_names_mlp5(rep, hf_truth)


def test_ours_against_hf(files, hf_truth, hf_smol):
    """HF transformers as a runtime (``run --runtime hf``, its own module outputs saved): ours(clean) vs HF(planted)."""
    oc, hc, hb = _run(files, "infertrace", "clean"), _run(files, "hf", "clean"), _run(files, "hf", "bad")
    rc, rep = _bisect(oc, hb, "--floor-from", oc, hc)
    assert rc == 1
    _assert_names_mlp5(rep, hf_truth)
    assert rep["first_tap"]["rel_l2"] == pytest.approx(hf_truth[(LAYER, "mlp_out")], rel=2e-2)
