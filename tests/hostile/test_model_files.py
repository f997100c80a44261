"""Hostile model files and run options (issue 13): each is one line, exit 2, bounded time and memory.

GGUF headers are checked against the file size before gguf-py parses them (case G1 and the whole
kind: counts, lengths, types, alignment, offsets); hyper-parameters are typed strictly and bounded
by the tensors present; only regular files are read; chat templates render under limits; a context
past the trained one warns with its cost, and one over the memory bound is refused up front.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import time
import tracemalloc
from pathlib import Path

import gguf  # noqa: F401 - imported up front: the time bounds below are on the checks, not on importing gguf-py
import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from infertrace.errors import InfertraceError
from infertrace.loading.gguf_check import check_gguf_header
from infertrace.loading.weights import load_checkpoint
from tests.helpers.hostile_gguf import (ARRAY, FLOAT32, STRING, UINT8, UINT32, UINT64, arr, g1_bytes, gguf_bytes, kv,
                                patch_kv, s, tensor_info)
from tests.helpers.tiny import make_weights, write_gguf, write_hf

runner = CliRunner()


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (instead of hanging the suite) when the block runs longer than ``seconds``."""

    def boom(*_):
        raise TimeoutError(f"took longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _err(*args: str) -> str:
    with deadline(60):
        res = runner.invoke(app, list(args))
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in res.output, res.output
    return lines[0]


@pytest.fixture(scope="module")
def weights():
    return make_weights()


@pytest.fixture()
def gguf_path(tmp_path, weights):
    w, sh = weights
    return write_gguf(tmp_path / "m.gguf", w, sh)


@pytest.fixture()
def hf_dir(tmp_path, weights):
    w, sh = weights
    return write_hf(tmp_path / "hf", w, sh)


def _set_config(d: Path, **changes) -> Path:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))  # allow_nan: Infinity / NaN as Python's json writes them
    return d


# ------------------------------------------------------------------------------------------ G1


def test_g1_array_count_past_end_of_file(tmp_path):
    """Case G1 exactly: 49 bytes, ARRAY of UINT8 with count 2^62 -> one line, exit 2, < 1 s, a few MB."""
    p = tmp_path / "g1.gguf"
    p.write_bytes(g1_bytes())
    assert p.stat().st_size == 49
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(InfertraceError) as e:
        load_checkpoint(p, header_only=True)
    elapsed = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 1.0, elapsed
    assert peak < 4 << 20, peak  # bytes traced by Python and numpy while refusing the file
    assert f"claims {1 << 62} UINT8 elements" in e.value.message and "only 0 bytes are left" in e.value.message
    line = _err("inspect", str(p))
    assert "g1.gguf" in line and f"{1 << 62} UINT8" in line
    assert f"{1 << 62} UINT8" in _err("run", "-m", str(p), "-p", "hi")  # same refusal through run


# ----------------------------------------------------------------------- the whole header kind

