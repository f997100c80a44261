"""A GGUF file's header (metadata + tensor table) read once by gguf-py, then cached as JSON.

gguf-py's ``GGUFReader`` stays the reader of record, but building its field objects for the
49,152-entry token and merge arrays of a small model costs seconds, on every start. The first
load parses with ``GGUFReader`` and writes what the loader needs — the metadata as ``inspect``
shows it, the ``tokenizer.*`` values as :meth:`Tokenizer.from_gguf` reads them, and the tensor
table with each tensor's data offset, numpy dtype and shape exactly as ``GGUFReader`` computed
them — to ``$XDG_CACHE_HOME/infertrace/gguf/`` (default ``~/.cache``). Later loads read that
JSON and memory-map tensor data at the recorded offsets: no ``GGUFReader``, no gguf import
for ``inspect``.

Validity: an entry is found by (resolved path, size, mtime) and used only when the SHA-256 of
the file's first ``header_len`` bytes (everything before the tensor data) equals the recorded
one, the gguf-py version and cache format match, and every field passes type and bounds
checks (offsets inside the file, known dtypes, sizes that agree with shapes), and — because the
digest proves the file unchanged, not the entry — its content equals the file's header bytes
(tensor table re-derived from the walk, every value encoded back and compared:
:mod:`infertrace.loading.gguf_cache_verify`). Anything else — a poisoned entry,
a changed file, a corrupt or foreign cache file, an unwritable cache directory — falls back to
``GGUFReader``, silently. JSON only (never pickle); written atomically (temp file + rename).
``INFERTRACE_NO_CACHE=1`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

#: bump when the cached layout changes, or when what must pass before an entry is written changes
#: (2: entries are written only after check_gguf_header and check_gguf_tokenizer_fields passed)
CACHE_FORMAT = 2
#: the four tokenizer arrays ``inspect`` shows as ``<N entries>``
from infertrace.loading.gguf_cache_verify import LARGE_ARRAYS  # noqa: E402  (defined beside the verifier that re-encodes them)
#: numpy dtypes GGUFReader gives tensor data (byte order explicit)
_DTYPES = {f"{e}{t}" for e in "<>" for t in ("f2", "f4", "f8", "i2", "i4", "i8")} | {"|i1", "|u1"}
#: cache files larger than this are not read (a header of a 256k-token vocabulary is ~20 MB of JSON)
MAX_CACHE_BYTES = 256 << 20


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the table, as ``GGUFReader`` computed it.

    ``shape`` is ggml ``ne`` order; ``np_dtype``/``np_shape`` describe the numpy view of the
    data (``uint8`` rows of blocks for quantised types); ``data_offset`` is absolute, in bytes.
    """

    name: str
    type_id: int  # GGMLQuantizationType value
    type_name: str  # its name (F32, Q4_1, ...)
    shape: list[int]
    n_bytes: int
    data_offset: int
    np_dtype: str
    np_shape: list[int]


@dataclass
class GGUFHeader:
    """What the loader needs from a GGUF file besides tensor data.

    Attributes:
        path: the file.
        header_len: bytes before the tensor data (KV metadata + tensor table + padding).
        display: every metadata key -> value as ``inspect`` shows it (``GGUFReaderField.contents()``,
            None when unreadable; the four large tokenizer arrays as ``"<N entries>"``).
        values: ``tokenizer.*`` keys decoded as :meth:`Tokenizer.from_gguf` reads them
            (strings leniently UTF-8 decoded, arrays as lists).
        n_tokens: length of ``tokenizer.ggml.tokens`` (0 when absent).
        tensors: the tensor table in file order.
        from_cache: True when read from the cache (for tests and benchmarks).
        facts: on a cache hit, the :func:`~infertrace.loading.gguf_check.check_gguf_header` walk of the
            file the entry was verified against (None after a parse).
    """

    path: Path
    header_len: int
    display: dict[str, Any]
    values: dict[str, Any]
    n_tokens: int
    tensors: list[TensorEntry]
    from_cache: bool = False
    facts: Any = field(default=None, compare=False, repr=False)  # the walk a cache hit was verified with

    def tensor_data(self, t: TensorEntry, mm: np.ndarray | None = None) -> np.ndarray:
        """The data of ``t`` as the read-only numpy view ``GGUFReader`` would give (``np_shape``).

        ``mm``: an ``np.memmap(path, mode="r")`` to share between calls (opened when None).
        """
        mm = np.memmap(self.path, mode="r") if mm is None else mm
        dt = np.dtype(t.np_dtype)
        # a plain ndarray over the mapping: dequantising memmap-subclass views costs one
        # __array_finalize__ per row split (seconds on a 135M model)
        return np.asarray(mm[t.data_offset: t.data_offset + t.n_bytes]).view(dt).reshape(t.np_shape)


