"""The spool a served vLLM's processes write their step records to (:mod:`.plugin`), and its reader
(:mod:`.collect`).

Layout: ``SPOOL/<role>-<pid>/seg-<n>.json`` (+ ``seg-<n>.safetensors`` with the segment's arrays), one
directory per process, ``role`` = ``core`` (the engine core's scheduler records) or ``rank<r>`` (the
model-runner records of tensor-parallel rank r). A segment's JSON is ``{"version", "role", "pid",
"records": [...], "arrays": {key: [record index, field]}, "notes": [...]}``; arrays are stored under
``key`` in the safetensors file (numpy, never pickle).

Safety: the spool and each process directory are created 0700 and opened with ``O_NOFOLLOW`` (a
symlink is refused, never followed); every file is written under a temporary name in the opened
directory (``dir_fd``) and renamed into place (one segment appears whole or not at all); each process
keeps its own bytes under a limit, dropping its oldest segments and saying so in the next one.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

import numpy as np

#: spool format version (``collect`` refuses another)
VERSION = 1
#: default size limit of one process's segments (bytes); ``INFERTRACE_SPOOL_MB`` overrides
DEFAULT_LIMIT = 256 << 20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def open_dir(path: str, create: bool = True) -> int:
    """An fd of directory ``path`` (created 0700 when missing), refusing a symlink or another owner's directory.

    Raises:
        OSError: a symlink (``ELOOP``), not a directory, or owned by another user / open to others.
    """
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    fd = os.open(path, _DIR_FLAGS)
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        os.close(fd)
        raise PermissionError(f"spool directory {path} must be owned by this user and mode 0700")
    return fd


def write_file(dir_fd: int, name: str, data: bytes) -> None:
    """Write ``data`` as ``name`` in the directory ``dir_fd`` atomically (temporary name, then rename), 0600."""
    tmp = f".tmp-{name}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


class SpoolWriter:
    """One process's segments in ``SPOOL/<role>-<pid>/``.

    Args:
        root: the spool directory (``INFERTRACE_SPOOL``); role: ``core`` or ``rank<r>``;
        limit: the most bytes this process keeps (oldest segments dropped beyond it).

    Raises:
        OSError: the spool or process directory is a symlink, not a directory, or not private.
    """

    def __init__(self, root: str, role: str, limit: int = DEFAULT_LIMIT):
        self.role, self.limit, self.pid = role, limit, os.getpid()
        root_fd = open_dir(root)
        try:
            name = f"{role}-{self.pid}"
            try:
                os.mkdir(name, 0o700, dir_fd=root_fd)
            except FileExistsError:
                pass
            self.fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
        finally:
            os.close(root_fd)
        if not stat.S_ISDIR(os.fstat(self.fd).st_mode):  # pragma: no cover - O_DIRECTORY already refuses
            raise NotADirectoryError(name)
        self.n = 0
        self.kept: list[tuple[int, int]] = []  # (segment number, bytes)
        self.dropped: tuple[int, int] | None = None  # the oldest and newest segment dropped so far

    def write(self, records: list[dict[str, Any]], arrays: dict[str, np.ndarray] | None = None) -> None:
        """Write one segment: ``records`` (JSON-able) and ``arrays`` (name -> numpy array, any shape)."""
        from safetensors.numpy import save

        self.n += 1
        arrays = arrays or {}
        blob = save({k: np.ascontiguousarray(v) for k, v in arrays.items()}) if arrays else b""
        body = json.dumps(records, separators=(",", ":")).encode()
        self._bound(len(body) + len(blob) + 512)  # room for this segment first: its note then says what went
        notes = ([f"spool limit {self.limit} bytes: dropped segments {self.dropped[0]}..{self.dropped[1]} (oldest first)"]
                 if self.dropped else [])  # every segment after a drop says so (older notes may be dropped too)
        doc = {"version": VERSION, "role": self.role, "pid": self.pid, "segment": self.n, "records": records,
               "arrays": sorted(arrays), "notes": notes}
        text = json.dumps(doc, separators=(",", ":")).encode()
        if blob:
            write_file(self.fd, f"seg-{self.n:06d}.safetensors", blob)
        write_file(self.fd, f"seg-{self.n:06d}.json", text)
        self.kept.append((self.n, len(text) + len(blob)))

    def _bound(self, incoming: int) -> None:
        """Drop the oldest segments until ``incoming`` more bytes fit under the limit (segment 1, the process's
        header, always stays)."""
        total = sum(b for _, b in self.kept) + incoming
        dropped = []
        while total > self.limit and len(self.kept) > 1:
            n, b = self.kept.pop(1)
            for ext in ("json", "safetensors"):
                try:
                    os.unlink(f"seg-{n:06d}.{ext}", dir_fd=self.fd)
                except FileNotFoundError:
                    pass
            total -= b
            dropped.append(n)
        if dropped:
            self.dropped = (self.dropped[0] if self.dropped else dropped[0], dropped[-1])

    def close(self) -> None:
        """Close the directory fd."""
        try:
            os.close(self.fd)
        except OSError:
            pass
