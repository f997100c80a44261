"""Random tiny Llamas written as GGUF and HF safetensors: loader, R2 end to end, R3 tied head,
and logits against HF transformers (independent implementation)."""

import pytest
import torch

from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.errors import InfertraceError
from infertrace.model.decoder import DecoderModel
from infertrace.loading.weights import load_checkpoint
from tests.helpers.tiny import make_weights, write_gguf, write_hf

transformers = pytest.importorskip("transformers")


def _our_logits(path, ids, backend="cells"):
    ck = load_checkpoint(path)
    m = DecoderModel(ck.config, ck.weights)
    from infertrace.kv.base import ChunkSpec
    from infertrace.engine.engine import make_kv

    kv = make_kv(m, EngineOptions(backend=backend, ctx_size=64, tokens_per_block=4), "torch")
    inp = kv.prepare([ChunkSpec(0, 0, len(ids))])
    return ck, m.forward(torch.tensor(ids), inp, kv, torch.arange(len(ids)))  # [T, V]


def _hf_logits(d, ids):
    m = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0]


IDS = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]


@pytest.mark.parametrize("n_head,n_kv", [(8, 2), (4, 2)])
def test_r2_gguf_permuted_and_hf_give_same_logits_as_transformers(tmp_path, n_head, n_kv):
    w, s = make_weights(n_head=n_head, n_kv=n_kv, H=n_head * 8)
    hf_dir = write_hf(tmp_path / "hf", w, s)
    gg = write_gguf(tmp_path / "m.gguf", w, s)
    ref = _hf_logits(hf_dir, IDS)
    ck_g, lg = _our_logits(gg, IDS)
    ck_h, lh = _our_logits(hf_dir, IDS)
    assert ck_g.config.rope_pairing_in_file == "norm" and ck_h.config.rope_pairing_in_file == "neox"
    assert torch.allclose(lg, ref, atol=1e-4), (lg - ref).abs().max()
    assert torch.allclose(lh, ref, atol=1e-4)
    assert torch.allclose(lg, lh, atol=1e-5)


@pytest.mark.parametrize("tie", [True, False])
def test_r3_tied_and_untied_heads(tmp_path, tie):
    w, s = make_weights(tie=tie, seed=3)
    gg = write_gguf(tmp_path / "m.gguf", w, s)
    ck, logits = _our_logits(gg, IDS)
    assert ck.config.tie_embeddings is tie
    assert ("output" in ck.weights) is (not tie)
    ref = _hf_logits(write_hf(tmp_path / "hf", w, s), IDS)
    assert torch.allclose(logits, ref, atol=1e-4)
    # the head really is the tensor it should be: recompute the last row from the final hidden
    head = w["model.embed_tokens.weight"] if tie else w["lm_head.weight"]
    other = w["lm_head.weight"] if not tie else None
    m = DecoderModel(ck.config, ck.weights)
    assert torch.equal(m.output, head)
    if other is not None:
        assert not torch.equal(m.output, w["model.embed_tokens.weight"])


def test_theta_default_when_absent(tmp_path):
    w, s = make_weights()
    ck = load_checkpoint(write_gguf(tmp_path / "m.gguf", w, s, theta=None))
    assert ck.config.rope_theta == 10000.0 and ck.config.rope_theta_is_default
    assert any("default theta" in n for n in ck.notes)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    w, s = make_weights()
    p = write_gguf(tmp_path / "m.gguf", w, s, arch="mamba")
    with pytest.raises(InfertraceError, match="unsupported architecture 'mamba'"):
        load_checkpoint(p)


def test_chunked_and_batched_runs_equal_solo_on_tiny_model(tmp_path):
    w, s = make_weights()
    ck = load_checkpoint(write_gguf(tmp_path / "m.gguf", w, s))
    m = DecoderModel(ck.config, ck.weights)

    def run(backend, prompts, **kw):
        e = Engine(m, ck.tokenizer, EngineOptions(backend=backend, ctx_size=128, tokens_per_block=4, **kw))
        for p in prompts:
            e.add_request(p, SamplingParams(max_new_tokens=6, ignore_eos=True))
        return [r.output_ids for r in e.run()]

    prompts = [IDS, IDS[:3], IDS[2:9], [5]]
    solo = [run("cells", [p])[0] for p in prompts]
    for backend in ("cells", "paged"):
        assert run(backend, prompts) == solo
        assert run(backend, prompts, prefill_chunk=3, max_batch_tokens=5) == solo
