"""``infertrace bisect`` on a planted truth, real model: SmolLM2-135M (the default GGUF, dequantised by HF
transformers in fp32) saved as an HF directory twice, once unchanged and once with layer 5's
``mlp.down_proj.weight`` perturbed. Our engine runs both; bisect must name the layer and tap HF's own
forward hooks say the perturbation first changes (layer 5's MLP output, not its attention, nothing in
layers 0..4), and find no divergence between clean copies (the GGUF fp32 against the HF directory fp32).
"""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app

PROMPT = "The capital of France is"
LAYER = 5  # the planted layer
N_NEW = 3


def _bisect(*args: str):
    return CliRunner().invoke(app, ["bisect", *args])


@pytest.fixture(scope="session")
def hf_copies(hf_smol, tmp_path_factory):
    """(clean dir, perturbed dir, clean HF model, perturbed HF model): fp32 LlamaForCausalLM copies of the
    GGUF, the perturbed one with ``layers[5].mlp.down_proj.weight += 0.5 * std * N(0, 1)`` (seed 0)."""
    import torch
    import transformers

    tok, src = hf_smol
    cfg = src.config
    if hasattr(cfg, "quantization_config"):  # GGUF-loaded models refuse save_pretrained; a plain copy saves
        cfg = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.to_dict().items() if k != "quantization_config"})
    root = tmp_path_factory.mktemp("bisect_models")
    out = []
    for name, perturb in (("clean", False), ("bad", True)):
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        m.load_state_dict(src.state_dict())
        m.eval()
        if perturb:
            w = m.model.layers[LAYER].mlp.down_proj.weight  # [H, n_ff]
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                w += 0.5 * w.std() * torch.randn(w.shape, generator=g)
        d = root / name
        m.save_pretrained(d)
        tok.save_pretrained(d)
        out.append((d, m))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def _save_run(loaded, path, prompts, **opts):
    from infertrace.capture.tensors import encode_tensors
    from infertrace.engine.engine import EngineOptions
    from infertrace.engine.options import SamplingParams
    from infertrace.runner import PromptSpec, run_requests
    from infertrace.trace.store import save_trace

    layers = list(range(loaded.config.n_layer))
    tensors: dict = {}
    tr = run_requests(loaded, [PromptSpec(p, SamplingParams(max_new_tokens=N_NEW)) for p in prompts],
                      EngineOptions(**opts), tensors=tensors, tensor_layers=layers)
    save_trace(tr, path, encode_tensors(tensors, layers))
    return tr


@pytest.fixture(scope="session")
def traces(hf_copies, smol, tmp_path_factory):
    """Saved traces of our engine (fp32, tensors of every layer): the GGUF, the clean HF dir, the
    perturbed HF dir, and the perturbed dir run beside a second request with --prefill-chunk 3."""
    from infertrace.runner import load_model

    clean_dir, bad_dir, _, _ = hf_copies
    root = tmp_path_factory.mktemp("bisect_traces")
    out = {"gguf": root / "gguf", "clean": root / "clean", "bad": root / "bad", "bad_batched": root / "bad_batched"}
    _save_run(smol, out["gguf"], [PROMPT])
    _save_run(load_model(clean_dir), out["clean"], [PROMPT])
    bad = load_model(bad_dir)
    tr = _save_run(bad, out["bad"], [PROMPT])
    _save_run(bad, out["bad_batched"], [PROMPT, "Hi"], prefill_chunk=3)
    out["prompt_ids"] = tr.requests[0]["prompt_ids"]
    _save_run(smol, root / "other", ["A different prompt here"])
    out["other"] = root / "other"
    return out


@pytest.fixture(scope="session")
def hf_truth(hf_copies, traces):
    """From HF itself (forward hooks on both copies, our prompt's token ids): per layer, the relative L2
    of the attention output, the MLP output and the layer output between clean and perturbed."""
    import torch

    _, _, clean, bad = hf_copies
    ids = torch.tensor([traces["prompt_ids"]])  # [1, T]

    from tests.helpers.hf_taps import hf_taps

    a, b = hf_taps(clean, ids), hf_taps(bad, ids)
    whole = {k: float((a[k] - b[k]).norm() / a[k].norm()) for k in a}
    last = {k: float((a[k][0, -1] - b[k][0, -1]).norm() / a[k][0, -1].norm()) for k in a}  # the last prompt token's row
    return {"whole": whole, "last": last}


