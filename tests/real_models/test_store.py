"""Saved traces on the real SmolLM2-135M: ``run --save`` (manifest + safetensors + timing), the
same run giving the same bytes, ``load_trace`` round trip, ``show`` printing exactly what
``run`` printed, ``diff`` naming the first divergence (exit 1) or none (exit 0),
``dump-kv --step N DIR`` from the record and saved tensors, and broken/truncated/newer trace
files as one ``error:`` line with exit 2 for show, diff, report and dump-kv.
"""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from infertrace.capture.tensors import encode_tensors, read_tensor
from infertrace.cli.app import app
from infertrace.engine.engine import EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.runner import PromptSpec, run_requests
from infertrace.trace.records import SCHEMA_VERSION
from infertrace.trace.store import load_tensors, load_trace, save_trace

pytestmark = pytest.mark.model

PROMPT = "The capital of"
ENV = {"COLUMNS": "120"}
RUN = ("run", "--prompt", PROMPT, "--max-new-tokens", "3")


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def _ok(res, code: int = 0):
    assert res.exit_code == code, (res.output, res.exception)
    return res


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The worked example saved twice with tensors of layers 0 and 5 (and the run's stdout)."""
    base = tmp_path_factory.mktemp("saved")
    a, b = base / "a", base / "b"
    ra = _ok(invoke(*RUN, "--save", a, "--layers", "0,5"))
    _ok(invoke(*RUN, "--save", b, "--layers", "0,5"))
    return a, b, ra


def _copy(src, dst, edit=None):
    shutil.copytree(src, dst)
    if edit is not None:
        d = json.loads((dst / "trace.json").read_text())
        edit(d)
        (dst / "trace.json").write_text(json.dumps(d))
    return dst


# ----------------------------------------------------------------------------- save / load


def test_save_writes_manifest_tensors_timing(saved):
    a, _, res = saved
    assert sorted(p.name for p in a.iterdir()) == ["tensors.safetensors", "timing.json", "trace.json"]
    m = json.loads((a / "trace.json").read_text())
    assert m["schema_version"] == SCHEMA_VERSION and m["model"]["file"].endswith(".gguf")
    assert {"file", "size", "metadata_sha256"} <= set(m["model"]) and m["config"]["n_layer"] == 30
    assert m["store"]["keep"] == "tensors" and m["store"]["tensor_layers"] == [0, 5]
    idx = m["store"]["tensors"]
    assert idx["step0/layer0/q_pre_rope"] == {"dtype": "float32", "shape": [3, 9, 64]}
    assert idx["step2/layer5/seq0/k_cache"]["shape"] == [5, 3, 64]  # cache after step 2: positions 0..4
    assert idx["step1/logits_topk_ids"] == {"dtype": "int64", "shape": [1, 20]}
    assert "time_ms" not in (a / "trace.json").read_text()  # timings live in timing.json only
    assert [s["step"] for s in json.loads((a / "timing.json").read_text())["steps"]] == [0, 1, 2]
    assert "saved trace to" in res.stderr and res.stdout.startswith("╭")


def test_same_run_same_bytes(saved):
    a, b, _ = saved
    assert (a / "trace.json").read_bytes() == (b / "trace.json").read_bytes()
    assert (a / "tensors.safetensors").read_bytes() == (b / "tensors.safetensors").read_bytes()


def test_round_trip_and_lazy_tensors(smol, tmp_path):
    tensors: dict = {}
    spec = [PromptSpec(PROMPT, SamplingParams(max_new_tokens=2))]
    trace = run_requests(smol, spec, EngineOptions(backend="paged", tokens_per_block=2), tensors=tensors, tensor_layers=[1, 3])
    save_trace(trace, tmp_path, encode_tensors(tensors, [1, 3]))
    back = load_trace(tmp_path)
    assert back.to_dict() == trace.to_dict()  # time_ms merged back from timing.json
    tt = load_tensors(tmp_path)
    assert tt is not None and tt.layers == [1, 3] and set(tt.names()) == set(tensors)
    for name in ("step0/layer1/k_post_rope", "step1/layer3/seq0/v_cache", "step1/logits_topk_values"):
        assert read_tensor(tt, name).equal(tensors[name])
    # RoPE: k_cache holds the rotated K of the positions written at each step; V is not rotated
    k0, kc = read_tensor(tt, "step0/layer1/k_post_rope"), read_tensor(tt, "step0/layer1/seq0/k_cache")
    assert kc.equal(k0) and read_tensor(tt, "step0/layer1/seq0/v_cache").equal(read_tensor(tt, "step0/layer1/v"))
    # top-k logits agree with the sampler's record
    top = trace.steps[0].decode.per_request[0]["top"]
    assert read_tensor(tt, "step0/logits_topk_ids")[0, :3].tolist() == [c["id"] for c in top[:3]]
    # a summary save: manifest only, and an older tensors file is removed
    save_trace(trace, tmp_path)
    assert load_tensors(tmp_path) is None and not (tmp_path / "tensors.safetensors").exists()
    # run --save runs/first with no runs/ yet: the missing parents are created, the trace loads back
    nested = tmp_path / "runs" / "deeper" / "first"
    save_trace(trace, nested)
    assert [s.to_dict() for s in load_trace(nested).steps] == [s.to_dict() for s in trace.steps]


def test_tensor_capture_keeps_records_and_evidence_layer(smol):
    spec = [PromptSpec(PROMPT, SamplingParams(max_new_tokens=2))]
    plain = run_requests(smol, spec, layer=2)
    t: dict = {}
    rich = run_requests(smol, spec, layer=2, tensors=t, tensor_layers=[0, 7])
    strip = lambda tr: [{k: v for k, v in s.to_dict().items() if k != "time_ms"} for s in tr.steps]  # noqa: E731
    assert strip(plain) == strip(rich)  # same records, same evidence layer (2), whatever layers are tapped
    assert rich.steps[0].positions.evidence["layer"] == 2
    assert {n.split("/")[1] for n in t if n.count("/") >= 2} == {"layer0", "layer7"}


# ----------------------------------------------------------------------------- show


def test_show_prints_what_run_printed(saved):
    a, _, res = saved
    assert _ok(invoke("show", a)).stdout == res.stdout


def test_show_with_steps_and_vars_equals_run(saved, tmp_path):
    a, _, _ = saved
    live = _ok(invoke(*RUN, "--show", "mask,decode", "--steps", "1", "--save", tmp_path / "s", "--keep", "summary"))
    assert _ok(invoke("show", tmp_path / "s", "--var", "mask,decode", "--step", "1")).stdout == live.stdout
    assert _ok(invoke("show", a, "--var", "mask,decode", "--step", "1")).stdout == live.stdout
    assert "--step 7: no such step in this trace (steps 0..2)" in _one_error_line(invoke("show", a, "--step", "7"))


# ----------------------------------------------------------------------------- diff


def test_diff_identical_traces(saved):
    a, b, _ = saved
    res = _ok(invoke("diff", a, b))
    assert res.stdout.startswith("no difference between") and "tensors compared" in res.stdout


def _set(path):
    def edit(d):
        obj = d
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1][0]] = path[-1][1]
    return edit


