"""Reading a served vLLM's spool (:mod:`.spool`) back: bounded, validated, never following a symlink.

The spool is untrusted input (another process, possibly another user, wrote it): every file is opened
with ``O_NOFOLLOW`` relative to its opened directory, sizes are bounded before reading, JSON fields are
type-checked before use, arrays come from safetensors (no pickle) and are checked for the dtype and
shape each field must have. Every problem is one :class:`~infertrace.errors.InfertraceError` line.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from infertrace.errors import InfertraceError
from infertrace.runtimes.vllm.spool import VERSION

#: bounds on what is read (bytes / counts)
MAX_JSON = 16 << 20
MAX_ARRAYS = 1 << 30
MAX_TOTAL = 8 << 30
MAX_SEGMENTS = 200_000
_PROC = re.compile(r"^(core|rank(\d{1,3}))-(\d{1,10})$")
_SEG = re.compile(r"^seg-(\d{6})\.json$")
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
#: capture fields: (dtype kind, ndim, length: "R" rows, "R1" rows + 1, "T" tokens, None any)
_FIELDS = {"query_start_loc": ("i", 1, "R1"), "seq_lens": ("i", 1, "R"), "block_table": ("i", 2, "R"),
           "slot_mapping": ("i", 1, "T"), "input_ids": ("i", 1, "T"), "positions": ("i", 1, "T"),
           "logits": ("f", 2, None), "sampled": ("i", 2, "R"), "hidden": ("f", 2, "T"),
           "q_pre": ("f", 2, "T"), "q_rot": ("f", 2, "T"), "k_pre": ("f", 2, "T"), "k_rot": ("f", 2, "T"),
           "k_written": ("f", 3, "T"), "v_written": ("f", 3, "T"), "k_cache": ("f", 3, "T"), "v_cache": ("f", 3, "T"),
           "draft_token_ids": ("i", 1, None)}
_REQUIRED = ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "positions", "logits", "sampled")


@dataclass
class Spool:
    """What a spool holds: the engine core's header and step records, and per rank its header and captures."""

    header: dict[str, Any]
    steps: dict[int, dict[str, Any]]
    rank_headers: dict[int, dict[str, Any]] = field(default_factory=dict)
    captures: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _bad(where: str, what: str) -> InfertraceError:
    return InfertraceError(f"collect: {where}: {what}; this is not a spool infertrace's vLLM plugin wrote intact")


def _read(dir_fd: int, name: str, limit: int, where: str) -> bytes:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as e:
        raise _bad(f"{where}/{name}", f"cannot be opened ({e.strerror}; a symlink is never followed)") from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise _bad(f"{where}/{name}", f"{size} bytes, over the limit of {limit}")
        return f.read(limit + 1)


