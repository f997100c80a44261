"""llama.cpp's non-unified KV cache (``--kv-unified off``, kv/streams.py) without a model: the
split_equal ubatch rule, per-stream placement, heads and kq_mask layout worked by hand, sequence
operations per stream, the cross-stream seq_cp, and the CLI refusals. The comparison with llama.cpp
itself is in tests/runtimes/llamacpp/test_llamacpp_streams.py."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.engine.engine import Engine, EngineOptions
from infertrace.engine.sampler import SamplingParams
from infertrace.kv.base import ChunkSpec
from infertrace.kv.streams import CellsStreamsKV, split_equal_chunks

NEG = float("-inf")


def test_split_equal_chunks_hand_examples():
    # llama_batch_allocr::split_equal(sequential=true): consecutive seq_ids from the first, cut to the shortest
    assert split_equal_chunks([0, 1, 2], [5, 3, 4]) == ([0, 1, 2], 3)
    assert split_equal_chunks([0, 2], [1, 1]) == ([0], 1)  # 2 != 0 + 1: seq 2 waits for the next ubatch
    assert split_equal_chunks([2, 0, 1, 3], [1, 1, 1, 1]) == ([0, 3], 1)  # 2, then 3 (= 2 + 1); 0 and 1 not
    assert split_equal_chunks([], []) == ([], 0)


def test_streams_placement_heads_and_kq_mask_worked_example():
    kv = CellsStreamsKV(1, 1, 4, size=8, n_seq_max=3)
    inp = kv.prepare([ChunkSpec(0, 0, 3), ChunkSpec(1, 0, 3)])
    # each sequence fills its own stream from cell 0; global rows = stream * 8 + cell (llama.cpp k_idxs)
    assert inp.cell_idx.tolist() == [0, 1, 2, 8, 9, 10]
    assert inp.head_before == [0, 0] and inp.head_after == [3, 3]
    assert inp.ne == [8, 3, 1, 2]  # ne = [n_kv (capped at the stream size), n_tps, 1, streams of the ubatch]
    assert list(inp.kq_mask.shape) == [2, 1, 3, 8]
    causal = [[1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]]
    for j in range(2):  # both streams hold their sequence at cells 0..2: the same causal block, no foreign cell
        assert (inp.kq_mask[j, 0] == 0).int().tolist() == causal
    inp = kv.prepare([ChunkSpec(1, 3, 1), ChunkSpec(2, 0, 1)])
    assert inp.cell_idx.tolist() == [11, 16] and inp.streams == [1, 2] and inp.ne == [8, 1, 1, 2]
    assert (inp.kq_mask[0, 0, 0] == 0).int().tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert (inp.kq_mask[1, 0, 0] == 0).int().tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    assert [s.head for s in kv.streams] == [3, 4, 1] and kv.used == 8
    assert kv.logical_mask(inp)[0].int().tolist() == [[1, 1, 1, 1]]
    with pytest.raises(Exception, match="split_equal"):  # not one ubatch: unequal T
        kv.prepare([ChunkSpec(0, 3, 2), ChunkSpec(1, 4, 1)])


def test_streams_n_kv_is_the_largest_of_the_ubatch_streams():
    kv = CellsStreamsKV(1, 1, 4, size=600, n_seq_max=2)
    kv.prepare([ChunkSpec(0, 0, 300)])  # stream 0: used_max_p1 300 -> padded 512
    inp = kv.prepare([ChunkSpec(0, 300, 1), ChunkSpec(1, 0, 1)])  # stream 1 alone would read 256
    assert inp.n_kv == 512 and inp.ne == [512, 1, 1, 2]
    assert (inp.kq_mask[1, 0, 0] == 0).nonzero().flatten().tolist() == [0]  # stream 1 keeps only its one cell


def test_streams_seq_ops_touch_only_the_sequence_stream():
    kv = CellsStreamsKV(1, 1, 4, size=8, n_seq_max=2)
    kv.prepare([ChunkSpec(0, 0, 4), ChunkSpec(1, 0, 4)])
    op = kv.seq_rm(0, 2, -1)
    assert op and op["stream"] == 0 and kv.streams[0].head == 2 and kv.seq_pos_max(0) == 1
    assert kv.seq_pos_max(1) == 3 and kv.streams[1].head == 4  # the other stream is untouched
    assert kv.seq_keep(0) and kv.seq_len(1) == 4  # llama.cpp seq_keep: only seq 0's stream is visited


def test_cross_stream_seq_cp_copies_the_whole_stream_or_refuses_a_part():
    kv = CellsStreamsKV(2, 1, 4, size=8, n_seq_max=2)
    inp = kv.prepare([ChunkSpec(0, 0, 5)])
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        kv.write(layer, torch.randn(5, 1, 4, generator=g), torch.randn(5, 1, 4, generator=g), inp)
    kv.prepare([ChunkSpec(1, 0, 2)])  # dst holds cells of its own: reset by the copy
    refused = kv.seq_cp(0, 1, 2, -1)  # llama.cpp: GGML_ASSERT(is_full), the process aborts
    assert not refused and "full KV buffers" in refused["refused"] and kv.seq_len(1) == 2
    op = kv.seq_cp(0, 1)
    assert op and op["stream_copy"] == [0, 1] and op["cells"] == "0..4"
    assert kv.cells_of(1) == [(8 + c, c) for c in range(5)]  # same cell indices in stream 1, owner seq 1
    assert kv.streams[1].head == kv.streams[0].head == 5
    for layer in range(2):
        k0, v0 = kv.read(layer, 0)
        k1, v1 = kv.read(layer, 1)
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    nxt = kv.prepare([ChunkSpec(0, 5, 1), ChunkSpec(1, 5, 1)])
    assert nxt.cell_idx.tolist() == [5, 13]


def _tiny_engine(tmp_path, **o):
    from infertrace.loading.weights import load_checkpoint
    from infertrace.model.decoder import DecoderModel
    from tests.helpers.tiny import make_weights, write_gguf

    w, s = make_weights(seed=5)
    ck = load_checkpoint(write_gguf(tmp_path / "m.gguf", w, s))
    return ck, DecoderModel(ck.config, ck.weights)


def test_non_unified_generates_the_unified_tokens_with_one_ubatch_per_step(tmp_path):
    ck, m = _tiny_engine(tmp_path)
    prompts = [[72, 101, 108, 108, 111], [33, 34, 35], [100, 101, 102, 103, 104, 105, 106]]
    out = {}
    for unified in (True, False):
        e = Engine(m, ck.tokenizer, EngineOptions(ctx_size=768, n_seq_max=3, kv_unified=unified))
        for p in prompts:
            e.add_request(p, SamplingParams(max_new_tokens=6, ignore_eos=True))
        steps = []
        while (b := e.step()) is not None:
            steps.append([(c.req.seq_id, c.T) for c in b.chunks])
        out[unified] = ([r.output_ids for r in e.requests.values()], steps)
    assert out[False][0] == out[True][0]  # isolation per stream = isolation by the mask
    for chunks in out[False][1]:  # every step is one split_equal ubatch
        sids, ts = [s for s, _ in chunks], [t for _, t in chunks]
        assert sids == list(range(sids[0], sids[0] + len(sids))) and len(set(ts)) == 1
    # split_equal of the first batch (prompts of 5, 3, 7 tokens): 3 of each; then the rest of that batch: seq 0's
    # 2 (seq 2 is not seq 0 + 1: a ubatch of its own), then seq 2's 4; only then the next batch
    assert out[False][1][:4] == [[(0, 3), (1, 3), (2, 3)], [(0, 2)], [(2, 4)], [(0, 1), (1, 1), (2, 1)]]


@pytest.mark.parametrize("args,msg", [
    (["run", "-p", "x", "--kv-unified", "off", "--backend", "paged"], "error: --kv-unified: off (one stream per sequence) is llama.cpp's cells convention; it needs backend cells"),
    (["run", "-p", "x", "--kv-unified", "off", "--prefix-cache", "on"], "error: --prefix-cache: needs kv_unified on: across streams"),
    (["run", "-p", "x", "--kv-unified", "maybe"], "--kv-unified"),
    (["diff-backends", "-p", "x", "--kv-unified", "off"], "diff-runtimes llama.cpp"),
])
def test_kv_unified_refusals_are_one_line(args, msg):
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    assert msg in r.output and "Traceback" not in r.output


def test_cli_trace_check_dump_kv_and_report_show_streams(tmp_path):
    import json

    from tests.helpers.tiny import make_weights, write_gguf

    w, s = make_weights(seed=5)
    gguf = write_gguf(tmp_path / "m.gguf", w, s)
    out = tmp_path / "run"
    run = CliRunner().invoke(app, ["run", "--model", str(gguf), "-p", "abcd", "-p", "xy", "-n", "2", "--ctx-size", "64",
                                   "--kv-unified", "off", "--save", str(out), "--keep", "summary", "--show", "mask"])
    assert run.exit_code == 0, run.output
    assert "stream 1 (seq 1)" in run.output  # the mask panel draws each stream's block
    d = json.loads((out / "trace.json").read_text())
    assert d["options"]["settings"]["kv_unified"] is False and d["options"]["settings"]["n_seq_max"] == 2
    assert any("non-unified KV" in n for n in d["notes"])
    st0 = d["steps"][0]
    kq = st0["mask"]["kq_mask"]
    assert [r["seq_id"] for r in st0["batch"]] == [0, 1] and [r["T"] for r in st0["batch"]] == [2, 2]  # split_equal
    # --ctx-size 64 over 2 streams: llama.cpp n_ctx = pad256(64) = 256, n_ctx_seq = pad256(256 / 2) = 256 cells each
    assert kq["ne"] == [256, 2, 1, 2] and kq["torch_shape"] == [2, 1, 2, 256]  # n_kv = min(stream size 256, pad256(2))
    assert [b["stream"] for b in kq["streams"]] == [0, 1]
    assert kq["streams"][1]["rows"][1][:3] == ["0", "0", "-inf"] and kq["streams"][1]["cell_seq"][0] == [1]
    ph = st0["kv"]["physical"]
    assert (ph["n_stream"], ph["stream_size"], ph["size"]) == (2, 256, 512)
    assert [(x["stream"], x["head"], x["used"]) for x in ph["streams"]] == [(0, 2, 2), (1, 2, 2)]
    assert [c["cell"] for c in ph["cells"]] == [0, 1, 256, 257]  # global rows: stream x 256 + cell
    assert CliRunner().invoke(app, ["check", str(out)]).exit_code == 0
    dump = CliRunner().invoke(app, ["dump-kv", str(out), "--step", "0"])
    assert dump.exit_code == 0 and "2 streams × 256 cells" in dump.output and "stream 1: seq 1 · head 2" in dump.output
    assert "(per stream, above)" not in dump.output and "n = used_max_p1" not in dump.output  # no global row-based n_kv
    assert "used_max_p1 2 · n_kv 256" in dump.output  # stream 0's own: cells 0..1 used, padded to 256
    html = tmp_path / "r.html"
    rep = CliRunner().invoke(app, ["report", str(out), "-o", str(html)])
    assert rep.exit_code == 0 and "kq_mask, stream 1" in html.read_text()
    # a tampered trace: streams that do not add up to the cells, a stream id past n_stream
    good = (out / "trace.json").read_text()
    for path, value, msg in ((("stream_size",), 33, "with size = n_stream"), (("streams", 1, "stream"), 7, "inside the 2 streams")):
        bad = json.loads(good)
        tgt = bad["steps"][0]["kv"]["physical"]
        for k in path[:-1]:
            tgt = tgt[k]
        tgt[path[-1]] = value
        (out / "trace.json").write_text(json.dumps(bad))
        r = CliRunner().invoke(app, ["check", str(out)])
        assert r.exit_code == 1 and msg in r.output and "Traceback" not in r.output  # a cross-field violation


def test_context_shift_per_stream_equals_each_request_alone(tmp_path):
    """A request's context is its stream (llama.cpp's server slot: n_ctx_seq): two requests in streams
    of 256 cells (--ctx-size 300: pad256 -> 512, / 2 = 256) shift exactly as each one alone in a unified
    cache of 256."""
    ck, m = _tiny_engine(tmp_path)
    prompts = [[72, 101, 108, 108, 111, 44, 32], [33, 34, 35]]
    p = SamplingParams(max_new_tokens=260, ignore_eos=True)

    def run(ps, **o):
        e = Engine(m, ck.tokenizer, EngineOptions(context_shift=True, **o))
        for x in ps:
            e.add_request(x, p)
        while e.step() is not None:
            pass
        return [r.output_ids for r in e.requests.values()], e

    both, e = run(prompts, ctx_size=300, n_seq_max=2, kv_unified=False)
    assert e.ctx_limit == 256 and e.kv.size == 256
    alone = [run([x], ctx_size=256, n_seq_max=1)[0][0] for x in prompts]
    assert both == alone and all(len(t) == 260 for t in both)  # 260 + prompt tokens in 256 cells: shifted, not stopped


def test_windowed_model_non_unified_is_refused_in_one_line(tmp_path):
    """Gemma 3 style sliding window with --kv-unified off: llama.cpp keeps an iSWA pool (base + SWA
    cells) per stream, which the cells backend does not model: refused in one line, like --runtime llama.cpp."""
    from tests.helpers.tiny import make_weights, write_hf

    w, s = make_weights(family="gemma3", n_layer=6, seed=4)
    d = write_hf(tmp_path / "hf", w, s, sliding_window=3)
    args = ["run", "-m", str(d), "-p", "Hello world, hello", "-p", "abcdefg", "-n", "3", "--ctx-size", "64"]
    r = CliRunner().invoke(app, args + ["--kv-unified", "off"])
    assert r.exit_code == 2 and "iSWA pool per stream" in r.output and "Traceback" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    assert CliRunner().invoke(app, args + ["--kv-unified", "on"]).exit_code == 0  # the unified cache still runs it

