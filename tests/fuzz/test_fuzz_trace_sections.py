"""Fuzz targets for the newer trace sections (issue 23: Gemma 3 sliding window, speculative verify
rows, hybrid layer map, the display fields), on real traces the tool writes with tiny models
(tests/helpers/tiny.py, tests/helpers/tiny_qwen35.py).

Inputs: one of three saved traces (Gemma 3 windowed cells run, speculative draft-tree cells run,
Qwen3.5 hybrid paged run) with 1..3 mutations drawn by hypothesis, each at a path inside
``mask.swa``, a row's ``visible`` / ``visible_swa`` / ``spec`` / ``cache_*``, ``hidden.rows``,
``hybrid`` or the config's ``sliding_window`` / ``swa_layers`` / ``layer_types`` / ``n_layer``: a
value of the same type (another int, a flipped mask entry, a range text), another type, a deletion
or a list made shorter or longer.

Invariants: ``check`` exits 0, 1 (one ``violation:`` line) or 2 (one ``error:`` line), ``show``
exits 0 or 2, never an internal error, a traceback, a control byte or more than the time bound;
and a mutation that changes a value ``check`` recomputes from the trace's own facts (a windowed
query's keys, a verify node's cell, the window size and its layers, a cache range, a hidden row's
token, a layer type) never passes ``check``.
"""

from __future__ import annotations

import copy
import json
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

from tests.helpers.tiny import make_weights, write_gguf  # noqa: E402
from tests.helpers.tiny_qwen35 import make_weights as make_q35, write_hf_dir  # noqa: E402

BAD_TERMINAL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
KINDS = ("gemma", "spec", "hybrid")
#: paths (joined with "/", list indices as "#") of the values check recomputes from other facts
DERIVED = re.compile(r"steps/#/batch/#/(visible_swa/#|visible/#|spec/cells/#|cache_before|cache_after)"
                     r"|steps/#/mask/swa/(n_swa|layers/#|global_layers/#)"
                     r"|steps/#/hidden/rows/#/(token_id|pos|seq_id)"
                     r"|config/(sliding_window|layer_types/#|swa_layers/#)")
SECTIONS = re.compile(r"steps/#/(mask/swa|batch/#/(visible|visible_swa|spec|cache_before|cache_after)|hidden/rows|hybrid)"
                      r"|config/(sliding_window|swa_layers|layer_types|n_layer)")


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("sections")
    w, s = make_weights(family="gemma3", n_layer=6, seed=5)
    g = write_gguf(root / "g.gguf", w, s, kv={"attention.sliding_window": 4})
    w, s = make_weights(seed=5, n_layer=3)
    ll = write_gguf(root / "l.gguf", w, s)
    w, s = make_q35(seed=2)
    q = write_hf_dir(root / "q35", w, s)
    runs = {"gemma": [g, "-p", "abcdefgh", "-p", "xyz", "-n", "2"],
            "spec": [ll, "-p", "abcabcabcabcab", "-n", "4", "--speculative", "draft", "--draft-layers", "1",
                     "--spec-tree=-1,-1,0,0,1,2"],
            "hybrid": [q, "-p", "hello", "-n", "2", "--backend", "paged"]}
    out = {}
    for kind, (model, *args) in runs.items():
        d = root / kind
        res = CliRunner().invoke(app, ["run", "-m", str(model), "--ignore-eos", "--keep", "summary", *args, "--save", str(d)])
        assert res.exit_code == 0, res.output[-500:]
        out[kind] = (d, json.loads((d / "trace.json").read_text(encoding="utf-8")))
        assert CliRunner().invoke(app, ["check", str(d)]).exit_code == 0
    return out