def test_hf_confirms_the_planted_layer(hf_truth):
    """The independent truth: in HF, layers 0..4 are untouched, layer 5's attention too, its MLP output not."""
    hf_truth = hf_truth["whole"]
    first = min(k for k, v in hf_truth.items() if v > 0)
    assert first == (LAYER, "mlp_out")
    assert all(hf_truth[(i, t)] == 0.0 for i in range(LAYER) for t in ("attn_out", "mlp_out", "resid_post"))
    assert hf_truth[(LAYER, "attn_out")] == 0.0
    assert hf_truth[(LAYER, "mlp_out")] > 0.1


def test_bisect_names_the_planted_layer_and_tap(traces, hf_truth):
    r = _bisect(str(traces["clean"]), str(traces["bad"]), "--json")
    assert r.exit_code == 1, r.output
    res = json.loads(r.output)
    want_layer, want_tap = min(k for k, v in hf_truth["whole"].items() if v > 0)  # from HF, not from infertrace
    assert (res["first_tap"]["layer"], res["first_tap"]["tap"]) == (want_layer, want_tap)
    assert res["first_tap"]["branch"] == "MLP"
    assert res["first_tap"]["layers_not_compared_before"] == []  # every layer was saved
    at = {(e["layer"], e["tap"]): e for e in res["taps"]}
    assert not at[(LAYER, "attn_out")]["above"] and at[(LAYER, "attn_out")]["rel_l2"] == 0.0
    assert all(not e["above"] for e in res["taps"] if e["layer"] < LAYER)
    # the last prompt token's row: HF's own relative error of layer 5's MLP there matches ours to fp32 noise
    assert res["position"] == len(traces["prompt_ids"]) - 1
    hf5 = hf_truth["last"][(LAYER, "mlp_out")]
    assert res["first_tap"]["rel_l2"] == pytest.approx(hf5, rel=1e-3)
    assert at[(LAYER, "resid_post")]["rel_l2"] == pytest.approx(hf_truth["last"][(LAYER, "resid_post")], rel=1e-3)
    assert res["first_logits"]["pos"] == res["position"]
    assert res["floor"]["source"].startswith("default for two float32 traces")
    assert res["batch"]["a"]["requests"] == [{"seq_id": 0, "phase": "prefill", "kind": "prefill", "C": 0,
                                              "T": len(traces["prompt_ids"])}]


def test_bisect_text_names_layer_and_branch(traces):
    r = _bisect(str(traces["clean"]), str(traces["bad"]))
    assert r.exit_code == 1, r.output
    assert f"first tap above the floor: layer {LAYER} mlp_out (MLP)" in r.output
    assert "default for two float32 traces" in r.output


def test_clean_copies_do_not_diverge(traces):
    """The GGUF fp32 against the HF directory fp32 of the same weights, and a trace against itself: exit 0."""
    for a, b in (("gguf", "clean"), ("clean", "clean")):
        r = _bisect(str(traces[a]), str(traces[b]), "--json")
        assert r.exit_code == 0, r.output
        res = json.loads(r.output)
        assert res["first_logits"] is None and res["first_top1"] is None and not res["diverged"]
        assert res["max_logits_rel_l2"] < 1e-3


def test_measured_floor_from_clean_pair(traces):
    """--floor-from the two clean copies: the measured floor is printed with its source, the planted layer still found."""
    r = _bisect(str(traces["clean"]), str(traces["bad"]), "--floor-from", str(traces["gguf"]), str(traces["clean"]), "--json")
    assert r.exit_code == 1, r.output
    res = json.loads(r.output)
    assert res["floor"]["source"].startswith("measured from --floor-from") and res["floor"]["per_tap"]
    assert res["floor"]["logits_rel_l2"] < 1e-3
    assert (res["first_tap"]["layer"], res["first_tap"]["tap"]) == (LAYER, "mlp_out")
    r = _bisect(str(traces["clean"]), str(traces["bad"]), "--floor", "10")  # a floor above every error: exit 0
    assert r.exit_code == 0, r.output
    assert "--floor (given)" in r.output