def _int(x: Any, where: str, lo: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < lo:
        raise _bad(where, f"expected an integer >= {lo}, got {str(x)[:40]!r}")
    return x


def _ints(x: Any, where: str) -> list[int]:
    if not isinstance(x, list):
        raise _bad(where, "expected a list of integers")
    return [_int(v, where) for v in x]


def _str(x: Any, where: str) -> str:
    if not isinstance(x, str) or len(x) > 256:
        raise _bad(where, "expected a string of at most 256 characters")
    return x


def check_sd(sd: Any, where: str) -> None:
    """Validate scheduler data (:func:`~infertrace.runtimes.vllm.steprec.scheduler_data`)."""
    if not isinstance(sd, dict):
        raise _bad(where, "no scheduler data")
    for pair in sd.get("num_scheduled_tokens", None) or []:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise _bad(where, "num_scheduled_tokens is not [[req_id, n], ...]")
        _str(pair[0], where), _int(pair[1], where)
    if not isinstance(sd.get("new"), list) or not isinstance(sd.get("cached"), dict) or not isinstance(sd.get("spec"), dict):
        raise _bad(where, "scheduler data lacks new / cached / spec")
    for r in sd["new"]:
        if not isinstance(r, dict):
            raise _bad(where, "a new request is not an object")
        _str(r.get("req_id"), where), _int(r.get("num_computed_tokens"), where)
        _ints(r.get("block_ids"), where), _ints(r.get("prompt_token_ids"), where)
    c = sd["cached"]
    ids = [_str(x, where) for x in c.get("req_ids") or []]
    if len(_ints(c.get("num_computed_tokens"), where)) != len(ids) or len(c.get("new_block_ids") or []) != len(ids):
        raise _bad(where, "cached requests' lists differ in length")
    for nb in c["new_block_ids"]:
        if nb is not None:
            _ints(nb, where)
    for x in (c.get("resumed") or []) + list(sd.get("preempted") or []) + list(sd.get("finished") or []):
        _str(x, where)
    for k, v in sd["spec"].items():
        _str(k, where), [_int(t, where, -1) for t in (v if isinstance(v, list) else [None])]
    _int(sd.get("total_num_scheduled_tokens"), where)


def _check_step(r: Any, where: str) -> int:
    s = _int(r.get("step"), where)
    check_sd(r.get("sd"), f"{where} step {s}")
    _int(r.get("free"), where)
    for pair in r.get("refs") or []:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise _bad(where, "refs is not [[block, ref_cnt], ...]")
        _int(pair[0], where), _int(pair[1], where)
    _ints(r.get("free_head") or [], where)
    _ints(r.get("freed") or [], where)
    if not isinstance(r.get("requests"), dict) or not isinstance(r.get("outputs", {}), dict):
        raise _bad(where, f"step {s} lacks requests / outputs")
    return s


def check_capture(r: dict[str, Any], where: str) -> None:
    """Validate one model-runner capture: fields present, dtypes, shapes consistent with R rows and T tokens."""
    ids = r.get("req_ids")
    if not isinstance(ids, list) or not ids:
        raise _bad(where, "capture without req_ids")
    [_str(x, where) for x in ids]
    R, T = len(ids), _int(r.get("num_actual_tokens"), where)
    for k in _REQUIRED:
        if not isinstance(r.get(k), np.ndarray):
            raise _bad(where, f"capture lacks the array {k}")
    for k, (kind, nd, length) in _FIELDS.items():
        a = r.get(k)
        if a is None:
            continue
        if not isinstance(a, np.ndarray) or a.dtype.kind not in (kind, "u" if kind == "i" else kind) or a.ndim != nd:
            raise _bad(where, f"{k} must be a {nd}-d {'integer' if kind == 'i' else 'float'} array")
        want = {"R": R, "R1": R + 1, "T": T, None: a.shape[0]}[length]
        if a.shape[0] != want:
            raise _bad(where, f"{k} has {a.shape[0]} rows, expected {want}")
    b = r.get("batch")
    if b is not None:  # the whole batch's ids and counts (the worker kept the marked rows)
        if not isinstance(b, dict) or not isinstance(b.get("req_ids"), list) or len(b["req_ids"]) > 4096:
            raise _bad(where, "batch is not {req_ids, num_actual_tokens, ...}")
        [_str(x, where) for x in b["req_ids"]]
        _int(b.get("num_actual_tokens"), where)
        for k in ("max_query_len", "num_decode_tokens"):
            if b.get(k) is not None:
                _int(b[k], where)
        r["batch"] = {k: b.get(k) for k in ("req_ids", "num_actual_tokens", "max_query_len", "num_decode_tokens")}
    q = r["query_start_loc"]
    if q[0] != 0 or q[-1] != T or np.any(np.diff(q) < 0):
        raise _bad(where, "query_start_loc is not 0 .. num_actual_tokens, non-decreasing")


def _segments(root_fd: int, name: str, budget: list[int]) -> list[dict[str, Any]]:
    from safetensors.numpy import load

    try:
        fd = os.open(name, _DIR, dir_fd=root_fd)
    except OSError as e:
        raise _bad(name, f"not a directory ({e.strerror}; a symlink is never followed)") from None
    try:
        names = sorted(n for n in os.listdir(fd) if _SEG.match(n))
        if len(names) > MAX_SEGMENTS:
            raise _bad(name, f"{len(names)} segments, over the limit of {MAX_SEGMENTS}")
        out = []
        for n in names:
            raw = _read(fd, n, MAX_JSON, name)
            budget[0] += len(raw)
            try:
                doc = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise _bad(f"{name}/{n}", f"not JSON ({str(e)[:80]})") from None
            if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("records"), list):
                raise _bad(f"{name}/{n}", f"not a version-{VERSION} segment")
            arrays: dict[str, np.ndarray] = {}
            if doc.get("arrays"):
                blob = _read(fd, n[:-5] + ".safetensors", MAX_ARRAYS, name)
                budget[0] += len(blob)
                try:
                    arrays = load(blob)
                except Exception as e:  # safetensors raises its own error types on a corrupt header
                    raise _bad(f"{name}/{n[:-5]}.safetensors", f"not a safetensors file ({str(e)[:80]})") from None
            if budget[0] > MAX_TOTAL:
                raise _bad(name, f"the spool is over {MAX_TOTAL} bytes")
            for key, a in arrays.items():
                i, _, fld = key.partition(".")
                if not i.isdigit() or int(i) >= len(doc["records"]) or fld not in _FIELDS:
                    raise _bad(f"{name}/{n}", f"unexpected array {key[:40]!r}")
                doc["records"][int(i)][fld] = a
            for note in doc.get("notes") or []:
                out.append({"kind": "note", "text": _str(note, name)})
            out += [r for r in doc["records"] if isinstance(r, dict)]
        return out
    finally:
        os.close(fd)


