"""Commands that do not compute stay light: ``--help``, ``inspect``, ``show``, ``report``,
``diff``, ``dump-kv DIR`` and ``check`` run in a fresh interpreter without importing torch or the engine
(checked in ``sys.modules`` after the command, so the property cannot silently regress), and
saved tensors read through numpy equal what torch reads from the same file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

#: run one CLI invocation in this interpreter, then write which heavy modules got imported
PROBE = """
import json, sys
from infertrace.cli.app import app
code = 0
try:
    app(sys.argv[2:], prog_name="infertrace")
except SystemExit as e:
    code = e.code or 0
heavy = ("torch", "transformers", "triton", "infertrace.engine.engine", "infertrace.runner", "infertrace.model.decoder")
loaded = {m: m in sys.modules for m in heavy + ("numpy", "gguf", "tokenizers")}
open(sys.argv[1], "w").write(json.dumps({"code": code, "loaded": loaded}))
"""

HEAVY = ("torch", "transformers", "triton", "infertrace.engine.engine", "infertrace.runner", "infertrace.model.decoder")


def probe(tmp_path: Path, *argv: str) -> dict:
    out = tmp_path / f"probe-{abs(hash(argv))}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               XDG_CACHE_HOME=str(tmp_path / "cache"), COLUMNS="120")
    p = subprocess.run([sys.executable, "-c", PROBE, str(out), *argv], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and out.exists(), (argv, p.stderr[-2000:])
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def saved_trace(smol, tmp_path_factory):
    """A short real run saved with tensors of layer 0 (the saved-trace commands' input)."""
    from infertrace.engine.options import EngineOptions, SamplingParams
    from infertrace.runner import PromptSpec, run_requests
    from infertrace.capture.tensors import encode_tensors
    from infertrace.trace.store import save_trace

    d = tmp_path_factory.mktemp("startup") / "trace"
    tensors: dict = {}
    trace = run_requests(smol, [PromptSpec("The capital of", SamplingParams(max_new_tokens=2))],
                         EngineOptions(), tensors=tensors, tensor_layers=[0])
    save_trace(trace, d, encode_tensors(tensors, [0]))
    return d


def test_help_imports_neither_torch_nor_numpy(tmp_path):
    r = probe(tmp_path, "--help")
    assert r["code"] == 0
    assert not any(r["loaded"][m] for m in HEAVY + ("numpy", "gguf")), r["loaded"]


@pytest.mark.model
@pytest.mark.parametrize("argv", [
    ("show", "{d}", "--step", "1"),
    ("report", "{d}", "-o", "{tmp}/r.html"),
    ("diff", "{d}", "{d}"),
    ("dump-kv", "--step", "1", "{d}"),
    ("dump-kv", "--step", "1", "{d}", "--layer", "0", "--head", "1"),  # values from the saved tensors
    ("inspect",),
    ("inspect", "--json"),
    ("check", "{d}"),
], ids=["show", "report", "diff", "dump-kv", "dump-kv-values", "inspect", "inspect-json", "check"])
def test_commands_that_do_not_compute_import_no_torch(saved_trace, tmp_path, argv):
    args = [a.format(d=saved_trace, tmp=tmp_path) for a in argv]
    r = probe(tmp_path, *args)
    assert r["code"] == 0, args
    assert not any(r["loaded"][m] for m in HEAVY), r["loaded"]


def test_bf16_f16_int_tensors_read_through_numpy_equal_torch(tmp_path):
    """``TraceTensors.array`` (numpy; bf16 widened to float32) equals torch's read of the same file."""
    from safetensors.torch import save_file

    from infertrace.capture.tensors import read_tensor
    from infertrace.trace.store import TraceTensors

    g = torch.Generator().manual_seed(0)
    ts = {"a/bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16), "a/f16": torch.randn(4, generator=g).half(),
          "a/f32": torch.randn(2, 3, generator=g), "a/ids": torch.arange(-3, 9, dtype=torch.int64).reshape(3, 4)}
    ts["a/bf16"][0, 0] = float("inf")
    ts["a/bf16"][1, 2] = float("nan")
    path = tmp_path / "tensors.safetensors"
    save_file(ts, path, metadata={"format": "pt"})
    index = {k: {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)} for k, t in ts.items()}
    tt = TraceTensors(path, index, [0])
    for k, t in ts.items():
        arr = tt.array(k)
        assert list(arr.shape) == list(t.shape)
        if t.dtype == torch.bfloat16:
            assert arr.dtype == np.float32
            np.testing.assert_array_equal(arr, t.float().numpy())  # exact: bf16 -> f32 is a widening
        else:
            assert arr.dtype == t.numpy().dtype
            np.testing.assert_array_equal(arr, t.numpy())
        back = read_tensor(tt, k)  # the torch read keeps the saved dtype, bit for bit
        assert back.dtype == t.dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_torch_free_option_defaults_match_the_engine():
    """The CLI reads defaults from :mod:`infertrace.engine.options`; the engine re-exports the same classes."""
    from infertrace.engine import engine, options, sampler
    from infertrace.kv import paged

    assert engine.EngineOptions is options.EngineOptions and sampler.SamplingParams is options.SamplingParams
    assert paged.DEFAULT_TOKENS_PER_BLOCK == options.DEFAULT_TOKENS_PER_BLOCK == options.EngineOptions().tokens_per_block


def test_gguf_is_imported_without_its_mistral_hook():
    """infertrace imports gguf-py through ``loading/gguf_lib.py``: the optional mistral_common import of
    ``gguf.vocab`` (pydantic, torch.export: ~0.45 s of CPU per ``run``, measured) does not happen, gguf-py
    still reads the default model's header, and mistral_common imports normally afterwards."""
    code = (
        "import sys, importlib.util\n"
        "from infertrace.loading.gguf_lib import gguf\n"
        "from infertrace.loading.registry import default_model_path\n"
        "g = gguf()\n"
        "assert not any(m.startswith('mistral_common') for m in sys.modules), 'mistral_common was imported'\n"
        "r = g.GGUFReader(str(default_model_path()))\n"
        "assert r.fields['general.architecture'].contents() == 'llama'\n"
        "if importlib.util.find_spec('mistral_common') is not None:\n"
        "    import mistral_common.tokens.tokenizers.mistral  # not left blocked\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
