"""The real SmolLM2-135M-Instruct GGUF (Q4_1): tokens and logits against HF transformers on the
same file, the study's worked example, and batching cases P1-P3 on both backends."""

from __future__ import annotations

import pytest
import torch

from infertrace.engine.engine import Engine, EngineOptions, make_kv
from infertrace.engine.sampler import SamplingParams
from infertrace.kv.base import ChunkSpec
from infertrace.runner import PromptSpec, run_requests

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
]


def _greedy_hf(hf, ids, n):
    """HF forward with its own KV cache, argmax each step, no EOS handling (like ignore_eos)."""
    import inspect

    _, model = hf
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = model(x, use_cache=True, **{key: past})
            past = getattr(res, "cache", None) or res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            x = torch.tensor([[nxt]])
    return out


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_greedy_tokens_equal_hf_for_32_tokens(smol, hf_smol, prompt, backend):
    ids = smol.tokenizer.encode(prompt)
    assert ids == hf_smol[0](prompt, add_special_tokens=False).input_ids
    e = Engine(smol.model, smol.tokenizer, EngineOptions(backend=backend))
    r = e.add_request(ids, SamplingParams(max_new_tokens=32, ignore_eos=True))
    e.run()
    assert r.output_ids == _greedy_hf(hf_smol, ids, 32)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_last_token_logits_within_1e3_of_hf(smol, hf_smol, prompt):
    ids = smol.tokenizer.encode(prompt)
    with torch.no_grad():
        ref = hf_smol[1](torch.tensor([ids])).logits[0, -1].float()  # [V]
    kv = make_kv(smol.model, EngineOptions(ctx_size=64), "torch")
    inp = kv.prepare([ChunkSpec(0, 0, len(ids))])
    ours = smol.model.forward(torch.tensor(ids), inp, kv, torch.tensor([len(ids) - 1]))[0]  # [V]
    assert (ours - ref).abs().max().item() < 1e-3


def test_paris(smol):
    t = run_requests(smol, [PromptSpec("The capital of France is", SamplingParams(max_new_tokens=8))])
    assert t.requests[0]["text"].startswith(" Paris")


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_study_worked_example_on_real_model(smol, backend):
    ids = smol.tokenizer.encode("The capital of")
    assert len(ids) == 3
    t = run_requests(smol, [PromptSpec("", SamplingParams(max_new_tokens=3), ids=ids)], EngineOptions(backend=backend))
    s0, s1, s2 = (st.batch[0] for st in t.steps[:3])
    assert (s0.phase, s0.positions, s0.visible, s0.cache_after) == ("prefill", [0, 1, 2], ["0", "0..1", "0..2"], "0..2")
    assert (s1.phase, s1.positions, s1.visible, s1.cache_after) == ("decode", [3], ["0..3"], "0..3")
    assert (s2.phase, s2.positions, s2.visible, s2.cache_after) == ("decode", [4], ["0..4"], "0..4")
    # the decode input is the token sampled one step earlier (d, then e)
    assert s1.token_ids == [s0.sampled] and s2.token_ids == [s1.sampled]
    # hidden rows: only current tokens are embedded
    assert t.steps[0].hidden.logical_shape == [3, 576] and t.steps[1].hidden.logical_shape == [1, 576]
    assert t.steps[0].hidden.ggml_ne == [576, 3]
    # the hidden row of token 'The' is the embedding row (dequantised Q8_0)
    emb = smol.model.tok_embd[ids[0]]
    assert t.steps[0].hidden.rows[0].first == [round(float(x), 6) for x in emb[:4]]
    # KV logical shapes before/after
    assert t.steps[1].kv.per_request[0]["shape_before"] == [3, 3, 64]
    assert t.steps[1].kv.per_request[0]["shape_after"] == [4, 3, 64]
    # RoPE evidence: position 0 unrotated, later ones rotated; V untouched, norms kept
    ev = t.steps[0].positions.evidence
    assert ev["rows"][0]["dq_max"] == 0 and ev["rows"][1]["dq_max"] > 0 and ev["rows"][2]["dk_max"] > 0
    assert ev["v_cache_minus_v_proj_max"] == 0 and ev["k_cache_minus_k_rot_max"] == 0
    assert t.steps[0].positions.theta == 100000.0 and not t.steps[0].positions.theta_is_default
    if backend == "cells":
        rows = t.steps[0].mask.kq_mask["rows"]
        assert [r[:4] for r in rows[:3]] == [["0", "-inf", "-inf", "-inf"], ["0", "0", "-inf", "-inf"], ["0", "0", "0", "-inf"]]
        assert t.steps[0].mask.kq_mask["ne"] == [256, 3, 1, 1]  # llama.cpp: n_kv padded to 256, one row per token
    else:
        md = t.steps[1].mask.metadata
        assert md["seq_lens"] == [1] and md["kv_lens"] == [4] and md["cu_seqlens"] == [0, 1]
        assert md["request_types"] == ["generation"] and md["dense_mask_tensor"] is None