_T16 = b"\0" * 64  # data of one F32 tensor of 16 elements
HOSTILE_HEADERS = {
    "key length past the end": (gguf_bytes([s("k", length=1 << 40) + b"k" * 16], n_kv=1), "over the limit of 4096"),
    "string value past the end": (gguf_bytes([kv("a", STRING, s(b"", length=1000))]), "needs 1000 bytes"),
    "n_kv 2^63": (gguf_bytes([], n_kv=1 << 63), "over the limit of 65536"),
    "n_tensors 10^6": (gguf_bytes([], n_tensors=10 ** 6), "over the limit of 65536"),
    "counts do not fit the file": (gguf_bytes([], n_kv=1000), "cannot fit"),
    "unknown value type": (gguf_bytes([kv("a", 13, b"")]), "unknown value type 13"),
    "array of strings past the end": (gguf_bytes([kv("a", ARRAY, arr(STRING, 1000))]), "1000 STRING elements"),
    "array of unknown items": (gguf_bytes([kv("a", ARRAY, arr(77, 1, b"\0"))]), "unknown value type 77"),
    "arrays nested too deep": (gguf_bytes([kv("a", ARRAY, arr(ARRAY, 1, arr(ARRAY, 1, arr(ARRAY, 1, arr(ARRAY, 1, arr(ARRAY, 1))))))]),
                               "deeper than the limit of 4"),
    "too many array elements": (gguf_bytes([kv("a", ARRAY, arr(UINT8, 1_100_000, b"\0" * 1_100_000))]),
                                "over the limit of 1048576"),
    "duplicate key": (gguf_bytes([kv("a", UINT8, b"\1"), kv("a", UINT8, b"\1")]), "appears twice"),
    "key not UTF-8": (gguf_bytes([s(b"\xff\xfe") + struct.pack("<I", UINT8) + b"\0"]), "not UTF-8"),
    "alignment not a power of two": (gguf_bytes([kv("general.alignment", UINT32, struct.pack("<I", 48))]),
                                     "not a power of two"),
    "alignment zero": (gguf_bytes([kv("general.alignment", UINT32, struct.pack("<I", 0))]), "not a power of two"),
    "alignment of the wrong type": (gguf_bytes([kv("general.alignment", UINT64, struct.pack("<Q", 32))]), "expected UINT32"),
    "misaligned tensor offset": (gguf_bytes([], [tensor_info("t", [16], offset=4)], _T16 + b"\0" * 32),
                                 "not a multiple of the alignment 32"),
    "tensor past the end": (gguf_bytes([], [tensor_info("t", [16])], _T16[:32]), "past the end of the file"),
    "tensor offset wraps around": (gguf_bytes([], [tensor_info("t", [16], offset=(1 << 64) - 32)], _T16),
                                   "past the end of the file"),
    "overlapping tensors": (gguf_bytes([], [tensor_info("a", [16], offset=0), tensor_info("b", [16], offset=32)], _T16 * 2),
                            "overlaps tensor 'a'"),
    "five dimensions": (gguf_bytes([], [tensor_info("t", [1, 1, 1, 1, 16])], _T16), "over the limit of 4"),
    "zero dimension": (gguf_bytes([], [tensor_info("t", [0])], _T16), "must be >= 1"),
    "unknown ggml type": (gguf_bytes([], [tensor_info("t", [16], ggml_type=99)], _T16), "unknown ggml type 99"),
    "ne[0] not a multiple of the block": (gguf_bytes([], [tensor_info("t", [16], ggml_type=2)], _T16), "block size 32"),
    "dims product beyond the file": (gguf_bytes([], [tensor_info("t", [1 << 32, 1 << 32])], _T16), "more than the whole file"),
    "tensor name too long": (gguf_bytes([], [tensor_info("t" * 100, [16])], _T16), "over the limit of 63"),
    "duplicate tensor": (gguf_bytes([], [tensor_info("t", [16]), tensor_info("t", [16], offset=64)], _T16 * 2), "appears twice"),
    "short file": (b"GGUF" + struct.pack("<I", 3) + b"\0" * 4, "shorter than a GGUF header"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_HEADERS))
def test_hostile_gguf_headers(tmp_path, case):
    data, expect = HOSTILE_HEADERS[case]
    p = tmp_path / "h.gguf"
    p.write_bytes(data)
    t0 = time.perf_counter()
    with pytest.raises(InfertraceError) as e:
        check_gguf_header(p)
    assert time.perf_counter() - t0 < 1.0
    assert expect in e.value.message, e.value.message
    assert expect in _err("inspect", str(p))


def test_valid_handmade_gguf_agrees_with_gguf_py(tmp_path):
    """The pre-pass accepts a well-formed file and finds the same data offsets gguf-py does."""
    import gguf

    data = gguf_bytes([kv("general.alignment", UINT32, struct.pack("<I", 64)), kv("a", ARRAY, arr(STRING, 2, s("x") + s("yz")))],
                      [tensor_info("a", [16], offset=0), tensor_info("b", [4, 4], offset=64)], _T16 * 2, alignment=64)
    p = tmp_path / "ok.gguf"
    p.write_bytes(data)
    facts = check_gguf_header(p)
    reader = gguf.GGUFReader(str(p))
    assert facts.alignment == 64 and facts.data_offset == reader.data_offset
    assert [facts.data_offset + t.offset for t in facts.tensors] == [t.data_offset for t in reader.tensors]
    assert [t.n_bytes for t in facts.tensors] == [int(t.n_bytes) for t in reader.tensors] == [64, 64]


def test_real_tiny_gguf_passes_the_pre_pass(gguf_path):
    facts = check_gguf_header(gguf_path)
    assert facts.n_tensors == len(load_checkpoint(gguf_path, header_only=True).tensors) == 2 + 2 * 9


