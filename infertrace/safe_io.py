"""Reading untrusted files and writing outputs without surprises.

Reading (:func:`read_regular`): only regular files are read — a FIFO, a device such as
``/dev/zero`` or a directory is refused before a byte is read (``open`` with ``O_NONBLOCK``,
then ``fstat``), and at most ``limit`` bytes are read. :func:`safetensors_header` parses a
``.safetensors`` header itself (8-byte length bounded, JSON, every tensor's dtype, shape and
byte range inside the file, ranges in order and not overlapping) before the library maps it.

Writing a file: every file the tool writes goes through :func:`write_output` (``report -o``,
the model and GGUF-header caches). It looks at what is at the destination first (``lstat``):

* nothing: the data go to a temporary file next to it (``O_CREAT | O_EXCL | O_NOFOLLOW``, a name
  planted there is never followed or reused), which is then hard-linked to the destination
  (``os.link`` fails when the name exists): the destination is created exclusively and whole;
  of two writers racing for one new name, one gets it and the other "exists (taken ...)", exit 2;
* a regular file: refused without ``force``; with it, replaced atomically: the temporary file and
  the name are swapped (``renameat2(RENAME_EXCHANGE)``) and what came out must be the file seen
  before, else it is swapped back (``os.replace`` after a re-check where the call is missing);
* a character device (``/dev/null``, a terminal) or a FIFO, directly or through a symlink
  (``/dev/stdout``): written through, never unlinked or replaced (a FIFO must get a reader
  within :data:`FIFO_WAIT_S` seconds, else one line);
* a symlink to a regular file or to nothing: refused without ``force``; with it the link itself
  is replaced (its target is never written), except a system alias under ``/dev`` or ``/proc``;
* a directory, socket, block device: refused in one line, ``force`` or not.

:func:`write_file_atomic` is the temporary-file-and-replace step alone. :func:`fresh_dir_beside` makes the temporary directory of
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
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable, Union

from infertrace.errors import InfertraceError
from infertrace.safe_text import visible

#: bytes read from a trace.json at most (limit MAX_MANIFEST_BYTES)
MAX_MANIFEST_BYTES = 256 << 20
#: safetensors' own header limit (the Rust reader refuses more)
MAX_ST_HEADER = 100 << 20
#: seconds a FIFO named as an input or output may take to get its other end (writer / reader)
FIFO_WAIT_S = 5.0

ST_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
#: torch dtype names (as trace.json's tensor index writes them) -> safetensors dtype
TORCH_TO_ST = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
               "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def _name(path: Any) -> str:
    """A path for a one-line message: terminal-safe, and named in at most 200 characters (a path of
    thousands of characters is clipped, not echoed whole)."""
    t = visible(str(path))
    return t if len(t) <= 200 else t[:199] + "…"


def read_regular(path: str | Path, limit: int, what: str = "file") -> bytes:
    """The bytes of ``path`` when it is a regular file of at most ``limit`` bytes.

    Raises:
        InfertraceError: missing, not a regular file (FIFO, device, directory, socket), larger
            than ``limit``, unreadable.
    """
    p = _name(path)
    fd, st = open_regular(path, what)
    try:
        if st.st_size > limit:
            raise InfertraceError(f"{p} is {st.st_size} bytes, more than the limit of {limit} for a {what}")
        return _read_bounded(fd, limit, f"{p} grew past the limit of {limit} bytes for a {what} while being read")
    except OSError as e:
        raise InfertraceError(f"cannot read {p}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def open_regular(path: str | Path, what: str = "file", follow: bool = True) -> tuple[int, os.stat_result]:
    """Open ``path`` read-only when it is a regular file: ``O_NONBLOCK`` (a FIFO does not block the
    open) and ``O_NOCTTY``, then ``fstat`` on the open descriptor (no race with a swapped name);
    ``follow=False`` adds ``O_NOFOLLOW`` (a symlink as the last component is refused). The caller
    closes the descriptor.

    Returns:
        ``(fd, stat)`` of the open file.

    Raises:
        InfertraceError: missing, a symlink (``follow=False``), not a regular file (FIFO, device,
            directory, socket), unreadable.
    """
    p = _name(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if not follow and e.errno == errno.ELOOP:
            raise InfertraceError(f"{p} is a symlink; give the {what} itself (symlinks are not followed)") from None
        raise InfertraceError(f"cannot read {p}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise InfertraceError(f"cannot read {p}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InfertraceError(f"{p} is not a regular file; give the {what} itself (not a pipe, device or directory)")
    return fd, st


def _read_bounded(fd: int, limit: int, over: str) -> bytes:
    """Read ``fd`` to its end in chunks of at most 1 MiB, never more than ``limit`` + 1 bytes in all.

    Raises:
        InfertraceError: ``over`` when more than ``limit`` bytes arrive.
        OSError: a failed read (the callers turn it into one line).
    """
    chunks, n = [], 0
    while True:
        b = os.read(fd, min(1 << 20, limit + 1 - n))
        if not b:
            return b"".join(chunks)
        chunks.append(b)
        n += len(b)
        if n > limit:
            raise InfertraceError(over)


def pread_exact(fd: int, offset: int, n: int, short: str) -> bytes:
    """Exactly ``n`` bytes of ``fd`` from ``offset`` (``os.pread`` in chunks of at most 1 MiB: the
    file position is not moved, nothing past ``offset + n`` is read).

    Raises:
        InfertraceError: ``short`` when the file ends (or shrank) before ``offset + n``.
        OSError: a failed read (the callers turn it into one line).
    """
    chunks, got = [], 0
    while got < n:
        b = os.pread(fd, min(1 << 20, n - got), offset + got)
        if not b:
            raise InfertraceError(short)
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def read_input(path: str | Path, limit: int, what: str = "file") -> bytes:
    """The bytes of an input that may also be a pipe: a regular file (as :func:`read_regular`) or a
    FIFO / pipe (``--prompts <(cmd)``, ``/dev/stdin`` from a pipe), opened by :func:`open_fifo` so a
    FIFO nobody writes is refused after :data:`FIFO_WAIT_S` seconds instead of blocking for ever;
    at most ``limit`` bytes either way.

    Raises:
        InfertraceError: missing, a device / socket / directory, a FIFO with no writer, over ``limit``,
            unreadable.
    """
    p = _name(path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise InfertraceError(f"cannot read the {what} {p}: {e.strerror or e}") from None
    if stat.S_ISREG(st.st_mode):
        return read_regular(path, limit, what)
    if not stat.S_ISFIFO(st.st_mode):
        raise InfertraceError(f"{p} is {_kind(st.st_mode)}; give the {what} itself or a pipe such as <(cat FILE)")
    try:
        fd = open_fifo(path, write=False, what=what)
    except OSError as e:
        raise InfertraceError(f"cannot read {p}: {e.strerror or e}") from None
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise InfertraceError(f"{p} changed while being opened; run again")
        return _read_bounded(fd, limit, f"{p} is over the limit of {limit} bytes for a {what}")
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


#: what :func:`write_output` writes: bytes, or a function filling an open binary file (large outputs)
Payload = Union[bytes, Callable[[BinaryIO], None]]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _fill(f: BinaryIO, data: Payload) -> None:
    if isinstance(data, (bytes, bytearray, memoryview)):
        f.write(data)
    else:
        data(f)


def _temp_beside(target: Path) -> tuple[int, Path]:
    """A new temporary file next to ``target``: ``(fd, path)``; ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0644 before umask."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
    for _ in range(100):
        tmp = target.with_name(f".{target.name}.{os.urandom(6).hex()}.tmp")
        try:
            return os.open(tmp, flags, 0o644), tmp
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, "cannot create a temporary file", str(target.parent))  # pragma: no cover


