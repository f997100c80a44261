"""--sampler-order: HF order (temperature, then filters) vs llama.cpp's common_sampler order (filters on
unscaled logits, temperature last). The hand example of issue 12, then llama.cpp's own sampler chain
(llama_sampler_init_top_k / top_p / min_p / temp through llama-cpp-python) keeps the same sets."""

from __future__ import annotations

import ctypes

import pytest
import torch

from infertrace.engine.sampler import SamplingParams, default_order, kept_set, sample


def test_hand_example_kept_sets() -> None:
    # logits [3, 2, 1], top-p 0.8, temperature 0.5.
    # hf: softmax([6, 4, 2]) = [0.867, 0.117, 0.016]; 0.867 >= 0.8 already -> keeps {0}.
    # llama.cpp: softmax([3, 2, 1]) = [0.665, 0.245, 0.090]; 0.665 < 0.8, 0.910 >= 0.8 -> keeps {0, 1},
    #            then temperature: softmax([3, 2] / 0.5) = [0.8808, 0.1192].
    x = torch.tensor([3.0, 2.0, 1.0])
    p = SamplingParams(temperature=0.5, top_p=0.8)
    ids, probs = kept_set(x, p, "hf")
    assert ids.tolist() == [0] and probs.tolist() == [1.0]
    ids, probs = kept_set(x, p, "llama.cpp")
    assert ids.tolist() == [0, 1]
    assert probs.tolist() == pytest.approx([0.880797, 0.119203], abs=1e-6)


def test_draws_follow_the_order() -> None:
    x = torch.tensor([3.0, 2.0, 1.0])
    p = SamplingParams(temperature=0.5, top_p=0.8)
    g = torch.Generator().manual_seed(0)
    assert {sample(x, p, [], g, order="hf").token for _ in range(200)} == {0}
    g = torch.Generator().manual_seed(0)
    assert {sample(x, p, [], g, order="llama.cpp").token for _ in range(200)} == {0, 1}


def test_default_order_follows_the_runtime() -> None:
    assert default_order("cells") == "llama.cpp"
    assert default_order("paged") == "hf"


def _llamacpp_kept(llama_cpp, logits: list[float], p: SamplingParams) -> list[int]:
    """The candidates left by llama.cpp's chain top-k -> top-p -> min-p -> temp (common_sampler order)."""
    L = llama_cpp
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    if p.top_k > 0:
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(p.top_k))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(p.top_p, 1))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(p.min_p, 1))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(p.temperature))
    n = len(logits)
    data = (L.llama_token_data * n)(*[L.llama_token_data(i, v, 0.0) for i, v in enumerate(logits)])
    arr = L.llama_token_data_array(data=ctypes.cast(data, L.llama_token_data_p), size=n, selected=-1, sorted=False)
    L.llama_sampler_apply(chain, ctypes.byref(arr))
    kept = [arr.data[i].id for i in range(arr.size)]
    L.llama_sampler_free(chain)
    return kept


def test_llamacpp_sampler_keeps_the_same_sets(llama_cpp) -> None:
    assert _llamacpp_kept(llama_cpp, [3.0, 2.0, 1.0], SamplingParams(temperature=0.5, top_p=0.8)) == [0, 1]
    gen = torch.Generator().manual_seed(1)
    settings = [SamplingParams(temperature=t, top_k=k, top_p=tp, min_p=mp)
                for t in (0.3, 0.7, 1.5) for k in (0, 40) for tp in (1.0, 0.9, 0.5) for mp in (0.0, 0.05)]
    differs = 0
    for p in settings:
        x = torch.randn(300, generator=gen) * 3  # [V]
        ours, _ = kept_set(x, p, "llama.cpp")
        theirs = _llamacpp_kept(llama_cpp, x.tolist(), p)
        assert sorted(ours.tolist()) == sorted(theirs), p
        differs += sorted(kept_set(x, p, "hf")[0].tolist()) != sorted(theirs)
    assert differs > 0  # the two orders really keep different sets on these settings


# ----------------------------------------------------------------------------- the penalty window (case S4)