# ------------------------------------------------------------------------ hyper-parameters


def test_gguf_layer_count_2_pow_31_is_refused_before_names(gguf_path):
    patch_kv(gguf_path, "llama.block_count", UINT32, struct.pack("<I", 1 << 31))
    t0 = time.perf_counter()
    line = _err("inspect", str(gguf_path))
    assert time.perf_counter() - t0 < 10
    assert "llama.block_count is 2147483648, outside the supported range 1..1024" in line


def test_gguf_layer_count_beyond_tensors_present(gguf_path):
    patch_kv(gguf_path, "llama.block_count", UINT32, struct.pack("<I", 3))
    assert "llama.block_count is 3 but the file only has tensors for 2 layer(s)" in _err("inspect", str(gguf_path))


@pytest.mark.parametrize("key, vtype, payload, expect", [
    ("llama.block_count", FLOAT32, struct.pack("<f", 2.5), "llama.block_count must be an integer, got 2.5"),
    ("llama.context_length", FLOAT32, struct.pack("<f", 256.0), "llama.context_length must be an integer, got 256.0"),
    ("llama.rope.freq_base", FLOAT32, struct.pack("<f", float("inf")), "llama.rope.freq_base is inf"),
    ("llama.rope.freq_base", FLOAT32, struct.pack("<f", float("nan")), "llama.rope.freq_base is nan"),
    ("llama.rope.freq_base", FLOAT32, struct.pack("<f", -1.0), "llama.rope.freq_base is -1; it must be > 0"),
    ("llama.attention.layer_norm_rms_epsilon", FLOAT32, struct.pack("<f", float("inf")), "layer_norm_rms_epsilon is inf"),
    ("llama.attention.layer_norm_rms_epsilon", FLOAT32, struct.pack("<f", 0.0), "it must be > 0"),
    ("llama.rope.freq_base", UINT32, struct.pack("<I", 10000), None),  # an integer theta is a number: accepted
])
def test_gguf_hyper_parameters_typed_and_finite(gguf_path, key, vtype, payload, expect):
    patch_kv(gguf_path, key, vtype, payload)
    if expect is None:
        assert load_checkpoint(gguf_path, header_only=True).config.rope_theta == 10000.0
        return
    assert expect in _err("inspect", str(gguf_path))


def test_gguf_tokenizer_of_the_wrong_type(tmp_path):
    """A token list that is not ARRAY of STRING is refused by name (not a TypeError deep inside)."""
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_array("tokenizer.ggml.tokens", [1, 2, 3])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InfertraceError) as e:
        from infertrace.loading.gguf_check import check_gguf_tokenizer_fields
        from infertrace.loading.weights import read_gguf

        check_gguf_tokenizer_fields(read_gguf(tmp_path / "t.gguf"), "t.gguf")
    assert "tokenizer.ggml.tokens must be an ARRAY of STRING" in e.value.message


