"""llama.cpp's own Gemma 3 iSWA memory and Qwen3.5 recurrent cells, captured through ``--runtime
llama.cpp`` and diffed against the cells backend (issue 21 scope 4).

Expected values are worked by hand from llama.cpp's source (llama-cpp-python 0.3.36's vendored
``src/llama-kv-cache-iswa.cpp``, ``llama-kv-cache.cpp`` ``find_slot`` / ``apply_ubatch``,
``llama-memory-recurrent.cpp`` ``find_slot``), and read back from llama.cpp itself
(``llama_memory_seq_pos_min``, the graph inputs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from infertrace.engine.engine import EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.runner import PromptSpec, load_model
from infertrace.trace.check import check_trace
from infertrace.trace.store import manifest_dict, validate_manifest

pytestmark = pytest.mark.model

#: 301 tokens with the tiny byte tokenizer: more than the 256-cell SWA pool, so cells get reused
LONG = "The quick brown fox jumps over the lazy dog. " * 7


@pytest.fixture(scope="module")
def tiny_g3(tmp_path_factory, llama_cpp):
    from tests.helpers.tiny import make_weights, write_gguf

    w, s = make_weights(seed=7, family="gemma3", n_layer=6, tie=True)
    p = write_gguf(tmp_path_factory.mktemp("g3") / "g3.gguf", w, s,
                   kv={"attention.sliding_window": 4, "final_logit_softcapping": 3.0})
    return load_model(p)


@pytest.fixture(scope="module")
def tiny_q35(tmp_path_factory, llama_cpp):
    from tests.helpers.tiny_qwen35 import make_weights, write_gguf

    w, s = make_weights(seed=3)
    return load_model(write_gguf(tmp_path_factory.mktemp("q35") / "m.gguf", w, s))


def test_swa_pool_size_is_llama_cpps_formula():
    from infertrace.kv.iswa import swa_pool_size

    # GGML_PAD(min(n_ctx, n_swa * n_seq_max + n_ubatch), 256)
    assert swa_pool_size(512, 4, 1, 64) == 256  # min(512, 68) -> 256
    assert swa_pool_size(1024, 512, 1, 64) == 768  # min(1024, 576) -> 768
    assert swa_pool_size(2048, 512, 4, 512) == 2048  # min(2048, 2560) = 2048
    assert swa_pool_size(1024, 512, 1, 64, swa_full=True) == 1024
    assert swa_pool_size(16, 512, 1, 16) == 16  # an unpadded ctx caps the pool


def test_tiny_gemma3_swa_pool_reuse_equals_llama_cpp(tiny_g3):
    """301 tokens in ubatches of 64 through a 256-cell SWA pool (n_swa 4): llama.cpp's own cells,
    masks and seq_pos_min equal the cells backend's, and the hand-worked reuse happens on both."""
    from infertrace.compare.llamacpp import compare_with_llamacpp
    from infertrace.runner import run_requests
    from infertrace.runtimes.llamacpp.engine import run_requests_llamacpp

    assert len(tiny_g3.tokenizer.encode(LONG)) == 301
    specs = [PromptSpec(LONG, SamplingParams(max_new_tokens=3, ignore_eos=True))]
    opts = EngineOptions(ctx_size=512, max_batch_tokens=64, n_seq_max=1)
    rep = compare_with_llamacpp(tiny_g3, specs, opts, layer=0)
    st = rep["structural"]
    assert st["mismatches"] == [] and st["placement"].startswith("identical")
    assert st["checked"] > 100 and rep["first_exceeding"] is None
    lt = run_requests_llamacpp(tiny_g3, specs, opts, layer=0)
    ot = run_requests(tiny_g3, specs, opts)
    assert lt.options["llama_cpp"]["swa_full"] is False
    for tr in (lt, ot):
        pools = [s.mask.swa["pool"] for s in tr.steps]
        assert {p["size"] for p in pools} == {256}  # min(512, 4 * 1 + 64) padded to 256
        # steps 0-3 fill cells 0..255 with pos 0..255; step 4 (pos 256..300, head 256 = size) wraps to
        # cell 0: pos p with 256 - p >= 4 left every window, so cells 0..44 are reused (45 tokens)
        assert [p["k_idxs"] for p in pools[:5]] == ["0..63", "64..127", "128..191", "192..255", "0..44"]
        assert pools[4]["reused"] == "0..44" and pools[4]["head_after"] == 45 and pools[3]["reused"] == "-"
        assert pools[5]["k_idxs"] == "45" and pools[5]["reused"] == "45"  # decode: the next oldest cell
        assert tr.steps[4].kv.physical["swa_pool"]["used"] == 256
        validate_manifest(manifest_dict(tr), "t")
        assert check_trace(manifest_dict(tr))[0] is None
    from infertrace.trace.engine_diff import cross_engine_diff

    res, cross = cross_engine_diff(manifest_dict(lt), manifest_dict(ot))  # `infertrace diff` of the two saved traces
    assert res.equal, res.differences[:3]
    # llama.cpp's own answer: llama_kv_cache_iswa::seq_pos_min is the SWA pool's, 45 once pos 0..44 are gone
    assert lt.steps[4].kv.physical["llama_memory_seq_pos"] == {"0": [45, 300]}
    assert lt.steps[3].kv.physical["llama_memory_seq_pos"] == {"0": [0, 255]}


