"""``run --runtime vllm`` on a GGUF loads a cached HF conversion (runtimes/vllm/convert_cache.py): planted
cache entries are refused in one line (exit 2) before vLLM starts, and a hostile chat template in the
model never reaches vLLM, which renders one at start-up without limits (issue 30 items 6 and 7).

What the planted entries did before: a symlink to another model's conversion, or a symlinked
``model.safetensors``, ran with exit 0 — vLLM computed the other model's weights while the trace named
the original file; a planted entry of another shape was an internal error, exit 1. The GGUF's template
(two nested 100,000-iteration loops) was copied into the conversion and hung vLLM's start-up.

vLLM really runs here (``--runtime vllm``, tiny 2-layer model with head_dim 64): once on a clean
conversion (the baseline every planted case is made from) and once on the GGUF with the hostile
template (must finish under a timeout).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from infertrace.cli.app import app
from tests.helpers.tiny import make_weights, write_gguf, write_hf

pytestmark = [pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(n_layer=2, H=256, n_head=4, n_kv=2, head_dim=64, ff=512)
RUN = ["-p", "hello", "-n", "2", "--ignore-eos", "--tokens-per-block", "32", "--num-blocks", "16", "--ctx-size", "256"]
HOSTILE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
MANIFEST = "infertrace-manifest.json"


def _env(xdg: Path) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return {**os.environ, "PYTHONPATH": path, "XDG_CACHE_HOME": str(xdg), "COLUMNS": "200", "INFERTRACE_NO_CACHE": "1"}


def _vllm_run(model: Path, xdg: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """``run --runtime vllm`` in a fresh process (vLLM starts for real), with its own cache."""
    return subprocess.run([sys.executable, "-m", "infertrace", "run", "--runtime", "vllm", "--model", str(model), *RUN,
                           "--json"], capture_output=True, text=True, env=_env(xdg), timeout=timeout)


def _refusal(model: Path, xdg: Path) -> str:
    """``run --runtime vllm`` in this process: it must stop in one line, exit 2, before vLLM starts."""
    t0 = time.perf_counter()
    res = CliRunner().invoke(app, ["run", "--runtime", "vllm", "--model", str(model), *RUN],
                             env={"XDG_CACHE_HOME": str(xdg), "COLUMNS": "200", "INFERTRACE_NO_CACHE": "1"})
    assert res.exit_code == 2, (res.output, res.exception)
    assert "Traceback" not in res.output and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert time.perf_counter() - t0 < 120  # refused before vLLM builds an engine
    return lines[0]


def _sha(p: Path) -> str:
    import hashlib

    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Model A converted and run by vLLM (exit 0: the baseline), model B (another shape) converted."""
    from infertrace.runtimes.vllm import import_vllm
    from infertrace.runtimes.vllm.convert import _convert

    import_vllm()  # required: a failure naming the extra, not a skip
    root = tmp_path_factory.mktemp("conv")
    xdg = root / "xdg"
    w, s = make_weights(seed=1, **TINY)
    a = write_gguf(root / "a.gguf", w, s)
    w, s = make_weights(seed=2, **{**TINY, "H": 128, "ff": 256})
    b = write_gguf(root / "b.gguf", w, s)
    r = _vllm_run(a, xdg)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["runtime"] == "vllm" and len(out["requests"][0]["output_ids"]) == 2
    hf = xdg / "infertrace" / "vllm-hf-v2"
    entry_b = hf / _sha(b)
    _convert(b, entry_b, _sha(b))  # B's conversion, as a run on B would write it (no vLLM run needed)
    return SimpleNamespace(xdg=xdg, a=a, b=b, entry_a=hf / _sha(a), entry_b=entry_b)


@pytest.fixture
def fresh(cache, tmp_path):
    """A private copy of the cache (each case plants into its own)."""
    xdg = tmp_path / "xdg"
    shutil.copytree(cache.xdg, xdg, symlinks=True)
    hf = xdg / "infertrace" / "vllm-hf-v2"
    return SimpleNamespace(xdg=xdg, a=cache.a, entry_a=hf / cache.entry_a.name, entry_b=hf / cache.entry_b.name)