def _logits_rows_and_tokens(smol, backend, prompts, **opts):
    e = Engine(smol.model, smol.tokenizer, EngineOptions(backend=backend, **opts))
    for p in prompts:
        e.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True))
    batch = e.scheduler.schedule(0)
    return e, batch


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_p1_chunked_prefill_positions_kv_and_logits(smol, backend):
    ids = smol.tokenizer.encode("One two three four five six seven eight nine ten")[:10]
    assert len(ids) == 10
    full = run_requests(smol, [PromptSpec("", SamplingParams(max_new_tokens=2), ids=ids)], EngineOptions(backend=backend))
    ch = run_requests(smol, [PromptSpec("", SamplingParams(max_new_tokens=2), ids=ids)],
                      EngineOptions(backend=backend, prefill_chunk=4))
    assert [st.batch[0].positions for st in ch.steps[:4]] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [10]]
    assert ch.steps[1].batch[0].visible[0] == "0..4" and ch.steps[2].batch[0].visible[1] == "0..9"
    assert ch.steps[0].decode.per_request[0]["row"] is None  # no logits for a non-final chunk
    assert ch.requests[0]["output_ids"] == full.requests[0]["output_ids"]
    assert ch.steps[2].decode.per_request[0]["top"] == full.steps[0].decode.per_request[0]["top"] or all(
        abs(a["logit"] - b["logit"]) < 1e-4 for a, b in zip(ch.steps[2].decode.per_request[0]["top"], full.steps[0].decode.per_request[0]["top"]))


def test_p1_chunked_kv_contents_equal_unchunked(smol):
    ids = smol.tokenizer.encode("One two three four five six seven eight nine ten")[:10]
    outs = []
    for chunk in (None, 4):
        e = Engine(smol.model, smol.tokenizer, EngineOptions(backend="paged", prefill_chunk=chunk))
        e.add_request(ids, SamplingParams(max_new_tokens=1))
        for _ in range(3 if chunk else 1):
            e.step()
        outs.append(e.kv.read(5, 0) if e.kv.seq_len(0) else None)
    # after prefill the request finished (max_new_tokens=1) and released; read before release instead
    e1 = Engine(smol.model, smol.tokenizer, EngineOptions(backend="cells"))
    e2 = Engine(smol.model, smol.tokenizer, EngineOptions(backend="cells", prefill_chunk=4))
    for e in (e1, e2):
        e.add_request(ids, SamplingParams(max_new_tokens=4))
    e1.step()
    for _ in range(3):
        e2.step()
    for layer in (0, 29):
        k1, v1 = e1.kv.read(layer, 0)
        k2, v2 = e2.kv.read(layer, 0)
        assert k1.shape == (10, 3, 64)
        assert torch.allclose(k1, k2, atol=1e-4) and torch.allclose(v1, v2, atol=1e-4)


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_p2_packed_last_token_gather(smol, backend):
    ids = smol.tokenizer.encode("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau")
    assert len(ids) >= 20
    lens = [1, 5, 5, 4, 5]
    prompts, o = [], 0
    for n in lens:
        prompts.append(ids[o : o + n])
        o += n
    t = run_requests(smol, [PromptSpec("", SamplingParams(max_new_tokens=2), ids=p) for p in prompts],
                     EngineOptions(backend=backend))
    assert t.steps[0].decode.logits_rows == [0, 5, 10, 14, 19]
    assert t.steps[0].decode.logits_shape == [5, 49152]
    for p, r in zip(prompts, t.requests):
        solo = run_requests(smol, [PromptSpec("", SamplingParams(max_new_tokens=2), ids=p)], EngineOptions(backend=backend), trace=False)
        assert r["output_ids"] == solo.requests[0]["output_ids"]


