"""Speculative decoding on a hybrid (Qwen3.5-type: Gated DeltaNet + gated attention) model, in both
memory conventions: a verify chunk keeps the GDN conv / recurrent state after every candidate
(a tree branch continuing from its parent's state), the accepted candidate's snapshot becomes the
state, the KV rewinds as on a plain model.

Checked against independent computations: greedy speculative output == plain greedy output token
for token (n-gram and draft-model drafts, chain and tree, chunked prefill, several requests, late
arrivals); after every verify the recurrent state tensors equal the plain run's at the same length
(fp32: within 4e-6 elementwise and 2e-6 relative, the plain engine's own batched-vs-solo spread, see
FP32_ABS); each tree candidate's state equals the state of its root-to-node path run as one
ordinary chunk (the chunked delta rule); the memory budget counts the snapshots as allocated."""

import pytest
import torch

from infertrace.engine.engine import Engine, EngineOptions, make_kv
from infertrace.engine.sampler import SamplingParams
from infertrace.kv.budget import check_kv_budget, recurrent_state_bytes, spec_snapshots
from infertrace.loading.weights import load_checkpoint
from infertrace.model.decoder import DecoderModel
from infertrace.model.gdn import gdn_sequence, gdn_tree
from tests.helpers import tiny as tiny_dense
from tests.helpers.tiny_qwen35 import make_weights, write_hf_dir

#: the first prompt repeats itself; the others are plain
PROMPTS = [[72, 101, 108, 108, 111, 72, 101, 108], [33, 34, 35], [100, 101, 102, 103, 104, 105, 106], [7]]
TREE = (-1, -1, 0, 0, 1, 2)
N_NEW = 24
#: fp32 agreement of two runs' GDN states: the projections feeding the state multiply a different number of
#: packed rows in the two runs (a verify chunk has K+1 rows per request, a plain decode 1), which rounds the last
#: bits differently, and the recurrence carries that along. The plain engine itself differs this much from itself:
#: the same request batched with three others vs alone, up to 3.6e-6 elementwise / 1.1e-6 relative (Frobenius) on
#: this model; speculative vs plain measured up to 1.8e-6 / 1.1e-6. A wrong snapshot is off by orders of magnitude.
FP32_ABS, FP32_REL = 4e-6, 2e-6


