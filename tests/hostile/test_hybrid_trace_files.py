"""Hostile saved hybrid (Qwen3.5) traces: the ``hybrid`` section of a real saved trace mutated
(numbers turned into script / terminal payloads, free-text strings set to them, huge arrays,
shapes and slots that disagree with each other). ``show`` / ``report`` / ``check`` / ``diff`` /
``dump-kv`` exit 0, 1 or 2 with one line, print no control byte, write an inert page, in bounded
time; the HTML report shows the hybrid section (layer map, positions, GDN state), escaped."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.helpers import hostile as H
from tests.hostile.test_trace_files import check_inert, invoke, no_control, one_line_or_ok
from tests.helpers.tiny_qwen35 import make_weights, write_hf_dir


@pytest.fixture(scope="module")
def hybrid_trace(tmp_path_factory) -> Path:
    """A real saved trace of the tiny Qwen3.5 model (paged, prompt of 4 tokens + 2 decode steps)."""
    root = tmp_path_factory.mktemp("hyb")
    w, s = make_weights(seed=2)
    model = write_hf_dir(root / "m", w, s)
    res = invoke("run", "-m", model, "-p", "hello", "-n", "3", "--backend", "paged", "--save", root / "t")
    assert res.exit_code == 0, res.stderr
    return root / "t"


def _load(t: Path) -> dict:
    return json.loads((t / "trace.json").read_text(encoding="utf-8"))


def _write(d: dict, t: Path, ref: Path | None = None) -> Path:
    """``d`` as ``t/trace.json``, beside the reference trace's tensors file (the manifest names it)."""
    shutil.rmtree(t, ignore_errors=True)
    H.write_trace(d, t)
    if ref is not None and (ref / "tensors.safetensors").exists():
        shutil.copy(ref / "tensors.safetensors", t)
    return t


def _all_commands(ref: Path, t: Path, tmp_path: Path) -> dict[str, object]:
    """Run every reader on ``t``; each exits 0/1/2 with at most one error line and no control byte, quickly."""
    out = {}
    for name, args, ok in (("show", ("show", t, "--show", "all"), (0,)), ("report", ("report", t, "-o", tmp_path / "r.html", "--force"), (0,)),
                           ("check", ("check", t), (0, 1)), ("diff", ("diff", ref, t), (0, 1)),
                           ("dump-kv", ("dump-kv", "--step", "0", t), (0,))):
        t0 = time.monotonic()
        res = invoke(*args)
        assert time.monotonic() - t0 < 10, name
        one_line_or_ok(res, ok)
        if name != "report":
            no_control(res.stdout + res.stderr)
        out[name] = res
    return out


def test_hybrid_numbers_as_payloads_are_refused(hybrid_trace, tmp_path):
    """Every number field of the hybrid section set to a string is refused (exit 2, one line) by show."""
    d = _load(hybrid_trace)
    pats = [p for p, kind in H.patterns(d) if "hybrid" in p and kind != "str"]
    assert len(pats) > 30
    for i, pat in enumerate(pats):
        t = _write(H.replace_all(d, pat, lambda _v: H.TERM_PAYLOAD), tmp_path / f"t{i % 2}", hybrid_trace)
        res = invoke("show", t)
        assert one_line_or_ok(res, ()) == 2, pat
        no_control(res.stderr)


@pytest.mark.parametrize("payload", [H.TERM_PAYLOAD, H.HTML_PAYLOAD])
def test_hybrid_free_text_payloads_render_escaped(hybrid_trace, tmp_path, payload):
    """Every free-text string of the hybrid section the schema accepts carries the payload at once."""
    d = _load(hybrid_trace)
    accepted = 0
    for pat, kind in H.patterns(d):
        if "hybrid" not in pat or kind != "str":
            continue
        trial = H.replace_all(d, pat, lambda _v: payload)
        if invoke("show", _write(trial, tmp_path / "trial", hybrid_trace)).exit_code == 0:
            d, accepted = trial, accepted + 1
    assert accepted >= 10  # dtype names and the prefix-reuse reason are free text
    t = _write(d, tmp_path / "all", hybrid_trace)
    res = _all_commands(hybrid_trace, t, tmp_path)
    assert all(r.exit_code in (0, 1) for r in res.values()), {k: r.stderr for k, r in res.items()}
    html = (tmp_path / "r.html").read_text(encoding="utf-8")
    check_inert(html)
    if payload is H.TERM_PAYLOAD:
        assert "[bold red]markup[/bold red]" in res["show"].stdout  # Rich markup printed literally, not interpreted


