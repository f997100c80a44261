"""Issue 22, tried as a hostile but realistic user would: each fix checked against an independent value.

* context shift (C1, C2) against llama.cpp itself: llama-cpp-python's own KV cache driven with the
  server's rule (``n_keep = min(n_ctx - 4, --n-keep + add_bos)``, ``n_discard = (n_past - n_keep) / 2``,
  ``llama_memory_seq_rm`` + ``llama_memory_seq_add``) gives the same shifts, tokens and logits as ours;
* llama.cpp's ``--repeat-last-n -1`` is ``n_ctx`` (``common_init_from_params`` / the server's
  ``params_from_json_cmpl``: "setting penalty_last_n to ctx_size"), which differs from "every token
  seen" once a context shift lets a request see more than ``n_ctx`` tokens (S4);
* hostile traces and files (L2, X3, G2, T3).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from infertrace.engine.engine import EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.loading.weights import load_checkpoint
from infertrace.model.decoder import DecoderModel
from infertrace.runner import Loaded, PromptSpec, run_requests
from tests.helpers.tiny import make_weights, write_gguf

PROMPT = [72, 101, 108, 108, 111, 33, 34, 35, 100, 101]


def _llamacpp_shift_run(L, path, ids: list[int], n_keep_arg: int, ctx: int, n_new: int, add_bos: bool,
                        penalties: tuple[int, float] | None = None):
    """Greedy generation by llama.cpp (F32 K/V, no flash attention) with the server's context shift done
    through llama.cpp's own ``llama_memory_seq_rm`` / ``llama_memory_seq_add``; ``penalties`` =
    ``(penalty_last_n, repeat_penalty)`` through ``llama_sampler_init_penalties`` (prompt accepted first).
    Returns (tokens, per-step logits [V] float32, shifts as (n_past, n_keep, n_discard))."""
    llm = L.Llama(model_path=str(path), n_ctx=ctx, n_batch=ctx, swa_full=True, verbose=False, type_k=0, type_v=0,
                  flash_attn=False, n_threads=1)
    mem = L.llama_get_memory(llm._ctx.ctx)
    V = llm.n_vocab()
    smpl = None
    if penalties is not None:
        smpl = L.llama_sampler_init_penalties(V, penalties[0], penalties[1], 0.0, 0.0)
        for t in ids:
            L.llama_sampler_accept(smpl, t)
    llm.eval(ids)
    cache, out, logits, shifts = list(ids), [], [], []
    for i in range(n_new):
        lg = np.ctypeslib.as_array(L.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(V,)).copy()  # [V]
        logits.append(lg)
        x = lg
        if smpl is not None:
            data = (L.llama_token_data * V)(*[L.llama_token_data(j, float(v), 0.0) for j, v in enumerate(lg)])
            arr = L.llama_token_data_array(data=ctypes.cast(data, L.llama_token_data_p), size=V, selected=-1, sorted=False)
            L.llama_sampler_apply(smpl, ctypes.byref(arr))
            x = np.empty(V, dtype=np.float32)
            for j in range(arr.size):
                x[arr.data[j].id] = arr.data[j].logit
        t = int(np.argmax(x))
        out.append(t)
        if smpl is not None:
            L.llama_sampler_accept(smpl, t)
        if i == n_new - 1:
            break
        n_past = len(cache)
        if n_past + 1 >= ctx:  # server update_slots / pre_decode
            n_keep = min(ctx - 4, (len(ids) if n_keep_arg < 0 else n_keep_arg) + int(add_bos))  # -1: the prompt
            n_left = n_past - n_keep
            n_discard = max(0, min(n_left // 2, n_left - 1))
            shifts.append((n_past, n_keep, n_discard))
            L.llama_memory_seq_rm(mem, 0, n_keep, n_keep + n_discard)
            L.llama_memory_seq_add(mem, 0, n_keep + n_discard, n_past, -n_discard)
            cache = cache[:n_keep] + cache[n_keep + n_discard:]
            llm.n_tokens = len(cache)
            llm.input_ids[: len(cache)] = cache
        llm.eval([t])
        cache.append(t)
    if smpl is not None:
        L.llama_sampler_free(smpl)
    return out, logits, shifts


def _ours(path, ids, n_keep, ctx, n_new, backend, **params):
    ck = load_checkpoint(path)
    loaded = Loaded(ck, DecoderModel(ck.config, ck.weights))
    tr = run_requests(loaded, [PromptSpec("", SamplingParams(max_new_tokens=n_new, ignore_eos=True, **params), ids=ids)],
                      EngineOptions(backend=backend, ctx_size=ctx, tokens_per_block=4, context_shift=True, n_keep=n_keep,
                                    sampler_order="llama.cpp"), show=("positions", "decode"))
    tops = [pr["top"] for st in tr.steps for pr in st.decode.per_request]
    shifts = [(r.shift["n_past"], r.shift["n_keep"], r.shift["n_discard"]) for st in tr.steps for r in st.batch if r.shift]
    return tr, tr.requests[0]["output_ids"], tops, shifts


@pytest.fixture(scope="module")
def bos_gguf(tmp_path_factory):
    w, s = make_weights(seed=3)
    return write_gguf(tmp_path_factory.mktemp("bos") / "m.gguf", w, s, add_bos=True)


@pytest.mark.parametrize("backend", ["cells", "paged"])
@pytest.mark.parametrize("n_keep, shifts", [(0, [(11, 1, 5)]), (2, [(11, 3, 4)]), (8, [(11, 8, 1)] * 4),
                                            (-1, [(11, 7, 2)] * 2)])
def test_context_shift_equals_llamacpps_own_kv_cache(llama_cpp, bos_gguf, backend, n_keep, shifts):
    """Case C1 against llama.cpp itself: [BOS, "abcde"], ctx 12, 10 greedy tokens. --n-keep 8 is n_ctx - 4:
    with the BOS it would be 9, clamped to 8 (llama.cpp's min(n_ctx - 4, n_keep)), one token dropped per
    shift. --n-keep -1 (llama.cpp's --keep -1, refused before) keeps the prompt: its 6 tokens + add_bos = 7
    (llama.cpp counts the BOS twice), n_discard (11 - 7) / 2 = 2. Same shifts, same tokens, top-5 logits within 1e-4 of llama.cpp's (measured 6.5e-6)."""
    ids = [257, 97, 98, 99, 100, 101]
    ref, ref_logits, ref_shifts = _llamacpp_shift_run(llama_cpp, bos_gguf, ids, n_keep, 12, 10, add_bos=True)
    assert ref_shifts == shifts
    _, out, tops, ours_shifts = _ours(bos_gguf, ids, n_keep, 12, 10, backend)
    assert ours_shifts == shifts and out == ref
    assert max(abs(t["logit"] - float(ref_logits[i][t["id"]])) for i, top in enumerate(tops) for t in top) <= 1e-4


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_gemma3_context_shift_equals_llamacpps_own_k_shift(llama_cpp, tmp_path, backend):
    """Case C2 against llama.cpp's own K-shift (build_rope_shift per layer: windowed layers base 10000,
    global 1e6): 6-layer tiny Gemma 3, window 4, ctx 16, --n-keep 2, two shifts of 6. Top-5 logits
    within 2e-3 of llama.cpp's at every step (the floor before any shift is already 3e-4 on this model:
    GELU-tanh and norms in ggml's order; measured max 8.2e-4, unchanged by the shifts)."""
    w, s = make_weights(family="gemma3", n_layer=6, seed=5)
    path = write_gguf(tmp_path / "g.gguf", w, s, kv={"attention.sliding_window": 4})
    ref, ref_logits, ref_shifts = _llamacpp_shift_run(llama_cpp, path, PROMPT, 2, 16, 14, add_bos=False)
    _, out, tops, ours_shifts = _ours(path, PROMPT, 2, 16, 14, backend)
    assert ref_shifts == ours_shifts == [(15, 2, 6)] * 2 and out == ref
    assert max(abs(t["logit"] - float(ref_logits[i][t["id"]])) for i, top in enumerate(tops) for t in top) <= 2e-3


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_penalty_window_minus_one_is_n_ctx_under_context_shift(llama_cpp, bos_gguf, backend):
    """Case S4, -1 past the context: llama.cpp turns --repeat-last-n -1 into n_ctx (common_init_from_params,
    server params_from_json_cmpl) before building the chain, so with a context shift the window is the
    last 12 tokens, not every token seen. [BOS, "abcde"], ctx 12, --n-keep 0, 24 tokens, repetition 3:
    the same tokens as llama.cpp's own penalties sampler (window 12) over its own shifted cache."""
    ids = [257, 97, 98, 99, 100, 101]
    ref, _, ref_shifts = _llamacpp_shift_run(llama_cpp, bos_gguf, ids, 0, 12, 24, add_bos=True, penalties=(12, 3.0))
    tr, out, _, shifts = _ours(bos_gguf, ids, 0, 12, 24, backend, repetition_penalty=3.0, penalty_last_n=-1)
    assert shifts == ref_shifts and len(shifts) >= 2
    assert out == ref
    assert tr.requests[0]["params"]["penalty_last_n"] == 12  # recorded as run, as llama.cpp logs it


# ----------------------------------------------------------------------------- X3: a shift record that lies


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_check_catches_a_shift_whose_shown_ranges_lie(tmp_path, backend):
    """A real context-shift trace ("abcde", ctx 12, --n-keep 1: n_past 11, drop 1..5, move 6..10 -> 1..5)
    passes check; tampered so that what ``show`` prints is not what n_keep / n_discard did, it fails with
    step, seq and variable: ``removed`` claiming the BOS range 0..4, ``moved`` elsewhere, n_keep moved by
    one with the ranges left (paged: nothing else catches it, no cell identity), and the request's copy of
    the shift differing from the step's op."""
    import copy
    import json

    from typer.testing import CliRunner

    from infertrace.cli.app import app
    from infertrace.trace.check import check_trace

    w, s = make_weights(seed=5)
    g = write_gguf(tmp_path / "m.gguf", w, s)
    d = tmp_path / "t"
    r = CliRunner().invoke(app, ["run", "-m", str(g), "--ignore-eos", "--save", str(d), "-p", "abcde", "--ctx-size", "12",
                                 "-n", "10", "--context-shift", "--n-keep", "1", "--backend", backend,
                                 "--tokens-per-block", "4", "--keep", "summary"])
    assert r.exit_code == 0, r.output
    m = json.loads((d / "trace.json").read_text(encoding="utf-8"))
    assert check_trace(m)[0] is None
    st_i = next(i for i, st in enumerate(m["steps"]) if any(x.get("shift") for x in st["batch"]))
    sh = m["steps"][st_i]["batch"][0]["shift"]
    assert (sh["n_past"], sh["n_keep"], sh["n_discard"], sh["removed"], sh["moved"]) == (11, 1, 5, "1..5", "6..10 -> 1..5")

    def tampered(edit, both=True):
        bad = copy.deepcopy(m)
        st = bad["steps"][st_i]
        targets = [st["batch"][0]["shift"]] + ([o for o in st["serving"]["ops_before_step"]] if both else [])
        for t in targets:
            edit(t)
        return check_trace(bad)[0]

    for edit, rule, text in (
            (lambda t: t.update(removed="0..4"), "context shift of the cached positions", "removed '0..4' is not '1..5'"),
            (lambda t: t.update(moved="1..2 -> 7..8"), "context shift of the cached positions", "is not '6..10 -> 1..5'"),
            (lambda t: t.update(n_keep=2), "context shift of the cached positions", "removed '1..5' is not '2..6'")):
        v = tampered(edit)
        assert v and (v.step, v.seq_id, v.variable, v.rule) == (m["steps"][st_i]["step"], 0, "positions", rule)
        assert text in v.detail
    v = tampered(lambda t: t.update(k_shift_max_abs_layer0=0.5), both=False)  # the row alone: show prints the row's
    assert v and (v.seq_id, v.variable, v.rule) == (0, "serving", "context shift recorded once")


# ----------------------------------------------------------------------------- --audit-kv on a hybrid model


def test_audit_recomputation_of_a_hybrid_equals_hfs_cache(tmp_path):
    """--audit-kv on Qwen3.5 (GDN + attention layers, partial rotary) crashed with an internal error
    (the from-scratch recomputation built a plain cells cache the hybrid forward cannot use). Its
    recomputation now runs the hybrid memory, and the attention layers' K/V equal HF's own hybrid cache
    (DynamicCache layers 1 and 3; measured 3.6e-6); GDN layers have no K/V (None)."""
    import torch

    pytest.importorskip("transformers")
    from infertrace.kv.audit import recompute_kv
    from infertrace.model.decoder import DecoderModel
    from tests.helpers.tiny_qwen35 import hf_model, make_weights as q35_weights, write_hf_dir

    w, s = q35_weights(seed=3)
    ck = load_checkpoint(write_hf_dir(tmp_path / "q35", w, s))
    m = DecoderModel(ck.config, ck.weights)
    ids = [72, 101, 108, 108, 111, 33, 34, 35]
    with torch.no_grad():
        cache = hf_model(w, s)(torch.tensor([ids]), use_cache=True).past_key_values
    fk, fv = recompute_kv(m, ids)
    attn = [i for i in range(m.cfg.n_layer) if not m.cfg.is_linear(i)]
    assert attn == [1, 3] and [i for i, k in enumerate(fk) if k is None] == [0, 2]
    for i in attn:
        hk, hv = cache.layers[i].keys[0].transpose(0, 1), cache.layers[i].values[0].transpose(0, 1)  # [L, n_kv, hd]
        assert (fk[i] - hk).abs().max() <= 1e-5 and (fv[i] - hv).abs().max() <= 1e-5


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_audit_kv_runs_on_a_hybrid_model(tmp_path, backend):
    """`run --audit-kv` on a hybrid model: exit 0 (was "internal error: AttributeError"), and every step's
    audit of the attention layers' cache is exact (<= 1e-5; measured 5.6e-6)."""
    import json

    from typer.testing import CliRunner

    from infertrace.cli.app import app
    from tests.helpers.tiny_qwen35 import make_weights as q35_weights, write_gguf as q35_gguf

    w, s = q35_weights(seed=1)
    g = q35_gguf(tmp_path / "q35.gguf", w, s)
    r = CliRunner().invoke(app, ["run", "-m", str(g), "-p", "Hello world", "--ctx-size", "16", "-n", "4", "--audit-kv",
                                 "--backend", backend, "--tokens-per-block", "4", "--ignore-eos", "--json"])
    assert r.exit_code == 0, r.output
    t = json.loads(r.output)
    audits = [st["serving"]["audit"] for st in t["steps"]]
    assert len(audits) == 4 and all(a["max_abs_exact"] <= 1e-5 for a in audits)
    assert sum(g["entries"] for g in audits[-1]["by_provenance"]) == 11 + 3  # every cached position audited


def test_check_catches_a_kept_cell_that_moves(tmp_path):
    """Cells (llama.cpp): a cell a sequence keeps without writing it holds the same position, or the
    position the step's context shift moved it to (pos - n_discard past the dropped range). Tampered:
    a retained finished sequence's cell moved to pos 40 (passed check before), and a shifted cell put at
    pos 11 instead of 1. Both fail with step, seq and variable kv; the real traces pass."""
    import copy
    import json

    from typer.testing import CliRunner

    from infertrace.cli.app import app
    from infertrace.trace.check import check_trace

    w, s = make_weights(seed=5)
    g = str(write_gguf(tmp_path / "m.gguf", w, s))

    def save(d, *args):
        r = CliRunner().invoke(app, ["run", "-m", g, "--ignore-eos", "--save", str(d), "--keep", "summary", *args])
        assert r.exit_code == 0, r.output
        return json.loads((d / "trace.json").read_text(encoding="utf-8"))

    # seq 0 "abcdefgh" finishes at step 10 and is retained; seq 1 arrives at step 20 and hits its prefix
    m = save(tmp_path / "ret", "-p", "abcdefgh", "-p", "abcdefxy", "--ctx-size", "20", "-n", "10", "--prefix-cache", "on",
             "--arrival", "0", "--arrival", "20")
    assert check_trace(m)[0] is None
    i = next(i for i, st in enumerate(m["steps"]) if st["kv"]["physical"].get("retained") == [0])
    i += 1  # a step after the finish: seq 0 is retained and nobody writes its cells
    bad = copy.deepcopy(m)
    cell = next(c for c in bad["steps"][i]["kv"]["physical"]["cells"] if c["seq_ids"] == [0] and c["pos"] == 3)
    cell["pos"] = 40
    v = check_trace(bad)[0]
    assert (v.step, v.seq_id, v.variable, v.rule) == (m["steps"][i]["step"], 0, "kv", "a kept cell keeps its position")
    assert f"cell {cell['cell']} held pos 3 of seq 0 and now holds pos 40, expected 3" in v.detail

    # "abcde", ctx 12, --n-keep 1: the shift moves pos 6..10 to 1..5
    m = save(tmp_path / "sh", "-p", "abcde", "--ctx-size", "12", "-n", "10", "--context-shift", "--n-keep", "1")
    assert check_trace(m)[0] is None
    i = next(i for i, st in enumerate(m["steps"]) if any(r.get("shift") for r in st["batch"]))
    bad = copy.deepcopy(m)
    cells = bad["steps"][i]["kv"]["physical"]["cells"]
    moved = next(c for c in cells if c["pos"] == 1)  # was pos 6 before the shift
    moved["pos"] = 11  # moved the wrong way (pos 11 is free: the step writes pos 6)
    v = check_trace(bad)[0]
    assert (v.step, v.seq_id, v.variable, v.rule) == (m["steps"][i]["step"], 0, "kv", "a kept cell keeps its position")
    assert "held pos 6 of seq 0 and now holds pos 11, expected 1 after the context shift" in v.detail


def test_check_catches_a_retained_sequence_that_is_not_finished(tmp_path):
    """The prefix cache's retained list names finished sequences (llama.cpp server keeps a finished slot's
    cells). Tampered to name a sequence never computed (77), or seq 1 while it runs: both passed check
    before; now each is a kv violation naming the seq."""
    import copy
    import json

    from typer.testing import CliRunner

    from infertrace.cli.app import app
    from infertrace.trace.check import check_trace

    w, s = make_weights(seed=5)
    g = str(write_gguf(tmp_path / "m.gguf", w, s))
    d = tmp_path / "ret"
    r = CliRunner().invoke(app, ["run", "-m", g, "--ignore-eos", "--save", str(d), "--keep", "summary", "-p", "abcdefgh",
                                 "-p", "abcdefxy", "--ctx-size", "20", "-n", "10", "--prefix-cache", "on",
                                 "--arrival", "0", "--arrival", "20"])
    assert r.exit_code == 0, r.output
    m = json.loads((d / "trace.json").read_text(encoding="utf-8"))
    assert check_trace(m)[0] is None
    i = next(i for i, st in enumerate(m["steps"]) if st["kv"]["physical"].get("retained") == [0])
    j = next(j for j, st in enumerate(m["steps"]) if any(x["seq_id"] == 1 for x in st["batch"]))
    for at, ids, sid, why in ((i, [0, 77], 77, "was never computed"), (j, [0, 1], 1, "is running in this step")):
        bad = copy.deepcopy(m)
        bad["steps"][at]["kv"]["physical"]["retained"] = ids
        v = check_trace(bad)[0]
        assert (v.step, v.seq_id, v.variable, v.rule) == (m["steps"][at]["step"], sid, "kv", "retained sequences are finished ones")
        assert why in v.detail
