"""Issue 23 re-probe by the adversary (breaker): findings on main after the issue-23 fixes.

Each test drives the CLI with the hostile input and asserts exit 2 with one ``error:`` line and no
traceback (never exit 1 "internal error"). Paths only; no device nodes are needed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.helpers import hostile as H
from infertrace.cli.app import app


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


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


# ------------------------------------------------------ report -o under a regular file (ENOTDIR)


@pytest.mark.parametrize("force", [False, True])
def test_report_output_under_a_regular_file_is_one_line(tmp_path, force):
    t = _trace(tmp_path)
    f = tmp_path / "plain"
    f.write_text("keep me")
    res = invoke("report", t, "-o", f / "x.html", *(["--force"] if force else []))
    refused(res, "Not a directory")
    assert f.read_text() == "keep me"


# ------------------------------------------------------ a name longer than NAME_MAX (ENAMETOOLONG)


LONG = "a" * 300  # NAME_MAX is 255 on Linux file systems


@pytest.mark.parametrize("cmd", ["show", "check", "report", "inspect"])
@pytest.mark.parametrize("deep", [False, True])
def test_path_over_name_max_is_one_line_in_every_reader(tmp_path, cmd, deep):
    p = tmp_path / LONG / "x" if deep else tmp_path / LONG
    refused(invoke(cmd, p), "File name too long")


def test_report_output_over_name_max_is_one_line(tmp_path):
    t = _trace(tmp_path)
    refused(invoke("report", t, "-o", tmp_path / LONG), "File name too long")


def test_save_and_make_qwen35_out_over_name_max_are_one_line(tmp_path):
    refused(invoke("make-qwen35", "--out", tmp_path / LONG), "File name too long")
    refused(invoke("run", "-m", tmp_path / LONG, "-p", "a", "-n", "1"), "File name too long")


# ------------------------------------------------------ --kv-unified off: a prompt longer than its stream


def test_kv_unified_off_full_stream_names_ctx_size_not_num_blocks(tmp_path):
    """3 sequences, --ctx-size 512: llama.cpp's n_ctx_seq = pad256(pad256(512) / 3) = 256 cells per stream; a
    300-token prompt does not fit its stream. The refusal must name --ctx-size (the cells backend has no
    --num-blocks) and the split."""
    from tests.helpers.tiny import make_weights, write_gguf

    w, s = make_weights(seed=0)
    m = write_gguf(tmp_path / "m.gguf", w, s)
    res = invoke("run", "-m", m, "-p", "ab" * 150, "-p", "xyzxyzx", "-p", "qq", "-n", "2", "--kv-unified", "off",
                 "--ctx-size", "512")
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    line = res.output.strip().splitlines()[-1]  # (a warning line before it: 512 is past the tiny model's 256)
    assert line.startswith("error:") and all(x in line for x in ("raise --ctx-size", "holds 256", "over 3 sequences"))
    assert "--num-blocks" not in line


# ------------------------------------------------------ thread variables: leading zeros, blank OMP_NUM_THREADS


@pytest.mark.parametrize("var", ["INFERTRACE_THREADS", "OMP_NUM_THREADS"])
def test_thread_variable_with_many_leading_zeros_is_its_value(monkeypatch, var):
    """libgomp (strtoul) reads 45 zeros then 2 as 2; it was cut at 40 characters and refused as 0."""
    from infertrace.threads import env_threads

    monkeypatch.setenv(var, "0" * 45 + "2")
    assert env_threads(var) == 2


def test_blank_omp_num_threads_is_unset_before_torch_loads(monkeypatch):
    """A blank OMP_NUM_THREADS is 'unset' for the tool but libgomp prints "Invalid value for
    environment variable OMP_NUM_THREADS" on stderr when torch loads: the check removes it."""
    import os

    from infertrace.threads import check_thread_settings

    monkeypatch.setenv("OMP_NUM_THREADS", "  ")
    check_thread_settings(None)
    assert "OMP_NUM_THREADS" not in os.environ


# ------------------------------------------------------ make-qwen35 --out a symlink: refused before writing


