"""Fuzz targets for the trace reader and each trace consumer (issue 13, hypothesis).

Inputs: a golden trace (fixtures/golden, or a schema 1 one of fixtures/traces/v1, read through the
upgrade) with a few mutations drawn by hypothesis — a leaf
replaced by another type or an extreme value (huge/negative integers, NaN/inf, 10^400, long,
control-character or markup strings, nested lists), keys deleted or added, lists truncated,
duplicated or emptied — serialised, then sometimes cut short, deeply nested or given an integer
literal longer than Python's int-string limit.

Invariant for every target: success, or exit 2 with one ``error:`` line (the reader: returns or
raises InfertraceError); never another exit code, an internal error, a traceback, or more than
TIME_BOUND_S seconds. Run longer: ``INFERTRACE_FUZZ_EXAMPLES=2000 INFERTRACE_FUZZ_RANDOM=1
pytest tests/fuzz -q`` (see tests/fuzz/README.md).
"""

from __future__ import annotations

import copy
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import pytest
from tests.fuzz.fuzzkit import check_cli_result, fuzz_settings, record
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from infertrace.cli.app import app

from tests.helpers.hostile import active_content  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "golden"
NAMES = ["worked-example-cells", "worked-example-paged", "batching-cells", "batching-paged"]
V1 = GOLDEN.parent / "traces" / "v1"
BASE = {n: json.loads((GOLDEN / n / "trace.json").read_text(encoding="utf-8")) for n in NAMES}
#: schema 1 traces (upgraded in memory by the reader): "v1/<golden name>"
BASE.update({f"v1/{n}": json.loads((V1 / n / "trace.json").read_text(encoding="utf-8"))
             for n in ("worked-example-cells", "batching-paged")})
NAMES = list(BASE)
BAD_TERMINAL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _paths(x: Any, path: tuple = ()) -> list[tuple]:
    """Every path to a value (containers included), in document order."""
    out = [path]
    if isinstance(x, dict):
        for k, v in x.items():
            out += _paths(v, path + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out += _paths(v, path + (i,))
    return out


PATHS = {n: _paths(d)[1:] for n, d in BASE.items()}

extreme_ints = st.sampled_from([-1, 0, 1, 2 ** 31, 2 ** 63, 2 ** 64 + 1, -(2 ** 63), 10 ** 30, 10 ** 400])
strings = st.one_of(st.text(max_size=40), st.sampled_from([
    "", "\x1b]52;c;SGVsbG8=\x07", "\x1b[2J", "\x9b31m", "[bold]x[/bold]", "[/]", "</script><script>alert(1)</script>",
    "0\" onmouseover=\"x", "0..999999999", "-", "1..0", "cells", "paged", "prefill", "decode", "nan", "x" * 5000]))
values = st.one_of(extreme_ints, st.floats(allow_nan=True, allow_infinity=True), strings, st.booleans(), st.none(),
                   st.lists(st.integers(-5, 10 ** 6), max_size=6), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
                   st.just([[[[]]]]), st.integers(-10 ** 9, 10 ** 12))


def _get(d: Any, path: tuple) -> Any:
    for k in path:
        d = d[k]
    return d


@st.composite
def mutated_trace(draw) -> tuple[str, bytes]:
    name = draw(st.sampled_from(NAMES))
    d = copy.deepcopy(BASE[name])
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(d)[1:]
        path = paths[draw(st.integers(0, len(paths) - 1))]
        parent, key = _get(d, path[:-1]), path[-1]
        op = draw(st.sampled_from(["same_type"] * 6 + ["replace", "replace", "delete", "add_key", "list_len"]))
        try:
            cur = parent[key]
        except (KeyError, IndexError, TypeError):
            continue
        if op == "same_type" and isinstance(cur, bool):
            parent[key] = not cur
        elif op == "same_type" and isinstance(cur, int):
            parent[key] = draw(st.one_of(extreme_ints, st.integers(-3, 3 * max(3, abs(cur)))))
        elif op == "same_type" and isinstance(cur, float):
            parent[key] = draw(st.floats(allow_nan=True, allow_infinity=True))
        elif op == "same_type" and isinstance(cur, str):
            parent[key] = draw(strings)
        elif op in ("replace", "same_type"):
            parent[key] = draw(values)
        elif op == "delete":
            del parent[key]
        elif op == "add_key" and isinstance(cur, dict):
            cur[draw(strings)] = draw(values)
        elif op == "list_len" and isinstance(cur, list):
            how = draw(st.sampled_from(["empty", "drop_last", "dup", "many"]))
            if how == "empty":
                cur.clear()
            elif how == "drop_last" and cur:
                cur.pop()
            elif how == "dup" and cur:
                cur.append(copy.deepcopy(cur[-1]))
            elif how == "many" and cur and not isinstance(cur[0], (dict, list)):
                cur.extend([cur[0]] * draw(st.integers(1, 3000)))
    text = json.dumps(d, allow_nan=True)
    tail = draw(st.sampled_from(["none"] * 6 + ["truncate", "deep", "longint"]))
    if tail == "truncate":
        text = text[: draw(st.integers(0, len(text)))]
    elif tail == "deep":
        n = draw(st.sampled_from([50, 2000, 100000]))
        text = text.replace('"notes": [', '"notes": [' + "[" * n + "]" * n + ",", 1)
    elif tail == "longint":
        v = f'"schema_version": {d.get("schema_version")}' if isinstance(d, dict) else '"schema_version": 2'
        text = text.replace(v, v + ', "x": ' + "7" * 5000, 1)
    return name, text.encode("utf-8")


def _write(tmp: Path, data: bytes) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "trace.json").write_bytes(data)
    return tmp


