"""Issue 23, re-probe of hostile input (cases X4, X5, X6, L3, G3, R6, X9 of ../shared/cases.md).

Each test drives the command (or the one helper every command goes through) with the hostile
input and asserts the outcome the issue asks for: exit 0 with the named effect, or exit 2 with one
``error:`` line and no traceback. Device nodes and FIFOs are made in a temporary directory; the
machine's own ``/dev/null`` is never touched.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.helpers import hostile as H
from infertrace import safe_io
from infertrace.cli.app import app
from infertrace.errors import InfertraceError

ROOT = Path(__file__).resolve().parents[2]


def invoke(*args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def refused(res, *needles):
    """Exit 2 with exactly one ``error:`` line holding every needle; no traceback."""
    assert res.exit_code == 2, (res.exit_code, res.stdout[-400:], res.stderr[-800:], res.exception)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "internal error" not in lines[0], res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _trace(tmp_path: Path) -> Path:
    t = tmp_path / "t"
    shutil.copytree(H.GOLDEN / "worked-example-cells", t)
    return t


def _chardev(path: Path) -> Path:
    """A character device node with /dev/null's numbers (1, 3) at ``path``, or skip."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, OSError) as e:
        pytest.skip(f"cannot make a device node here ({e.strerror}): needs root and CAP_MKNOD")
    return path


# ----------------------------------------------------------------------------- X4: --force and special files


@pytest.mark.parametrize("force", [False, True])
def test_report_into_a_character_device_writes_through_and_keeps_the_node(tmp_path, force):
    t = _trace(tmp_path)
    dev = _chardev(tmp_path / "devnull")
    res = invoke("report", t, "-o", dev, *(["--force"] if force else []))
    assert res.exit_code == 0, (res.stderr, res.exception)
    st = os.lstat(dev)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)  # still /dev/null's node, not a 260 kB file
    assert "wrote" in res.stderr and "wrote" not in res.stdout  # the message never goes into the output stream


def test_report_through_a_symlink_to_a_device_keeps_link_and_node(tmp_path):
    t = _trace(tmp_path)
    dev = _chardev(tmp_path / "devnull")
    link = tmp_path / "stdout-alias"
    link.symlink_to(dev)
    res = invoke("report", t, "-o", link, "--force")
    assert res.exit_code == 0, res.stderr
    assert link.is_symlink() and os.readlink(link) == str(dev) and stat.S_ISCHR(os.lstat(dev).st_mode)