def test_clean_entry_is_what_we_wrote_and_is_reused(cache, monkeypatch):
    """The entry the baseline run wrote: a 0700 directory of 0600 regular files, a manifest with the GGUF's
    sha256 and each file's sha256 (recomputed here), no chat template; a second lookup reuses it."""
    from infertrace.runtimes.vllm.convert import hf_dir_for

    e = cache.entry_a
    assert e.is_dir() and not e.is_symlink() and (os.lstat(e).st_mode & 0o777) == 0o700
    doc = json.loads((e / MANIFEST).read_text())
    assert doc["source"] == {"sha256": _sha(cache.a), "name": "a.gguf"} and e.name == _sha(cache.a)
    assert set(doc["files"]) == {p.name for p in e.iterdir()} - {MANIFEST}
    for name, f in doc["files"].items():
        p = e / name
        assert p.is_file() and not p.is_symlink() and (os.lstat(p).st_mode & 0o777) == 0o600
        assert f == {"sha256": _sha(p), "size": p.stat().st_size}
    assert {"config.json", "model.safetensors"} <= set(doc["files"]) and "chat_template.jinja" not in doc["files"]
    before = (e / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache.xdg))
    assert hf_dir_for(cache.a) == e
    assert (e / "model.safetensors").stat().st_mtime_ns == before  # verified and reused, not converted again


def _symlink_entry(f):  # the entry replaced by a symlink to another model's conversion (ran B's weights, exit 0)
    shutil.rmtree(f.entry_a)
    f.entry_a.symlink_to(f.entry_b)


def _symlink_weights(f):  # model.safetensors a symlink to another model's file
    (f.entry_a / "model.safetensors").unlink()
    (f.entry_a / "model.safetensors").symlink_to(f.entry_b / "model.safetensors")


def _other_shape(f):  # a real directory holding another model's whole conversion, manifest included (exit 1 before)
    shutil.rmtree(f.entry_a)
    shutil.copytree(f.entry_b, f.entry_a)


def _forged_weights(f):  # same size, other bytes, manifest untouched
    p = f.entry_a / "model.safetensors"
    raw = bytearray(p.read_bytes())
    raw[-64:] = bytes(64)
    p.write_bytes(bytes(raw))


def _no_manifest(f):  # an entry infertrace did not write (or an older one): nothing says where it came from
    (f.entry_a / MANIFEST).unlink()


def _planted_template(f):  # a chat template vLLM would render at start-up
    (f.entry_a / "chat_template.jinja").write_text(HOSTILE)


def _template_manifest_rewritten(f):  # template added to tokenizer_config.json and the manifest recomputed to match
    p = f.entry_a / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    cfg["chat_template"] = HOSTILE
    p.write_text(json.dumps(cfg))
    m = json.loads((f.entry_a / MANIFEST).read_text())
    m["files"]["tokenizer_config.json"] = {"sha256": _sha(p), "size": p.stat().st_size}
    (f.entry_a / MANIFEST).write_text(json.dumps(m))


def _hard_link(f):  # model.safetensors a hard link (the same bytes reachable, and changeable, from elsewhere)
    p = f.entry_a / "model.safetensors"
    other = f.xdg / "elsewhere.safetensors"
    os.link(p, other)


def _world_writable(f):
    os.chmod(f.entry_a, 0o777)


def _entry_is_a_file(f):
    shutil.rmtree(f.entry_a)
    f.entry_a.write_bytes(b"not a model")


def _root_symlink(f):  # the whole cache root a symlink to a directory someone else controls
    hf = f.entry_a.parent
    elsewhere = f.xdg / "planted"
    hf.rename(elsewhere)
    hf.symlink_to(elsewhere)


