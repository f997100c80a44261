"""The spool of a served vLLM (runtimes/vllm/spool.py, spool_read.py) as hostile input and as a private
bounded store: 0700 directories, 0600 files, symlinks refused on both sides, the size limit dropping the
oldest segments with a note, and every malformed spool one line with exit 2 from ``infertrace collect``
(the spool is read before any model loads). No vLLM needed: segments are written with the writer."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from infertrace.errors import InfertraceError
from infertrace.runtimes.vllm.spool import SpoolWriter
from infertrace.runtimes.vllm.spool_read import read_spool

ROOT = Path(__file__).resolve().parents[2]
HEADER = {"kind": "header", "block_size": 32, "num_blocks": 8, "max_model_len": 64, "tensor_parallel_size": 1}


def _sd(rid: str = "r-0-abcdef12", n: int = 3) -> dict:
    return {"num_scheduled_tokens": [[rid, n]], "new": [{"req_id": rid, "num_computed_tokens": 0, "block_ids": [1],
                                                        "prompt_token_ids": [1, 2, 3]}],
            "cached": {"req_ids": [], "num_computed_tokens": [], "new_block_ids": [], "resumed": []}, "spec": {},
            "preempted": [], "finished": [], "total_num_scheduled_tokens": n}


def _step(s: int = 0, **kw) -> dict:
    return {"kind": "step", "step": s, "sd": _sd(), "free": 6, "refs": [[1, 1]], "free_head": [2, 3],
            "requests": {"r-0-abcdef12": {"marked": "x", "params": {}}}, "outputs": {}, **kw}


def _capture(T: int = 3, **over) -> tuple[dict, dict]:
    arrays = {"query_start_loc": np.array([0, T]), "seq_lens": np.array([T]), "block_table": np.array([[1, 0]]),
              "slot_mapping": np.arange(32, 32 + T), "positions": np.arange(T), "input_ids": np.array([1, 2, 3][:T]),
              "logits": np.zeros((1, 16), np.float32), "sampled": np.array([[5]])}
    arrays.update(over)
    return {"kind": "capture", "step": 0, "req_ids": ["r-0-abcdef12"], "num_actual_tokens": T}, arrays


def _spool(tmp_path: Path, capture: tuple[dict, dict] | None = None) -> Path:
    root = tmp_path / "spool"
    w = SpoolWriter(str(root), "core")
    w.write([HEADER])
    w.write([_step()])
    r = SpoolWriter(str(root), "rank0")
    r.write([{"kind": "header", "layer": 0, "head_size": 64}])
    rec, arrays = capture or _capture()
    r.write([rec], {f"0.{k}": v for k, v in arrays.items()})
    return root


def _collect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infertrace.cli.app", "collect", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_writer_is_private_and_reader_reads_it_back(tmp_path: Path) -> None:
    root = _spool(tmp_path)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for d in root.iterdir():
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        for f in d.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600 and not f.name.startswith(".tmp-")
    sp = read_spool(str(root))
    assert sp.header["block_size"] == 32 and list(sp.steps) == [0]
    assert sp.captures[0][0]["slot_mapping"].tolist() == [32, 33, 34]


def test_writer_refuses_a_symlinked_or_shared_spool(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(OSError):
        SpoolWriter(str(tmp_path / "link"), "core")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o755)
    with pytest.raises(PermissionError):
        SpoolWriter(str(open_dir), "core")


def test_size_limit_drops_the_oldest_segments_with_a_note(tmp_path: Path) -> None:
    w = SpoolWriter(str(tmp_path / "s"), "core", limit=3000)
    for s in range(12):
        w.write([_step(s)])
    d = next((tmp_path / "s").iterdir())
    kept = sorted(p.name for p in d.iterdir())
    assert "seg-000001.json" in kept and "seg-000002.json" not in kept and "seg-000012.json" in kept  # the header stays
    newest = json.loads((d / "seg-000012.json").read_text())["notes"]
    first_kept = sorted(int(p.name[4:10]) for p in d.iterdir())[1]
    assert newest == [f"spool limit 3000 bytes: dropped segments 2..{first_kept - 1} (oldest first)"]
    assert sum(p.stat().st_size for p in d.iterdir()) <= 3000


@pytest.mark.parametrize("case", ["symlink_spool", "symlink_proc", "symlink_segment", "bad_json", "bad_version",
                                  "two_cores", "bad_shape", "bad_dtype", "unknown_array", "qsl", "bad_field", "missing"])
def test_collect_refuses_a_malformed_spool_in_one_line(tmp_path: Path, case: str) -> None:
    root = _spool(tmp_path, _capture(positions=np.arange(5)) if case == "bad_shape" else
                  _capture(slot_mapping=np.zeros(3, np.float32)) if case == "bad_dtype" else
                  _capture(query_start_loc=np.array([1, 3])) if case == "qsl" else None)
    core = next(p for p in root.iterdir() if p.name.startswith("core-"))
    arg = root
    if case == "symlink_spool":
        arg = tmp_path / "ln"
        arg.symlink_to(root)
    elif case == "symlink_proc":
        core.rename(tmp_path / "elsewhere")
        core.symlink_to(tmp_path / "elsewhere")
    elif case == "symlink_segment":
        (core / "seg-000002.json").rename(tmp_path / "seg.json")
        (core / "seg-000002.json").symlink_to(tmp_path / "seg.json")
    elif case == "bad_json":
        (core / "seg-000002.json").write_text("{not json")
    elif case == "bad_version":
        (core / "seg-000002.json").write_text(json.dumps({"version": 99, "records": []}))
    elif case == "two_cores":
        (root / "core-1").mkdir(mode=0o700)
    elif case == "unknown_array":
        rank = next(p for p in root.iterdir() if p.name.startswith("rank0"))
        doc = json.loads((rank / "seg-000002.json").read_text())
        from safetensors.numpy import save

        (rank / "seg-000002.safetensors").write_bytes(save({"0.__reduce__": np.zeros(1)}))
        (rank / "seg-000002.json").write_text(json.dumps(doc))
    elif case == "bad_field":
        doc = json.loads((core / "seg-000002.json").read_text())
        doc["records"][0]["sd"]["num_scheduled_tokens"] = [["r", -4]]
        (core / "seg-000002.json").write_text(json.dumps(doc))
    elif case == "missing":
        arg = tmp_path / "nope"
    with pytest.raises(InfertraceError):
        read_spool(str(arg))
    r = _collect(str(arg), "--save", str(tmp_path / "out"))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: collect: ") and "Traceback" not in r.stderr


def test_reader_bounds_a_segment_size(tmp_path: Path, monkeypatch) -> None:
    import infertrace.runtimes.vllm.spool_read as sr

    root = _spool(tmp_path)
    monkeypatch.setattr(sr, "MAX_JSON", 100)
    with pytest.raises(InfertraceError, match="over the limit of 100"):
        read_spool(str(root))