def test_report_into_a_fifo_with_a_reader_writes_the_page(tmp_path):
    t = _trace(tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    res = invoke("report", t, "-o", fifo, "--force")
    reader.join(30)
    assert res.exit_code == 0, res.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert got and got[0].startswith(b"<!DOCTYPE html>") and got[0].rstrip().endswith(b"</html>")


def test_report_into_a_fifo_without_a_reader_is_refused_within_the_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(safe_io, "FIFO_WAIT_S", 0.3)
    t = _trace(tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    refused(invoke("report", t, "-o", fifo, "--force"), "is a FIFO with no reader after 0.3 s")
    assert time.monotonic() - t0 < 20
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_report_never_replaces_a_socket_or_a_symlink_to_a_directory(tmp_path):
    t = _trace(tmp_path)
    sock_path = tmp_path / "s.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock_path))
    try:
        refused(invoke("report", t, "-o", sock_path, "--force"), "is a socket", "never replaced")
        assert stat.S_ISSOCK(os.lstat(sock_path).st_mode)
    finally:
        s.close()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("k")
    link = tmp_path / "dirlink"
    link.symlink_to(outside)
    refused(invoke("report", t, "-o", link, "--force"), "is a directory")
    assert link.is_symlink() and (outside / "keep").read_text() == "k"


def test_write_output_refuses_devices_for_caches(tmp_path):
    fifo = tmp_path / "entry.json"
    os.mkfifo(fifo)
    with pytest.raises(InfertraceError, match="not a regular file"):
        safe_io.write_output(fifo, b"{}", force=True, option="header cache", devices=False)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_model_cache_note_planted_as_a_fifo_is_refused_not_replaced(tmp_path):
    from infertrace.loading.registry import _write_note

    target = tmp_path / "m.gguf"
    target.write_bytes(b"x")
    note = tmp_path / "m.gguf.sha256"
    os.mkfifo(note)
    with pytest.raises(InfertraceError, match="not a regular file"):
        _write_note(note, target, "ab" * 32)
    assert stat.S_ISFIFO(os.lstat(note).st_mode)


def test_header_cache_entry_planted_as_a_fifo_stays_a_fifo(tmp_path, monkeypatch):
    from infertrace.loading import gguf_meta
    from tests.helpers.tiny import make_weights, write_gguf

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("INFERTRACE_NO_CACHE", raising=False)
    g = tmp_path / "m.gguf"
    write_gguf(g, *make_weights())
    res = invoke("inspect", g)
    assert res.exit_code == 0, res.stderr
    entries = [p for p in (tmp_path / "cache").rglob("*.json")]
    assert len(entries) == 1, entries
    entries[0].unlink()
    os.mkfifo(entries[0])
    res = invoke("inspect", g)  # the cache write fails quietly (an optimisation); the FIFO is left alone
    assert res.exit_code == 0, res.stderr
    assert stat.S_ISFIFO(os.lstat(entries[0]).st_mode)
    assert gguf_meta is not None


def test_save_force_never_deletes_a_fifo_under_a_trace_files_name(tmp_path):
    from infertrace.trace.store import load_saved, save_trace

    trace, _ = load_saved(H.GOLDEN / "worked-example-cells")
    d = tmp_path / "D"
    d.mkdir()
    os.mkfifo(d / "trace.json")
    with pytest.raises(InfertraceError, match="is a FIFO, not a saved trace file"):
        save_trace(trace, d, None, replace=True)
    assert stat.S_ISFIFO(os.lstat(d / "trace.json").st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["D"]  # no staging directory left behind


def test_make_qwen35_out_special_file_is_refused_and_kept(tmp_path):
    fifo = tmp_path / "ckpt"
    os.mkfifo(fifo)
    refused(invoke("make-qwen35", "--out", fifo), "exists and is not an empty directory")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_publish_dir_never_renames_onto_a_device_or_fifo(tmp_path):
    for make in (os.mkfifo, _chardev):
        target = tmp_path / f"out-{make.__name__}"
        make(target)
        tmp = safe_io.fresh_dir_beside(target)
        with pytest.raises(safe_io.DirTaken):
            safe_io.publish_dir(tmp, target, replace=True)
        mode = os.lstat(target).st_mode
        assert stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)
        shutil.rmtree(tmp)


# ----------------------------------------------------------------------------- L3: two reports, one new path


def test_concurrent_reports_to_one_new_path_exactly_one_wins(tmp_path):
    """Four ``report T -o new.html`` started together: one exit 0, three exit 2 "exists", the page whole."""
    t = _trace(tmp_path)
    out = tmp_path / "new.html"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, "-m", "infertrace", "report", str(t), "-o", str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [(p.wait(120), p.stderr.read()) for p in procs]
    codes = sorted(c for c, _ in results)
    assert codes == [0, 2, 2, 2], results
    for c, err in results:
        if c == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: ") and "exists" in lines[0], err
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.html", "t"]  # no temporary file left


def test_write_output_racing_threads_create_once(tmp_path):
    """Eight threads racing for each of 20 new names: exactly one creates it, whole; the rest are refused."""
    for i in range(20):
        out = tmp_path / f"o{i}"
        barrier = threading.Barrier(8)
        wins, losses = [], []

        def go(k):
            barrier.wait()
            try:
                safe_io.write_output(out, bytes([k]) * 4096, force=False)
                wins.append(k)
            except InfertraceError as e:
                assert "exists" in e.message
                losses.append(k)

        ths = [threading.Thread(target=go, args=(k,)) for k in range(8)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        assert len(wins) == 1 and len(losses) == 7
        assert out.read_bytes() == bytes([wins[0]]) * 4096
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"o{i}" for i in range(20))


def test_report_force_replaces_a_regular_file_atomically(tmp_path):
    t = _trace(tmp_path)
    out = tmp_path / "r.html"
    out.write_text("old")
    ino = os.lstat(out).st_ino
    refused(invoke("report", t, "-o", out), "exists", "--force")
    assert out.read_text() == "old"
    res = invoke("report", t, "-o", out, "--force")
    assert res.exit_code == 0 and "wrote" in res.stdout
    assert out.read_text().startswith("<!DOCTYPE html>") and os.lstat(out).st_ino != ino  # a new file renamed in


# ----------------------------------------------------------------------------- X6: a FIFO with no writer


def test_prompts_fifo_without_a_writer_is_refused_within_seconds(tmp_path):
    """``mkfifo p; run --prompts p``: refused after FIFO_WAIT_S (5 s), not a hang in open()."""
    fifo = tmp_path / "p"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    refused(invoke("run", "--prompts", fifo), "is a FIFO with nothing written to it after 5 s")
    assert time.monotonic() - t0 < 60  # without the bound, open() never returns


def test_prompts_fifo_with_a_writer_is_read(tmp_path):
    from infertrace.cli.common import read_prompts_file

    fifo = tmp_path / "p"
    os.mkfifo(fifo)

    def writer():
        time.sleep(0.3)  # the reader is already waiting
        with open(fifo, "w") as f:
            f.write('{"prompt": "hi", "max_new_tokens": 3}\n{"prompt": "yo"}\n')

    th = threading.Thread(target=writer, daemon=True)
    th.start()
    specs = read_prompts_file(fifo, {"max_new_tokens": 5}, chat=False)
    th.join(10)
    assert [(s.text, s.params.max_new_tokens) for s in specs] == [("hi", 3), ("yo", 5)]


def test_prompts_process_substitution_pipe_is_read():
    """``--prompts <(echo ...)``: bash hands over /dev/fd/N, an anonymous pipe whose writer exists."""
    from infertrace.cli.common import read_prompts_file

    r, w = os.pipe()
    os.write(w, b'{"prompt": "abc"}\n')
    os.close(w)
    try:
        specs = read_prompts_file(Path(f"/proc/self/fd/{r}"), {"max_new_tokens": 2}, chat=False)
    finally:
        os.close(r)
    assert [s.text for s in specs] == ["abc"]


def test_prompts_device_is_refused_before_reading(tmp_path):
    dev = _chardev(tmp_path / "zeroish")
    refused(invoke("run", "--prompts", dev), "is a character device", "or a pipe")


# ----------------------------------------------------------------------------- X5: thread counts


def _no_thread_env(monkeypatch):
    for var in ("INFERTRACE_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("cmd", [["run", "-p", "hi"], ["dump-kv", "--step", "0", "-p", "hi"],
                                 ["diff-backends", "-p", "hi"]])
@pytest.mark.parametrize("value", [str(2**63), "1000000000", "1000"])
def test_threads_option_over_the_limit_is_one_line(monkeypatch, cmd, value):
    from infertrace.threads import MAX_THREADS_PER_CPU, available_cpus, max_threads

    _no_thread_env(monkeypatch)
    limit = max(MAX_THREADS_PER_CPU * available_cpus(), 8)
    assert max_threads() == limit and limit < 1000
    refused(invoke(*cmd, "--threads", value), "--threads", f"is more than {limit} threads")


@pytest.mark.parametrize("value", ["-1", "0"])
def test_threads_option_below_one_is_one_line(monkeypatch, value):
    _no_thread_env(monkeypatch)
    refused(invoke("run", "-p", "hi", "--threads", value), "--threads must be >= 1")


def test_threads_option_not_an_integer_is_a_usage_error(monkeypatch):
    _no_thread_env(monkeypatch)
    res = invoke("run", "-p", "hi", "--threads", "1e9")
    assert res.exit_code == 2 and "Traceback" not in res.stderr and "Invalid value for '--threads'" in res.stderr


@pytest.mark.parametrize("var", ["INFERTRACE_THREADS", "OMP_NUM_THREADS"])
@pytest.mark.parametrize("value, needle", [
    ("1000", "is more than"), ("1000000000", "is more than"), (str(2**63), "is more than"), ("9" * 5000, "is more than"),
    ("1e9", "is not a thread count"), ("-4", "is not a thread count"), ("4,2", "is not a thread count"),
    ("0", "must be >= 1"),
])
def test_thread_variables_are_bounded(monkeypatch, var, value, needle):
    _no_thread_env(monkeypatch)
    monkeypatch.setenv(var, value)
    refused(invoke("run", "-p", "hi"), f"{var}=", needle)


def test_huge_omp_num_threads_is_refused_before_torch_loads(tmp_path):
    """A fresh interpreter: one line, exit 2, and torch (whose libgomp reads OMP_NUM_THREADS) never imported."""
    code = ("import sys\nfrom infertrace.cli.app import main\n"
            "try:\n    main()\nfinally:\n    print('torch' in sys.modules, file=sys.stderr)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1000000000", "PYTHONPATH": str(ROOT)}
    env.pop("INFERTRACE_THREADS", None)
    p = subprocess.run([sys.executable, "-c", code, "run", "-p", "hi"], env=env, capture_output=True, text=True,
                       timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr[-2000:]
    assert lines[-1] == "False" and len(lines) == 2 and lines[0].startswith("error: OMP_NUM_THREADS= 1000000000 is more than")


# ----------------------------------------------------------------------------- G3: odd tensor names, hybrid drafts


@pytest.mark.parametrize("name", ["blk.x.attn_q.weight", "blk.", "blk.\u00b2.attn_q.weight", "blk.\u0663.attn_q.weight",
                                  "blk.1234567890.attn_q.weight"])
def test_tensor_without_a_layer_number_is_one_line_in_inspect_and_run(tmp_path, name, monkeypatch):
    """``int("x")`` / ``int("²")`` on the layer field was an internal error; an Arabic-Indic digit aliased layer 3."""
    import numpy as np

    from tests.helpers.tiny import make_weights, write_gguf

    monkeypatch.setenv("INFERTRACE_NO_CACHE", "1")
    g = write_gguf(tmp_path / "m.gguf", *make_weights(), extra_tensors={name: np.zeros(4, np.float32)})
    shown = name.removesuffix(".weight")
    refused(invoke("inspect", g), f"tensor '{shown}' has no layer number after 'blk.'")
    refused(invoke("run", "-m", g, "-p", "hi", "-n", "1"), f"tensor {shown}")


def test_layer_number_is_ascii_digits_only():
    from infertrace.model.families import FAMILIES, hf_to_engine_name, layer_number

    assert [layer_number(x) for x in ("0", "17", "x", "", "\u00b2", "\u0663", "1" * 10, "-1", " 1")] == \
        [0, 17, None, None, None, None, None, None, None]
    fam = FAMILIES["llama"]
    assert hf_to_engine_name(fam, "model.layers.\u0663.self_attn.q_proj.weight") is None
    assert hf_to_engine_name(fam, "model.layers.3.self_attn.q_proj.weight") == "blk.3.attn_q"


def test_hybrid_draft_model_runs_instead_of_an_internal_error(tmp_path):
    """G3: a hybrid (Gated DeltaNet) --draft-model used to end in AttributeError on CellsKV.state; the draft now keeps
    a hybrid memory with state checkpoints, so greedy speculative decoding gives plain greedy's tokens."""
    import json

    from tests.helpers import tiny_qwen35 as Q

    q35 = Q.write_gguf(tmp_path / "q35.gguf", *Q.make_weights())
    plain = invoke("run", "-m", q35, "-p", "hello", "-n", "6", "--save", tmp_path / "plain")
    spec = invoke("run", "-m", q35, "-p", "hello", "-n", "6", "--speculative", "draft", "--draft-model", q35,
                  "--save", tmp_path / "spec")
    assert plain.exit_code == 0, plain.output
    assert spec.exit_code == 0, spec.output
    assert "Traceback" not in spec.output

    def tokens(d):
        return json.loads((d / "trace.json").read_text())["requests"][0]["output_ids"]

    assert tokens(tmp_path / "spec") == tokens(tmp_path / "plain")


# ----------------------------------------------------------------------------- R6: what run saves, show reads


def test_tokens_per_block_over_the_schema_limit_is_refused_before_the_run(tmp_path):
    from infertrace.trace.schema import LIMITS

    d = tmp_path / "D"
    refused(invoke("run", "-p", "hi", "--backend", "paged", "--tokens-per-block", LIMITS["MAX_TOKENS_PER_BLOCK"] + 1,
                   "--save", d), f"--tokens-per-block: {LIMITS['MAX_TOKENS_PER_BLOCK'] + 1} is over the limit of "
                                 f"{LIMITS['MAX_TOKENS_PER_BLOCK']}")
    assert not d.exists()


@pytest.mark.parametrize("opt, value, needle", [
    ("--max-batch-tokens", (1 << 24) + 1, "--max-batch-tokens: 16777217 is over the limit of 16777216 tokens"),
    ("--prefill-chunk", (1 << 24) + 1, "--prefill-chunk: 16777217 is over the limit of 16777216 tokens"),
    ("--max-new-tokens", 10**9, "--max-new-tokens 1000000000 is over the limit of 16777216 tokens per request"),
])
def test_recorded_options_over_the_schema_limits_are_refused(opt, value, needle):
    from infertrace.trace.schema import LIMITS

    assert LIMITS["MAX_CTX"] == 1 << 24
    refused(invoke("run", "-p", "hi", opt, value), needle)


def test_arrival_over_max_steps_is_refused():
    refused(invoke("run", "-p", "hi", "--arrival", (1 << 20) + 1), "--arrival 1048577 is over the limit of 1048576 steps")


@pytest.mark.parametrize("n", [10**9, 2_000_000])
def test_context_shift_steps_are_bounded_before_the_run(n):
    """-n 1e9 --context-shift ran for ever; now refused up front: a trace holds at most MAX_STEPS steps."""
    t0 = time.monotonic()
    line = refused(invoke("run", "-p", "hi", "-n", n, "--context-shift"))
    assert ("is over the limit" in line) if n > 1 << 24 else \
        (f"could take up to {n} steps (with --context-shift every request generates all its --max-new-tokens), "
         "more than the 1048576 a trace holds" in line)
    assert time.monotonic() - t0 < 60


def test_step_bound_counts_context_shift_and_arrivals():
    from infertrace.cli.run_options import run_step_bound
    from infertrace.engine.drive import PromptSpec
    from infertrace.engine.options import SamplingParams

    specs = [PromptSpec("a", SamplingParams(max_new_tokens=100), 0), PromptSpec("b", SamplingParams(max_new_tokens=10), 7)]
    assert run_step_bound(specs, 32, context_shift=False) == 7 + 31 + 10  # capped by ctx_size - 1 without a shift
    assert run_step_bound(specs, 32, context_shift=True) == 7 + 100 + 10


def test_startup_estimate_is_true_under_context_shift():
    import torch

    from infertrace.engine.options import EngineOptions
    from infertrace.kv.budget import run_cost_warnings

    class Cfg:
        n_ctx_train, n_layer, n_head_kv, head_dim = 16, 2, 2, 8

    plain = run_cost_warnings(Cfg, EngineOptions(ctx_size=32), [100], torch.float32)
    shifted = run_cost_warnings(Cfg, EngineOptions(ctx_size=32, context_shift=True), [100], torch.float32)
    assert "up to 31 decode steps per request (" in plain[-1]
    assert "up to 100 decode steps per request (with --context-shift" in shifted[-1]


def test_a_run_past_max_steps_stops_with_one_line(monkeypatch):
    """The safety net behind the up-front bound: the driver stops at MAX_STEPS and says so."""
    from infertrace.engine import drive as D
    from infertrace.errors import InfertraceError as E
    from infertrace.trace import schema

    class Req:
        seq_id, status = 0, "running"

    class Eng:
        requests = {0: Req()}
        n = 0

        def add_request(self, *a):
            pass

        def step(self):
            self.n += 1
            return object()

    monkeypatch.setitem(schema.LIMITS, "MAX_STEPS", 5)
    eng = Eng()
    with pytest.raises(E, match="did not finish within 5 steps"):
        D.drive_bounded(eng, [])
    assert eng.n == 5


# ----------------------------------------------------------------------------- X9: sliding_window 0


def test_hf_mask_with_window_zero_hides_every_key():
    """The fact behind the refusal: HF's sliding-window causal mask with window 0 admits no (q, kv) pair."""
    import torch
    from transformers.masking_utils import sliding_window_causal_mask_function

    fn = sliding_window_causal_mask_function(0)
    b, h = torch.tensor(0), torch.tensor(0)
    assert not any(bool(fn(b, h, torch.tensor(q), torch.tensor(k))) for q in range(6) for k in range(6))
    fn1 = sliding_window_causal_mask_function(1)  # window 1: the query's own key only
    assert [(q, k) for q in range(4) for k in range(4) if bool(fn1(b, h, torch.tensor(q), torch.tensor(k)))] == \
        [(0, 0), (1, 1), (2, 2), (3, 3)]


def test_gemma3_gguf_sliding_window_zero_is_refused(tmp_path):
    from tests.helpers.tiny import make_weights, write_gguf

    g = write_gguf(tmp_path / "g.gguf", *make_weights(family="gemma3"), kv={"attention.sliding_window": 0})
    refused(invoke("run", "-m", g, "-p", "hi", "-n", "1"), "gemma3.attention.sliding_window", "a window of 0 keys hides every key")


@pytest.mark.parametrize("family, extra", [("gemma3", {"sliding_window": 0}), ("mistral", {"sliding_window": 0}),
                                           ("qwen2", {"use_sliding_window": True, "sliding_window": 0,
                                                      "max_window_layers": 1})])
def test_hf_sliding_window_zero_is_refused(tmp_path, family, extra):
    from tests.helpers.tiny import make_weights, write_hf

    w, s = make_weights(family=family)
    d = write_hf(tmp_path / family, w, s, **extra)
    refused(invoke("run", "-m", d, "-p", "hi", "-n", "1"), "sliding_window", "a window of 0 keys hides every key")


# ----------------------------------------------------------------------------- lower severity (item 9)


def test_teacher_force_of_other_prompts_is_refused(llama_cpp):
    golden = H.GOLDEN / "worked-example-cells"  # one request: "The capital of"
    refused(invoke("run", "--runtime", "llama.cpp", "-p", "Another prompt", "--teacher-force", golden),
            "request 0 had the prompt 'The capital of', this run has 'Another prompt'")
    refused(invoke("run", "--runtime", "llama.cpp", "-p", "The capital of", "-p", "x", "--teacher-force", golden),
            "holds 1 request(s), this run has 2")


def test_teacher_force_of_another_model_file_warns(capsys):
    from infertrace.cli.run import check_teacher_force
    from infertrace.engine.drive import PromptSpec

    golden = H.GOLDEN / "worked-example-cells"
    check_teacher_force(golden, [PromptSpec("The capital of")], Path("SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert capsys.readouterr().err == ""
    check_teacher_force(golden, [PromptSpec("The capital of")], Path("/m/other.gguf"))
    err = capsys.readouterr().err
    assert err.startswith("warning: --teacher-force") and "'SmolLM2-135M-Instruct.Q4_1.gguf'" in err and "'other.gguf'" in err


def test_n_discard_beyond_the_context_is_refused_not_clamped():
    refused(invoke("run", "-p", "hi", "--context-shift", "--n-discard", 1000, "--ctx-size", 16),
            "error: --n-discard: 1000 is more than a context shift of 16 tokens can drop (at most ctx_size - 2 - n_keep = 14)")
    refused(invoke("run", "-p", "hi", "--context-shift", "--n-keep", 4, "--n-discard", 11, "--ctx-size", 16),
            "(at most ctx_size - 2 - n_keep = 10)")


def test_n_discard_over_n_left_at_the_shift_is_refused(tmp_path):
    """The up-front bound cannot know BOS or --n-keep -1; the shift itself refuses instead of clamping."""
    from tests.helpers.tiny import make_weights, write_gguf

    g = write_gguf(tmp_path / "b.gguf", *make_weights(), add_bos=True)  # BOS: n_keep 0 keeps 1 token
    res = invoke("run", "-m", g, "-p", "hello", "-n", 20, "--ctx-size", 16, "--context-shift", "--n-discard", 14,
                 "--ignore-eos")
    refused(res, "--n-discard: 14 is more than the 13 tokens a context shift of request 0 can drop (n_past 15, n_keep 1")


@pytest.mark.parametrize("tree", ["-1,,0", "-1,0,", ",-1", "-1, ,0"])
def test_spec_tree_with_an_empty_item_is_refused(tree):
    refused(invoke("run", "-p", "hi", "--speculative", "ngram", f"--spec-tree={tree}"), "error: --spec-tree: has an empty item")


def test_num_spec_tokens_beside_spec_tree_is_refused():
    refused(invoke("run", "-p", "hi", "--speculative", "ngram", "--spec-tree=-1,0,0", "--num-spec-tokens", 5),
            "--num-spec-tokens sets a chain's length; --spec-tree gives the tree itself (3 nodes)")


def test_a_fifo_swapped_in_after_the_check_is_never_replaced(tmp_path, monkeypatch):
    """The race behind X4: the destination was a regular file when looked at, a FIFO (or device) when replaced.
    The swap (RENAME_EXCHANGE) brings the FIFO out, sees it is not the file seen before, and swaps it back."""
    out = tmp_path / "r.html"
    out.write_text("old")
    real = safe_io._classify

    def classify_then_swap(target, force, option):
        got = real(target, force, option)
        os.unlink(out)
        os.mkfifo(out)  # another process swaps the name between the check and the write
        return got

    monkeypatch.setattr(safe_io, "_classify", classify_then_swap)
    with pytest.raises(InfertraceError, match="changed while the output was being written; nothing was replaced"):
        safe_io.write_output(out, b"new", force=True)
    assert stat.S_ISFIFO(os.lstat(out).st_mode)  # (the FIFO may reuse the old inode number: the type tells them apart)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]  # the temporary file is gone, nothing else left


def test_top_k_over_max_id_is_refused_before_the_run(tmp_path):
    """SAMPLER.top_k is at most MAX_ID in the schema: a larger --top-k (or JSONL top_k) was saved, then refused by show."""
    refused(invoke("run", "-p", "hi", "--top-k", 2**40), f"--top-k {2**40} is over the limit of {2**31} (MAX_ID")
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi", "top_k": 3000000000}\n')
    refused(invoke("run", "--prompts", f), "p.jsonl line 1: 'top_k' 3000000000 is over the limit")  # the file's key, not a flag


@pytest.mark.parametrize("key", ["temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                                 "presence_penalty"])
def test_prompts_file_integer_past_float_range_is_one_line(tmp_path, key):
    """A 401-digit integer for a float field: math.isfinite raised OverflowError (an internal error)."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi", "%s": 1%s}\n' % (key, "0" * 400))
    refused(invoke("run", "--prompts", f), "must be a finite number (got an integer of 401 digits)")
