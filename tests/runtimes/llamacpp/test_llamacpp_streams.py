"""llama.cpp's non-unified KV cache (``kv_unified = false``: one stream per sequence) captured on the
real SmolLM2-135M GGUF and compared with the cells backend's ``--kv-unified off`` (kv/streams.py):
the structural diff is exact, the kq_mask ``ne`` and every token's stream and cell are llama.cpp's own
captured values, and ``seq_cp`` across streams behaves as llama.cpp (a whole-stream copy; a partial
range aborts llama.cpp and is refused here).

Needs llama-cpp-python (the ``llama_cpp`` fixture fails by name without it, never skips).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from infertrace.cli.run_options import kv_streams_options
from infertrace.engine.engine import EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.kv.base import ChunkSpec
from infertrace.kv.streams import CellsStreamsKV
from infertrace.runner import PromptSpec

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "1, 2, 3, 4, 5,", "Hello"]
STREAM = 256  # cells per stream: ctx 768 / 3 sequences (llama.cpp n_ctx_seq, already a multiple of 256)


def _opts() -> EngineOptions:
    return kv_streams_options(EngineOptions(ctx_size=3 * STREAM), len(PROMPTS))


@pytest.fixture(scope="module")
def taps(smol, llama_cpp):
    """Ours (cells, non-unified) and llama.cpp (kv_unified = false) on the same forced schedule."""
    from infertrace.compare.llamacpp import StepTap, _run_ours
    from infertrace.runtimes.llamacpp.engine import run_llamacpp

    specs = [PromptSpec(t, SamplingParams(max_new_tokens=4, ignore_eos=True)) for t in PROMPTS]
    eng, ours = _run_ours(smol.model, smol.tokenizer, specs, _opts(), 0, None)
    forced = {sid: list(r.output_ids) for sid, r in eng.requests.items()}
    lt = StepTap(0)
    leng, notes = run_llamacpp(smol, specs, _opts(), lt, 0, forced)
    settings = leng.lctx.settings()
    leng.close()
    return ours.steps, lt.steps, settings, notes


def test_structural_diff_exact_against_llamacpp_non_unified(taps) -> None:
    from infertrace.compare.llamacpp import structural_diff

    ours, theirs, settings, notes = taps
    assert settings["kv_unified"] is False and settings["n_ctx_seq"] == STREAM and settings["n_seq_max"] == 3
    d = structural_diff(ours, theirs)
    assert d["mismatches"] == [] and d["checked"] > 50
    assert d["placement"].startswith("identical")  # every token in the same stream and cell as llama.cpp put it
    assert any("non-unified KV (256 cells per stream)" in n for n in notes)


def test_kq_mask_ne_and_stream_cells_are_llamacpps_own(taps, smol) -> None:
    _, theirs, _, _ = taps
    n = [len(smol.tokenizer.encode(p)) for p in PROMPTS]
    assert n == [5, 14, 1]
    # split_equal of the first batch (prompts of 5, 14 and 1 tokens): 1 token of each, then 4 of seq 0 and
    # seq 1, then seq 1's last 9; only then the next batch (decode tokens of all three)
    assert [st["chunks"] for st in theirs[:4]] == [[(0, 0, 1), (1, 0, 1), (2, 0, 1)], [(0, 1, 4), (1, 1, 4)],
                                                   [(1, 5, 9)], [(0, 5, 1), (1, 14, 1), (2, 1, 1)]]
    # ggml ne = [n_kv, n_tokens per stream, 1, n_stream of the ubatch], as llama.cpp built it
    assert [st["ne"] for st in theirs[:4]] == [[STREAM, 1, 1, 3], [STREAM, 4, 1, 2], [STREAM, 9, 1, 1], [STREAM, 1, 1, 3]]
    assert theirs[1]["head"] == ([1, 1], [5, 5]) and theirs[2]["head"] == ([5], [14])  # per-stream v_heads
    for st in theirs:  # llama.cpp's k_idxs: each row in its sequence's stream, at the cell = its position
        t = st["ne"][1]
        for r, g in enumerate(st["cell_idx"]):
            sid, C, _ = st["chunks"][r // t]
            assert g // STREAM == sid and g % STREAM == C + r % t
            keep = (st["mask"][r] == 0).nonzero().flatten().tolist()  # the row keeps its stream's cells 0..pos
            assert keep == list(range(C + r % t + 1))


def test_seq_cp_across_streams_matches_llamacpp(smol_path, llama_cpp) -> None:
    from infertrace.runtimes.llamacpp.capture import LlamaCppContext

    ctx = LlamaCppContext(smol_path, 2 * STREAM, 64, 2, 0, 2, "auto", kv_unified=False)
    try:
        prompt = [504, 3575, 282, 4649, 314]
        ctx.decode(prompt, list(range(5)), [0] * 5, [False] * 4 + [True])
        ctx.seq_cp(0, 1, -1, -1)  # whole sequence: stream 0 copied into stream 1
        assert ctx.seq_pos_range(1) == (0, 4)
        cap = ctx.decode([253, 253], [5, 5], [0, 1], [True, True])
        l_idx = cap.tensors["attn_inp_k_idxs"].reshape(-1).tolist()
        l_keep = (cap.tensors["attn_inp_kq_mask"].reshape(2, 1, 1, -1)[:, 0, 0] == 0)  # [2, n_kv]
        lg = cap.tensors["logits"]
    finally:
        ctx.close()
    assert l_idx == [5, STREAM + 5]  # stream 1's head was copied from stream 0 (v_heads[dst] = v_heads[src])
    assert np.array_equal(lg[0], lg[1])  # seq 1 reads a copy of seq 0's K/V: the same logits, bit for bit

    kv = CellsStreamsKV(1, 1, 4, STREAM, 2)
    kv.prepare([ChunkSpec(0, 0, 5)])
    assert kv.seq_cp(0, 1)
    inp = kv.prepare([ChunkSpec(0, 5, 1), ChunkSpec(1, 5, 1)])
    assert inp.cell_idx.tolist() == l_idx
    assert torch.equal(inp.kq_mask[:, 0, 0] == 0, torch.from_numpy(l_keep))  # same cells kept in both streams


def test_partial_seq_cp_across_streams_aborts_llamacpp_and_is_refused_here(smol_path, llama_cpp) -> None:
    code = ("import sys\nfrom infertrace.runtimes.llamacpp.capture import LlamaCppContext\n"
            f"c = LlamaCppContext(sys.argv[1], {2 * STREAM}, 64, 2, 0, 1, 'auto', kv_unified=False)\n"
            "c.decode([504, 3575, 282], [0, 1, 2], [0, 0, 0], [False, False, True])\n"
            "c.seq_cp(0, 1, 1, -1)\nprint('seq_cp returned')\n")
    env = {**os.environ, "GGML_NO_BACKTRACE": "1", "PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-c", code, str(smol_path)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode != 0 and "seq_cp returned" not in r.stdout
    assert "seq_cp() is only supported for full KV buffers" in r.stderr
    kv = CellsStreamsKV(1, 1, 4, STREAM, 2)
    kv.prepare([ChunkSpec(0, 0, 3)])
    op = kv.seq_cp(0, 1, 1, -1)
    assert not op and "full KV buffers" in op["refused"] and kv.seq_len(1) == 0  # nothing changed


def test_cli_saved_non_unified_traces_diff_clean(tmp_path, llama_cpp) -> None:
    """`run --kv-unified off` by llama.cpp and by the cells backend, saved: `diff` finds no structural
    difference (per-stream mask blocks, cells, heads included) and `check` passes on both."""
    from typer.testing import CliRunner

    from infertrace.cli.app import app

    args = ["run", "-p", "The capital of France is", "-p", "1, 2, 3,", "-n", "2", "--ctx-size", "512", "--kv-unified", "off",
            "--keep", "summary", "--json"]
    for eng in ("llama.cpp", "infertrace"):
        r = CliRunner().invoke(app, args + ["--runtime", eng, "--save", str(tmp_path / eng)])
        assert r.exit_code == 0, r.output
        assert CliRunner().invoke(app, ["check", str(tmp_path / eng)]).exit_code == 0
    d = CliRunner().invoke(app, ["diff", str(tmp_path / "infertrace"), str(tmp_path / "llama.cpp")])
    assert d.exit_code == 0 and "structure: identical" in d.output, d.output


def test_ctx_size_not_256_per_stream_is_padded_like_llamacpp(smol, llama_cpp) -> None:
    """--ctx-size 600 over 2 sequences: llama.cpp pads n_ctx to 768, n_ctx_seq = 384 -> 512; the
    cells backend builds its streams from the same n_ctx_seq and the cell placement is identical."""
    from infertrace.compare.llamacpp import StepTap, _run_ours, structural_diff
    from infertrace.kv.streams import n_ctx_seq
    from infertrace.runtimes.llamacpp.engine import run_llamacpp

    prompts = ["The capital of France is", "1, 2, 3,"]
    opts = kv_streams_options(EngineOptions(ctx_size=600), len(prompts))
    specs = [PromptSpec(t, SamplingParams(max_new_tokens=3, ignore_eos=True)) for t in prompts]
    eng, ours = _run_ours(smol.model, smol.tokenizer, specs, opts, 0, None)
    forced = {sid: list(r.output_ids) for sid, r in eng.requests.items()}
    lt = StepTap(0)
    leng, _ = run_llamacpp(smol, specs, opts, lt, 0, forced)
    theirs = leng.lctx.n_ctx_seq
    leng.close()
    assert theirs == 512 and n_ctx_seq(600, 2) == theirs and eng.ctx_limit == theirs
    assert eng.kv.size == theirs
    d = structural_diff(ours.steps, lt.steps)
    assert d["mismatches"] == [] and d["placement"].startswith("identical"), d["placement"]