def read_spool(path: str) -> Spool:
    """Read and validate the spool at ``path``.

    Raises:
        InfertraceError: a missing / symlinked spool, none or several engine-core runs in it, a file over the
            bounds, a malformed record or array.
    """
    try:
        root_fd = os.open(path, _DIR)
    except OSError as e:
        raise InfertraceError(f"collect: {path}: cannot open the spool directory ({e.strerror}; a symlink is never "
                              "followed); pass the INFERTRACE_SPOOL directory the server wrote") from None
    try:
        procs = [(m.group(1), m.group(2), n) for n in sorted(os.listdir(root_fd)) if (m := _PROC.match(n))]
        cores = [n for role, _, n in procs if role == "core"]
        if len(cores) != 1:
            raise InfertraceError(f"collect: {path} holds {len(cores)} engine-core runs ({', '.join(cores[:4]) or 'none'}); "
                                  "give the spool of one server run (one INFERTRACE_SPOOL directory per server start)")
        budget = [0]
        sp = Spool(header={}, steps={})
        for rec in _segments(root_fd, cores[0], budget):
            if rec.get("kind") == "header":
                sp.header = rec
            elif rec.get("kind") == "step":
                s = _check_step(rec, cores[0])
                if s in sp.steps:
                    raise _bad(cores[0], f"step {s} recorded twice")
                sp.steps[s] = rec
            elif rec.get("kind") == "note":
                sp.notes = [n for n in sp.notes if not n.startswith("engine core: ")] + [f"engine core: {rec['text']}"]
        for role, rank, n in procs:
            if role == "core":
                continue
            r = int(rank)
            if r in sp.rank_headers:
                raise InfertraceError(f"collect: {path} holds two runs of rank {r}; give the spool of one server run")
            caps: dict[int, dict[str, Any]] = {}
            for rec in _segments(root_fd, n, budget):
                if rec.get("kind") == "header":
                    sp.rank_headers[r] = rec
                elif rec.get("kind") == "capture":
                    s = _int(rec.get("step"), n)
                    check_capture(rec, f"{n} step {s}")
                    caps[s] = rec
                elif rec.get("kind") == "note":  # the newest says it all (cumulative)
                    sp.notes = [x for x in sp.notes if not x.startswith(f"rank {r}: ")] + [f"rank {r}: {rec['text']}"]
            sp.rank_headers.setdefault(r, {})
            sp.captures[r] = caps
        if not sp.header:
            raise _bad(cores[0], "no header segment (the first one) in the engine core's records")
        return sp
    finally:
        os.close(root_fd)