_counter = iter(range(10 ** 9))


def _fresh(tmp_path: Path) -> Path:
    return tmp_path / f"f{next(_counter)}"


def invoke(*args: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    res = CliRunner().invoke(app, [str(a) for a in args])
    return res, time.monotonic() - t0


@fuzz_settings()
@given(mutated_trace())
def test_fuzz_trace_reader(tmp_path, case):
    from infertrace.errors import InfertraceError
    from infertrace.trace.store import load_saved

    _, data = case
    d = _write(_fresh(tmp_path), data)
    t0 = time.monotonic()
    try:
        load_saved(d)
        record("trace reader", "accepted")
    except InfertraceError as e:
        assert "\n" not in e.message
        record("trace reader", "refused (InfertraceError)")
    assert time.monotonic() - t0 < 20


def _step_of(data: bytes) -> int:
    m = re.search(rb'"step": (\d+)', data)
    return int(m.group(1)) if m else 0


@pytest.mark.parametrize("command", ["show", "report", "diff", "dump-kv", "export"])
def test_fuzz_consumers(tmp_path, command):
    @fuzz_settings()
    @given(mutated_trace())
    def run(case):
        name, data = case
        d = _write(_fresh(tmp_path), data)
        args = {"show": ["show", d], "report": ["report", d, "-o", d / "r.html"],
                "diff": ["diff", GOLDEN / name.rsplit("/", 1)[-1], d], "dump-kv": ["dump-kv", "--step", _step_of(data), d],
                "export": ["export", d, "-o", d.parent / f"{d.name}-p.json", "--force"]}[command]
        res, elapsed = invoke(*args)
        check_cli_result(command, res, elapsed, ok=(0, 1) if command == "diff" else (0,))
        out = res.stdout + res.stderr
        assert BAD_TERMINAL.search(out) is None, repr(out[:300])
        if command == "report" and res.exit_code == 0:
            html = (d / "r.html").read_text(encoding="utf-8")
            a = active_content(html)
            assert not a.handlers and not a.loaders and len(a.scripts) == 2, (a.handlers[:2], a.loaders[:2])
        if command == "export" and res.exit_code == 0:  # strict JSON, ASCII (present/perfetto.py)
            raw = (d.parent / f"{d.name}-p.json").read_bytes()
            assert raw.isascii() and isinstance(json.loads(raw)["traceEvents"], list)

    run()