@pytest.mark.parametrize("changes, expect", [
    ({"num_hidden_layers": 1 << 31}, "num_hidden_layers is 2147483648, outside the supported range 1..1024"),
    ({"num_hidden_layers": 3}, "num_hidden_layers is 3 but the file only has tensors for 2 layer(s)"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers must be an integer, got 2.5"),
    ({"num_hidden_layers": 2.0}, "num_hidden_layers must be an integer, got 2.0"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer, got True"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers must be an integer, got a string"),
    ({"hidden_size": -32}, "hidden_size is -32, outside the supported range"),
    ({"rope_theta": float("inf")}, "rope_theta is inf; it must be a finite number"),
    ({"rope_theta": float("nan")}, "rope_theta is nan"),
    ({"rope_theta": -5}, "rope_theta is -5; it must be > 0"),
    ({"rms_norm_eps": 0}, "rms_norm_eps is 0; it must be > 0"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a number, got a string"),
    ({"rope_scaling": {"type": "linear", "factor": float("inf")}}, "rope_scaling.factor is inf"),
    ({"rope_scaling": {"type": "linear", "factor": -2.0}}, "rope_scaling.factor is -2; it must be > 0"),
    ({"rope_scaling": "linear"}, "rope_scaling must be an object or null, got a string"),
    ({"max_position_embeddings": 1e30}, "max_position_embeddings must be an integer"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a list of strings"),
])
def test_hf_config_typed_strictly(hf_dir, changes, expect):
    _set_config(hf_dir, **changes)
    line = _err("inspect", str(hf_dir))
    assert "config.json has an invalid value" in line and expect in line, line


@pytest.mark.parametrize("text, expect", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"num_hidden_layers": ' + "9" * 5000 + "}", "invalid value"),
    ('{"a": 1', "not valid JSON"),
    ("\xff", "is not UTF-8 text"),
])
def test_hf_config_json_that_cannot_be_parsed(hf_dir, text, expect):
    (hf_dir / "config.json").write_text(text, encoding="latin-1")
    assert expect in _err("inspect", str(hf_dir))


# ------------------------------------------------------------------------- regular files only


def test_fifo_as_model_returns_promptly(tmp_path):
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    t0 = time.perf_counter()
    assert "not a regular file" in _err("inspect", str(fifo))
    assert "not a regular file" in _err("run", "-m", str(fifo), "-p", "hi")
    assert time.perf_counter() - t0 < 10


def test_dev_zero_as_model():
    assert Path("/dev/zero").exists(), "the hostile-file tests need Linux's /dev/zero"
    assert "not a regular file" in _err("inspect", "/dev/zero")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_fifo_inside_an_hf_directory(hf_dir, name):
    (hf_dir / name).unlink()
    os.mkfifo(hf_dir / name)
    assert "is a FIFO; only regular files are read" in _err("inspect", str(hf_dir))


# ---------------------------------------------------------------------------- chat templates


def _hf_with_template(hf_dir: Path, template: str) -> Path:
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": False, "eos_token": "<|im_end|>", "chat_template": template}))
    return hf_dir


@pytest.mark.parametrize("template, expect", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "loops ran more than the limit of 1000000 iterations"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "calls nest deeper than the limit of 64"),
    ("{% for x in [[1]] recursive %}{{ loop([[1]]) }}{% endfor %}", "calls nest deeper than the limit of 64"),
    ("{{ 'x' * 10 ** 9 }}", "over the limit of 8388608"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "over the limit of 8388608"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "the rendered prompt is over the limit of 8388608 characters"),
    ("{{ 'x' | center(1000000000) }}", "argument 1000000000 is over the template size limit"),
    ("{{ '{:999999999}'.format(1) }}", "format width or precision is over the template size limit"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
])
def test_chat_template_limits(hf_dir, template, expect):
    d = _hf_with_template(hf_dir, template)
    t0 = time.perf_counter()
    line = _err("run", "-m", str(d), "-p", "hi", "--chat", "-n", "1")
    assert time.perf_counter() - t0 < 30
    assert "chat template failed" in line and expect in line, line


def test_chat_template_deadline_and_unchanged_output():
    """The deadline names its limit; a template using loops, recursion and macros renders exactly as
    jinja2's own sandbox renders it."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from infertrace.tokenizer.template_limits import LimitedSandbox, TemplateLimitError

    slow = LimitedSandbox(seconds=0.2, iterations=10 ** 12)
    with pytest.raises(TemplateLimitError, match="longer than the limit of 0.2 s"):
        slow.render(slow.from_string("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"))
    src = ("{% macro m(x) %}[{{ x }}]{% endmacro %}{% set ns = namespace(n=0) %}"
           "{% for msg in messages %}{% set ns.n = ns.n + 1 %}{{ loop.index }}:{{ m(msg['role']) }}{{ msg['content'] | trim }}"
           "{% if not loop.last %}|{% endif %}{% endfor %}"
           "{% for x in tree recursive %}<{{ x.name }}{{ loop(x.kids) if x.kids }}>{% endfor %}{{ ns.n }}{{ '%05d' % 7 }}{{ 'a' ~ 'b' }}")
    ctx = {"messages": [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}],
           "tree": [{"name": "r", "kids": [{"name": "k", "kids": []}]}]}
    env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True)
    ref = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    assert env.render(env.from_string(src), **ctx) == ref.from_string(src).render(**ctx) == "1:[user]hi|2:[assistant]yo<r<k>>200007ab"


# ------------------------------------------------------------------------------ run options


def test_ctx_size_beyond_trained_context_warns_with_cost(gguf_path):
    """tiny model: n_ctx_train 256, 2 layers, 2 KV heads x head_dim 8. K+V per layer at 1000 cells in
    float32 = 2 * 1000 * 2 * 8 * 4 = 128000 bytes = 125.0 KiB; 2 layers = 250.0 KiB."""
    with deadline(120):
        res = runner.invoke(app, ["run", "-m", str(gguf_path), "-p", "hi", "-n", "2", "--ctx-size", "1000"])
    assert res.exit_code == 0, res.output
    warn = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert warn == ["warning: --ctx-size 1000 is beyond the model's trained context (256 tokens): positions past 256 "
                    "were never trained; the KV cache takes 125.0 KiB per layer x 2 layers = 250.0 KiB at float32"]
    with deadline(120):
        res = runner.invoke(app, ["run", "-m", str(gguf_path), "-p", "hi", "-n", "300", "--ctx-size", "300", "--json"])
    assert res.exit_code == 0, res.output
    warn = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert any("--max-new-tokens 300 is beyond the model's trained context (256 tokens): up to 299 decode steps" in w
               for w in warn), warn
    json.loads(res.stdout)  # stdout stays pure JSON
    with deadline(120):
        res = runner.invoke(app, ["run", "-m", str(gguf_path), "-p", "hi", "-n", "2"])  # default ctx: no warning
    assert res.exit_code == 0 and "warning:" not in res.stderr, res.stderr


def test_absurd_ctx_size_refused_up_front(gguf_path, monkeypatch):
    assert "error: --ctx-size: 16777217 is over the limit of 16777216 tokens" in _err(
        "run", "-m", str(gguf_path), "-p", "hi", "--ctx-size", str((1 << 24) + 1))
    assert "over the limit of 16777216 tokens" in _err(
        "run", "-m", str(gguf_path), "-p", "hi", "--backend", "paged", "--num-blocks", str(1 << 20), "--tokens-per-block", "32")
    import infertrace.kv.budget as budget

    monkeypatch.setattr(budget, "memory_limit_bytes", lambda device="cpu": 1 << 20)
    # K+V at 10000 cells: 2 * 10000 * 2 kv heads * 8 * 4 bytes = 1280000 B = 1.2 MiB per layer, x 2 layers = 2560000 B;
    # cells also keep pos (8 B) and 64 seq_id flags per cell: 10000 * 72 = 720000 B = 703.1 KiB; total 3280000 B = 3.1 MiB
    line = _err("run", "-m", str(gguf_path), "-p", "hi", "--ctx-size", "10000")
    assert ("KV cache for 10000 tokens would take 3.1 MiB (1.2 MiB per layer x 2 layers at float32 + 703.1 KiB of cell "
            "bookkeeping), over the limit of 1.0 MiB") in line, line


@pytest.mark.parametrize("factors, expect", [
    ((1.0,) * 3, "rope_freqs.weight has 3 entries but the rotary dimension 8 needs 4"),
    ((1.0, float("inf"), 1.0, 1.0), "non-finite or non-positive frequency divisor"),
    ((1.0, 0.0, 1.0, 1.0), "non-finite or non-positive frequency divisor"),
])
def test_rope_freq_factors_checked(gguf_path, factors, expect):
    """GGUF ``rope_freqs.weight`` must hold rope_dim / 2 finite positive divisors (else garbage RoPE or a
    shape error mid-run)."""
    import dataclasses

    cfg = load_checkpoint(gguf_path, header_only=True).config
    with pytest.raises(InfertraceError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(cfg, rope_freq_factors=factors).validate()


@pytest.mark.parametrize("content, expect", [
    ("[" * 100_000 + "\n", "line 1: not valid JSON (nested too deeply or a number too long)"),
    ('{"prompt": "hi", "seed": ' + "9" * 5000 + "}\n", "line 1: not valid JSON (nested too deeply or a number too long)"),
])
def test_prompts_file_hostile_json(gguf_path, tmp_path, content, expect):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    assert expect in _err("run", "-m", str(gguf_path), "--prompts", str(f))


def test_prompts_file_is_read_with_a_bound():
    """--prompts accepts pipes (``<(cmd)``) but refuses a device such as /dev/zero (issue 23, X6:
    a device may never end or never answer) before reading a byte of it."""
    assert Path("/dev/zero").exists(), "the hostile-file tests need Linux's /dev/zero"

    assert "/dev/zero is a character device; give the --prompts JSONL file itself or a pipe" in _err(
        "run", "-p", "x", "--prompts", "/dev/zero")