# ----------------------------------------------------------------------------- reading with gguf-py


def _display_value(f: Any) -> Any:
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 - gguf raises various errors on odd fields
        return None


def header_from_reader(p: Path, reader: Any) -> GGUFHeader:
    """Build the :class:`GGUFHeader` from an open ``gguf.GGUFReader`` (the reader of record)."""
    from infertrace.loading.gguf_lib import gguf

    GGMLQuantizationType = gguf().GGMLQuantizationType

    from infertrace.tokenizer.vocab import _gguf_value

    display: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for k, f in reader.fields.items():
        display[k] = f"<{len(f.data)} entries>" if k in LARGE_ARRAYS else _display_value(f)
        if k.startswith("tokenizer."):
            values[k] = _gguf_value(reader, k)
    tok = reader.fields.get("tokenizer.ggml.tokens")
    tensors = []
    for t in reader.tensors:
        tensors.append(TensorEntry(
            name=t.name, type_id=int(t.tensor_type), type_name=GGMLQuantizationType(t.tensor_type).name,
            shape=[int(x) for x in t.shape], n_bytes=int(t.n_bytes), data_offset=int(t.data_offset),
            np_dtype=t.data.dtype.str, np_shape=[int(x) for x in t.data.shape]))
    return GGUFHeader(p, int(reader.data_offset), display, values, len(tok.data) if tok is not None else 0, tensors)


# ----------------------------------------------------------------------------- the cache


def cache_dir() -> Path | None:
    """``$XDG_CACHE_HOME/infertrace/gguf`` (default ``~/.cache/...``); None when disabled."""
    if os.environ.get("INFERTRACE_NO_CACHE", "").strip() not in ("", "0"):
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "infertrace" / "gguf"


def _gguf_version() -> str:
    try:
        import importlib.metadata as md

        return md.version("gguf")
    except Exception:  # noqa: BLE001 - an unknown version never matches a cached one
        return "unknown"


def _entry_path(d: Path, p: Path, st: os.stat_result) -> Path:
    key = f"{p.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode("utf-8", "surrogateescape")
    return d / (hashlib.sha256(key).hexdigest()[:32] + ".json")


def _header_sha(p: Path, n: int) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        left = n
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _valid_tensor(t: Any, header_len: int, size: int) -> TensorEntry | None:
    if not isinstance(t, dict) or set(t) != {f for f in TensorEntry.__dataclass_fields__}:
        return None
    ints = ("type_id", "n_bytes", "data_offset")
    if not (isinstance(t["name"], str) and isinstance(t["type_name"], str) and all(_is_int(t[k]) for k in ints)
            and isinstance(t["np_dtype"], str) and t["np_dtype"] in _DTYPES):
        return None
    for k in ("shape", "np_shape"):
        if not (isinstance(t[k], list) and 0 < len(t[k]) <= 8 and all(_is_int(x) and x >= 0 for x in t[k])):
            return None
    if not (header_len <= t["data_offset"] and t["n_bytes"] >= 0 and t["data_offset"] + t["n_bytes"] <= size):
        return None
    if int(np.prod(t["np_shape"], dtype=np.int64)) * np.dtype(t["np_dtype"]).itemsize != t["n_bytes"]:
        return None
    return TensorEntry(**t)