def test_penalty_window_hand_example() -> None:
    """logits [2, -2, 0.5, 1], tokens seen [0, 1, 0, 3] (oldest first).
    Window 2 = the last two tokens {0, 3}: 2/2 = 1, 1/2 = 0.5; token 1 (outside) keeps -2.
    Whole context, repetition 1, frequency 0.5, presence 0.25 (counts 0:2, 1:1, 3:1):
    2 - (2*0.5 + 0.25) = 0.75, -2 - 0.75 = -2.75, 1 - 0.75 = 0.25; token 2 never seen keeps 0.5."""
    from infertrace.engine.sampler import apply_penalties

    x = torch.tensor([2.0, -2.0, 0.5, 1.0])
    seen = [0, 1, 0, 3]
    out = apply_penalties(x, seen, SamplingParams(repetition_penalty=2.0, penalty_last_n=2), "llama.cpp")
    assert out.tolist() == [1.0, -2.0, 0.5, 0.5]
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, penalty_last_n=-1)
    assert apply_penalties(x, seen, p, "llama.cpp").tolist() == [0.75, -2.75, 0.5, 0.25]
    assert apply_penalties(x, seen, SamplingParams(repetition_penalty=2.0, penalty_last_n=0), "llama.cpp").tolist() == x.tolist()
    # the order's default window: 64 in llama.cpp's order, the whole context in HF's
    long = [0] + [3] * 64  # token 0 is 65 tokens back
    assert apply_penalties(x, long, SamplingParams(repetition_penalty=2.0), "llama.cpp")[0] == 2.0
    assert apply_penalties(x, long, SamplingParams(repetition_penalty=2.0), "hf")[0] == 1.0


def test_frequency_presence_refused_in_hf_order() -> None:
    from infertrace.engine.sampler import apply_penalties
    from infertrace.errors import ConfigError

    with pytest.raises(ConfigError, match="needs the llama.cpp sampler order") as e:
        apply_penalties(torch.zeros(4), [1], SamplingParams(presence_penalty=0.5), "hf")
    assert e.value.field == "sampling.presence_penalty"  # the library's field; the CLI names --presence-penalty


def _llamacpp_penalised(L, logits: list[float], seen: list[int], last_n: int, rep: float, freq: float, pres: float) -> list[float]:
    """llama.cpp's penalties sampler: every token of ``seen`` accepted (prompt first), then applied."""
    smpl = L.llama_sampler_init_penalties(len(logits), last_n, rep, freq, pres)
    for t in seen:
        L.llama_sampler_accept(smpl, t)
    n = len(logits)
    data = (L.llama_token_data * n)(*[L.llama_token_data(i, v, 0.0) for i, v in enumerate(logits)])
    arr = L.llama_token_data_array(data=ctypes.cast(data, L.llama_token_data_p), size=n, selected=-1, sorted=False)
    L.llama_sampler_apply(smpl, ctypes.byref(arr))
    out = [0.0] * n
    for i in range(arr.size):
        out[arr.data[i].id] = arr.data[i].logit
    L.llama_sampler_free(smpl)
    return out


def test_penalties_equal_llamacpp_sampler(llama_cpp) -> None:
    """Random logits and histories through llama.cpp's own penalties sampler (the window as a ring
    buffer, frequency / presence per count) and ours: the same penalised logits."""
    from infertrace.engine.sampler import apply_penalties

    gen = torch.Generator().manual_seed(3)
    checked = 0
    for last_n in (1, 7, 64, -1):
        for rep, freq, pres in ((1.3, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.4, 0.0), (1.0, 0.0, -0.3), (1.5, 0.2, 0.6)):
            x = torch.randn(300, generator=gen) * 3  # [V]
            seen = torch.randint(0, 40, (100,), generator=gen).tolist()
            ours = apply_penalties(x, seen, SamplingParams(repetition_penalty=rep, frequency_penalty=freq,
                                                           presence_penalty=pres, penalty_last_n=last_n), "llama.cpp")
            theirs = _llamacpp_penalised(llama_cpp, x.tolist(), seen, len(seen) if last_n == -1 else last_n, rep, freq, pres)
            assert ours.tolist() == pytest.approx(theirs, rel=1e-6, abs=1e-6), (last_n, rep, freq, pres)
            checked += int((ours != x).sum())
    assert checked > 300  # many logits really penalised (376 of the 20 x 300)