def test_batch_of_the_step_is_reported(traces):
    """B ran the prompt in chunks of 3 beside a second request: at the last prompt position B's step holds
    seq 0's chunk 3..4 of 5 and seq 1's prefill; the defect is still layer 5's MLP."""
    r = _bisect(str(traces["clean"]), str(traces["bad_batched"]), "--json")
    assert r.exit_code == 1, r.output
    res = json.loads(r.output)
    n = len(traces["prompt_ids"])
    assert n == 5
    b = res["batch"]["b"]["requests"]
    assert b[0] == {"seq_id": 0, "phase": "prefill", "kind": "prefill chunk 3..4 of 5", "C": 3, "T": 2}
    assert [x["seq_id"] for x in b] == [0, 1]
    assert (res["first_tap"]["layer"], res["first_tap"]["tap"]) == (LAYER, "mlp_out")
    # a measured floor from a bit-identical pair (0 at layer 0) is raised to the fp32 minimum, so the
    # rounding of the chunked batch (~1e-7 at layer 0) is not taken for the defect
    r = _bisect(str(traces["clean"]), str(traces["bad_batched"]), "--floor-from", str(traces["gguf"]), str(traces["clean"]),
                "--json")
    assert r.exit_code == 1, r.output
    res = json.loads(r.output)
    assert (res["first_tap"]["layer"], res["first_tap"]["tap"]) == (LAYER, "mlp_out")
    assert res["floor"]["source"].endswith("at least 1e-05")


def test_bad_input_is_one_line_exit_2(traces, tmp_path):
    r = _bisect(str(traces["clean"]), str(traces["other"]))
    assert r.exit_code == 2 and "different token sequences" in r.output and "Traceback" not in r.output
    r = _bisect(str(traces["clean"]), str(traces["bad"]), "--floor", "1", "--floor-from", str(traces["gguf"]), str(traces["clean"]))
    assert r.exit_code == 2 and "not both" in r.output
    r = _bisect(str(traces["clean"]), str(traces["bad"]), "--floor", "nan")
    assert r.exit_code == 2 and "--floor" in r.output
    # another model: the same trace with a config field changed
    d = tmp_path / "other_model"
    shutil.copytree(traces["clean"], d)
    m = json.loads((d / "trace.json").read_text())
    m["config"]["n_ff"] = 1024
    (d / "trace.json").write_text(json.dumps(m))
    r = _bisect(str(traces["clean"]), str(d))
    assert r.exit_code == 2 and "different models" in r.output, r.output
    # a trace saved without tensors has no logits rows to compare: said so, exit 2
    d = tmp_path / "summary"
    d.mkdir()
    m = json.loads((traces["bad"] / "trace.json").read_text())
    m["store"] = {"keep": "summary", "tensor_layers": [], "tensors": {}}
    (d / "trace.json").write_text(json.dumps(m))
    r = _bisect(str(traces["clean"]), str(d))
    assert r.exit_code == 2 and "no position has saved logits in both traces" in r.output, r.output


