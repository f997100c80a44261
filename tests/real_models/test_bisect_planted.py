"""``bisect`` across runtimes on a planted truth: the default SmolLM2 GGUF with layer 9's ``attn_q.weight``
perturbed (tests/helpers/planted.py: dequantised, ``+= 0.5 * std * N(0, 1)``, stored F32), run by our
engine, llama.cpp and vLLM (each loads the file itself). The truth comes from HF transformers loading
both GGUFs with its own GGUF reader: forward hooks say layers 0..8 are untouched, and in layer 9 the
query projection changes first (K and V do not). ``bisect`` must name layer 9 ``q_pre_rope`` (attention,
Q) for ours<->ours, ours<->llama.cpp, ours<->vLLM and llama.cpp<->vLLM, each pair's floor measured from the
same two runtimes on the clean file.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app

PROMPT = "The capital of France is"
LAYER = 9
N_NEW = 3


def _bisect(*args: str) -> tuple[int, dict]:
    r = CliRunner().invoke(app, ["bisect", *args, "--json"])
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, json.loads(r.output)


@pytest.fixture(scope="module")
def files(smol, tmp_path_factory):
    from tests.helpers.planted import perturbed_gguf

    root = tmp_path_factory.mktemp("planted")
    return {"clean": smol.ckpt.path, "bad": perturbed_gguf(smol.ckpt.path, root / "bad_q9.gguf", f"blk.{LAYER}.attn_q.weight"),
            "root": root}


@pytest.fixture(scope="module")
def hf_truth(files, hf_smol):
    """Per (layer, tap): HF's relative L2 between the clean and the planted file, on the last prompt row."""
    from tests.helpers.hf_taps import planted_truth

    return planted_truth(hf_smol, files["bad"], PROMPT)


@pytest.fixture(scope="module")
def traces(files, smol, tmp_path_factory):
    """Saved traces: ours on both files (every layer), llama.cpp and vLLM on both (layer 9)."""
    from infertrace.capture.tensors import encode_tensors
    from infertrace.engine.engine import EngineOptions
    from infertrace.engine.options import SamplingParams
    from infertrace.runner import PromptSpec, load_model, run_requests
    from infertrace.trace.store import save_trace

    root, out = files["root"], {}
    for name in ("clean", "bad"):
        loaded = smol if name == "clean" else load_model(files["bad"])
        layers, tensors = list(range(loaded.config.n_layer)), {}
        tr = run_requests(loaded, [PromptSpec(PROMPT, SamplingParams(max_new_tokens=N_NEW))], EngineOptions(),
                          tensors=tensors, tensor_layers=layers)
        save_trace(tr, root / f"ours_{name}", encode_tensors(tensors, layers))
        out[f"ours_{name}"] = str(root / f"ours_{name}")
    return out


def _runtime(traces, files, engine: str) -> dict:
    """llama.cpp in this process (CliRunner), vLLM in its own (a second in-process vLLM engine is not reliable)."""
    for name in ("clean", "bad"):
        key = f"{engine}_{name}"
        if key in traces:
            continue
        d = files["root"] / key
        args = ["run", "--runtime", engine, "-m", str(files[name]), "-p", PROMPT, "-n", str(N_NEW), "--layer", str(LAYER),
                "--save", str(d)]
        if engine == "llama.cpp":
            r = CliRunner().invoke(app, args)
            assert r.exit_code == 0, r.output
        else:
            r = subprocess.run([sys.executable, "-m", "infertrace", *args], capture_output=True, text=True, timeout=1200)
            assert r.returncode == 0, r.stderr[-2000:]
        traces[key] = str(d)
    return traces


def test_hf_says_layer_9_q_changes_first(hf_truth):
    assert min(i for (i, _), v in hf_truth.items() if v > 0) == LAYER
    assert all(v == 0.0 for (i, _), v in hf_truth.items() if i < LAYER)
    assert hf_truth[(LAYER, "k_pre_rope")] == 0.0 and hf_truth[(LAYER, "v")] == 0.0
    assert hf_truth[(LAYER, "q_pre_rope")] > 0.3


def _assert_names_q9(rep: dict, hf_truth: dict, compared_before: bool) -> None:
    assert rep["diverged"]
    assert (rep["first_tap"]["layer"], rep["first_tap"]["tap"]) == (LAYER, "q_pre_rope")
    assert rep["first_tap"]["branch"] == "attention (Q)"
    assert rep["position"] == rep["tokens"]["prompt"] - 1  # the last prompt row: the first logits row computed
    assert rep["first_tap"]["rel_l2"] == pytest.approx(hf_truth[(LAYER, "q_pre_rope")], rel=2e-2)  # HF's own error
    at = {(e["layer"], e["tap"]): e for e in rep["taps"]}
    assert not at[(LAYER, "k_pre_rope")]["above"] and not at[(LAYER, "v")]["above"]
    assert (rep["first_tap"]["layers_not_compared_before"] == []) == compared_before


def test_ours_against_ours(traces, hf_truth):
    rc, rep = _bisect(traces["ours_clean"], traces["ours_bad"])
    assert rc == 1
    _assert_names_q9(rep, hf_truth, compared_before=True)
    assert all(not e["above"] for e in rep["taps"] if e["layer"] < LAYER)


@pytest.mark.needs_llamacpp
def test_ours_against_llamacpp(traces, files, hf_truth, llama_cpp):
    t = _runtime(traces, files, "llama.cpp")
    rc, rep = _bisect(t["ours_clean"], t["llama.cpp_bad"], "--floor-from", t["ours_clean"], t["llama.cpp_clean"])
    assert rc == 1 and rep["floor"]["source"].startswith("measured from --floor-from")
    _assert_names_q9(rep, hf_truth, compared_before=False)  # llama.cpp's trace taps layer 9 only


@pytest.mark.needs_vllm
@pytest.mark.slow
def test_ours_against_vllm_and_vllm_against_llamacpp(traces, files, hf_truth, vllm_mod, llama_cpp):
    t = _runtime(_runtime(traces, files, "vllm"), files, "llama.cpp")
    rc, rep = _bisect(t["ours_clean"], t["vllm_bad"], "--floor-from", t["ours_clean"], t["vllm_clean"])
    assert rc == 1
    _assert_names_q9(rep, hf_truth, compared_before=False)
    rc, rep = _bisect(t["llama.cpp_clean"], t["vllm_bad"], "--floor-from", t["llama.cpp_clean"], t["vllm_clean"])
    assert rc == 1
    _assert_names_q9(rep, hf_truth, compared_before=False)  # both tap layer 9 only: nothing earlier saved in either
