"""Saved traces of the serving mechanisms (prefix cache, context shift, KV audit) pass the trace
schema and every consumer reads them back: ``show``, ``report``, ``dump-kv DIR`` exit 0 and print
the serving records (prefix hit, shared blocks with ref counts, the context shift)."""

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from tests.helpers.tiny import make_weights, write_gguf


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    w, s = make_weights(seed=5)
    return str(write_gguf(tmp_path_factory.mktemp("tiny") / "m.gguf", w, s))


def _cli(*args):
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_saved_prefix_cache_and_context_shift_round_trip(gguf, tmp_path, backend):
    d = str(tmp_path / "t")
    # the same 10 bytes twice: the second request (arriving at step 3) hits the first's prefix
    _cli("run", "-m", gguf, "-p", "HelloWorld", "-p", "HelloWorld", "--arrival", "0", "--arrival", "3", "-n", "8",
         "--ignore-eos", "--prefix-cache", "on", "--backend", backend, "--tokens-per-block", "4", "--ctx-size", "16",
         "--context-shift", "--n-keep", "1", "--audit-kv", "--save", d,
         *(["--num-blocks", "12"] if backend == "paged" else []))  # paged: room for both requests at once
    assert _cli("check", d).startswith("ok: ")  # hit, shift and retained sequence are valid serving events (case X3)
    out = _cli("show", d, "--show", "all")  # the panels (show draws none by default)
    assert "prefix lookup: hit" in out and "from request 0" in out
    assert "context shift seq" in out
    assert "KV audit" in out
    html = tmp_path / "r.html"
    _cli("report", d, "-o", str(html))
    assert html.stat().st_size > 0
    dump = _cli("dump-kv", "--step", "3", d)
    assert ("(ref 2)" in dump) if backend == "paged" else ("retained" in dump or "0,1" in dump)


@pytest.mark.parametrize("backend", ["cells", "paged"])
def test_saved_windowed_trace_round_trip(tmp_path, backend):
    """A Gemma 3-style tiny checkpoint (windowed and global layers): the saved trace passes the schema and
    ``check``, and ``show`` / ``report`` / ``dump-kv DIR`` print the window records."""
    from tests.helpers.tiny import write_hf

    w, s = make_weights(family="gemma3", n_layer=6, tie=True, seed=2)
    m = str(write_hf(tmp_path / "hf", w, s, sliding_window=4, final_logit_softcapping=3.0))
    d = str(tmp_path / "t")
    _cli("run", "-m", m, "-p", "HelloWorld!", "-n", "3", "--ignore-eos", "--backend", backend, "--save", d)
    _cli("check", d)
    out = _cli("show", d, "--step", "0", "--var", "mask")
    assert "sees keys p-W+1..p" in out or "window" in out
    _cli("report", d, "-o", str(tmp_path / "r.html"))
    _cli("dump-kv", "--step", "1", d)
