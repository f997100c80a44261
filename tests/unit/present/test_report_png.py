"""docs/report-worked-example.png is made from a run by docs/make_report_png.py (issue 31 item 7): the facts the
picture shows (written beside it as .png.json) must be those of the trace the code writes now -- step 0's kq_mask
``ne`` = [n_kv, n_tokens_pad, 1, n_stream] and ``n_kv`` for the 3-token prompt, the tokens -- else the picture is
stale and the script must be rerun. Reference: llama.cpp pads n_kv to 256 cells (``GGML_PAD(n_kv, 256)`` in
llama_kv_cache::get_n_kv), the prompt "The capital of" is 3 tokens (HF's tokenizer on the GGUF)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app

ROOT = Path(__file__).resolve().parents[3]
PNG = ROOT / "docs" / "report-worked-example.png"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def png_size(p: Path) -> tuple[int, int]:
    b = p.read_bytes()
    assert b[:8] == b"\x89PNG\r\n\x1a\n" and b[12:16] == b"IHDR"
    return struct.unpack(">II", b[16:24])


def test_committed_picture_is_of_the_current_trace(hf_smol):
    tok, _ = hf_smol
    shown = json.loads(Path(str(PNG) + ".json").read_text())
    assert png_size(PNG) == tuple(shown["window"]) and PNG.stat().st_size < 1_000_000
    res = CliRunner().invoke(app, ["run", "-p", shown["prompt"], "-n", "3", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    km = d["steps"][0]["mask"]["kq_mask"]
    assert shown["prompt_ids"] == tok(shown["prompt"]).input_ids == d["requests"][0]["prompt_ids"]
    assert km["ne"] == shown["kq_mask_ne"] == [256, 3, 1, 1] and km["n_kv"] == shown["n_kv"] == 256
    assert d["requests"][0]["output_ids"] == shown["output_ids"]


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not on PATH (apt-get install -y chromium)")
def test_script_regenerates_the_picture(tmp_path):
    out = tmp_path / "shot.png"
    p = subprocess.run([sys.executable, str(ROOT / "docs" / "make_report_png.py"), "--out", str(out)], capture_output=True,
                       text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-2000:]
    assert png_size(out) == (1200, 2450) and out.stat().st_size > 20_000
    assert json.loads(Path(str(out) + ".json").read_text()) == json.loads(Path(str(PNG) + ".json").read_text())
    assert "kq_mask ne [256, 3, 1, 1], n_kv 256" in p.stdout
