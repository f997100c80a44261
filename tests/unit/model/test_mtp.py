"""Qwen3.5's MTP draft head (``--speculative mtp``) on tiny random checkpoints.

* loading: HF ``mtp.*`` and the GGUF's ``blk.N.nextn.*`` (written as llama.cpp's converter writes
  them: ``block_count`` counts the MTP block, norms ``1 + w``) give the same engine tensors; a file
  that declares the head without its tensors runs without it and refuses ``--speculative mtp``.
* the draft's inputs, recorded in the trace, against a step computed by hand from the raw weights:
  the main model's final-normed hidden state from HF transformers' ``Qwen3_5ForCausalLM``, the MTP
  step with torch ops (``fc(cat(enorm(embed(token)), hnorm(hidden)))``) and HF's own full-attention
  decoder layer / norm / lm head loaded with the ``mtp.layers.0`` weights (vLLM ``qwen3_5_mtp.py``
  wiring); the draft tokens and top logits must agree, and the chained row must read the MTP's own
  hidden state at the previous position.
* MTP speculative == plain greedy (cells and paged, chain and tree); with a head built to copy the
  main model's prediction (every draft accepted) and with a perturbed one (some accepted, some not),
  the acceptance counts agree with the emitted tokens.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.errors import InfertraceError
from infertrace.loading.weights import load_checkpoint
from infertrace.model.decoder import DecoderModel
from tests.helpers.tiny_qwen35 import hf_config, make_weights, write_gguf, write_hf_dir

IDS = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]  # "Hello world" in the byte-level tiny tokenizer
PROMPT = "Hello world"


def _load(d):
    ck = load_checkpoint(d)
    return ck, DecoderModel(ck.config, ck.weights)


@pytest.fixture(scope="module", params=[1, 2], ids=["all-attention", "hybrid"])
def tiny(request, tmp_path_factory):
    w, s = make_weights(seed=11, mtp=True, interval=request.param)
    root = tmp_path_factory.mktemp(f"mtp{request.param}")
    d = write_hf_dir(root / "hf", w, s)
    g = write_gguf(root / "m.gguf", w, s)
    ck, m = _load(d)
    return {"w": w, "s": s, "dir": d, "gguf": g, "ck": ck, "m": m, "root": root}


def _run(m, tok, spec=None, backend="cells", n=10, k=3, tree=None, prompts=(IDS,)):
    e = Engine(m, tok, EngineOptions(backend=backend, ctx_size=96, tokens_per_block=4, speculative=spec, num_spec_tokens=k,
                                     spec_tree=tree))
    rs = [e.add_request(list(p), SamplingParams(max_new_tokens=n, ignore_eos=True)) for p in prompts]
    e.run()
    return [r.output_ids for r in rs], e


# ----------------------------------------------------------------------------- loading


def test_hf_and_gguf_mtp_tensors_agree(tiny):
    ckg = load_checkpoint(tiny["gguf"])
    ck = tiny["ck"]
    n = tiny["s"]["n_layer"]
    assert ck.config.n_layer == ckg.config.n_layer == n and ck.config.mtp_layers == ckg.config.mtp_layers == 1
    names = sorted(k for k in ck.weights if k.startswith(f"blk.{n}."))
    assert names == sorted(k for k in ckg.weights if k.startswith(f"blk.{n}."))
    assert {f"blk.{n}.nextn.{x}" for x in ("eh_proj", "enorm", "hnorm", "shared_head_norm")} <= set(names)
    for k in names:
        torch.testing.assert_close(ck.weights[k], ckg.weights[k], rtol=0, atol=0)
    w = tiny["w"]  # the HF norm weights are zero-centred: loaded as 1 + w, as the converter stores them
    torch.testing.assert_close(ck.weights[f"blk.{n}.nextn.enorm"], 1 + w["mtp.pre_fc_norm_embedding.weight"])
    torch.testing.assert_close(ck.weights[f"blk.{n}.nextn.eh_proj"], w["mtp.fc.weight"])
    assert any("MTP draft head loaded" in x for x in ck.notes) and not any("not loaded: mtp." in x for x in ck.notes)
    rows = {r[0]: r for r in ckg.config.settings}
    assert rows["qwen35.nextn_predict_layers"][2] == "honoured"


def test_declared_head_without_tensors_runs_without_it(tmp_path):
    w, s = make_weights(seed=2, mtp=True, interval=1)
    w = {k: v for k, v in w.items() if not k.startswith("mtp.")}  # config says mtp_num_hidden_layers 1, no tensors
    ck, m = _load(write_hf_dir(tmp_path / "hf", w, s))
    assert ck.config.mtp_layers == 0 and m.mtp is None
    assert any(r[0] == "mtp head" and "no MTP tensors" in r[3] for r in ck.config.settings)
    with pytest.raises(InfertraceError, match="needs a model with an MTP head"):
        Engine(m, ck.tokenizer, EngineOptions(ctx_size=32, speculative="mtp"))
    w2, s2 = make_weights(seed=2, mtp=False, interval=1)  # no MTP in config or file: the same, said once
    ck2, m2 = _load(write_hf_dir(tmp_path / "hf2", w2, s2))
    assert ck2.config.mtp_layers == 0 and "mtp_layers" not in ck2.config.to_dict()


def test_gguf_partial_mtp_head_is_incomplete(tmp_path):
    w, s = make_weights(seed=2, mtp=True, interval=1)
    w.pop("mtp.layers.0.mlp.up_proj.weight")
    g = write_gguf(tmp_path / "m.gguf", w, s)
    with pytest.raises(InfertraceError, match="lacks tensor blk.4.ffn_up"):
        load_checkpoint(g)


# ----------------------------------------------------------------------------- the draft's inputs, by hand


def _rms(x, w, eps=1e-6):
    """HF ``Qwen3_5RMSNorm``: x / rms(x) * (1 + w) in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())