def _echo(w: dict, k: float) -> None:
    """Make a tiny model whose greedy output falls into cycles prompt lookup can find: the lm head row of
    token ``next(t)`` (the next token of t's 5-cycle) is t's embedding and the embeddings are scaled
    by ``k`` so the current token dominates the residual stream -- except where the GDN / attention
    layers tip the argmax, which is where drafts get rejected."""
    E = w["model.embed_tokens.weight"]
    V = E.shape[0]
    nxt = torch.tensor([5 * (t // 5) + (t + 1) % 5 if 5 * (t // 5) + 4 < V else t for t in range(V)])
    lm = torch.zeros_like(E)
    lm[nxt] = E
    w["lm_head.weight"] = lm
    w["model.embed_tokens.weight"] = E * k


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybspec")
    w, s = make_weights(seed=3)
    _echo(w, 10.0)
    ck = load_checkpoint(write_hf_dir(root / "target", w, s))
    dw, ds = tiny_dense.make_weights(n_layer=1, H=32, seed=4, tie=False)  # a dense (llama) draft, same vocabulary
    _echo(dw, 10.0)
    return {"ck": ck, "m": DecoderModel(ck.config, ck.weights), "draft": str(tiny_dense.write_hf(root / "draft", dw, ds))}


def _run(models, prompts=PROMPTS, arrivals=None, **kw):
    """Run to completion stepwise; returns (outputs, engine, states, verifies): ``states[(seq, length)]``
    = the GDN state tensors of every layer after a step left ``seq`` with ``length`` computed tokens;
    ``verifies`` the (seq, C, T, parents, accepted, rewind record) of every verify."""
    ck, m = models["ck"], models["m"]
    e = Engine(m, ck.tokenizer, EngineOptions(ctx_size=256, tokens_per_block=4, **kw))
    for i, p in enumerate(prompts):
        e.add_request(p, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True), arrival_step=(arrivals or [0] * 9)[i])
    verifies = []
    if e.spec is not None:
        orig = e.spec.rewind

        def rewind(engine, chunk, accepted, inp, row):
            op = orig(engine, chunk, accepted, inp, row)
            verifies.append((chunk.req.seq_id, chunk.C, chunk.T, list(chunk.parents), list(accepted), op))
            return op

        e.spec.rewind = rewind
    st, states = e.kv.state, {}
    while e.step() is not None:
        for sid, slot in st.owner.items():
            n = e.requests[sid].num_computed
            states[(sid, n)] = ([st.conv[il][slot].clone() for il in st.layers], [st.rec[il][slot].clone() for il in st.layers])
    return [r.output_ids for r in e.requests.values()], e, states, verifies


@pytest.fixture(scope="module")
def plain(models):
    return {be: _run(models, backend=be) for be in ("cells", "paged")}


def _same_states(spec_states, plain_states, verifies):
    """Every state the speculative run held after a verify equals the plain run's at that length; returns
    how many verifies with a rejected candidate were compared."""
    n_rejected = 0
    for sid, C, T, parents, accepted, op in verifies:
        key = (sid, C + len(accepted))
        if key not in spec_states:  # the request finished in that step: its slot was freed
            continue
        conv, rec = spec_states[key]
        pconv, prec = plain_states[key]
        for a, b in zip(conv + rec, pconv + prec):
            assert a.dtype == torch.float32
            err, rel = float((a - b).abs().max()), float((a - b).norm() / b.norm())
            assert err <= FP32_ABS and rel <= FP32_REL, (key, err, rel)
        n_rejected += len(accepted) < T
    return n_rejected


@pytest.mark.parametrize("backend", ["cells", "paged"])
@pytest.mark.parametrize("method", ["ngram", "draft-layers", "draft-model"])
def test_greedy_chain_equals_plain_and_state_equals_plain_state(models, plain, backend, method):
    extra = {"ngram": {}, "draft-layers": {"draft_layers": 3}, "draft-model": {"draft_model": models["draft"]}}[method]
    out, e, states, verifies = _run(models, backend=backend, speculative="ngram" if method == "ngram" else "draft",
                                    num_spec_tokens=3, **extra)
    ref, _, ref_states, _ = plain[backend]
    assert out == ref
    acc = [len(v[4]) - 1 for v in verifies]
    assert max(acc) >= 2 and min(acc) == 0  # drafts accepted and drafts rejected
    assert _same_states(states, ref_states, verifies) > 0
    for sid, C, T, parents, accepted, op in verifies:  # the rewind kept the last accepted candidate's snapshot
        s = op["state"]
        assert s["kept_node"] == accepted[-1] and s["snapshots"] == T and s["convention"] == backend
        assert s["kept_snapshot"] == (T - len(accepted) if backend == "cells" else accepted[-1])  # rs_idx / draft index
        assert sorted(s["dropped_nodes"] + [s["kept_node"]]) == list(range(T))
    if method == "draft-layers":  # a hybrid draft rolls back to its state checkpoint, never re-evaluates from 0
        assert e.spec.drafter.restored > 0 and e.spec.drafter.recomputed == 0
    # every cell / block and every state slot is free at the end
    assert (e.kv.attn.used == 0) if backend == "cells" else (len(e.kv.attn.free) == e.kv.attn.num_blocks)
    assert not e.kv.state.owner and not e.kv.state.pending


@pytest.mark.parametrize("backend", ["cells", "paged"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_tree_equals_plain_and_accepted_branch_need_not_be_the_first(models, plain, backend, method):
    extra = {"draft_layers": 3} if method == "draft" else {}
    out, e, states, verifies = _run(models, backend=backend, speculative=method, spec_tree=TREE, **extra)
    ref, _, ref_states, _ = plain[backend]
    assert out == ref
    assert _same_states(states, ref_states, verifies) > 0
    # a verify whose accepted path left the root through its second child: that branch's state continued
    # from the root's, not from the previous row (the first branch)
    second = [v for v in verifies if len(v[4]) > 1 and v[4][1] != 1 and v[3][v[4][1]] == 0]
    if method == "draft":  # the draft's second-best token wins now and then (prompt lookup's second follower rarely does)
        assert second, "no verify accepted a branch other than the first"
        assert any((v[0], v[1] + len(v[4])) in states for v in second)  # and its state was compared above


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_chunked_prefill_late_arrivals_several_requests(models, backend):
    kw = dict(backend=backend, prefill_chunk=3, max_batch_tokens=9)
    ref, _, ref_states, _ = _run(models, arrivals=[0, 1, 3, 4], **kw)
    out, e, states, verifies = _run(models, arrivals=[0, 1, 3, 4], speculative="ngram", num_spec_tokens=3, **kw)
    assert out == ref
    assert _same_states(states, ref_states, verifies) > 0
    assert len({v[0] for v in verifies}) == len(PROMPTS)  # every request verified drafts


def test_tree_snapshots_are_each_path_run_as_one_chunk():
    """gdn_tree's state after candidate i == the root state advanced over i's root-to-node path by the
    chunked delta rule (gdn_sequence with T > 1), an independent form of the recurrence."""
    g = torch.Generator().manual_seed(0)
    nk, nv, dk, dv, K = 2, 4, 8, 8, 4
    C = 2 * nk * dk + nv * dv
    T = len(TREE) + 1
    parents = [-1] + [p + 1 for p in TREE]
    qkv = torch.randn(T, C, generator=g)
    gg = -torch.rand(T, nv, generator=g)
    beta = torch.rand(T, nv, generator=g)
    w = torch.randn(C, K, generator=g) * 0.5
    conv0, S0 = torch.randn(C, K - 1, generator=g), torch.randn(nv, dk, dv, generator=g) * 0.1
    o, convs, Ss = gdn_tree(qkv, gg, beta, w, conv0, S0, parents, nk, nv, dk, dv)
    for i in range(T):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        path = path[::-1]
        po, pconv, pS, _ = gdn_sequence(qkv[path], gg[path], beta[path], w, conv0, S0, nk, nv, dk, dv)
        torch.testing.assert_close(Ss[i], pS, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(convs[i], pconv, atol=0, rtol=0)  # the last K-1 inputs of the path
        torch.testing.assert_close(o[i], po[-1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(Ss[2], gdn_sequence(qkv[[0, 1, 2]], gg[[0, 1, 2]], beta[[0, 1, 2]], w, conv0, S0,
                                                  nk, nv, dk, dv)[2])  # node 2 (a sibling of 1) did not follow 1
    with pytest.raises(ValueError, match="parents"):
        gdn_tree(qkv, gg, beta, w, conv0, S0, [-1, 1] + parents[2:], nk, nv, dk, dv)


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_budget_counts_the_snapshots(models, backend):
    from infertrace.kv.base import ChunkSpec

    m = models["m"]
    cfg = m.cfg
    n_lin = sum(1 for i in range(cfg.n_layer) if cfg.is_linear(i))
    per_slot = cfg.conv_dim * (cfg.ssm_conv_kernel - 1) + cfg.ssm_n_v_heads * cfg.ssm_k_head_dim * cfg.ssm_v_head_dim
    assert (n_lin, per_slot) == (2, 64 * 3 + 4 * 8 * 8)  # tiny_qwen35 SHAPE: conv_dim 2*2*8 + 4*8 = 64
    for kw, snaps in ((dict(), 0), (dict(speculative="ngram", num_spec_tokens=3), 4),
                      (dict(speculative="ngram", spec_tree=TREE), len(TREE) + 1)):
        o = EngineOptions(backend=backend, ctx_size=64, tokens_per_block=4, n_seq_max=3, **kw)
        assert spec_snapshots(o) == snaps
        assert recurrent_state_bytes(cfg, o, torch.float32) == 3 * n_lin * per_slot * 4 * (1 + snaps)
        kv = make_kv(m, o, "torch")  # what is allocated once every slot verified is what is counted
        st = kv.state
        if snaps:
            for sid in range(3):
                kv.prepare([ChunkSpec(sid, 0, 1)])
                kv.prepare([ChunkSpec(sid, 1, snaps, [-1] + list(range(snaps - 1)))])
                for il in st.layers:
                    st.keep_snapshots(il, st.owner[sid], torch.zeros(snaps, *st.conv_shape), torch.zeros(snaps, *st.rec_shape))
        allocated = sum(t.numel() * t.element_size() for d in (st.conv, st.rec) for t in d.values()) + st.snapshot_bytes()
        assert allocated == recurrent_state_bytes(cfg, o, torch.float32)
        plain_total = check_kv_budget(cfg, EngineOptions(backend=backend, ctx_size=64, tokens_per_block=4, n_seq_max=3),
                                      torch.float32)
        assert check_kv_budget(cfg, o, torch.float32) - plain_total == 3 * n_lin * per_slot * 4 * snaps
    # a budget over the limit says the snapshots are in it
    from infertrace.errors import InfertraceError

    big = EngineOptions(backend=backend, ctx_size=64, tokens_per_block=4, n_seq_max=10 ** 7, speculative="ngram",
                        num_spec_tokens=3)
    with pytest.raises(InfertraceError, match=r"GDN state for 10000000 sequences \(with 4 verify snapshots each\)"):
        check_kv_budget(cfg, big, torch.float32)


# --- the trace: which snapshot was kept, the state before / after, through the CLI -------------------------------------
def _invoke(*args):
    from typer.testing import CliRunner

    from infertrace.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "120"})


@pytest.fixture(scope="module", params=[("cells", ["--num-spec-tokens", "3"]), ("paged", ["--spec-tree=-1,-1,0,0,1,2"])],
                ids=["cells-chain", "paged-tree"])
def saved(request, tmp_path_factory):
    backend, shape = request.param
    root = tmp_path_factory.mktemp("hybtrace")
    w, s = make_weights(seed=3)
    _echo(w, 10.0)
    model = write_hf_dir(root / "m", w, s)
    d = root / backend
    res = _invoke("run", "--model", model, "--prompt", "HelloHel", "-n", "12", "--ignore-eos", "--backend", backend,
                  "--tokens-per-block", "4", "--speculative", "draft", "--draft-layers", "3", *shape, "--save", d,
                  "--keep", "summary", "--show", "all")  # the panels asserted below (run shows none by default)
    assert res.exit_code == 0, res.output
    return backend, d, res.output


def test_trace_records_the_kept_snapshot_and_state_before_after(saved, models, plain):
    import json

    backend, d, out = saved
    m = json.loads((d / "trace.json").read_text())
    assert PROMPTS[0] == [72, 101, 108, 108, 111, 72, 101, 108]  # "HelloHel": the plain run's first request
    ref_states = plain[backend][2]
    st_layers = models["m"].cfg
    gdn = [i for i in range(st_layers.n_layer) if st_layers.is_linear(i)]
    rows, prev = 0, None
    for st in m["steps"]:
        for r in st["batch"]:
            sp = r.get("spec")
            if not sp:
                continue
            gs = sp["rewind"]["state"]
            acc = sp["accepted_nodes"]
            assert gs["convention"] == backend and gs["kept_node"] == acc[-1] and gs["snapshots"] == r["T"]
            assert gs["index_name"] == ("rs_idx" if backend == "cells" else "accepted_leaf_positions")
            # before = the state the previous step left; after = the state this step leaves (hybrid panel)
            now = {ly["layer"]: ly for ly in st["hybrid"]["state"]["per_seq"][0]["layers"]}
            was = {ly["layer"]: ly for ly in prev["hybrid"]["state"]["per_seq"][0]["layers"]}
            for ly in gs["layers"]:
                for k in ("conv_norm", "conv_sum", "rec_norm", "rec_sum"):
                    assert ly["before"][k] == was[ly["layer"]][k] and ly["after"][k] == now[ly["layer"]][k]
                # and the kept state is the plain run's at the same length (an independent run)
                conv, rec = ref_states[(0, r["C"] + len(acc))]
                j = gdn.index(ly["layer"])
                assert abs(ly["after"]["rec_norm"] - float(rec[j].norm())) <= 1e-5 * max(1.0, ly["after"]["rec_norm"])
                assert abs(ly["after"]["conv_norm"] - float(conv[j].norm())) <= 1e-5 * max(1.0, ly["after"]["conv_norm"])
            rows += 1
        prev = st
    assert rows >= 2
    hs = m["steps"][0]["hybrid"]["state"]
    assert hs["snapshots_per_slot"] == (4 if backend == "cells" else 7)  # K + 1 / tree nodes + 1
    assert hs["snapshot_bytes_per_seq"] == hs["bytes_per_seq"] * hs["snapshots_per_slot"] == 2 * (64 * 3 + 4 * 8 * 8) * 4 * hs["snapshots_per_slot"]
    flat = " ".join(out.replace("│", " ").split())  # the panels' text, unwrapped
    assert f"speculative verify: {hs['snapshots_per_slot']} state snapshots per slot" in flat
    assert "GDN state slot 0: kept snapshot of node" in out
    assert ("rs_idx = " in out) if backend == "cells" else ("accepted_leaf_positions = " in out)
    res = _invoke("check", d)
    assert res.exit_code == 0 and "no violation" in res.output, res.output
    res = _invoke("report", d, "-o", d.parent / f"{backend}.html")
    assert res.exit_code == 0 and "GDN state: kept snapshot of node" in (d.parent / f"{backend}.html").read_text()


def test_tampered_state_record_is_caught(saved, tmp_path):
    import json

    _, d, _ = saved
    m = json.loads((d / "trace.json").read_text())
    r = next(r for st in m["steps"] for r in st["batch"] if r.get("spec") and r["spec"]["rejected_nodes"])
    gs = r["spec"]["rewind"]["state"]
    gs["kept_node"] = r["spec"]["rejected_nodes"][0]  # as if a rejected candidate's state had been kept
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "trace.json").write_text(json.dumps(m))
    res = _invoke("check", bad)
    assert res.exit_code != 0 and "GDN state kept snapshot" in res.output, res.output
    gs["kept_node"], gs["layers"][0]["after"]["rec_norm"] = 10 ** 9, -1.0  # out of bounds: refused on load
    (bad / "trace.json").write_text(json.dumps(m))
    res = _invoke("show", bad)
    assert res.exit_code == 2 and "Traceback" not in res.output and ("kept_node" in res.output or "rec_norm" in res.output)


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_sampling_chain_keeps_the_state_of_the_tokens_it_emitted(models, backend):
    """Speculative sampling (temperature 0.8, rejection sampling) on the hybrid model: after every verify the
    state equals a fresh prefill of exactly the tokens the request then holds (one chunk, the chunked delta
    rule), so the state follows whatever was accepted, not the drafts."""
    from infertrace.kv.base import ChunkSpec

    ck, m = models["ck"], models["m"]
    e = Engine(m, ck.tokenizer, EngineOptions(backend=backend, ctx_size=256, tokens_per_block=4, speculative="draft",
                                              draft_layers=3, num_spec_tokens=3))
    for i, p in enumerate(PROMPTS[:2]):
        e.add_request(p, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, temperature=0.8, seed=11 + i))
    st, seen, partial = e.kv.state, [], 0
    while (b := e.step()) is not None:
        for c in b.chunks:
            if c.parents is None or c.req.seq_id not in st.owner:
                continue
            n = c.req.num_computed
            partial += n < c.C + c.T
            slot = st.owner[c.req.seq_id]
            seen.append((list(c.req.cache_ids[:n]), [st.rec[il][slot].clone() for il in st.layers],
                         [st.conv[il][slot].clone() for il in st.layers]))
    assert len(seen) >= 4 and partial >= 1  # verifies with a rejected draft among them
    for ids, rec, conv in seen:
        kv = make_kv(m, EngineOptions(backend="cells", ctx_size=256), "torch")
        m.forward(torch.tensor(ids), kv.prepare([ChunkSpec(0, 0, len(ids))]), kv, torch.tensor([len(ids) - 1]))
        for j, il in enumerate(kv.state.layers):
            torch.testing.assert_close(rec[j], kv.state.rec[il][0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(conv[j], kv.state.conv[il][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_hybrid_checkpoint_restore_returns_state_and_kv_to_the_checkpoint(models, backend):
    """HybridKV.checkpoint / restore (a hybrid draft's rollback): after more tokens and a restore the state
    tensors are the checkpoint's exactly and the attention part holds the checkpoint's positions; the next
    tokens then give the same logits and state as a run that never went past the checkpoint."""
    from infertrace.kv.base import ChunkSpec

    m = models["m"]
    ids = PROMPTS[0]
    kvs = [make_kv(m, EngineOptions(backend=backend, ctx_size=64, tokens_per_block=4), "torch") for _ in range(2)]
    for kv in kvs:
        m.forward(torch.tensor(ids[:5]), kv.prepare([ChunkSpec(0, 0, 5)]), kv, torch.tensor([4]))
    a, b = kvs
    ck = a.checkpoint(0)
    m.forward(torch.tensor([9, 9, 9]), a.prepare([ChunkSpec(0, 5, 3)]), a, torch.tensor([2]))  # a rejected draft
    assert not a.seq_rm(0, 5, -1)  # a recurrent state cannot drop the tail ...
    assert a.restore(0, ck) and a.seq_len(0) == 5  # ... but goes back to its checkpoint
    for il in a.state.layers:
        assert torch.equal(a.state.rec[il][0], ck["state"][il][1]) and torch.equal(a.state.conv[il][0], ck["state"][il][0])
    la = m.forward(torch.tensor(ids[5:]), a.prepare([ChunkSpec(0, 5, 3)]), a, torch.tensor([2]))
    lb = m.forward(torch.tensor(ids[5:]), b.prepare([ChunkSpec(0, 5, 3)]), b, torch.tensor([2]))
    assert torch.equal(la, lb)
    for il in a.state.layers:
        assert torch.equal(a.state.rec[il][0], b.state.rec[il][0])
