"""``--weights quant`` through the decoder's linear-op point (issue 20): recorded in the trace,
shown in the header, the same greedy tokens as the float path in float32 (whose quantised
kernel multiplies gguf-py's exact weights), refused where it cannot run."""

from __future__ import annotations

import json

import pytest

from infertrace.errors import InfertraceError
from infertrace.loading.model import resolve_weights


def _run(tmp_path, name, *args):
    from typer.testing import CliRunner

    from infertrace.cli.app import app

    out = tmp_path / name
    r = CliRunner().invoke(app, ["run", "--prompt", "The capital of France is", "-n", "4", "--save", str(out), *args])
    assert r.exit_code == 0, r.output
    return json.loads((out / "trace.json").read_text()), r.output


def test_quant_float32_matches_float_and_is_recorded(tmp_path):
    q, out_q = _run(tmp_path, "q", "--weights", "quant")
    f, out_f = _run(tmp_path, "f", "--weights", "float")
    d, out_d = _run(tmp_path, "d")  # auto in float32 -> float
    assert q["options"]["weights"] == {"weights": "quant", "kernels": {"Q4_1": "dequant", "Q8_0": "dequant"}}
    assert any("--weights quant)" in n for n in q["notes"])
    assert f["options"]["weights"] == {"weights": "float"}  # --weights float given: recorded and in the header
    assert "weights float (every tensor dequantised at load" in " ".join(out_f.split())
    assert "weights" not in d["options"] and "weights float" not in " ".join(out_d.split())  # default: goldens unchanged
    assert q["requests"][0]["output_ids"] == f["requests"][0]["output_ids"] == d["requests"][0]["output_ids"]


def test_quant_bf16_header_names_the_kernels(tmp_path):
    q, out = _run(tmp_path, "b", "--dtype", "bfloat16")  # auto: a GGUF in bf16 on the CPU -> quant
    assert q["options"]["weights"]["kernels"] == {"Q4_1": "int4pack", "Q8_0": "int4x2"}
    assert "weights quant (Q4_1 int4pack, Q8_0 int4x2)" in " ".join(out.split())
    assert any("(--weights auto -> quant)" in n for n in q["notes"])  # auto chose quant: the note says so
    from infertrace.trace.schema import validate_trace

    validate_trace(q, "trace.json")  # the recorded weights section is schema-checked (untrusted on load)
    for bad, msg in (({"weights": "int3"}, "options.weights.weights"),
                     ({"weights": "quant", "kernels": {str(i): "dense" for i in range(65)}}, "exceeds the limit 64"),
                     ({"weights": "quant", "kernels": {"Q4_1": 7}}, "options.weights.kernels")):
        q["options"]["weights"] = bad
        with pytest.raises(Exception, match=msg):
            validate_trace(q, "trace.json")


def test_weights_choice(tmp_path, smol_path):
    assert resolve_weights("auto", smol_path, "float32", "cpu") == "float"
    assert resolve_weights("auto", smol_path, "bfloat16", "cpu") == "quant"
    assert resolve_weights("auto", tmp_path, "bfloat16", "cpu") == "float"  # an HF directory
    with pytest.raises(InfertraceError, match="reads GGUF files"):
        resolve_weights("quant", tmp_path, "float32", "cpu")
    with pytest.raises(InfertraceError, match="model.weights: must be one of"):
        resolve_weights("int3", smol_path, "float32", "cpu")


def _cli(*args):
    from typer.testing import CliRunner

    from infertrace.cli.app import app

    return CliRunner().invoke(app, list(args))


def test_dump_kv_takes_weights_and_records_it():
    """dump-kv --weights: the K/V shown come from the path chosen (bf16 quant differs from bf16 float, by
    less than the bf16 float path differs from float32), and the dump says which path computed them."""
    base = ["dump-kv", "--step", "0", "--prompt", "The capital of France is", "--layer", "0", "--full", "--json"]
    dumps = {}
    for w, dt in (("quant", "bfloat16"), ("float", "bfloat16"), ("float", "float32")):
        r = _cli(*base, "--weights", w, "--dtype", dt)
        assert r.exit_code == 0, r.output
        dumps[w, dt] = json.loads(r.output)
    assert dumps["quant", "bfloat16"]["weights"] == {"weights": "quant", "kernels": {"Q4_1": "int4pack", "Q8_0": "int4x2"}}
    assert "weights" not in dumps["float", "bfloat16"] and "weights" not in dumps["float", "float32"]

    def k_values(d):
        import numpy as np

        rows = [r for q in d["values"]["requests"] for r in q["rows"]]
        return np.array([r[kv] for r in rows for kv in ("k", "v")], dtype=np.float64)  # [2 * positions, head_dim]

    kq, kb, kf = (k_values(dumps[k]) for k in (("quant", "bfloat16"), ("float", "bfloat16"), ("float", "float32")))
    assert kq.shape == kb.shape == kf.shape and kq.size > 100
    assert not (kq == kb).all()  # the quantised kernels computed these K/V, not the float path
    assert abs(kq - kf).max() <= 2 * abs(kb - kf).max()  # as close to float32 as a bf16 float run (measured: 1.0x, 0.024)


def test_diff_backends_takes_weights():
    """diff-backends --weights quant: both backends on the quantised model agree, and the report says so;
    bad values and diff-runtimes vllm are refused in one line."""
    r = _cli("diff-backends", "--prompt", "The capital of France is", "-n", "2", "--dtype", "bfloat16",
             "--weights", "quant", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    assert rep["identical"] and rep["weights"]["weights"] == "quant"
    r = _cli("diff-backends", "--prompt", "x", "--weights", "int3")
    assert r.exit_code == 2 and "--weights" in r.output and "Traceback" not in r.output
    r = _cli("diff-runtimes", "vllm", "--prompt", "x", "--weights", "quant")
    assert r.exit_code == 2 and "does not apply to diff-runtimes vllm" in r.output