def _hf_mtp_layer(w, s):
    """HF's own one-layer ``Qwen3_5ForCausalLM`` holding the MTP block: layer 0 = ``mtp.layers.0``
    (full attention), norm = ``mtp.norm``, lm head = the main model's (shared)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = hf_config(dict(s, n_layer=1))
    for k in ("architectures", "model_type", "torch_dtype", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"):
        cfg.pop(k, None)
    cfg["layer_types"] = ["full_attention"]
    m = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg)).eval()
    sd = {"model.norm.weight": w["mtp.norm.weight"], "lm_head.weight": w["lm_head.weight"],
          "model.embed_tokens.weight": w["model.embed_tokens.weight"]}
    sd.update({"model.layers.0." + k[len("mtp.layers.0."):]: v for k, v in w.items() if k.startswith("mtp.layers.0.")})
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return m


def _by_hand(w, s, prompt, g0):
    """The first draft step computed from the raw HF weights: returns the main hidden at n-1, the
    MTP rows' (hidden read, logits) for the pending token's row and the chained row."""
    from tests.helpers.tiny_qwen35 import hf_model

    E = w["model.embed_tokens.weight"]
    fc = w["mtp.fc.weight"]
    with torch.no_grad():
        H = hf_model(w, s).model(input_ids=torch.tensor([prompt])).last_hidden_state[0]  # [n, H] after the final norm
        toks = prompt[1:] + [g0]  # row p pairs the hidden at p with the token at p + 1
        x = torch.cat([_rms(E[toks], w["mtp.pre_fc_norm_embedding.weight"]),
                       _rms(H, w["mtp.pre_fc_norm_hidden.weight"])], -1) @ fc.T  # [n, H] fc([e | h])
        mtp = _hf_mtp_layer(w, s)
        out = mtp.model(inputs_embeds=x[None]).last_hidden_state[0]  # [n, H] after mtp.norm
        l1 = mtp.lm_head(out[-1])  # [V] the pending token's row: draft 1
        d1 = int(l1.argmax())
        x2 = torch.cat([_rms(E[[d1]], w["mtp.pre_fc_norm_embedding.weight"]),
                        _rms(out[-1:], w["mtp.pre_fc_norm_hidden.weight"])], -1) @ fc.T  # [1, H] chained: own hidden
        out2 = mtp.model(inputs_embeds=torch.cat([x, x2])[None]).last_hidden_state[0]  # positions 0..n
        l2 = mtp.lm_head(out2[-1])  # [V] draft 2
    return H[-1], (out[-1], l1), (out2[-1], l2)


def _cli_run(path, out, *extra):
    r = CliRunner().invoke(app, ["run", "--model", str(path), "--prompt", PROMPT, "-n", "8", "--ignore-eos",
                                 "--speculative", "mtp", "--num-spec-tokens", "2", "--save", str(out), *map(str, extra)],
                           env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    return r.output, json.loads((out / "trace.json").read_text())


@pytest.mark.parametrize("src", ["dir", "gguf"])
def test_draft_inputs_in_trace_match_a_hand_computed_step(tiny, src):
    pytest.importorskip("transformers")
    w, s = tiny["w"], tiny["s"]
    out, tr = _cli_run(tiny[src], tiny["root"] / f"trace-{src}")
    n = len(IDS)
    g0 = tr["steps"][0]["batch"][0]["sampled"]  # the prefill's token: the pending token of the first draft
    st = tr["steps"][1]["batch"][0]
    sp = st["spec"]
    assert st["C"] == n and st["token_ids"][0] == g0 and sp["parents"] == [-1, 0, 1]
    rows = sp["mtp"]["rows"]
    assert sp["mtp"]["catch_up"]["positions"] == [0, n - 1]  # every prompt position's hidden state fed at its position
    r0, r1 = rows[0], rows[1]
    h_main, (h1, l1), (_, l2) = _by_hand(w, s, IDS, g0)
    # row 1: the target's hidden at n-1 (after output_norm) with the pending token, at position n-1
    assert (r0["node"], r0["position"], r0["token"], r0["hidden_from"], r0["hidden_position"]) == (-1, n - 1, g0, "target", n - 1)
    assert r0["hidden_norm"] == "output_norm"
    assert r0["hidden_l2"] == pytest.approx(float(h_main.norm()), rel=1e-5)
    assert r0["argmax"] == int(l1.argmax()) == sp["mtp"]["drafts"][0] == st["token_ids"][1]
    assert r0["logit_max"] == pytest.approx(float(l1.max()), rel=1e-4, abs=1e-5)
    # row 2 (chained): the MTP's own hidden at n-1 (after shared_head_norm) with draft 1, at position n
    assert (r1["node"], r1["position"], r1["token"], r1["hidden_from"], r1["hidden_position"]) == (0, n, r0["argmax"], "mtp", n - 1)
    assert r1["hidden_norm"] == "nextn.shared_head_norm"
    assert r1["hidden_l2"] == pytest.approx(float(h1.norm()), rel=1e-5)
    assert r1["argmax"] == int(l2.argmax()) == st["token_ids"][2]
    assert r1["logit_max"] == pytest.approx(float(l2.max()), rel=1e-4, abs=1e-5)
    assert tr["run"]["spec"]["method"] == "mtp" if "run" in tr else True
    r = CliRunner().invoke(app, ["check", str(tiny["root"] / f"trace-{src}")])
    assert r.exit_code == 0, r.output


# ----------------------------------------------------------------------------- speculative == greedy


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_mtp_speculative_equals_plain_greedy(tiny, backend):
    m, tok = tiny["m"], tiny["ck"].tokenizer
    prompts = (IDS, IDS[3:9], [33, 34, 35, 33, 34])
    plain, _ = _run(m, tok, None, backend, n=12, prompts=prompts)
    for k, tree in ((3, None), (1, None), (None, (-1, -1, 0, 0, 1))):
        spec, e = _run(m, tok, "mtp", backend, n=12, k=k or 3, tree=tree, prompts=prompts)
        assert spec == plain, (k, tree)
        assert e.spec.drafter.forwards > 0
        assert set(e.spec.drafter.cached) == set()  # every finished request's MTP cells and buffers released
        assert int((e.spec.drafter.kv.pos >= 0).sum()) == 0


def _copy_head(w, s, perturb: float):
    """Weights whose main model predicts from the current token only (every block's output projections
    zero: the next token is ``argmax(head(norm(embed(t))))``) and whose MTP head computes the same
    function of the token it reads (``fc = [I | perturb * R]``, its block's outputs zero, ``mtp.norm``
    = the main final norm): with ``perturb`` 0 its draft is what the main model will predict at the
    next position; a perturbation mixes the hidden state in and makes some drafts wrong."""
    w = dict(w)
    H = s["H"]
    for k in list(w):
        if k.startswith("model.layers.") and k.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
            w[k] = torch.zeros_like(w[k])
    R = torch.randn(H, H, generator=torch.Generator().manual_seed(7)) / H ** 0.5  # [H, H] entries of the mix ~ perturb
    w["mtp.fc.weight"] = torch.cat([torch.eye(H), perturb * R], 1)
    w["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(H)
    w["mtp.norm.weight"] = w["model.norm.weight"].clone()
    for k in ("mtp.layers.0.self_attn.o_proj.weight", "mtp.layers.0.mlp.down_proj.weight"):
        w[k] = torch.zeros_like(w[k])
    return w


@pytest.mark.parametrize("perturb", [0.0, 0.4])
def test_acceptance_counts_agree_with_emitted_tokens(tiny, tmp_path, perturb):
    w = _copy_head(tiny["w"], tiny["s"], perturb)
    d = write_hf_dir(tmp_path / "hf", w, tiny["s"])
    ck, m = _load(d)
    plain, _ = _run(m, ck.tokenizer, None, n=16)
    spec, e = _run(m, ck.tokenizer, "mtp", n=16, k=3)
    assert spec == plain
    st = e.spec.req_stats[0]
    acc, drafted = sum(st["accepted_by_pos"]), sum(st["drafted_by_pos"])
    if perturb == 0.0:  # the head copies the main model's prediction: every draft is accepted
        assert acc == drafted > 0 and st["verify_forwards"] <= -(-15 // 4) + 1
    else:  # some accepted, some rejected; the counts are what the outputs imply
        assert 0 < acc < drafted
    assert st["tokens"] == 15  # the prefill's token is not a decode-step token
    assert st["verify_forwards"] + acc == 15  # each target forward emits 1 + its accepted drafts
    _, tr = _cli_run(d, tmp_path / "trace")  # per verify step: accepted k <=> the first k drafts are what was emitted
    n_verify = 0
    for step in tr["steps"]:
        for r in step["batch"]:
            sp = r.get("spec")
            if not sp:
                continue
            n_verify += 1
            k, drafts = sp["accepted"], r["token_ids"][1:]
            assert sp["emitted"][:k] == drafts[:k] and sp["accepted_nodes"] == list(range(k + 1))
            assert k == len(drafts) or len(sp["emitted"]) == k or sp["emitted"][k] != drafts[k]
            assert sp["mtp"]["drafts"][: len(drafts)] == drafts
    assert n_verify > 0


def test_trace_check_and_budget_count_the_mtp_cache(tiny, tmp_path):
    from infertrace.kv.budget import check_kv_budget, mtp_kv_bytes

    cfg = tiny["ck"].config
    o = EngineOptions(ctx_size=64, speculative="mtp", num_spec_tokens=3)
    plain = check_kv_budget(cfg, dataclasses.replace(o, speculative="ngram"), torch.float32)  # same GDN snapshots, no MTP
    cells = 64 + o.n_seq_max * 4
    assert mtp_kv_bytes(cfg, o, torch.float32) == 2 * cells * cfg.n_head_kv * cfg.head_dim * 4 + cells * (8 + o.n_seq_max)
    assert check_kv_budget(cfg, o, torch.float32) == plain + mtp_kv_bytes(cfg, o, torch.float32)
    _, e = _run(tiny["m"], tiny["ck"].tokenizer, "mtp", n=4)
    kv = e.spec.summary()["draft_kv"]
    assert kv["cells"] == e.spec.drafter.kv.capacity_tokens == 96 + o.n_seq_max * 4
    assert kv["bytes"] == 2 * kv["cells"] * cfg.n_head_kv * cfg.head_dim * 4


# ----------------------------------------------------------------------------- make-qwen35 writes the head (HF and GGUF)

SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
             intermediate_size=96, vocab_size=300, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
             linear_num_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                                        "mrope_section": [1, 1, 0], "mrope_interleaved": True})


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """``make-qwen35``'s writer at a small size (the 0.8B shape is tests/cli/test_qwen35_08b.py's): HF dir and GGUF."""
    from infertrace.loading.synth import write_qwen35_08b

    root = tmp_path_factory.mktemp("made")
    return write_qwen35_08b(root / "hf", 3, **SMALL), write_qwen35_08b(root / "m.gguf", 3, fmt="gguf", **SMALL)


def test_make_qwen35_writes_the_mtp_head_in_hf_and_gguf(made):
    from safetensors import safe_open

    hf, gg = made
    with safe_open(str(hf / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight"} <= keys
    assert json.loads((hf / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    import gguf

    r = gguf.GGUFReader(str(gg))
    assert int(r.fields["qwen35.block_count"].contents()) == 5 and int(r.fields["qwen35.nextn_predict_layers"].contents()) == 1
    names = {t.name for t in r.tensors}
    assert {"blk.4.nextn.eh_proj.weight", "blk.4.nextn.enorm.weight", "blk.4.attn_q.weight", "blk.4.ffn_up.weight"} <= names
    a, b = load_checkpoint(hf), load_checkpoint(gg)  # the same weights through both loaders (GGUF norms stored 1 + w)
    assert a.config.mtp_layers == b.config.mtp_layers == 1 and set(a.weights) == set(b.weights)
    for k in a.weights:
        torch.testing.assert_close(a.weights[k], b.weights[k], rtol=0, atol=0)
    assert any("random weights" in n for n in b.notes)
    assert a.tokenizer.encode("Hi Qwen!") == b.tokenizer.encode("Hi Qwen!") == list(b"Hi Qwen!")


@pytest.mark.needs_llamacpp
def test_llama_cpp_loads_the_made_gguf_and_agrees(made):
    """llama.cpp (llama-cpp-python) reads the GGUF, MTP block included (its loader skips it unless
    load_mtp), and its logits agree with ours within bfloat16 rounding."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np

    ids = list(b"Hi Qwen!")
    lm = llama_cpp.Llama(str(made[1]), n_ctx=64, verbose=False, logits_all=True, n_threads=1)
    lm.eval(ids)
    theirs = torch.tensor(np.array(lm.scores[: len(ids)]))  # [T, V]
    ck, m = _load(made[1])
    from infertrace.engine.engine import make_kv
    from infertrace.kv.base import ChunkSpec

    kv = make_kv(m, EngineOptions(ctx_size=64), "torch")
    ours = m.forward(torch.tensor(ids), kv.prepare([ChunkSpec(0, 0, len(ids))]), kv, torch.arange(len(ids)))
    assert (theirs - ours).abs().max() < 1e-2 * theirs.abs().max(), (theirs - ours).abs().max()
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