#: case S4: 81 tokens, the only " Paris" (7042) at index 4, 77 tokens back from the next token
S4_PROMPT = ("My friend lives in Paris. We talked about the weather, the trains, the food, the music, the books and "
             "the films we liked when we were young, and about the long summers at the lake house with our cousins and "
             "grandparents, our old dog, the garden, the neighbours, the school, the market on Sundays and the small "
             "bakery on our street with the blue. The capital of France is")
PARIS = 7042


@pytest.mark.model
def test_s4_penalty_window_real_model(smol, llama_cpp, tmp_path) -> None:
    """SmolLM2, repetition penalty 3, greedy, llama.cpp order: llama.cpp's chain (prompt accepted,
    penalties(64, 3, 0, 0), greedy) on llama.cpp's own logits picks " Paris", outside the window;
    with the whole context in the window it is penalised and another token wins. Our sampler on
    the same logits, and `run` end to end, choose the same."""
    import json

    from typer.testing import CliRunner

    from infertrace.cli.app import app
    from infertrace.runtimes.llamacpp.capture import LlamaCppContext

    ids = smol.tokenizer.encode(S4_PROMPT)
    assert len(ids) == 81 and [i for i, t in enumerate(ids) if t == PARIS] == [4]
    lctx = LlamaCppContext(smol.ckpt.path, 256, 128, 1)
    try:
        logits = lctx.decode(ids, list(range(81)), [0] * 81, [False] * 80 + [True]).tensors["logits"][0].tolist()
    finally:
        lctx.close()

    def theirs(last_n: int) -> int:
        pen = _llamacpp_penalised(llama_cpp, logits, ids, last_n, 3.0, 0.0, 0.0)
        return max(range(len(pen)), key=lambda i: (pen[i], -i))  # greedy: first max

    x = torch.tensor(logits)
    g = torch.Generator()
    assert int(torch.argmax(x)) == PARIS
    assert theirs(64) == PARIS
    assert sample(x, SamplingParams(repetition_penalty=3.0), ids, g, order="llama.cpp").token == PARIS
    whole = theirs(81)
    assert whole != PARIS
    assert sample(x, SamplingParams(repetition_penalty=3.0, penalty_last_n=-1), ids, g, order="llama.cpp").token == whole
    # end to end, our engine's logits: the default window 64 in llama.cpp's order, recorded in the trace
    r = CliRunner()
    base = ["run", "-p", S4_PROMPT, "-n", "1", "--repetition-penalty", "3", "--sampler-order", "llama.cpp", "--json"]
    res = r.invoke(app, base)
    assert res.exit_code == 0, res.output
    t = json.loads(res.output)
    assert t["requests"][0]["output_ids"] == [PARIS]
    assert t["requests"][0]["params"]["penalty_last_n"] == 64
    assert t["steps"][0]["decode"]["per_request"][0]["sampler"]["penalty_last_n"] == 64
    res = r.invoke(app, [*base, "--penalty-last-n", "-1"])
    assert res.exit_code == 0, res.output
    t = json.loads(res.output)
    # -1 runs as llama.cpp runs it: n_ctx (common_init_from_params "setting penalty_last_n to ctx_size"), the default 2048 here
    assert t["requests"][0]["output_ids"] == [whole] and t["requests"][0]["params"]["penalty_last_n"] == 2048
    # the hf order penalises the whole context by default (HF RepetitionPenaltyLogitsProcessor)
    res = r.invoke(app, ["run", "-p", S4_PROMPT, "-n", "1", "--repetition-penalty", "3", "--sampler-order", "hf", "--json"])
    assert json.loads(res.output)["requests"][0]["output_ids"] == [whole]


def test_penalty_options_refused_in_one_line() -> None:
    from typer.testing import CliRunner

    from infertrace.cli.app import app

    r = CliRunner()
    for args, want in ((["--penalty-last-n", "-2"], "--penalty-last-n: must be -1"),
                       (["--frequency-penalty", "0.5", "--backend", "paged"], "needs the llama.cpp sampler order"),
                       (["--presence-penalty", "nan"], "--presence-penalty: must be a finite number")):
        res = r.invoke(app, ["run", "-p", "hi", "-n", "1", *args])
        assert res.exit_code == 2, (args, res.output)
        assert want in res.output and "Traceback" not in res.output, res.output
