"""diff across engines (a --runtime llama.cpp trace vs a cells trace): structure exactly, floats and
storage dtypes summarised. Built from the golden cells trace, relabelled and perturbed as llama.cpp's
trace differs (F16 mask and cache, float noise, another top token), so it runs without llama.cpp."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.trace.engine_diff import cross_engine_diff

GOLDEN = Path(__file__).resolve().parents[3] / "fixtures" / "golden" / "batching-cells"


def _as_llamacpp(m: dict) -> dict:
    b = copy.deepcopy(m)
    b["runtime"] = "llama.cpp"
    b["options"]["attention"] = "llama.cpp"
    for st in b["steps"]:
        if st.get("mask"):
            st["mask"]["kq_mask"]["dtype"] = "float16"
        if st.get("kv"):
            st["kv"]["dtype"] = "float16"
            for r in st["kv"]["layer_view"]["requests"]:
                for row in r["rows"]:
                    row["k"] = [x + 0.01 for x in row["k"]]
        if st.get("hidden"):
            for r in st["hidden"]["rows"]:
                r["mean"] += 1e-3
        if st.get("decode"):
            for p in st["decode"]["per_request"]:
                for t in p.get("top", []):
                    t["logit"] += 0.5
    return b


def _save(tmp: Path, name: str, m: dict) -> Path:
    d = tmp / name
    shutil.copytree(GOLDEN, d)
    (d / "trace.json").write_text(json.dumps(m), encoding="utf-8")
    return d


def test_same_structure_other_floats_is_clean(tmp_path: Path) -> None:
    a = json.loads((GOLDEN / "trace.json").read_text())
    b = _as_llamacpp(a)
    res, info = cross_engine_diff(b, a)
    assert res.equal, res.first
    f = info["floats"]
    assert f["same_top"] == f["rows"] == 6 and abs(f["max_abs"]["logits"] - 0.5) < 1e-6
    assert abs(f["max_abs"]["kv"] - 0.01) < 1e-6
    assert info["dtypes"]["a"] == {"kq_mask": ["float16"], "kv": ["float16"]}
    out = CliRunner().invoke(app, ["diff", str(_save(tmp_path, "lc", b)), str(GOLDEN)])
    assert out.exit_code == 0, out.output
    assert "engines differ (A: llama.cpp, B: infertrace)" in out.output and "structure: identical" in out.output
    assert "same top token 6/6 (100.0%)" in out.output


def test_one_cell_of_the_mask_differs(tmp_path: Path) -> None:
    a = json.loads((GOLDEN / "trace.json").read_text())
    b = _as_llamacpp(a)
    st = next(s for s in b["steps"] if s["step"] == 2)
    st["mask"]["kq_mask"]["rows"][1][5] = "0"  # seq 1's query would keep seq 0's cell 5
    res, _ = cross_engine_diff(b, a)
    assert not res.equal and res.first.step == 2 and res.first.variable == "mask"
    assert res.first.path == "steps[2].mask.kq_mask.rows[1][5]"
    out = CliRunner().invoke(app, ["diff", str(_save(tmp_path, "lc", b)), str(GOLDEN)])
    assert out.exit_code == 1 and "structure: 1 difference(s)" in out.output


def test_another_cell_placement_is_structural(tmp_path: Path) -> None:
    a = json.loads((GOLDEN / "trace.json").read_text())
    b = _as_llamacpp(a)
    st = next(s for s in b["steps"] if s["step"] == 1)
    st["kv"]["per_request"][1]["cells"] = "5..6"
    res, _ = cross_engine_diff(b, a)
    assert not res.equal and res.first.variable == "kv" and res.first.step == 1


def test_summary_line_is_truthful_across_engines(tmp_path: Path) -> None:
    """The last line must not claim floats 'within atol 0' after a 0.5 logits gap, and must say
    which trace kept tensors."""
    from infertrace.trace.diff import format_diff

    a = json.loads((GOLDEN / "trace.json").read_text())
    b = _as_llamacpp(a)
    out = CliRunner().invoke(app, ["diff", str(_save(tmp_path, "lc", b)), str(GOLDEN)])
    assert out.exit_code == 0, out.output
    last = out.output.strip().splitlines()[-1]
    assert "within atol" not in last and "no structural difference" in last, last
    assert "summarised above" in last and "tensors not compared across engines (neither trace kept them)" in last
    b["store"] = dict(b.get("store", {}), keep="tensors")  # A (llama.cpp) kept tensors, B did not
    res, _ = cross_engine_diff(b, a)
    line = format_diff(res, b, a, "A", "B")[-1]
    assert "A kept them, B did not" in line and "neither" not in line, line
    res, _ = cross_engine_diff(a, b)
    assert "B kept them, A did not" in format_diff(res, a, b, "A", "B")[-1]