def test_gemma3_270m_iswa_capture_diffs_clean(gemma, llama_cpp):
    """The real Gemma 3 270M (n_swa 512): kq_mask_swa and both pools exactly as llama.cpp built them."""
    from infertrace.compare.llamacpp import compare_with_llamacpp

    specs = [PromptSpec("The capital of France is", SamplingParams(max_new_tokens=2, ignore_eos=True))]
    rep = compare_with_llamacpp(gemma, specs, EngineOptions(ctx_size=1024, max_batch_tokens=64), layer=5)
    st = rep["structural"]
    assert st["mismatches"] == [] and st["placement"].startswith("identical")
    assert rep["next_token"]["same_top"] == rep["next_token"]["rows"]


def test_gemma3_270m_swa_pool_size_from_llama_cpps_cache(gemma, llama_cpp):
    """llama.cpp allocates the windowed layers' K cache with GGML_PAD(min(1024, 512 + 64), 256) = 768 cells."""
    from infertrace.runtimes.llamacpp.engine import run_requests_llamacpp

    specs = [PromptSpec("Hi", SamplingParams(max_new_tokens=1, ignore_eos=True))]
    tr = run_requests_llamacpp(gemma, specs, EngineOptions(ctx_size=1024, max_batch_tokens=64), layer=0)
    assert tr.steps[0].mask.swa["pool"]["size"] == 768 and tr.steps[0].kv.physical["size"] == 1024
    assert not any("SWA pool of" in n for n in tr.notes)  # llama.cpp's cache_k_l0 has 768 rows too


def test_tiny_qwen35_recurrent_cells_captured(tiny_q35):
    """Two 4-token prompts together, then decode: llama_memory_recurrent::find_slot by hand. Step 0:
    seq 0 -> cell 0, seq 1 -> cell 1 (head 0, n_rs 2); no cell has a source yet, so rs_z = the first
    cell without references = 0 and both read the zeroed state: s_copy [0, 0]. Decode: each reads its
    own cell (s_copy [0, 1]), nothing zeroed (rs_z -1). The cells backend gives the same cells."""
    from infertrace.runner import run_requests
    from infertrace.runtimes.llamacpp.engine import run_requests_llamacpp

    p = SamplingParams(max_new_tokens=3, ignore_eos=True)
    specs = [PromptSpec("abcd", p), PromptSpec("wxyz", p)]
    tr = run_requests_llamacpp(tiny_q35, specs, EngineOptions(ctx_size=256), layer=1)
    rs = [s.kv.physical["recurrent_cells"] for s in tr.steps]
    assert rs[0] == [{"ubatch": 0, "rs_z": 0, "s_copy": [0, 0], "n_rs": 2, "head": 0}]
    assert rs[1] == rs[2] == [{"ubatch": 0, "rs_z": -1, "s_copy": [0, 1], "n_rs": 2, "head": 0}]
    assert not [n for n in tr.notes if "llama_memory_seq_pos" in n]  # hybrid seq_pos_min/max = the last pos
    validate_manifest(manifest_dict(tr), "t")
    assert check_trace(manifest_dict(tr))[0] is None
    ours = run_requests(tiny_q35, specs, EngineOptions(ctx_size=256, n_seq_max=2))
    sd = ours.steps[0].hybrid["state"]
    assert sd["state_indices"] == [0, 1] and sd["rs_z"] == 0
    with pytest.raises(Exception, match="Gated DeltaNet layer"):
        run_requests_llamacpp(tiny_q35, specs, EngineOptions(ctx_size=256), layer=0)