@pytest.mark.parametrize("kind", ["dangling", "to-empty-dir"])
def test_make_qwen35_out_symlink_is_refused_before_any_weight_is_written(tmp_path, monkeypatch, kind):
    """publish_dir never renames onto a symlink, but the check came after writing the whole
    1.5 GB checkpoint (minutes). Refused first; the link and its target stay as they were."""
    import infertrace.loading.synth as synth

    if kind == "dangling":
        target = tmp_path / "nowhere"
    else:
        target = tmp_path / "empty"
        target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    called = []
    monkeypatch.setattr(synth, "_write_into", lambda *a, **k: called.append(a))
    refused(invoke("make-qwen35", "--out", link), "symlink")
    assert called == []
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["link"] + ([] if kind == "dangling" else ["empty"]))


# ------------------------------------------------------ check: an inv_freq that overflows the angle


def test_check_inv_freq_overflowing_the_angle_is_a_violation_not_an_internal_error(tmp_path):
    """inv_freq_first[0] = 1e308 passes the schema (a finite float); pos 2 * 1e308 = inf and
    math.cos(inf) raised ValueError ("math domain error", exit 1). It is a RoPE violation."""
    import json

    t = _trace(tmp_path)
    doc = json.loads((t / "trace.json").read_text())
    doc["steps"][0]["positions"]["inv_freq_first"][0] = 1e308
    (t / "trace.json").write_text(json.dumps(doc))
    res = invoke("check", t)
    assert res.exit_code == 1, (res.exit_code, res.stderr)
    assert "internal error" not in res.stderr and "Traceback" not in res.stderr
    assert "RoPE angle consistent with position" in res.stdout and "not a finite number" in res.stdout


# ------------------------------------------------------ check: a step's speculative totals


@pytest.fixture(scope="module")
def spec_trace(tmp_path_factory):
    """A greedy draft-layers run of a tiny llama (2 layers, draft = layer 0), saved."""
    from tests.helpers.tiny import make_weights, write_gguf

    d = tmp_path_factory.mktemp("spec")
    w, s = make_weights(seed=0)
    m = write_gguf(d / "m.gguf", w, s)
    res = invoke("run", "-m", m, "-p", "abcabcabc", "-n", "6", "--speculative", "draft", "--draft-layers", "1",
                 "--save", d / "t")
    assert res.exit_code == 0, (res.stderr, res.exception)
    return d / "t"


def _spec_mutant(src: Path, tmp_path: Path, edit) -> Path:
    import json

    t = tmp_path / "m"
    shutil.copytree(src, t)
    doc = json.loads((t / "trace.json").read_text())
    st = next(s for s in doc["steps"] if s.get("spec") and s["spec"]["drafted"])
    edit(st["spec"])
    (t / "trace.json").write_text(json.dumps(doc))
    return t


def test_unmodified_speculative_trace_passes_check(spec_trace):
    res = invoke("check", spec_trace)
    assert res.exit_code == 0, (res.stdout[-600:], res.stderr)


@pytest.mark.parametrize("edit, needle", [
    (lambda sp: sp.update(accepted=sp["drafted"] + 1), "spec.accepted"),  # more accepted than drafted
    (lambda sp: sp.update(acceptance_rate=0.0 if sp["acceptance_rate"] else 0.5), "spec.acceptance_rate"),
    (lambda sp: sp.update(acceptance_rate=None), "spec.acceptance_rate"),
])
def test_check_refuses_inconsistent_speculative_totals(spec_trace, tmp_path, edit, needle):
    """Engine._spec_record writes accepted <= drafted and acceptance_rate = round(accepted / drafted, 4);
    a trace that disagrees was accepted by check (exit 0)."""
    res = invoke("check", _spec_mutant(spec_trace, tmp_path, edit))
    assert res.exit_code in (1, 2), (res.exit_code, res.stdout[-400:])
    assert needle in res.stdout + res.stderr and "internal error" not in res.stderr


@pytest.mark.parametrize("target", ["dangling", "empty dir"])
def test_save_onto_a_symlink_is_refused_before_the_model_loads(tmp_path, target):
    """``run --save LINK``: safe_io.publish_dir never renames onto a symlink, so the run would be lost
    at the end; it is refused up front (the model file here is not a model: the refusal comes first),
    and the link and what it points to are left as they were."""
    model = tmp_path / "not-a-model.gguf"
    model.write_bytes(b"not a gguf file")
    link = tmp_path / "link"
    dest = tmp_path / "empty"
    if target == "empty dir":
        dest.mkdir()
    link.symlink_to(dest)
    refused(invoke("run", "-m", model, "-p", "a", "-n", "1", "--save", link), "is a symlink")
    assert link.is_symlink() and (dest.is_dir() and not any(dest.iterdir()) if target == "empty dir" else not dest.exists())
