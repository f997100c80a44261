"""Fuzz target: the HF model-directory reader (``config.json``, ``tokenizer_config.json``) and
``infertrace inspect`` on a tiny HF directory whose JSON files are hostile.

Inputs: the tiny directory of tests/tiny.py with (a) fields of ``config.json`` replaced by hostile
values (huge / negative / non-integer numbers, Infinity, NaN, bools, strings, nulls, lists,
objects, deep nesting) or deleted, (b) the JSON text truncated, byte-flipped, or replaced by deep
nesting / over-long integers, (c) ``tokenizer_config.json`` fields replaced the same way.

Invariant: :func:`load_checkpoint` returns or raises :class:`InfertraceError`; ``infertrace inspect
--json`` exits 0 (stdout is JSON) or 2 with one ``error:`` line, and so does ``infertrace run`` on a
directory the loader accepted; each example finishes within
``EXAMPLE_SECONDS``; peak RSS grows by less than ``RSS_GROWTH_MB`` over the run.

Examples per test: ``INFERTRACE_FUZZ_EXAMPLES`` (default 25); ``INFERTRACE_FUZZ_STATS=FILE`` appends
outcome counts as JSON lines. Run longer, e.g.::

    INFERTRACE_FUZZ_EXAMPLES=2000 python -m pytest -q -p no:cacheprovider tests/fuzz/test_fuzz_hf_config.py
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import resource
import signal
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from infertrace.cli.app import app  # noqa: E402
from infertrace.errors import InfertraceError  # noqa: E402
from infertrace.model.weights import load_checkpoint  # noqa: E402
from tests.tiny import make_weights, write_hf  # noqa: E402

EXAMPLES = int(os.environ.get("INFERTRACE_FUZZ_EXAMPLES", "25"))
EXAMPLE_SECONDS = 20
RSS_GROWTH_MB = 1024
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))

_RUN = CliRunner()
_STATS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
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


@contextlib.contextmanager
def _time_bound(seconds: int):
    def boom(*_):
        raise TimeoutError(f"example ran longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.fixture(scope="module")
def hf_dir() -> Path:
    w, sh = make_weights(n_layer=1, H=16, n_head=2, n_kv=1, head_dim=8, ff=16)
    return write_hf(_DIR / "hf", w, sh)


@pytest.fixture(scope="module")
def originals(hf_dir) -> dict[str, str]:
    return {n: (hf_dir / n).read_text() for n in ("config.json", "tokenizer_config.json")}


@pytest.fixture(scope="module", autouse=True)
def _report():
    rss0 = _rss_mb()
    yield
    assert _rss_mb() - rss0 < RSS_GROWTH_MB, f"peak RSS grew by {_rss_mb() - rss0:.0f} MB"
    out = os.environ.get("INFERTRACE_FUZZ_STATS")
    if out:
        with open(out, "a") as fh:
            for name, c in _STATS.items():
                fh.write(json.dumps({"target": name, **c}) + "\n")


def _check(name: str, d: Path, files: dict[str, str | bytes], originals: dict[str, str], header_only: bool, cli: bool) -> None:
    _STATS[name]["examples"] += 1
    for fn, text in files.items():
        (d / fn).write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    try:
        with _time_bound(EXAMPLE_SECONDS):
            try:
                load_checkpoint(d, header_only=header_only)
                _STATS[name]["loaded"] += 1
                if cli:  # a file the loader accepts must also run (or be refused) with one line
                    res = _RUN.invoke(app, ["run", "-m", str(d), "-p", "hi", "-n", "2", "--ctx-size", "64", "--json"])
                    assert res.exit_code in (0, 2), res.output
                    if res.exit_code == 2:
                        assert [ln for ln in res.output.splitlines() if ln.strip()][-1].startswith("error:"), res.output
                    _STATS[name][f"run exit {res.exit_code}"] += 1
            except InfertraceError as e:
                assert e.exit_code == 2 and "\n" not in e.message.strip()
                _STATS[name]["refused (InfertraceError)"] += 1
            if cli:
                res = _RUN.invoke(app, ["inspect", "--json", str(d)])
                assert res.exit_code in (0, 2), res.output
                if res.exit_code == 0:
                    json.loads(res.stdout)
                    _STATS[name]["cli exit 0"] += 1
                else:
                    lines = [ln for ln in res.output.splitlines() if ln.strip()]
                    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
                    _STATS[name]["cli exit 2"] += 1
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
