"""``run --runtime vllm --keep tensors --layers``: vLLM's per-layer taps from forward hooks on its own modules
(infertrace/runtimes/vllm/capture.py), the residual stream as ``hidden_states + residual`` (vLLM's decoder layers
return the two apart, the add fused into the next layer's RMSNorm). Held to HF transformers' own forward hooks
(tests/helpers/hf_taps.py) on the same prompt: vLLM runs float32 here, so every tap of the prefill rows agrees with
HF's to rounding (measured 2026-12-02: largest relative L2 ~3e-6 over layers 0, 3, 29).
"""

from __future__ import annotations

import numpy as np
import pytest

PROMPT = "The capital of France is"
LAYERS = (0, 3, 29)
TAPS = ("hidden_in", "q_pre_rope", "k_pre_rope", "attn_out", "mlp_out", "resid_post")


@pytest.fixture(scope="module")
def recorded(smol, vllm_run):
    from infertrace.engine.drive import PromptSpec
    from infertrace.engine.options import SamplingParams
    from infertrace.runtimes.api import RunSettings
    from infertrace.runtimes.loop import checked_settings, record_run
    from infertrace.runtimes.vllm.runtime import VllmRuntime
    from infertrace.trace.records import VARIABLES
    from tests.helpers.vllm_shared import LAYER, OPTS

    specs = [PromptSpec(PROMPT, SamplingParams(max_new_tokens=2))]
    settings = checked_settings(VllmRuntime, smol, specs, RunSettings(opts=OPTS, layer=LAYER, show=VARIABLES,
                                                                      tensor_layers=LAYERS))
    tensors: dict = {}
    rt = VllmRuntime(smol, settings, tensors, run=vllm_run)
    trace = record_run(rt, smol, specs, settings, tensors=tensors)
    vllm_run.llm.collective_rpc(vllm_run.capture.set_taps, args=([],))  # the shared engine: unhook for later tests
    return trace, {k: v.numpy() for k, v in tensors.items()}


def test_every_tap_equals_hfs_own(recorded, hf_smol):
    import torch

    from tests.helpers.hf_taps import hf_taps

    trace, t = recorded
    tok, model = hf_smol
    b = trace.steps[0].batch[0]
    hf = hf_taps(model, torch.tensor([b.token_ids]))  # [1, T, ...]
    pre = {}
    for il in LAYERS:
        # HF's decoder-layer input: the previous layer's output (the embedding for layer 0)
        pre[il] = hf[(il - 1, "resid_post")][0].numpy() if il else None
        for tap in TAPS:
            if tap == "hidden_in" and il == 0:
                continue
            got = t[f"step0/layer{il}/{tap}"][b.rows]  # [T, ...] vLLM's packed rows of this request
            want = pre[il] if tap == "hidden_in" else hf[(il, tap)][0].numpy()
            want = want.reshape(got.shape)
            rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            assert rel < 1e-4, (il, tap, rel)


def test_tap_sources_say_the_residual_is_summed(recorded):
    trace, t = recorded
    src = trace.options["tap_sources"]
    assert "hidden_states + residual" in src["resid_post"] and "o_proj" in src["attn_out"]
    assert f"step0/layer{LAYERS[-1]}/resid_post" in t and "step0/layer0/hidden_in" in t