def _step0(fn):
    def edit(d):
        fn(d["steps"][0]["hybrid"])
    return edit


BAD = {
    "hybrid is a list": (lambda d: d["steps"][0].update(hybrid=[1, 2]), "expected an object"),
    "types huge": (_step0(lambda h: h["layer_map"].update(types=["GDN"] * 200_000)), "config.n_layer"),
    "layer map disagrees with types": (_step0(lambda h: h["layer_map"].update(linear_attention=[1, 3])), "GDN / attn entries"),
    "state_indices huge": (_step0(lambda h: h["state"].update(state_indices=list(range(200_000)))), "batch entries"),
    "per_seq huge": (_step0(lambda h: h["state"].update(per_seq=h["state"]["per_seq"] * 100_000)), "distinct"),
    "slot beyond n_slots": (_step0(lambda h: h["state"]["per_seq"][0].update(slot=99_999)), "0..n_slots-1"),
    "rs_z beyond n_slots": (_step0(lambda h: h["state"].update(rs_z=10 ** 6)), "0..n_slots-1"),
    "state row names an attention layer": (_step0(lambda h: h["state"]["per_seq"][0]["layers"][0].update(layer=1)),
                                           "must name GDN layers"),
    "shown layer not full attention": (_step0(lambda h: h.update(layer=0)), "is not a full-attention layer"),
    "position_ids shape lies": (_step0(lambda h: h["positions"].update(position_ids_shape=[3, 1, 10 ** 6])), "[3, 1, N = 4]"),
    "position_ids ragged": (_step0(lambda h: h["positions"].update(position_ids=[[0], [0, 1], []])), "[3, 1, N = 4]"),
    "inp_pos_len lies": (_step0(lambda h: h["positions"].update(inp_pos_len=10 ** 6)), "inp_pos_len must be N"),
    "rec_shape huge": (_step0(lambda h: h["state"].update(rec_shape=[10 ** 9] * 3)), "MAX_DIM"),
    "conv_shape of rank 3": (_step0(lambda h: h["state"].update(conv_shape=[1, 2, 3])), "items"),
    "unknown convention": (_step0(lambda h: h["state"].update(convention="cells\x1b[2J")), "is not one of cells, paged"),
    "extra key": (_step0(lambda h: h.update({"\x1b]0;x\x07": 1})), "\\x1b]0;x\\x07"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_inconsistent_hybrid_section_is_one_line(hybrid_trace, tmp_path, case):
    edit, expect = BAD[case]
    d = _load(hybrid_trace)
    edit(d)
    t = _write(d, tmp_path / "t", hybrid_trace)
    res = _all_commands(hybrid_trace, t, tmp_path)
    for name in ("show", "report", "diff", "dump-kv"):
        assert res[name].exit_code == 2 and expect in res[name].stderr, (name, res[name].stderr)
    assert res["check"].exit_code in (1, 2)


def test_report_shows_the_hybrid_section(hybrid_trace, tmp_path):
    """The page carries the layer map, M-RoPE positions and the GDN state of each step, as the trace records them."""
    d = _load(hybrid_trace)
    out = tmp_path / "r.html"
    assert invoke("report", hybrid_trace, "-o", out).exit_code == 0
    html = out.read_text(encoding="utf-8")
    assert html.count('<div class="var var-hybrid">') == len(d["steps"]) == 3
    assert "2 GDN layers 0,2 + 2 full-attention layers 1,3" in html
    h0 = d["steps"][0]["hybrid"]
    assert "position_ids [3, 1, 4] I64" in html and "llama.cpp inp_pos [16]" in html
    s = h0["state"]
    assert f"conv [64, 3] + recurrent [4, 8, 8] F32 × 2 layers = {s['bytes_per_seq']} bytes per request" in html
    row = s["per_seq"][0]["layers"][1]
    assert f"<td>{row['rec_norm']:.4f}</td><td>{row['rec_sum']:+.4f}</td>" in html