def _write_temp(target: Path, data: Payload) -> Path:
    """``data`` in a fresh temporary file next to ``target`` (flushed and fsynced); its path."""
    fd, tmp = _temp_beside(target)
    try:
        with os.fdopen(fd, "wb") as f:
            _fill(f, data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return tmp


def _unlink_quietly(p: Path) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def write_file_atomic(path: str | Path, data: Payload) -> None:
    """Write ``data`` to ``path`` through a fresh temporary file in the same directory
    (``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0644 before umask) and ``os.replace``. It replaces
    whatever name is at ``path``: callers check first (:func:`write_output` does).

    Raises:
        OSError: the caller turns it into its one-line message.
    """
    target = Path(path)
    tmp = _write_temp(target, data)
    try:
        os.replace(tmp, target)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _kind(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a character device" if stat.S_ISCHR(mode) else "not a regular file")


def open_fifo(path: str | Path, write: bool, wait_s: float | None = None, what: str = "file") -> int:
    """Open the FIFO ``path`` without blocking for ever: ``O_NONBLOCK``, then wait at most
    ``wait_s`` (default :data:`FIFO_WAIT_S`) seconds for its other end; the descriptor is returned
    in blocking mode. For reading, the writer must have written something (or closed) by the
    deadline (``poll``).

    Raises:
        InfertraceError: no reader (writing) / no writer (reading) within the deadline.
        OSError: other open failures.
    """
    import select

    wait = FIFO_WAIT_S if wait_s is None else wait_s
    deadline = time.monotonic() + wait
    p = _name(path)
    if write:
        while True:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | _O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
                break
            except OSError as e:
                if e.errno != errno.ENXIO:  # ENXIO: a FIFO with no reader
                    raise
                if time.monotonic() >= deadline:
                    raise InfertraceError(f"{p} is a FIFO with no reader after {wait:g} s; start its reader first "
                                          "or give a regular file") from None
                time.sleep(0.05)
        os.set_blocking(fd, True)
        return fd
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    try:
        # Linux: a FIFO opened for reading signals nothing until a writer opens it and writes (POLLIN)
        # or opens and closes it (POLLHUP, an empty input); a FIFO nobody writes stays silent
        po = select.poll()
        po.register(fd, select.POLLIN | select.POLLHUP)
        if not po.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            raise InfertraceError(f"{p} is a FIFO with nothing written to it after {wait:g} s; give the {what} "
                                  "itself, or a pipe with a writer (such as <(cat FILE))")
    except BaseException:
        os.close(fd)
        raise
    os.set_blocking(fd, True)
    return fd


def write_output(path: str | Path, data: Payload, force: bool, option: str = "-o", devices: bool = True) -> str:
    """Write ``data`` to the destination ``path`` the safe way for what is there (see the module
    docstring): create exclusively, replace a regular file atomically with ``force``, write through a
    character device or FIFO, refuse anything else. Never unlinks or replaces a device node, FIFO,
    socket or directory, and never writes through a symlink to a regular file.

    Args:
        path: the destination named by the user (``option`` names it in messages).
        data: bytes, or ``fill(f)`` writing into a binary file object.
        force: replace an existing regular file (or a symlink to one: the link is replaced).
        devices: write through a character device or FIFO (False for caches: refused instead).

    Returns:
        ``"created"``, ``"replaced"`` or ``"written through"`` (a device or FIFO).

    Raises:
        InfertraceError: exists without ``force`` (also when another writer created it meanwhile),
            a directory / socket / block device, a FIFO without a reader, a system alias to a
            regular file, the destination changed while being written.
        OSError: other failures (the caller words them).
    """
    target = Path(path)
    shown = _name(path)
    action, st = _classify(target, force, option)
    if action == "through" and not devices:
        raise InfertraceError(f"{option} {shown} is not a regular file (a device or FIFO); remove it and run again")
    if action == "create":
        return _create_exclusive(target, data, shown, option)
    if action == "through":
        return _write_through(target, data, shown)
    assert st is not None
    return _replace(target, data, st, shown, option)


def check_destination(path: str | Path, force: bool, option: str = "-o") -> str:
    """What :func:`write_output` would do with ``path`` now, without writing: ``"create"``,
    ``"replace"`` or ``"through"`` (commands call it before expensive work; the write checks again).

    Raises:
        InfertraceError: as :func:`write_output` refuses.
    """
    return _classify(Path(path), force, option)[0]


def _classify(target: Path, force: bool, option: str) -> tuple[str, os.stat_result | None]:
    shown = _name(target)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return "create", None
    except OSError as e:  # ENOTDIR (a file used as a folder: -o reg/x.html), ELOOP, EACCES, ENAMETOOLONG
        raise InfertraceError(f"cannot write {option} {shown}: {e.strerror or e}; give a path in an existing directory") from None
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        try:
            end = os.stat(target)
        except OSError:
            end = None  # dangling or a loop: only the link itself can be replaced
        if end is not None and (stat.S_ISCHR(end.st_mode) or stat.S_ISFIFO(end.st_mode)):
            return "through", st
        if end is not None and not stat.S_ISREG(end.st_mode):
            raise InfertraceError(f"{option} {shown} is a symlink to {_kind(end.st_mode)}; give a file name")
        if not force:
            raise InfertraceError(f"{shown} exists; pass --force to replace it or choose another {option}")
        parent = os.path.realpath(target.parent)
        if parent in ("/dev", "/proc") or parent.startswith(("/dev/", "/proc/")):
            raise InfertraceError(f"{option} {shown} is a system alias of a regular file; give that file's own name")
        return "replace", st
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
        return "through", st
    if not stat.S_ISREG(mode):
        raise InfertraceError(f"{option} {shown} is {_kind(mode)}; give a file name (it is never replaced)")
    if not force:
        raise InfertraceError(f"{shown} exists; pass --force to replace it or choose another {option}")
    return "replace", st


def _create_exclusive(target: Path, data: Payload, shown: str, option: str) -> str:
    tmp = _write_temp(target, data)
    try:
        os.link(tmp, target, follow_symlinks=False)  # atomic and exclusive: EEXIST when the name was taken
        return "created"
    except FileExistsError:
        raise InfertraceError(f"{shown} exists (taken by another writer meanwhile); nothing was replaced, "
                              f"choose another {option}") from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.EXDEV, errno.ENOSYS):
            raise
    finally:
        _unlink_quietly(tmp)
    # a file system without hard links: create the name itself exclusively and write into it
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o644)
    except FileExistsError:
        raise InfertraceError(f"{shown} exists (taken by another writer meanwhile); nothing was replaced, "
                              f"choose another {option}") from None
    with os.fdopen(fd, "wb") as f:
        _fill(f, data)
    return "created"


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, stat.S_IFMT(a.st_mode)) == (b.st_dev, b.st_ino, stat.S_IFMT(b.st_mode))


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    call or flag is not available (then the caller falls back to ``os.replace``).

    Raises:
        OSError: the exchange failed for another reason (``ENOENT``: ``b`` vanished).
    """
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(str(a)), at_fdcwd, os.fsencode(str(b)), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _replace(target: Path, data: Payload, before: os.stat_result, shown: str, option: str) -> str:
    """Replace the regular file (or symlink) ``target`` seen as ``before``. With ``RENAME_EXCHANGE`` the new
    file and the old name are swapped atomically and what came out is checked: anything but the file
    seen before (a device node or FIFO swapped in meanwhile) is swapped back, never unlinked."""
    tmp = _write_temp(target, data)
    changed = InfertraceError(f"{option} {shown} changed while the output was being written; nothing was replaced")
    try:
        if _exchange(tmp, target):
            if not _same(os.lstat(tmp), before):  # tmp now names what was at target
                _exchange(tmp, target)
                raise changed
            return "replaced"
        if not _same(os.lstat(target), before):  # no RENAME_EXCHANGE: check, then replace (a narrow window)
            raise changed
        os.replace(tmp, target)
        return "replaced"
    except FileNotFoundError:
        raise InfertraceError(f"{option} {shown} disappeared while the output was being written; run again") from None
    finally:
        _unlink_quietly(tmp)  # the old file after an exchange; the unused new one otherwise


def _write_through(target: Path, data: Payload, shown: str) -> str:
    """Write into an existing character device or FIFO (opened without O_CREAT/O_TRUNC, checked by fstat)."""
    st = os.stat(target)
    if stat.S_ISFIFO(st.st_mode):
        fd = open_fifo(target, write=True)
    else:
        fd = os.open(target, os.O_WRONLY | _O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    try:
        got = os.fstat(fd)
        if not (stat.S_ISCHR(got.st_mode) or stat.S_ISFIFO(got.st_mode)):  # swapped meanwhile: never write into it
            raise InfertraceError(f"{shown} changed while being opened; nothing was written")
        with os.fdopen(fd, "wb", closefd=False) as f:
            _fill(f, data)
    finally:
        os.close(fd)
    return "written through"


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
    names = os.listdir(target)
    others = sorted(set(names) - set(replaceable))
    if others:
        raise DirTaken(f"{target} holds {visible(others[0])!r}, which is not part of a saved trace; not replacing it")
    for n in names:  # a FIFO, device node or symlink under a trace file's name is not a trace file: never deleted
        mode = os.lstat(target / n).st_mode
        if not stat.S_ISREG(mode):
            raise DirTaken(f"{target} holds {visible(n)!r}, which is {_kind(mode)}, not a saved trace file; not replacing it")
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    os.rmdir(aside)  # reserve a unique name, then move the old directory onto it
    os.rename(target, aside)
    try:
        os.rename(tmp, target)
    except OSError:
        os.rename(aside, target)  # put the old trace back
        raise
    shutil.rmtree(aside, ignore_errors=True)
