"""``bisect`` on defects planted in a test build of our engine (tests/helpers/planted_engine.py): layer 7's RoPE
base divided by 100, and layer 7's attention unable to see position 0. The expected error of the planted tap comes from
HF transformers' own functions on HF's own tensors of the clean model (``apply_rotary_pos_emb`` with the other
base's cos/sin; ``eager_attention_forward`` with the changed mask, then ``o_proj``), never from infertrace. bisect
must name layer 7 and the tap: ``q_post_rope`` for RoPE (Q and K before RoPE untouched), ``attn_out`` for the mask
(Q, K, V untouched), every earlier layer below the floor; and our clean engine against HF's clean run: nothing.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from infertrace.cli.app import app

PROMPT = "The capital of France is"
LAYER = 7


def _bisect(*args) -> tuple[int, dict]:
    r = CliRunner().invoke(app, ["bisect", *[str(a) for a in args], "--json"])
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, json.loads(r.output)


def _run(d, *extra) -> str:
    r = CliRunner().invoke(app, ["run", "-p", PROMPT, "-n", "2", "--save", str(d), "--layers", "all", *extra])
    assert r.exit_code == 0, r.output
    return str(d)


@pytest.fixture(scope="module")
def traces(smol, tmp_path_factory):
    from tests.helpers.planted_engine import drop_first_key, rope_base

    root = tmp_path_factory.mktemp("planted_engine")
    out = {"clean": _run(root / "clean"), "hf": None}
    theta = smol.config.rope_theta
    with rope_base(LAYER, theta / 100, smol.config.rope_dim):
        out["rope"] = _run(root / "rope")
    with drop_first_key(LAYER):
        out["mask"] = _run(root / "mask")
    r = CliRunner().invoke(app, ["run", "--runtime", "hf", "-p", PROMPT, "-n", "2", "--save", str(root / "hf"),
                                 "--layers", "all"])
    assert r.exit_code == 0, r.output
    out["hf"] = str(root / "hf")
    return out


@pytest.fixture(scope="module")
def hf_truth(hf_smol, smol):
    """HF's relative L2 of the planted tap on the last prompt row, from HF's own functions on HF's tensors."""
    from transformers.models.llama import modeling_llama as ml

    tok, model = hf_smol
    ids = torch.tensor([tok(PROMPT)["input_ids"]])  # [1, T]
    att = model.model.layers[LAYER].self_attn
    got = {}
    h = att.register_forward_hook(lambda m, a, kw, o: got.update(x=kw["hidden_states"].detach(), pe=kw["position_embeddings"]),
                                  with_kwargs=True)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        h.remove()
    x, (cos, sin) = got["x"], got["pe"]  # [1, T, H], [1, T, hd] each
    T, hd = x.shape[1], att.head_dim
    with torch.no_grad():
        q = att.q_proj(x).view(1, T, -1, hd).transpose(1, 2)  # [1, nh, T, hd]
        k = att.k_proj(x).view(1, T, -1, hd).transpose(1, 2)  # [1, nkv, T, hd]
        v = att.v_proj(x).view(1, T, -1, hd).transpose(1, 2)
        theta = smol.config.rope_theta / 100
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))  # [hd/2]
        ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None]  # [T, hd/2]
        emb = torch.cat([ang, ang], dim=-1)[None]  # [1, T, hd], as HF's rotary builds it
        q1, k1 = ml.apply_rotary_pos_emb(q, k, cos, sin)
        q2, _ = ml.apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
        rope = float((q1[0, :, -1] - q2[0, :, -1]).norm() / q1[0, :, -1].norm())
        causal = torch.full((T, T), float("-inf")).triu(1)  # [T, T]
        dropped = causal.clone()
        dropped[1:, 0] = float("-inf")  # queries past position 0 cannot see it
        outs = [att.o_proj(ml.eager_attention_forward(att, q1, k1, v, m[None, None], att.scaling)[0].reshape(1, T, -1))
                for m in (causal, dropped)]  # [1, T, H] each
        mask = float((outs[0][0, -1] - outs[1][0, -1]).norm() / outs[0][0, -1].norm())
    return {"rope": rope, "mask": mask}


def test_hf_functions_say_the_planted_tap_moves(hf_truth):
    assert hf_truth["rope"] > 0.05 and hf_truth["mask"] > 0.05


def test_rope_base_defect_is_named_as_rope_on_q(traces, hf_truth):
    rc, rep = _bisect(traces["clean"], traces["rope"])
    assert rc == 1
    ft = rep["first_tap"]
    assert (ft["layer"], ft["tap"]) == (LAYER, "q_post_rope") and ft["branch"] == "attention (RoPE on Q)"
    at = {(e["layer"], e["tap"]): e for e in rep["taps"]}
    assert not at[(LAYER, "q_pre_rope")]["above"] and not at[(LAYER, "k_pre_rope")]["above"]
    assert all(not e["above"] for e in rep["taps"] if e["layer"] < LAYER)
    assert ft["rel_l2"] == pytest.approx(hf_truth["rope"], rel=2e-2)


def test_mask_defect_is_named_as_attention(traces, hf_truth):
    rc, rep = _bisect(traces["clean"], traces["mask"])
    assert rc == 1
    ft = rep["first_tap"]
    assert (ft["layer"], ft["tap"]) == (LAYER, "attn_out") and ft["branch"] == "attention"
    at = {(e["layer"], e["tap"]): e for e in rep["taps"]}
    assert not any(at[(LAYER, t)]["above"] for t in ("q_pre_rope", "k_pre_rope", "v", "q_post_rope", "k_post_rope"))
    assert ft["rel_l2"] == pytest.approx(hf_truth["mask"], rel=2e-2)


def test_planted_builds_against_hf_clean_name_the_same_layer(traces):
    rc, rep = _bisect(traces["hf"], traces["clean"])
    assert rc == 0 and rep["max_logits_rel_l2"] < 1e-4  # our clean engine and HF agree
    for kind, tap in (("rope", "attn_out"), ("mask", "attn_out")):  # HF saves no post-RoPE tap: attention's output
        rc, rep = _bisect(traces["hf"], traces[kind], "--floor-from", traces["hf"], traces["clean"])
        assert rc == 1
        assert (rep["first_tap"]["layer"], rep["first_tap"]["tap"]) == (LAYER, tap), (kind, rep["first_tap"])