@pytest.mark.parametrize("path, expect", [
    (["steps", 1, "positions", "inp_pos", (0, 9)], "step 1 · seq 0 · variable positions · field inp_pos[0]"),
    (["steps", 2, "mask", "logical", 0, 0, (4, 0)], "step 2 · seq 0 · variable mask · field logical[0][0][4]"),
    (["steps", 1, "batch", 0, ("sampled", 42)], "step 1 · seq 0 · variable decode · field batch[0].sampled"),
    (["steps", 2, "kv", "physical", ("head", 9)], "step 2 · variable kv · field physical.head"),
])
def test_diff_finds_injected_change(saved, tmp_path, path, expect):
    a, _, _ = saved
    b = _copy(a, tmp_path / "b", _set(path))
    res = _ok(invoke("diff", a, b), code=1)
    assert res.stdout.startswith("first difference: " + expect), res.stdout
    assert "  A      " in res.stdout and "  B      " in res.stdout


def test_diff_float_tolerance_and_tensors(saved, tmp_path):
    a, _, _ = saved

    def nudge(delta):
        def edit(d):
            d["steps"][0]["hidden"]["rows"][1]["mean"] += delta
        return edit

    small = _copy(a, tmp_path / "small", nudge(5e-5))
    assert _ok(invoke("diff", a, small)).stdout.startswith("no difference")
    out = _ok(invoke("diff", a, small, "--atol", "0", "--rtol", "0"), code=1).stdout
    assert "step 0 · seq 0 · variable hidden · field rows[1].mean" in out
    # a changed tensor value is found when both traces kept tensors
    from safetensors.torch import load_file, save_file

    t = _copy(a, tmp_path / "t")
    ts = load_file(t / "tensors.safetensors")
    ts["step1/layer5/seq0/v_cache"][2, 1, 7] += 0.5
    save_file(ts, t / "tensors.safetensors", metadata={"format": "pt"})
    out = _ok(invoke("diff", a, t), code=1).stdout
    assert "step 1 · seq 0 · variable kv · field layer5/seq0/v_cache[2, 1, 7]" in out
    assert _ok(invoke("diff", a, t, "--no-tensors")).stdout.startswith("no difference")
    js = json.loads(_ok(invoke("diff", a, t, "--json"), code=1).stdout)
    assert js["equal"] is False and js["first"]["step"] == 1 and js["first"]["variable"] == "kv"


# ----------------------------------------------------------------------------- dump-kv DIR