def _read_cache(entry: Path, p: Path, st: os.stat_result) -> GGUFHeader | None:
    """The cached header, or None when absent, stale, corrupt or foreign (never raises)."""
    try:
        if not entry.is_file() or entry.stat().st_size > MAX_CACHE_BYTES:
            return None
        d = json.loads(entry.read_text(encoding="utf-8"))
        if not isinstance(d, dict) or d.get("format") != CACHE_FORMAT or d.get("gguf_py") != _gguf_version():
            return None
        hl = d.get("header_len")
        if (d.get("size") != st.st_size or d.get("mtime_ns") != st.st_mtime_ns or not _is_int(hl)
                or not 0 < hl <= st.st_size):
            return None
        if d.get("header_sha256") != _header_sha(p, hl):
            return None
        display, values, n_tokens, raw = d.get("display"), d.get("values"), d.get("n_tokens"), d.get("tensors")
        if not (isinstance(display, dict) and isinstance(values, dict) and _is_int(n_tokens) and n_tokens >= 0
                and isinstance(raw, list)):
            return None
        if not all(isinstance(k, str) and k.startswith("tokenizer.") for k in values):
            return None
        tokens = values.get("tokenizer.ggml.tokens")
        if tokens is not None and (not isinstance(tokens, list) or len(tokens) != n_tokens):
            return None
        tensors = [_valid_tensor(t, hl, st.st_size) for t in raw]
        if any(t is None for t in tensors) or len({t.name for t in tensors}) != len(tensors):
            return None
        return GGUFHeader(p, hl, display, values, n_tokens, tensors, from_cache=True)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a broken cache is a cache miss
        return None


def _write_cache(entry: Path, h: GGUFHeader, st: os.stat_result) -> None:
    """Write ``h`` atomically; any failure (read-only home, full disk, odd values) is ignored."""
    try:
        doc = {"format": CACHE_FORMAT, "gguf_py": _gguf_version(), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
               "header_len": h.header_len, "header_sha256": _header_sha(h.path, h.header_len),
               "display": h.display, "values": h.values, "n_tokens": h.n_tokens,
               "tensors": [asdict(t) for t in h.tensors]}
        text = json.dumps(doc, ensure_ascii=True, allow_nan=True)
        back = json.loads(text)
        if not (_same(back["display"], h.display) and _same(back["values"], h.values)):
            return  # a value JSON cannot hold exactly (e.g. a tuple or numpy scalar): do not cache
        entry.parent.mkdir(parents=True, exist_ok=True)
        from infertrace.safe_io import write_output

        write_output(entry, text.encode("utf-8"), force=True, option="header cache", devices=False)  # never replaces a FIFO or device
    except Exception:  # noqa: BLE001 - caching is an optimisation only
        return


def _same(a: Any, b: Any) -> bool:
    """Equal with equal types (NaN equals NaN): what a JSON round trip must preserve."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _verified(h: GGUFHeader, p: Path) -> bool:
    """The hit ``h`` checked against the file's header bytes (tensor table, keys, every value:
    :mod:`infertrace.loading.gguf_cache_verify`); the walk is kept on ``h.facts``. A poisoned or
    unverifiable entry is a miss (the file is parsed again and the entry rewritten).

    Raises:
        InfertraceError: the file's header itself is broken (check_gguf_header's one line).
    """
    import mmap

    from infertrace.loading.gguf_cache_verify import cached_header_matches_file
    from infertrace.loading.gguf_check import check_gguf_header

    facts = check_gguf_header(p)
    try:
        with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            ok = cached_header_matches_file(h, facts, mm)
    except (OSError, ValueError):
        return False
    h.facts = facts
    return ok


def load_header(p: Path, open_reader: Callable[[Path], Any], use_cache: bool = True) -> tuple[GGUFHeader, Any]:
    """The header of GGUF file ``p``: from the cache when valid, else parsed by ``open_reader(p)``
    (a ``GGUFReader`` after the magic/version checks) and cached.

    Returns:
        ``(header, reader)``; ``reader`` is None on a cache hit.

    A hit is used only when its content equals the file's header (:func:`_verified`).

    Raises:
        InfertraceError: whatever ``open_reader`` raises for a bad file (a cache hit implies the
            same header bytes parsed before).
    """
    d = cache_dir() if use_cache else None
    st = p.stat()
    entry = _entry_path(d, p, st) if d is not None else None
    if entry is not None:
        h = _read_cache(entry, p, st)
        if h is not None and _verified(h, p):
            return h, None
    reader = open_reader(p)
    h = header_from_reader(p, reader)
    if entry is not None:
        _write_cache(entry, h, st)
    return h, reader