def _paths(x: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(x, dict):
        for k, v in x.items():
            out += _paths(v, path + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out += _paths(v, path + (i,))
    return out


def _key(path: tuple) -> str:
    return "/".join("#" if isinstance(k, int) else str(k) for k in path)


def _get(d: Any, path: tuple) -> Any:
    for k in path:
        d = d[k]
    return d


def _at(d: Any, path: tuple) -> Any:
    """The value at ``path``, or a fresh sentinel when a later mutation removed or replaced a parent."""
    try:
        return _get(d, path)
    except (KeyError, IndexError, TypeError):
        return object()


ranges = st.one_of(st.sampled_from(["-", "0", "0..3", "1..4", "4..7", "3..7", "0..99999999", "7..3", "x", ""]),
                   st.builds(lambda a, b: f"{a}..{a + b}", st.integers(0, 20), st.integers(1, 20)))
values = st.one_of(st.integers(-3, 40), st.sampled_from([2 ** 31, 10 ** 30, -1]), st.text(max_size=8), st.none(), st.booleans(),
                   st.floats(allow_nan=True), st.lists(st.integers(-2, 30), max_size=5), ranges)


@st.composite
def mutated(draw, bases: dict) -> tuple[str, dict, bool, list]:
    kind = draw(st.sampled_from(KINDS))
    d = copy.deepcopy(bases[kind][1])
    derived_changed, log = False, []
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(d)[1:] if SECTIONS.match(_key(p))]
        path = paths[draw(st.integers(0, len(paths) - 1))]
        parent, key = _get(d, path[:-1]), path[-1]
        cur = parent[key]
        op = draw(st.sampled_from(["same_type"] * 5 + ["replace", "delete", "list_len"]))
        if op == "same_type" and isinstance(cur, bool):
            new = not cur
        elif op == "same_type" and isinstance(cur, int):
            new = draw(st.integers(0, max(8, 2 * cur)))
        elif op == "same_type" and isinstance(cur, str):
            new = draw(st.one_of(ranges, st.sampled_from(["0", "-inf", "GDN", "attn", "linear_attention", "full_attention"])))
        elif op == "delete" and isinstance(parent, dict):
            del parent[key]
            derived_changed = False  # a later deletion may take the changed value with it: no claim
            continue
        elif op == "list_len" and isinstance(cur, list) and cur:
            if draw(st.booleans()):
                cur.pop()
            else:
                cur.append(copy.deepcopy(cur[-1]))
            derived_changed = False
            continue
        else:
            new = draw(values)
        # a value of the same kind as the original at a recomputed field: the trace is now wrong
        # (a window size on a model without windowed layers changes nothing: ModelConfig.windowed_layers stays empty)
        no_window = _key(path) == "config/sliding_window" and not any(x is True for x in d["config"].get("swa_layers") or [])
        if DERIVED.fullmatch(_key(path)) and new != cur and type(new) is type(cur) and not no_window:
            derived_changed = True
        parent[key] = new
        log.append((_key(path), path, cur, new))
    if derived_changed:  # a changed value still differs from the saved trace's at the end (not set back)
        base = bases[kind][1]
        no_window = not any(x is True for x in d["config"].get("swa_layers") or [])
        derived_changed = any(DERIVED.fullmatch(k) and not (k == "config/sliding_window" and no_window)
                              and type(_at(d, p)) is type(_at(base, p)) and _at(d, p) != _at(base, p) for k, p, _, _ in log)
    return kind, d, derived_changed, log


def _write(tmp: Path, d: dict) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "trace.json").write_text(json.dumps(d, allow_nan=True), encoding="utf-8")
    return tmp


_counter = iter(range(10 ** 9))


@pytest.mark.parametrize("command", ["check", "show"])
def test_fuzz_newer_sections(bases, tmp_path, command):
    @fuzz_settings()
    @given(st.data())
    def run(data):
        kind, d, derived_changed, log = data.draw(mutated(bases))
        t = _write(tmp_path / f"f{next(_counter)}", d)
        t0 = time.monotonic()
        res = CliRunner().invoke(app, [command, str(t)])
        elapsed = time.monotonic() - t0
        check_cli_result(f"{command} (newer sections)", res, elapsed, ok=(0, 1) if command == "check" else (0,))
        out = res.stdout + res.stderr
        assert BAD_TERMINAL.search(out) is None, repr(out[:300])
        if command == "check":
            if res.exit_code == 1:
                assert len(res.stdout.strip().splitlines()) == 1 and res.stdout.startswith("violation: "), res.stdout
            if derived_changed:
                record("check (newer sections)", "recomputed field changed")
                assert res.exit_code != 0, (kind, log, res.stdout)

    run()