def test_dump_kv_from_saved_trace_matches_live(saved, smol):
    from infertrace.runner import dump_kv_at_step
    from infertrace.trace.saved_kv import dump_saved

    a, _, _ = saved
    spec = [PromptSpec(PROMPT, SamplingParams(max_new_tokens=3))]
    live = dump_kv_at_step(smol, spec, EngineOptions(), 2, layer=5, head=1)
    got = dump_saved(a, 2, layer=5, head=1)
    assert got["physical"]["cells"] == live["physical"]["cells"] and got["writes"] == live["writes"]
    for rl, rg in zip(live["values"]["requests"], got["values"]["requests"]):
        assert [r["pos"] for r in rl["rows"]] == [r["pos"] for r in rg["rows"]] == [0, 1, 2, 3, 4]
        assert [r["cell"] for r in rl["rows"]] == [r["cell"] for r in rg["rows"]]
        for x, y in zip(rl["rows"], rg["rows"]):
            assert x["k"] == pytest.approx(y["k"], abs=1e-6) and x["v"] == pytest.approx(y["v"], abs=1e-6)
    out = _ok(invoke("dump-kv", "--step", "1", a)).stdout
    assert "kv cache after step 1" in out
    out = _ok(invoke("dump-kv", "--step", "1", "--layer", "5", "--head", "2", a)).stdout
    assert "K/V values: layer 5, kv head 2" in out
    assert "layer 3 was not kept in this trace (tensors kept for layers 0, 5)" in _one_error_line(
        invoke("dump-kv", "--step", "1", "--layer", "3", a))
    assert "step 9 out of range: the trace has steps 0..2" in _one_error_line(invoke("dump-kv", "--step", "9", a))


def test_dump_kv_summary_trace_says_so(saved, tmp_path):
    a, _, _ = saved
    s = _copy(a, tmp_path / "s")
    save_trace(load_trace(s), s)  # re-save as summary
    assert "was saved with --keep summary" in _one_error_line(invoke("dump-kv", "--step", "0", "--layer", "0", s))
    assert _ok(invoke("dump-kv", "--step", "0", s)).stdout  # the layout still shows


# ----------------------------------------------------------------------------- options and broken files


def _one_error_line(res, code: int = 2) -> str:
    assert res.exit_code == code, (res.output, res.exception)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output
    return lines[0]


@pytest.mark.parametrize("args, expect", [
    (["--keep", "summary"], "--keep needs --save DIR"),
    (["--save", "x", "--keep", "all"], "--keep must be one of summary, tensors and/or variables"),
    (["--save", "x", "--keep", "summary,tensors"], "--keep takes summary or tensors, not both"),
    (["--save", "x", "--keep", "summary", "--layers", "1"], "it needs --keep tensors"),
    (["--save", "x", "--layers", "0,x"], "'x' is not a layer number or range"),
    (["--save", "x", "--layers", "31"], "--layers: 31 out of range: the model has layers 0..29"),
])
def test_save_option_errors(args, expect):
    assert expect in _one_error_line(invoke(*RUN, *args))


def _truncate(name, n):
    def f(d):
        p = d / name
        p.write_bytes(p.read_bytes()[:n])
    return f


def _json(edit):
    def f(d):
        m = json.loads((d / "trace.json").read_text())
        edit(m)
        (d / "trace.json").write_text(json.dumps(m))
    return f


BROKEN = {
    "missing-dir": (None, "does not exist"),
    "no-manifest": (lambda d: (d / "trace.json").unlink(), "no trace.json here"),
    "invalid-json": (lambda d: (d / "trace.json").write_text('{"schema_version": 1, "model": nope}'), "not valid JSON"),
    "truncated-json": (_truncate("trace.json", 3000), "truncated JSON"),
    "empty-json": (_truncate("trace.json", 0), "empty file"),
    "newer-schema": (_json(lambda m: m.update(schema_version=99)),
                     "trace schema 99 is newer than this infertrace supports (2); upgrade infertrace"),
    "missing-key": (_json(lambda m: m["steps"][1]["batch"][0].pop("positions")), "steps[1].batch[0]: missing key 'positions'"),
    "missing-top": (_json(lambda m: m.pop("requests")), "missing key 'requests'"),
    "not-object": (lambda d: (d / "trace.json").write_text("[1, 2]"), "expected a JSON object"),
    "truncated-tensors": (_truncate("tensors.safetensors", 20000), "may be truncated"),
    "tensors-gone": (lambda d: (d / "tensors.safetensors").unlink(), "tensors.safetensors is missing"),
}


@pytest.mark.parametrize("command", ["show", "diff", "report", "dump-kv"])
@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_trace_one_line_exit_2(saved, tmp_path, case, command):
    a, _, _ = saved
    edit, expect = BROKEN[case]
    bad = tmp_path / "bad"
    if edit is not None:
        shutil.copytree(a, bad)
        edit(bad)
    args = {"show": ["show", bad], "diff": ["diff", a, bad], "report": ["report", bad, "-o", tmp_path / "r.html"],
            "dump-kv": ["dump-kv", "--step", "0", bad]}[command]
    assert expect in _one_error_line(invoke(*args))
