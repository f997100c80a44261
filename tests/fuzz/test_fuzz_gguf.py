"""Fuzz target: the GGUF reader (header pre-pass, gguf-py, config, tokenizer, dequantisation) and
``infertrace inspect`` on hostile GGUF files.

Inputs: a tiny valid GGUF written with gguf-py's GGUFWriter (tests/helpers/tiny.py), then truncated,
bit-flipped, or with a u32/u64 overwritten by an interesting value (0, 1, 2^31, 2^62, 2^64-1 ...);
and structured hostile headers built byte by byte (tests/helpers/hostile_gguf.py) with arbitrary counts,
lengths, value types, dims, ggml types and offsets.

Invariant: :func:`load_checkpoint` returns or raises :class:`InfertraceError` (no other
exception); ``infertrace inspect --json`` exits 0 (stdout is JSON) or 2 with one ``error:`` line,
and so does ``infertrace run`` on a file the loader accepted;
each example finishes within ``fuzzkit.TIME_BOUND_S`` (SIGALRM) and the process' peak RSS grows by less
than ``fuzzkit.RSS_GROWTH_MB`` over the module.

Settings, the CLI invariant, the time bound and the RSS guard are :mod:`fuzzkit`'s
(``INFERTRACE_FUZZ_EXAMPLES``, default 25 inputs per test; ``INFERTRACE_FUZZ_REPORT=FILE`` writes the
outcome counts; see tests/fuzz/README.md). Run longer, e.g.::

    INFERTRACE_FUZZ_EXAMPLES=2000 python -m pytest -q -p no:cacheprovider tests/fuzz/test_fuzz_gguf.py
"""

from __future__ import annotations

import json
import struct
import tempfile
import time
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from tests.fuzz.fuzzkit import check_cli_result, fuzz_settings, record, time_bound  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from infertrace.cli.app import app  # noqa: E402
from infertrace.errors import InfertraceError  # noqa: E402
from infertrace.loading.weights import load_checkpoint  # noqa: E402
from tests.helpers.hostile_gguf import arr, gguf_bytes, kv, s, tensor_info  # noqa: E402
from tests.helpers.tiny import make_weights, write_gguf  # noqa: E402

SETTINGS = fuzz_settings()
INTERESTING = [0, 1, 2, 3, 31, 32, 33, 63, 64, 255, 1 << 15, 1 << 16, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32,
               1 << 40, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 32, (1 << 64) - 1]

_RUN = CliRunner()
_DIR = Path(tempfile.mkdtemp(prefix="infertrace-fuzz-gguf-"))
_N = [0]


@pytest.fixture(scope="module")
def seed() -> bytes:
    w, sh = make_weights(n_layer=1, H=16, n_head=2, n_kv=1, head_dim=8, ff=16)
    return write_gguf(_DIR / "seed.gguf", w, sh).read_bytes()


def _check(name: str, data: bytes, header_only: bool, cli: bool) -> None:
    """The invariant, for one input file."""
    _N[0] += 1
    p = _DIR / f"x{_N[0]}.gguf"  # a fresh name: nothing can be served from a cache keyed by path
    p.write_bytes(data)
    try:
        with time_bound():
            try:
                load_checkpoint(p, header_only=header_only)
                record(f"{name}: loader", "loaded")
                if cli:  # a file the loader accepts must also run (or be refused) with one line
                    t0 = time.perf_counter()
                    res = _RUN.invoke(app, ["run", "-m", str(p), "-p", "hi", "-n", "2", "--ctx-size", "64", "--json"])
                    check_cli_result(f"{name}: run", res, time.perf_counter() - t0)
            except InfertraceError as e:
                assert e.exit_code == 2 and "\n" not in e.message.strip()
                record(f"{name}: loader", "refused (InfertraceError)")
            if cli:
                t0 = time.perf_counter()
                res = _RUN.invoke(app, ["inspect", "--json", str(p)])
                check_cli_result(f"{name}: inspect --json", res, time.perf_counter() - t0)
                if res.exit_code == 0:
                    json.loads(res.stdout)
    finally:
        p.unlink()


