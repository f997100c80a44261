"""Reading untrusted files and writing outputs without surprises.

Reading (:func:`read_regular`): only regular files are read — a FIFO, a device such as
``/dev/zero`` or a directory is refused before a byte is read (``open`` with ``O_NONBLOCK``,
then ``fstat``), and at most ``limit`` bytes are read. :func:`safetensors_header` parses a
``.safetensors`` header itself (8-byte length bounded, JSON, every tensor's dtype, shape and
byte range inside the file, ranges in order and not overlapping) before the library maps it.

Writing: :func:`write_file_atomic` creates a temporary file next to the target with
``O_CREAT | O_EXCL | O_NOFOLLOW`` (a name planted there, symlink or not, is never followed or
reused) and renames it over the target with ``os.replace`` (a symlink planted at the target
is replaced, not followed). :func:`fresh_dir_beside` makes the temporary directory of
``run --save`` with :func:`tempfile.mkdtemp` (exclusive, mode 0700) next to the target, and
:func:`publish_dir` renames it into place: ``os.rename`` onto a name that does not exist,
or, for ``--force``/an empty target, the old directory is renamed aside first and deleted
after the new one is in place. Two writers racing for one new name: exactly one rename
succeeds; the other gets :class:`DirTaken`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

from infertrace.errors import InfertraceError
from infertrace.safe_text import visible

#: bytes read from a trace.json at most (limit MAX_MANIFEST_BYTES)
MAX_MANIFEST_BYTES = 256 << 20
#: safetensors' own header limit (the Rust reader refuses more)
MAX_ST_HEADER = 100 << 20

ST_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
#: torch dtype names (as trace.json's tensor index writes them) -> safetensors dtype
TORCH_TO_ST = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
               "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def _name(path: Any) -> str:
    return visible(str(path))


def read_regular(path: str | Path, limit: int, what: str = "file") -> bytes:
    """The bytes of ``path`` when it is a regular file of at most ``limit`` bytes.

    Raises:
        InfertraceError: missing, not a regular file (FIFO, device, directory, socket), larger
            than ``limit``, unreadable.
    """
    p = _name(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise InfertraceError(f"cannot read {p}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InfertraceError(f"{p} is not a regular file; give the {what} itself (not a pipe, device or directory)")
        if st.st_size > limit:
            raise InfertraceError(f"{p} is {st.st_size} bytes, more than the limit of {limit} for a {what}")
        chunks, n = [], 0
        while True:
            b = os.read(fd, min(1 << 20, limit + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
            if n > limit:
                raise InfertraceError(f"{p} grew past the limit of {limit} bytes for a {what} while being read")
        return b"".join(chunks)
    except OSError as e:
        raise InfertraceError(f"cannot read {p}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def parse_json(data: bytes | str, where: str) -> Any:
    """``json.loads`` whose every failure is one InfertraceError line: bad UTF-8, syntax, an
    integer longer than Python's int-string limit, nesting deeper than the parser's recursion.
    Syntax errors raise :class:`json.JSONDecodeError` for the caller's own wording."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError:
        raise InfertraceError(f"{where}: not UTF-8 text (corrupted?)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise InfertraceError(f"{where}: JSON nested too deeply to be a trace") from None
    except ValueError as e:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise InfertraceError(f"{where}: invalid JSON value ({' '.join(str(e).split())[:120]})") from None


def safetensors_header(path: str | Path) -> dict[str, dict[str, Any]]:
    """``{name: {"dtype", "shape", "data_offsets"}}`` of a safetensors file, checked against the file.

    Checks: regular file; 8-byte little-endian header length at most :data:`MAX_ST_HEADER` and
    inside the file; header a JSON object; each tensor a known dtype, a shape of non-negative
    ints, ``data_offsets = [begin, end]`` with ``end - begin = numel × itemsize``; the ranges,
    sorted, start at 0, touch without overlap and end exactly at the end of the file.

    Raises:
        InfertraceError: naming the file and the first problem.
    """
    p = _name(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise InfertraceError(f"cannot read {p}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InfertraceError(f"{p} is not a regular file")
        size = st.st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise InfertraceError(f"{p}: shorter than a safetensors header (truncated?); re-save the trace")
        n = int.from_bytes(head, "little")
        if n > MAX_ST_HEADER or 8 + n > size:
            raise InfertraceError(f"{p}: header length {n} runs past the file ({size} bytes) or the limit "
                                  f"{MAX_ST_HEADER}; the file is truncated or not safetensors")
        raw = os.pread(fd, n, 8)
    except OSError as e:
        raise InfertraceError(f"cannot read {p}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    try:
        header = parse_json(raw, p)
    except json.JSONDecodeError as e:
        raise InfertraceError(f"{p}: header is not valid JSON ({e.msg})") from None
    if not isinstance(header, dict):
        raise InfertraceError(f"{p}: header is not a JSON object")
    data_len = size - 8 - n
    spans = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        w = f"{p}: tensor {visible(name)[:80]!r}"
        if not isinstance(t, dict) or t.get("dtype") not in ST_DTYPES or not isinstance(t.get("shape"), list) \
                or not isinstance(t.get("data_offsets"), list) or len(t["data_offsets"]) != 2:
            raise InfertraceError(f"{w}: malformed header entry")
        shape, (b, e) = t["shape"], t["data_offsets"]
        if len(shape) > 8 or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 40 for x in shape):
            raise InfertraceError(f"{w}: malformed shape")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (b, e)) or not 0 <= b <= e <= data_len:
            raise InfertraceError(f"{w}: data offsets outside the file (truncated?); re-save the trace")
        numel = 1
        for x in shape:
            numel *= x
        if e - b != numel * ST_DTYPES[t["dtype"]]:
            raise InfertraceError(f"{w}: {e - b} bytes for shape {shape} {t['dtype']}")
        spans.append((b, e))
    spans.sort()
    end = 0
    for b, e in spans:
        if b != end:
            raise InfertraceError(f"{p}: tensor data ranges overlap or leave gaps")
        end = e
    if end != data_len:
        raise InfertraceError(f"{p}: size does not match its header (truncated?); re-save the trace")
    return {k: v for k, v in header.items() if k != "__metadata__"}


# ----------------------------------------------------------------------------- writing


def write_file_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a fresh temporary file in the same directory
    (``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0644 before umask) and ``os.replace``.

    Raises:
        OSError: the caller turns it into its one-line message.
    """
    target = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = target.with_name(f".{target.name}.{os.urandom(6).hex()}.tmp")
        try:
            fd = os.open(tmp, flags, 0o644)
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover
        raise OSError(errno.EEXIST, "cannot create a temporary file", str(target.parent))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class DirTaken(Exception):
    """The target directory of :func:`publish_dir` appeared (another writer) or is not empty."""


def fresh_dir_beside(target: str | Path) -> Path:
    """A new, empty, private directory next to ``target`` (same file system, so a rename is atomic).

    Raises:
        OSError: the parent does not exist or cannot be written.
    """
    t = Path(target)
    parent = t.parent if str(t.parent) else Path(".")
    d = Path(tempfile.mkdtemp(prefix=f".{t.name}.", suffix=".saving", dir=parent))
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(d, 0o777 & ~mask)  # the published directory gets the usual mode, not mkdtemp's 0700
    return d


def publish_dir(tmp: Path, target: Path, replace: bool, replaceable: frozenset[str] = frozenset()) -> None:
    """Move the finished directory ``tmp`` to ``target`` atomically.

    ``target`` missing: ``os.rename`` (fails if another writer got there first). ``target`` an
    empty directory, or ``replace`` and it holds only names in ``replaceable``: the old directory is
    renamed aside (an exclusive name), the new one renamed in, then the old one deleted; a
    directory that is not empty without ``replace``, or holding other files, is left alone.

    Raises:
        DirTaken: ``target`` exists (non-empty, not ``replace``) or appeared meanwhile, or is not a directory.
        OSError: other failures (``tmp`` is left for the caller to remove).
    """
    if not os.path.lexists(target):
        try:
            os.rename(tmp, target)  # a directory onto a non-existent name: atomic, exclusive
            return
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                raise
            # another writer created it meanwhile; fall through and treat it like an existing one
    if os.path.islink(target) or not target.is_dir():
        raise DirTaken(f"{target} exists and is not a directory")
    if not replace:
        try:
            os.rmdir(target)  # only an empty directory goes; another writer's content never does
        except OSError:
            raise DirTaken(f"{target} is not empty") from None
        try:
            os.rename(tmp, target)
            return
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise DirTaken(f"{target} was taken by another writer") from None
            raise
    others = sorted(set(os.listdir(target)) - set(replaceable))
    if others:
        raise DirTaken(f"{target} holds {visible(others[0])!r}, which is not part of a saved trace; not replacing it")
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    os.rmdir(aside)  # reserve a unique name, then move the old directory onto it
    os.rename(target, aside)
    try:
        os.rename(tmp, target)
    except OSError:
        os.rename(aside, target)  # put the old trace back
        raise
    shutil.rmtree(aside, ignore_errors=True)