def test_made_gguf_speculative_mtp_equals_greedy_through_the_cli(made, tmp_path):
    args = ["run", "--model", str(made[1]), "--prompt", "Hi Qwen!", "-n", "6", "--ignore-eos", "--backend", "paged"]
    plain = CliRunner().invoke(app, args + ["--save", str(tmp_path / "p")])
    spec = CliRunner().invoke(app, args + ["--speculative", "mtp", "--save", str(tmp_path / "s")])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    out = [json.loads((tmp_path / d / "trace.json").read_text())["requests"][0]["output_ids"] for d in ("p", "s")]
    assert out[0] == out[1] and len(out[0]) == 6
    bad = CliRunner().invoke(app, ["make-qwen35", "--out", str(tmp_path / "x"), "--format", "onnx"])
    assert bad.exit_code == 2 and "--format must be hf or gguf" in bad.output


def test_mtp_position_convention_does_not_change_the_draft(tiny):
    """vLLM runs the MTP row of (hidden at p, token at p+1) at position p (``set_inputs_first_pass``);
    llama.cpp's ``common_speculative_impl_draft_mtp::process`` at p+1 (the token's position). RoPE
    attention depends on position differences only, so both give the same logits (float rounding)."""
    from infertrace.kv.base import ChunkSpec
    from infertrace.kv.cells import CellsKV

    m, cfg = tiny["m"], tiny["m"].cfg
    g = torch.Generator().manual_seed(0)
    hid = torch.randn(6, cfg.n_embd, generator=g)  # [6, H]
    ids = torch.tensor([5, 9, 77, 3, 140, 12])
    outs = []
    for start in (0, 1):
        kv = CellsKV(1, cfg.n_head_kv, cfg.head_dim, 16, 1, torch.float32, "cpu")
        lg, h = m.mtp.forward(ids, hid, kv.prepare([ChunkSpec(0, start, 6)]), kv, torch.arange(6))
        outs.append((lg, h))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)