def test_swa_pool_purge_after_seq_rm_equals_llama_cpp(tiny_g3):
    """A hole, then reuse past it: 256 tokens fill the 256-cell SWA pool, ``seq_rm(0, 100, 101)`` frees
    cell 100 (head back to 100), and two tokens at pos 256, 257 take cell 100 (empty) and cell 101
    (pos 101 left every window: 256 - 101 >= 4). apply_ubatch then purges pos 0..99 of seq 0
    (``seq_rm(0, seq_pos_min 0, 101 + 1)``): seq_pos_min 102, 156 cells used, head 102 — by hand from
    llama_kv_cache::find_slot / apply_ubatch, and what llama.cpp itself reports."""
    import numpy as np

    from infertrace.kv.base import ChunkSpec
    from infertrace.kv.iswa import IswaCellsKV
    from infertrace.runtimes.llamacpp.capture import LlamaCppContext

    cfg = tiny_g3.config
    lc = LlamaCppContext(tiny_g3.ckpt.path, 512, 64, 1, 0, 1, "auto", swa_layers=cfg.windowed_layers)
    try:
        for a in range(0, 256, 64):
            lc.decode([5] * 64, list(range(a, a + 64)), [0] * 64, [False] * 63 + [True])
        lc.L.llama_memory_seq_rm(lc.mem, 0, 100, 101)
        cap = lc.decode([6, 7], [256, 257], [0, 0], [False, True])
        l_idx = cap.tensors["attn_inp_k_idxs_swa"].reshape(-1).astype(np.int64).tolist()
        l_base = cap.tensors["attn_inp_k_idxs"].reshape(-1).astype(np.int64).tolist()
        l_range = lc.seq_pos_range(0)
    finally:
        lc.close()
    kv = IswaCellsKV(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, 512, 1,
                     windows=[cfg.layer_window(i) for i in range(cfg.n_layer)], n_ubatch=64)
    assert kv.swa.size == 256
    for a in range(0, 256, 64):
        kv.prepare([ChunkSpec(0, a, 64)])
    assert kv.seq_rm(0, 100, 101)
    inp = kv.prepare([ChunkSpec(0, 256, 2)])
    assert l_idx == inp.swa.cell_idx.tolist() == [100, 101]
    assert l_base == inp.cell_idx.tolist() == [100, 256]  # the base pool: the hole, then the next free cell
    assert inp.swa.swa_pool.reused == "101" and inp.swa.swa_pool.purged == "seq 0: 0..99"
    assert l_range == (kv.seq_pos_min(0), kv.seq_pos_max(0)) == (102, 257)
    assert kv.swa.used == 156 and kv.swa.head == 102


def test_tiny_gemma3_iswa_inputs_told_apart_without_flash_attention(tiny_g3):
    """Flash attention off: the masks are consumed by kq_soft_max-{il} (not the flash-attention node);
    both pools are still told apart and equal the cells backend's."""
    from infertrace.compare.llamacpp import compare_with_llamacpp

    specs = [PromptSpec(LONG, SamplingParams(max_new_tokens=2, ignore_eos=True))]
    rep = compare_with_llamacpp(tiny_g3, specs, EngineOptions(ctx_size=512, max_batch_tokens=64), layer=5,
                                flash_attn="off")
    st = rep["structural"]
    assert rep["llama_cpp"]["flash_attn"] == "off"
    assert st["mismatches"] == [] and st["swa_checked"] > 40 and rep["first_exceeding"] is None
