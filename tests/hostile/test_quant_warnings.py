"""Quantised tensors with Inf scales (a hostile GGUF): the run stops with the one-line non-finite
error and nothing else on stderr — no numpy ``RuntimeWarning`` with a source path before it — on
every decode path: the quantised embedding lookup (``--weights quant``'s ``get_rows``), the
quantised matrices, and the float path's dequantisation.

Runs ``python -m infertrace`` in a subprocess with ``PYTHONWARNINGS=default`` so a warning numpy
raises is printed the way a user sees it (pytest's own warning capture would hide it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from tests.helpers.tiny import make_weights, write_gguf

Q = gguf.GGMLQuantizationType
ROOT = Path(__file__).resolve().parents[2]
INF_F16 = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)  # the f16 scale d = +Inf (0x7C00)


def _hostile(path: Path, poisoned: str) -> Path:
    """Q8_0 token embedding and Q projections; the blocks of ``poisoned`` get scale +Inf."""

    def q(name, arr):
        if name == "token_embd.weight" or name.endswith("attn_q.weight"):
            b = np.array(gguf.quants.quantize(arr, Q.Q8_0))  # [rows, blocks * 34]: f16 d + 32 int8 per block
            if name == poisoned:
                blocks = b.reshape(-1, 34)
                blocks[:, 0:2] = INF_F16
                b = blocks.reshape(arr.shape[0], -1)
            return b, Q.Q8_0
        return None

    w, s = make_weights(seed=3)
    return write_gguf(path, w, s, quant=q)


def _run(model: Path, *extra: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "default", "INFERTRACE_NO_CACHE": "1",
           "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "infertrace", "run", "--model", str(model), "--prompt", "ab",
                           "--max-new-tokens", "2", *extra], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("poisoned", ["token_embd.weight", "blk.0.attn_q.weight"])
@pytest.mark.parametrize("weights", ["quant", "float"])
def test_inf_scales_give_one_line_and_no_numpy_warning(tmp_path, poisoned, weights):
    model = _hostile(tmp_path / "inf.gguf", poisoned)
    # the file really holds an Inf scale: gguf-py's own dequantisation of the tensor is not finite
    t = next(t for t in gguf.GGUFReader(str(model)).tensors if t.name == poisoned)
    with np.errstate(all="ignore"):
        assert not np.isfinite(gguf.quants.dequantize(t.data, Q(t.tensor_type))).all()
    res = _run(model, "--weights", weights)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert "Warning" not in res.stderr and ".py:" not in res.stderr, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "NaN/inf" in lines[0], res.stderr
