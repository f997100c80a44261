"""Fuzz target: the HF model-directory reader (``config.json``, ``tokenizer_config.json``) and
``infertrace inspect`` on a tiny HF directory whose JSON files are hostile.

Inputs: the tiny directory of tests/helpers/tiny.py with (a) fields of ``config.json`` replaced by hostile
values (huge / negative / non-integer numbers, Infinity, NaN, bools, strings, nulls, lists,
objects, deep nesting) or deleted, (b) the JSON text truncated, byte-flipped, or replaced by deep
nesting / over-long integers, (c) ``tokenizer_config.json`` fields replaced the same way.

Invariant: :func:`load_checkpoint` returns or raises :class:`InfertraceError`; ``infertrace inspect
--json`` exits 0 (stdout is JSON) or 2 with one ``error:`` line, and so does ``infertrace run`` on a
directory the loader accepted; each example finishes within
``fuzzkit.TIME_BOUND_S`` (SIGALRM); peak RSS grows by less than ``fuzzkit.RSS_GROWTH_MB`` over the module.

Settings, the CLI invariant, the time bound and the RSS guard are :mod:`fuzzkit`'s
(``INFERTRACE_FUZZ_EXAMPLES``, default 25 inputs per test; ``INFERTRACE_FUZZ_REPORT=FILE`` writes the
outcome counts; see tests/fuzz/README.md). Run longer, e.g.::

    INFERTRACE_FUZZ_EXAMPLES=2000 python -m pytest -q -p no:cacheprovider tests/fuzz/test_fuzz_hf_config.py
"""

from __future__ import annotations

import json
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
from tests.helpers.tiny import make_weights, write_hf  # noqa: E402

SETTINGS = fuzz_settings()

_RUN = CliRunner()
_DIR = Path(tempfile.mkdtemp(prefix="infertrace-fuzz-hf-"))

CONFIG_FIELDS = ["num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
                 "architectures", "model_type", "rope_scaling", "rope_parameters", "sliding_window", "_name_or_path",
                 "attention_bias", "torch_dtype"]
TOKENIZER_FIELDS = ["add_bos_token", "bos_token", "eos_token", "unk_token", "pad_token", "chat_template"]

_scalar = st.one_of(
    st.sampled_from([0, 1, 2, 3, -1, 2.5, 2.0, 1 << 31, 1 << 62, 10 ** 30, float("inf"), float("-inf"), float("nan"),
                     1e308, -0.0, 1e-300, True, False, None, "", "2", "llama", "LlamaForCausalLM", "linear", "llama3"]),
    st.integers(), st.floats(), st.text(max_size=8))
_value = st.recursive(_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(["type", "rope_type", "factor", "low_freq_factor",
                                                                  "high_freq_factor", "original_max_position_embeddings",
                                                                  "rope_theta", "content"]), inner, max_size=4)),
    max_leaves=8)


@pytest.fixture(scope="module")
def hf_dir() -> Path:
    w, sh = make_weights(n_layer=1, H=16, n_head=2, n_kv=1, head_dim=8, ff=16)
    return write_hf(_DIR / "hf", w, sh)


@pytest.fixture(scope="module")
def originals(hf_dir) -> dict[str, str]:
    return {n: (hf_dir / n).read_text() for n in ("config.json", "tokenizer_config.json")}


def _check(name: str, d: Path, files: dict[str, str | bytes], originals: dict[str, str], header_only: bool, cli: bool) -> None:
    """The invariant, for the directory ``d`` with ``files`` replaced (restored afterwards)."""
    for fn, text in files.items():
        (d / fn).write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    try:
        with time_bound():
            try:
                load_checkpoint(d, header_only=header_only)
                record(f"{name}: loader", "loaded")
                if cli:  # a file the loader accepts must also run (or be refused) with one line
                    t0 = time.perf_counter()
                    res = _RUN.invoke(app, ["run", "-m", str(d), "-p", "hi", "-n", "2", "--ctx-size", "64", "--json"])
                    check_cli_result(f"{name}: run", res, time.perf_counter() - t0)
            except InfertraceError as e:
                assert e.exit_code == 2 and "\n" not in e.message.strip()
                record(f"{name}: loader", "refused (InfertraceError)")
            if cli:
                t0 = time.perf_counter()
                res = _RUN.invoke(app, ["inspect", "--json", str(d)])
                check_cli_result(f"{name}: inspect --json", res, time.perf_counter() - t0)
                if res.exit_code == 0:
                    json.loads(res.stdout)
    finally:
        for fn, text in originals.items():
            (d / fn).write_text(text)


@SETTINGS
@given(changes=st.dictionaries(st.sampled_from(CONFIG_FIELDS), st.one_of(_value, st.just("<delete>")), min_size=1, max_size=4),
       header_only=st.booleans(), cli=st.booleans())
def test_fuzz_config_fields(hf_dir, originals, changes, header_only, cli):
    """Fields of config.json replaced by hostile values or deleted."""
    cfg = json.loads(originals["config.json"])
    for k, v in changes.items():
        if v == "<delete>":
            cfg.pop(k, None)
        else:
            cfg[k] = v
    _check("config.json fields", hf_dir, {"config.json": json.dumps(cfg)}, originals, header_only, cli)


@SETTINGS
@given(data=st.data(), cli=st.booleans())
def test_fuzz_json_text(hf_dir, originals, data, cli):
    """config.json / tokenizer_config.json text truncated, byte-flipped, deeply nested, or with huge integers."""
    fn = data.draw(st.sampled_from(["config.json", "tokenizer_config.json"]), label="file")
    raw = bytearray(originals[fn].encode())
    kind = data.draw(st.sampled_from(["truncate", "flip", "nest", "bigint", "field"]), label="kind")
    if kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw)), label="cut")]
    elif kind == "flip":
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            i = data.draw(st.integers(0, len(raw) - 1), label="at")
            raw[i] = data.draw(st.integers(0, 255), label="byte")
    elif kind == "nest":
        n = data.draw(st.sampled_from([10, 1000, 100_000]), label="depth")
        raw = bytearray(("[" * n + "]" * n).encode() if data.draw(st.booleans(), label="list") else ('{"a":' * n + "1" + "}" * n).encode())
    elif kind == "bigint":
        obj = json.loads(originals[fn])
        key = data.draw(st.sampled_from(CONFIG_FIELDS if fn == "config.json" else TOKENIZER_FIELDS), label="key")
        raw = bytearray(json.dumps(obj)[:-1].encode() + f', "{key}": {"9" * data.draw(st.sampled_from([20, 5000]), label="digits")}}}'.encode())
    else:
        obj = json.loads(originals[fn])
        key = data.draw(st.sampled_from(CONFIG_FIELDS if fn == "config.json" else TOKENIZER_FIELDS), label="key")
        obj[key] = data.draw(_value, label="value")
        raw = bytearray(json.dumps(obj).encode())
    _check(f"{fn} text", hf_dir, {fn: bytes(raw)}, originals, header_only=data.draw(st.booleans(), label="header_only"), cli=cli)