@pytest.mark.needs_llamacpp
def test_draft_equals_llama_cpp_graph_mtp(made):
    """llama.cpp's own MTP graph on the made GGUF: its ``t_h_nextn`` is our hidden after the final norm
    (the MTP's input), and its MTP logits for the pending token's row are our draft logits (bfloat16
    weights: within 1 % of the logits' scale, same draft)."""
    pytest.importorskip("llama_cpp")
    from infertrace.engine.engine import make_kv
    from infertrace.kv.base import ChunkSpec
    from infertrace.kv.cells import CellsKV
    from tests.helpers.llama_mtp import llama_cpp_mtp

    ck, m = _load(made[1])
    ids = list(b"Hi Qwen!")
    kv = make_kv(m, EngineOptions(ctx_size=64), "torch")
    hid: list = []
    lg = m.forward(torch.tensor(ids), kv.prepare([ChunkSpec(0, 0, len(ids))]), kv, torch.tensor([len(ids) - 1]),
                   hidden_out=hid)
    pending = int(lg[0].argmax())
    res = llama_cpp_mtp(str(made[1]), ids, pending)
    assert res is not None, ("llama-cpp-python >= 0.3.36 (the llamacpp extra, pinned in pyproject) exposes the MTP "
                             "context API; this build does not: reinstall with make setup-dev")
    h_ref, mtp_ref = torch.tensor(res[0]), torch.tensor(res[1])
    assert (hid[0] - h_ref).abs().max() < 1e-2 * h_ref.abs().max()
    mk = CellsKV(1, m.cfg.n_head_kv, m.cfg.head_dim, 32, 1, torch.float32, "cpu")
    ours, _ = m.mtp.forward(torch.tensor(ids[1:] + [pending]), hid[0], mk.prepare([ChunkSpec(0, 0, len(ids))]), mk,
                            torch.tensor([len(ids) - 1]))
    assert (ours[0] - mtp_ref).abs().max() < 1e-2 * mtp_ref.abs().max(), (ours[0] - mtp_ref).abs().max()
    assert int(ours[0].argmax()) == int(mtp_ref.argmax())
    mk = CellsKV(1, m.cfg.n_head_kv, m.cfg.head_dim, 32, 1, torch.float32, "cpu")
    wrong, _ = m.mtp.forward(torch.tensor(ids[1:] + [pending]), hid[0] * 0, mk.prepare([ChunkSpec(0, 0, len(ids))]), mk,
                             torch.tensor([len(ids) - 1]))  # the comparison can fail: no hidden state, other logits
    assert (wrong[0] - mtp_ref).abs().max() > 5e-2 * mtp_ref.abs().max()