class _Capture:
    """Wraps ``DecoderModel.forward`` to keep each step's logits and attention inputs."""

    def __init__(self, model):
        self.model, self.orig, self.calls = model, model.forward, []

    def __enter__(self):
        def fwd(ids, inp, kv, rows, tracer=None):
            out = self.orig(ids, inp, kv, rows) if tracer is None else self.orig(ids, inp, kv, rows, tracer)
            self.calls.append((inp, out.clone()))
            return out

        self.model.forward = fwd
        return self

    def __exit__(self, *exc):
        del self.model.forward


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_p3_isolation_mixed_steps_match_solo_logits(smol, backend):
    tok = smol.tokenizer
    specs = [("The capital of France is", 0), ("def add(a, b):", 1), ("Water boils at", 3)]
    solos = []
    for text, _ in specs:
        e = Engine(smol.model, tok, EngineOptions(backend=backend))
        e.add_request(tok.encode(text), SamplingParams(max_new_tokens=5, ignore_eos=True))
        with _Capture(smol.model) as cap:
            e.run()
        solos.append((e.requests[0].output_ids, [out[0] for _, out in cap.calls]))
    e = Engine(smol.model, tok, EngineOptions(backend=backend, prefill_chunk=3))
    for text, arrival in specs:
        e.add_request(tok.encode(text), SamplingParams(max_new_tokens=5, ignore_eos=True), arrival_step=arrival)
    got = {i: [] for i in range(3)}
    mixed = False
    with _Capture(smol.model) as cap:
        while (batch := e.step()) is not None:
            if not batch.chunks:
                continue
            inp, out = cap.calls[-1]
            mixed |= {c.phase for c in batch.chunks} == {"prefill", "decode"}
            # the materialised mask is block-diagonal causal: own keys 0..pos, nothing foreign
            for m, c in zip(e.kv.logical_mask(inp), batch.chunks):
                expect = torch.arange(c.C + c.T).unsqueeze(0) <= torch.arange(c.C, c.C + c.T).unsqueeze(1)
                assert torch.equal(m, expect)
            j = 0
            for c in batch.chunks:
                if c.need_logits:
                    got[c.req.seq_id].append(out[j])
                    j += 1
    assert mixed
    for i in range(3):
        assert e.requests[i].output_ids == solos[i][0]
        assert len(got[i]) == len(solos[i][1]) == 5
        for a, b in zip(got[i], solos[i][1]):
            assert (a - b).abs().max().item() < 1e-4


def test_gguf_and_safetensors_copies_give_same_logits(smol, hf_smol, tmp_path):
    """HF transformers dequantises the same GGUF and saves it as safetensors (HF half-split Q/K
    order); our loader reads both copies; the logits agree."""
    from infertrace.model.decoder import DecoderModel
    from infertrace.loading.weights import load_checkpoint

    import json

    from safetensors.torch import save_file

    tok, model = hf_smol
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    save_file(sd, str(tmp_path / "model.safetensors"))
    tok.save_pretrained(str(tmp_path))
    ck = load_checkpoint(tmp_path)
    assert ck.config.source == "hf" and ck.config.rope_pairing_in_file == "neox"
    assert ck.config.n_head_kv == 3 and ck.config.tie_embeddings
    ids = smol.tokenizer.encode("The capital of France is")
    assert ck.tokenizer.encode("The capital of France is") == ids
    hf_model = DecoderModel(ck.config, ck.weights)
    out = []
    for m in (smol.model, hf_model):
        kv = make_kv(m, EngineOptions(ctx_size=64), "torch")
        inp = kv.prepare([ChunkSpec(0, 0, len(ids))])
        out.append(m.forward(torch.tensor(ids), inp, kv, torch.arange(len(ids))))  # [T, V]
    assert (out[0] - out[1]).abs().max().item() < 1e-4