def test_inconsistent_tensor_shape_is_refused(traces, tmp_path):
    """An untrusted trace whose layer tensor has fewer rows than the step computed: exit 2, one line."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "short_rows"
    shutil.copytree(traces["bad"], d)
    t = load_file(str(d / "tensors.safetensors"))
    name = f"step0/layer{LAYER}/mlp_out"
    t[name] = np.ascontiguousarray(t[name][:2])  # [2, H] where the step has N = 5 rows
    save_file(t, str(d / "tensors.safetensors"), metadata={"format": "pt"})
    m = json.loads((d / "trace.json").read_text())
    m["store"]["tensors"][name]["shape"] = [2, int(t[name].shape[1])]
    (d / "trace.json").write_text(json.dumps(m))
    r = _bisect(str(traces["clean"]), str(d))
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    assert "shape" in r.output


def test_llamacpp_trace_with_one_layer(traces, llama_cpp, tmp_path):
    """Ours (every layer) against real llama.cpp (its eval callback taps one layer, here 5): bisect compares
    what both saved, says the earlier layers were not compared, and names the two engines in the floor line."""
    lc = tmp_path / "lc"
    r = CliRunner().invoke(app, ["run", "--runtime", "llama.cpp", "--prompt", PROMPT, "-n", str(N_NEW), "--save", str(lc),
                                 "--layer", str(LAYER), "--json"])
    assert r.exit_code == 0, r.output
    r = _bisect(str(traces["gguf"]), str(lc), "--floor", "0", "--json")
    assert r.exit_code == 1, r.output
    res = json.loads(r.output)
    assert {e["layer"] for e in res["taps"]} == {-1, LAYER}
    assert res["first_tap"]["layer"] == LAYER and res["first_tap"]["layers_not_compared_before"] == list(range(LAYER))
    r = _bisect(str(traces["gguf"]), str(lc))
    assert "different engines (infertrace, llama.cpp)" in r.output and "not compared" in r.output


# ----------------------------------------------------------------------------- hand-worked, no model


def test_metrics_hand_worked():
    """a = [3, 4], b = [3, 0]: ||a - b|| = 4, ||a|| = 5 -> 0.8; a·b = 9, ||b|| = 3 -> cosine 9/15 = 0.6."""
    import numpy as np

    from infertrace.trace.bisect import above, compare_logits, err

    rel, cos = err(np.array([3.0, 4.0]), np.array([3.0, 0.0]))
    assert rel == pytest.approx(0.8) and cos == pytest.approx(0.6)
    assert err(np.zeros(3), np.zeros(3)) == (0.0, 1.0)
    assert above(float("nan"), 1.0) and above(float("inf"), 1.0) and not above(0.5, 1.0)
    # top-k ids [1, 2, 3] vs [2, 1, 7]: shared 1, 2; A (10, 9) and B (11, 10) are one shift apart -> 0 centred
    r = compare_logits((np.array([1, 2, 3]), np.array([10.0, 9.0, 8.0])), (np.array([2, 1, 7]), np.array([10.0, 11.0, 0.0])))
    assert (r["top1_a"], r["top1_b"], r["shared_topk"]) == (1, 2, 2)
    assert r["rel_l2"] == pytest.approx(0.0) and r["cosine"] == pytest.approx(1.0)
    # centred A = (0.5, -0.5), B = (-0.5, 0.5): ||a - b|| / ||a|| = 2, cosine -1
    r = compare_logits((np.array([1, 2]), np.array([10.0, 9.0])), (np.array([1, 2]), np.array([9.0, 10.0])))
    assert r["rel_l2"] == pytest.approx(2.0) and r["cosine"] == pytest.approx(-1.0)
    r = compare_logits((np.array([1, 2]), np.array([1.0, 0.0])), (np.array([5, 6]), np.array([1.0, 0.0])))
    assert r["rel_l2"] == float("inf")  # nothing shared: too far apart to compare


def test_comparable_positions_stop_at_the_first_different_token():
    from infertrace.errors import InfertraceError
    from infertrace.trace.bisect import Side, comparable

    def side(tokens, n_prompt=3):
        return Side("x", None, None, 0, tokens, n_prompt, {}, {})  # type: ignore[arg-type]

    assert comparable(side([1, 2, 3, 4, 5]), side([1, 2, 3, 4, 9])) == (4, 4)  # positions 0..3 fed the same inputs
    assert comparable(side([1, 2, 3, 4]), side([1, 2, 3, 4, 5])) == (4, None)
    with pytest.raises(InfertraceError, match="different token sequences"):
        comparable(side([1, 2, 3, 4]), side([1, 2, 7, 4]))