# ----------------------------------------------------------------------------- hostile input


def test_tampered_mtp_record_refused_or_shown_escaped(tiny, tmp_path):
    _, tr = _cli_run(tiny["dir"], tmp_path / "t")
    step, row = next((s, r) for s in tr["steps"] for r in s["batch"] if r.get("spec"))
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "t", bad)
    row["spec"]["mtp"]["rows"][0]["hidden_from"] = "oracle"  # not one of target / mtp
    (bad / "trace.json").write_text(json.dumps(tr))
    r = CliRunner().invoke(app, ["show", str(bad)])
    assert r.exit_code == 2 and "hidden_from" in r.output and "Traceback" not in r.output
    row["spec"]["mtp"]["rows"][0]["hidden_from"] = "target"
    assert CliRunner().invoke(app, ["check", str(tmp_path / "t")]).exit_code == 0
    row["spec"]["mtp"]["rows"][0]["hidden_position"] -= 1  # as if the MTP had read the hidden one position early
    (bad / "trace.json").write_text(json.dumps(tr))
    r = CliRunner().invoke(app, ["check", str(bad)])
    assert r.exit_code != 0 and "the MTP's first row must pair" in r.output
    row["spec"]["mtp"]["rows"][0]["hidden_position"] += 1
    row["spec"]["mtp"]["rows"][0]["hidden_norm"] = "output_norm\x1b[2J\x07"  # terminal control codes
    (bad / "trace.json").write_text(json.dumps(tr))
    r = CliRunner().invoke(app, ["show", str(bad), "--steps", str(step["step"]), "--show", "hidden"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "MTP draft inputs" in r.output and "\x1b[2J" not in r.output and "\x07" not in r.output


@pytest.mark.parametrize("nextn,msg", [(4, "must be in 0..block_count-1"), (2, "more than one MTP block")])
def test_gguf_bad_nextn_predict_layers(tmp_path, nextn, msg):
    w, s = make_weights(seed=2, interval=2)
    g = write_gguf(tmp_path / "m.gguf", w, s, extra_kv={"nextn_predict_layers": nextn})
    with pytest.raises(InfertraceError, match=msg):
        load_checkpoint(g)


def test_speculative_mtp_option_errors(tiny):
    for extra, msg in ((["--draft-layers", "1"], "error: --draft-layers: names a draft model; it needs method draft"),
                       (["--ngram-max", "5"], "error: --ngram-min: ngram_min / ngram_max set the n-gram drafter; they need method ngram")):
        r = CliRunner().invoke(app, ["run", "--model", str(tiny["dir"]), "--prompt", "hi", "-n", "2", "--speculative", "mtp",
                                     *extra])
        assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output
    w, s = make_weights(seed=2, interval=1)
    r = CliRunner().invoke(app, ["run", "--model", str(write_hf_dir(tiny["root"] / "nomtp", w, s)), "--prompt", "hi", "-n", "2",
                                 "--speculative", "mtp"])
    assert r.exit_code == 2 and "needs a model with an MTP head" in r.output


def test_preemption_and_recompute_keep_mtp_greedy(tiny):
    """A pool too small for three requests preempts two; their recompute hands the MTP the hidden rows
    again from position 0 (its cache from there is dropped) and the output still equals plain greedy."""
    m, tok = tiny["m"], tiny["ck"].tokenizer
    prompts = (IDS, IDS[3:9], [33, 34, 35, 33, 34])
    outs, pre = {}, {}
    for spec in (None, "mtp"):
        e = Engine(m, tok, EngineOptions(backend="paged", ctx_size=96, tokens_per_block=4, num_blocks=10, speculative=spec,
                                         num_spec_tokens=3))
        rs = [e.add_request(list(p), SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in prompts]
        e.run()
        outs[spec], pre[spec] = [r.output_ids for r in rs], sum(r.num_preemptions for r in rs)
    assert pre["mtp"] > 0 and outs["mtp"] == outs[None]


def test_sampling_chain_counts(tiny, tmp_path):
    """Speculative sampling with MTP drafts (q = the MTP's sampling distribution): every target forward
    emits 1 + its accepted drafts, and a head that copies the main model gets most drafts accepted."""
    ck, m = _load(write_hf_dir(tmp_path / "hf", _copy_head(tiny["w"], tiny["s"], 0.0), tiny["s"]))
    e = Engine(m, ck.tokenizer, EngineOptions(ctx_size=96, speculative="mtp", num_spec_tokens=3))
    e.add_request(IDS, SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.7, seed=3))
    e.run()
    st = e.spec.req_stats[0]
    acc = sum(st["accepted_by_pos"])
    assert st["verify_forwards"] + acc == 19 and acc > sum(st["drafted_by_pos"]) // 2


def test_chunked_prefill_late_arrivals_keep_mtp_greedy(tiny):
    """Prefill in 4-token chunks under an 8-token step budget, requests arriving at steps 0, 2, 5: the MTP
    is handed each chunk's hidden rows in order and drafts only once a request decodes; output == greedy."""
    m, tok = tiny["m"], tiny["ck"].tokenizer
    outs = {}
    for spec in (None, "mtp"):
        e = Engine(m, tok, EngineOptions(ctx_size=96, prefill_chunk=4, max_batch_tokens=8, speculative=spec,
                                          num_spec_tokens=2 if spec else EngineOptions.num_spec_tokens))  # no method: no draft count
        rs = [e.add_request(list(p), SamplingParams(max_new_tokens=10, ignore_eos=True), arrival_step=a)
              for p, a in ((IDS, 0), (IDS[2:10], 2), ([40, 41, 42, 43, 44, 45], 5))]
        e.run()
        outs[spec] = [r.output_ids for r in rs]
    assert outs["mtp"] == outs[None]
