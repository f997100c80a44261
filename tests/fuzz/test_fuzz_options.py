"""Fuzz target: hostile values of ``run``'s newer flags and thread variables, tensor-name layer fields,
and what sits at a ``report -o`` destination (issue 23: X4, X5, G3, R6, item 9).

Inputs: (a) ``run`` with any of ``--threads``, ``--tokens-per-block``, ``--max-batch-tokens``,
``--prefill-chunk``, ``--max-new-tokens``, ``--ctx-size``, ``--n-keep``, ``--n-discard``, ``--arrival``,
``--spec-tree``, ``--num-spec-tokens``, ``--context-shift``, ``--backend`` drawn hostile (huge,
negative, zero, limits ± 1) and ``INFERTRACE_THREADS`` / ``OMP_NUM_THREADS`` as arbitrary text; the
model path does not exist, so an input every check accepts ends in the loader's one-line refusal
and no model loads; (b) layer fields of tensor names (any text, Unicode digits included) through
``layer_number`` and the HF->engine name mapping; (c) a ``report -o`` destination that is missing, a
regular file, a FIFO, a symlink to one of those or to a directory, a directory, with and without
``--force``.

Invariant: exit 0 or exit 2 with one ``error:`` line, no internal error, no traceback, within
``fuzzkit.TIME_BOUND_S``; a destination that was not a regular file (or a symlink to one) is still
what it was afterwards; ``layer_number`` returns an int of at most 9 ASCII digits or None and never raises.
"""

from __future__ import annotations

import os
import shutil
import stat
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
from infertrace.model.families import FAMILIES, hf_to_engine_name, layer_number  # noqa: E402
from infertrace.trace.schema import LIMITS  # noqa: E402

SETTINGS = fuzz_settings()
_RUN = CliRunner()
_DIR = Path(tempfile.mkdtemp(prefix="infertrace-fuzz-opts-"))
GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "golden" / "worked-example-cells"

_edges = [0, 1, -1, 2, 3, 4, 16, 64, 65, 1000, 10**6, 10**9, 2**31, 2**63, 2**64, 10**30,
          LIMITS["MAX_CTX"], LIMITS["MAX_CTX"] + 1, LIMITS["MAX_TOKENS_PER_BLOCK"], LIMITS["MAX_TOKENS_PER_BLOCK"] + 1,
          LIMITS["MAX_STEPS"], LIMITS["MAX_STEPS"] + 1]
_int = st.one_of(st.sampled_from(_edges), st.integers(min_value=-(10**6), max_value=10**6))
INT_OPTS = ["--threads", "--tokens-per-block", "--max-batch-tokens", "--prefill-chunk", "--max-new-tokens", "--ctx-size",
            "--n-keep", "--n-discard", "--arrival", "--num-spec-tokens", "--num-blocks"]
_tree = st.one_of(st.sampled_from(["-1,,0", "-1,0,", ",", "", "-1", "-1,0,0,1", "-2", "0", "-1,5", "x", "-1,-1,0,1" * 20,
                                   "1e3", "-1, 0", "\u0663"]),
                  st.lists(st.integers(min_value=-3, max_value=70), max_size=70).map(lambda xs: ",".join(map(str, xs))))
_env = st.one_of(st.none(), st.sampled_from(["", "1", "2", "8", "9", "1000", "1e9", "-4", "4,2", "0", "9" * 50, " 3 ",
                                             "\u0663", "2**63"]),
               st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=6))


@SETTINGS
@given(ints=st.dictionaries(st.sampled_from(INT_OPTS), _int, max_size=4), tree=st.one_of(st.none(), _tree),
       shift=st.booleans(), paged=st.booleans(), spec=st.booleans(),
       env=st.fixed_dictionaries({"INFERTRACE_THREADS": _env, "OMP_NUM_THREADS": _env}))
def test_fuzz_run_options(ints, tree, shift, paged, spec, env):
    """Hostile option values: refused in one line before any model loads (the model path does not exist)."""
    args = ["run", "-m", str(_DIR / "missing.gguf"), "-p", "hi"]
    for k, v in ints.items():
        args += [k, str(v)]
    if tree is not None:
        args.append(f"--spec-tree={tree}")
    if spec or tree is not None or "--num-spec-tokens" in ints:
        args += ["--speculative", "ngram"]
    if shift:
        args.append("--context-shift")
    if paged:
        args += ["--backend", "paged"]
    import torch

    before = torch.get_num_threads()  # an accepted count is applied before the (missing) model is looked up
    t0 = time.perf_counter()
    try:
        with time_bound():
            res = _RUN.invoke(app, args, env=env)  # None: unset
    finally:
        torch.set_num_threads(before)
    check_cli_result("run options", res, time.perf_counter() - t0)
    assert res.exit_code == 2  # nothing here may start a run: the model does not exist


@SETTINGS
@given(field=st.one_of(st.text(max_size=12), st.sampled_from(["0", "00", "7", "x", "", "\u00b2", "\u0663", "1" * 9,
                                                              "1" * 10, "-1", "+1", " 1", "1 "])))
def test_fuzz_layer_fields(field):
    """A tensor name's layer field: an int of 1-9 ASCII digits, else None; the name mapping never raises."""
    n = layer_number(field)
    ok = 1 <= len(field) <= 9 and all(c in "0123456789" for c in field)
    assert (n == int(field)) if ok else (n is None)
    for fam in FAMILIES.values():
        hf_to_engine_name(fam, f"model.layers.{field}.self_attn.q_proj.weight")
    record("layer field", "number" if ok else "refused")


def _make(kind: str, p: Path) -> None:
    if kind == "file":
        p.write_text("old")
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "dir":
        p.mkdir()
    elif kind.startswith("link-"):
        target = p.with_name(p.name + ".target")
        _make(kind[5:], target)
        p.symlink_to(target)
    elif kind == "dangling":
        p.symlink_to(p.with_name("nowhere"))


@SETTINGS
@given(kind=st.sampled_from(["missing", "file", "fifo", "dir", "link-file", "link-fifo", "link-dir", "dangling"]),
       force=st.booleans())
def test_fuzz_report_destinations(kind, force, monkeypatch_module):
    """``report -o`` onto what is there: regular files replaced only with --force, nothing else ever replaced."""
    d = Path(tempfile.mkdtemp(dir=_DIR))
    try:
        out = d / "out.html"
        _make(kind, out)
        before = os.lstat(out).st_mode if os.path.lexists(out) else None
        t0 = time.perf_counter()
        res = _RUN.invoke(app, ["report", str(GOLDEN), "-o", str(out), *(["--force"] if force else [])])
        check_cli_result(f"report -o {kind}", res, time.perf_counter() - t0)
        after = os.lstat(out).st_mode if os.path.lexists(out) else None
        if kind in ("fifo", "dir", "link-fifo", "link-dir"):
            assert stat.S_IFMT(after) == stat.S_IFMT(before)  # never replaced (a FIFO without a reader: refused)
        if kind == "link-file" and not force:
            assert out.is_symlink() and out.with_name("out.html.target").read_text() == "old"
        if kind == "link-file" and force:
            assert out.with_name("out.html.target").read_text() == "old"  # the link's target is never written
        if kind == "file" and not force:
            assert out.read_text() == "old"
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def monkeypatch_module():
    """A FIFO without a reader is refused after FIFO_WAIT_S: keep it short here."""
    from infertrace import safe_io

    mp = pytest.MonkeyPatch()
    mp.setattr(safe_io, "FIFO_WAIT_S", 0.2)
    yield mp
    mp.undo()