@SETTINGS
@given(data=st.data())
def test_fuzz_mutated_gguf(seed, data):
    """Truncate, flip bits or overwrite integers of a valid tiny GGUF."""
    raw = bytearray(seed)
    kind = data.draw(st.sampled_from(["truncate", "bitflip", "int"]), label="kind")
    if kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="cut")]
    elif kind == "bitflip":
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            i = data.draw(st.integers(0, len(raw) - 1), label="at")
            raw[i] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    else:
        for _ in range(data.draw(st.integers(1, 3), label="writes")):
            width = data.draw(st.sampled_from([4, 8]), label="width")
            i = data.draw(st.integers(0, len(raw) - width), label="at")
            v = data.draw(st.sampled_from(INTERESTING), label="value") % (1 << (8 * width))
            raw[i:i + width] = v.to_bytes(width, "little")
    _check("mutated GGUF", bytes(raw), header_only=data.draw(st.booleans(), label="header_only"),
           cli=data.draw(st.booleans(), label="cli"))


_u64 = st.one_of(st.sampled_from(INTERESTING), st.integers(0, (1 << 64) - 1))
_u32 = st.one_of(st.sampled_from([x for x in INTERESTING if x < 1 << 32]), st.integers(0, (1 << 32) - 1))
_key = st.one_of(st.sampled_from(["general.alignment", "general.architecture", "llama.block_count",
                                  "tokenizer.ggml.tokens", "tokenizer.ggml.model", "a"]),
                 st.binary(min_size=0, max_size=8).map(lambda b: b.decode("latin-1")))


@st.composite
def _value(draw, depth: int = 0):
    """(value type, payload) with payloads that may lie about their length or count."""
    vtype = draw(st.integers(0, 13))
    if vtype in (0, 1, 7):
        return vtype, draw(st.binary(min_size=0, max_size=1))
    if vtype in (2, 3):
        return vtype, draw(st.binary(min_size=0, max_size=2))
    if vtype in (4, 5, 6):
        return vtype, struct.pack("<I", draw(_u32))
    if vtype in (10, 11, 12):
        return vtype, struct.pack("<Q", draw(_u64))
    if vtype == 8:
        body = draw(st.binary(max_size=16))
        return vtype, s(body, length=draw(st.one_of(st.just(len(body)), _u64)))
    if vtype == 9 and depth < 3:
        itype, item = draw(_value(depth + 1))
        count = draw(st.one_of(st.integers(0, 4), _u64))
        return vtype, arr(itype, count, item * min(count, 4))
    return vtype, draw(st.binary(max_size=8))


@st.composite
def _header(draw):
    kvs = [kv(draw(_key), *draw(_value())) for _ in range(draw(st.integers(0, 4)))]
    tensors = []
    for i in range(draw(st.integers(0, 3))):
        dims = draw(st.lists(st.one_of(st.integers(0, 64), _u64), min_size=0, max_size=5))
        tensors.append(tensor_info(draw(st.sampled_from([f"t{i}", "token_embd.weight", f"blk.{i}.attn_q.weight"])), dims,
                                   draw(st.one_of(st.sampled_from([0, 1, 2, 8, 12]), _u32)),
                                   draw(st.one_of(st.sampled_from([0, 32, 64, 4]), _u64)),
                                   n_dims=draw(st.one_of(st.none(), _u32))))
    n_kv = draw(st.one_of(st.none(), _u64))
    n_tensors = draw(st.one_of(st.none(), _u64))
    return gguf_bytes(kvs, tensors, draw(st.binary(max_size=256)), n_kv=n_kv, n_tensors=n_tensors,
                      version=draw(st.sampled_from([3, 3, 3, 2, 1, 4])))


@SETTINGS
@given(data=_header(), cli=st.booleans())
def test_fuzz_structured_hostile_header(data, cli):
    """Headers built byte by byte: counts, lengths, types, dims and offsets are anything."""
    _check("structured GGUF header", data, header_only=True, cli=cli)