PLANTED = {
    "symlink-entry": (_symlink_entry, "is a symlink"),
    "symlink-weights": (_symlink_weights, "holds model.safetensors, which is a symlink"),
    "other-shape": (_other_shape, "was converted from another file"),
    "forged-weights": (_forged_weights, "holds model.safetensors, which does not have the SHA-256 its manifest records"),
    "no-manifest": (_no_manifest, f"has no {MANIFEST}"),
    "planted-template": (_planted_template, "holds files its manifest does not name: chat_template.jinja"),
    "template-manifest-rewritten": (_template_manifest_rewritten, "carries a chat template"),
    "hard-link": (_hard_link, "holds model.safetensors, which has other hard links"),
    "world-writable": (_world_writable, "is writable by other users"),
    "entry-is-a-file": (_entry_is_a_file, "is not a directory"),
    "root-symlink": (_root_symlink, "the vLLM conversion cache"),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_entry_is_refused_before_vllm_starts(fresh, name):
    plant, expect = PLANTED[name]
    plant(fresh)
    line = _refusal(fresh.a, fresh.xdg)
    assert expect in line, line
    assert "remove it" in line
    if name != "root-symlink":
        assert str(fresh.entry_a) in line


def test_unwritable_cache_directory_is_one_line(tmp_path, monkeypatch):
    """The cache root cannot be created (mkdir gives PermissionError under /sys), or the private
    directory for a new conversion cannot be made in it (mkdtemp's PermissionError, as a non-root user
    gets in a 0555 directory): one line each, exit 2 (before: a PermissionError traceback, exit 1)."""
    w, s = make_weights(seed=3, **TINY)
    g = write_gguf(tmp_path / "c.gguf", w, s)
    with pytest.raises(PermissionError):
        os.makedirs("/sys/infertrace-test/x")
    line = _refusal(g, Path("/sys/infertrace-test"))
    assert "cannot create the vLLM conversion cache /sys/infertrace-test/infertrace/vllm-hf-v2" in line
    assert "XDG_CACHE_HOME" in line

    from infertrace import safe_io

    def denied(_target):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(safe_io, "fresh_dir_beside", denied)
    line = _refusal(g, tmp_path / "xdg")
    assert "cannot write the vLLM conversion cache" in line and "Permission denied" in line


def test_gguf_chat_template_does_not_reach_vllm(tmp_path):
    """A GGUF whose template loops 10^10 times: transformers' tokenizer of that GGUF carries it (what the
    conversion used to copy for vLLM to render), our own ``--chat`` refuses it in one line; ``run --runtime
    vllm`` now finishes (the template is not copied) and the entry holds no template."""
    import transformers

    w, s = make_weights(seed=1, **TINY)
    g = write_gguf(tmp_path / "t.gguf", w, s, chat_template=HOSTILE)
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf").chat_template == HOSTILE
    res = CliRunner().invoke(app, ["run", "--model", str(g), "-p", "hi", "--chat", "-n", "1"],
                             env={"INFERTRACE_NO_CACHE": "1"})
    assert res.exit_code == 2 and "loops ran more than the limit of 1000000 iterations" in res.stderr, res.output
    xdg = tmp_path / "xdg"
    t0 = time.perf_counter()
    r = _vllm_run(g, xdg, timeout=600)  # before: killed at 240 s, still rendering
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(json.loads(r.stdout)["requests"][0]["output_ids"]) == 2
    entry = xdg / "infertrace" / "vllm-hf-v2" / _sha(g)
    assert not (entry / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((entry / "tokenizer_config.json").read_text())
    assert time.perf_counter() - t0 < 600


def test_hf_directory_template_over_our_limits_is_refused(tmp_path):
    """An HF directory is loaded by vLLM as it is: its template is rendered first under our limits (the
    message vLLM's warm-up sends), and refused in one line before vLLM starts; a benign one passes."""
    from infertrace.runtimes.vllm.convert import check_template_for_vllm

    w, s = make_weights(seed=1, **TINY)
    d = write_hf(tmp_path / "hf", w, s)
    cfg = {"add_bos_token": False, "eos_token": "<|im_end|>",
           "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    check_template_for_vllm(d)  # benign: no error
    cfg["chat_template"] = HOSTILE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    line = _refusal(d, tmp_path / "xdg")
    assert "chat template loops ran more than the limit of 1000000 iterations" in line
    assert "vLLM renders it at start-up without limits" in line
