"""RoPE scaling added with the family layer: yarn and dynamic against HF's RoPE init functions
(``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``) and end to end on tiny checkpoints;
llama.cpp's legacy ``rope.scale_linear`` key and a factor without a type read as llama.cpp does."""

import pytest
import torch

from infertrace.errors import InfertraceError
from infertrace.model.families import config_from_hf
from infertrace.model.rope import inv_freq_f32, inv_freq_table, rope_attention_factor
from infertrace.loading.weights import load_checkpoint
from tests.unit.model.test_families import IDS, _hf, _hf_logits, _model, _our_logits
from tests.helpers.tiny import hf_config, make_weights, write_gguf, write_hf

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

SCALINGS = [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 1.3},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "truncate": False},
    {"rope_type": "dynamic", "factor": 4.0},
]


@pytest.mark.parametrize("rs", SCALINGS, ids=lambda r: "-".join(f"{k}={v}" for k, v in r.items() if k != "rope_type") + r["rope_type"])
def test_inv_freq_and_attention_factor_equal_hf_init(rs):
    _, s = make_weights()
    raw = hf_config(s, theta=50000.0, rope_scaling=dict(rs), head_dim=16)
    ours = config_from_hf(raw, tie_default=True)
    assert not ours.refusals and ours.rope_scaling.type == rs["rope_type"]
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures",)})
    inv, att = ROPE_INIT_FUNCTIONS[rs["rope_type"]](hf_cfg, "cpu")
    assert torch.allclose(inv_freq_table(ours).float(), inv.float(), rtol=1e-6, atol=0)
    assert torch.allclose(inv_freq_f32(ours), inv.float(), rtol=1e-6, atol=0)
    assert rope_attention_factor(ours) == pytest.approx(att, rel=1e-9)


@pytest.mark.parametrize("rs", [SCALINGS[0], SCALINGS[3], SCALINGS[5]], ids=["yarn", "yarn-mscale", "dynamic"])
def test_scaled_tiny_model_logits_equal_hf(tmp_path, rs):
    w, s = make_weights(seed=11)
    d = write_hf(tmp_path / "hf", w, s, rope_scaling=dict(rs))
    ref = _hf_logits(_hf(d), IDS)
    _, m = _model(d)
    assert (_our_logits(m, IDS) - ref).abs().max() < 1e-4


def test_dynamic_refuses_positions_beyond_max_position_embeddings(tmp_path):
    w, s = make_weights()
    d = write_hf(tmp_path / "hf", w, s, rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8)
    _, m = _model(d)
    with pytest.raises(InfertraceError, match="dynamic"):
        _our_logits(m, IDS)  # 11 tokens > 8


@pytest.mark.parametrize("kv", [{"rope.scale_linear": 2.0}, {"rope.scaling.factor": 2.0}, {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}],
                         ids=["legacy-key", "factor-without-type", "typed"])
def test_gguf_linear_scaling_spellings_equal_hf_linear(tmp_path, kv):
    w, s = make_weights(seed=2)
    ref = _hf_logits(_hf(write_hf(tmp_path / "hf", w, s, rope_scaling={"rope_type": "linear", "factor": 2.0})), IDS)
    ck = load_checkpoint(write_gguf(tmp_path / "m.gguf", w, s, kv=kv))
    assert ck.config.rope_scaling.type == "linear" and ck.config.rope_scaling.factor == 2.0
    _, m = _model(tmp_path / "m.gguf")
    assert (_our_logits(m, IDS) - ref).abs().max() < 1e-4
