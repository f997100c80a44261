"""Byte-level builders for hostile GGUF files (tests and fuzz targets).

``gguf_bytes`` writes the GGUF v3 layout by hand (so counts, lengths, types and offsets can be
anything, unlike gguf-py's GGUFWriter); ``patch_kv`` rewrites one key's type and value in place
in a file GGUFWriter wrote (same encoded size only).
"""

from __future__ import annotations

import struct
from pathlib import Path

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
F32 = 0  # ggml type


def s(text: str | bytes, length: int | None = None) -> bytes:
    """GGUF string: u64 length + bytes (``length`` overrides the stored length)."""
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b) if length is None else length) + b


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    """One key/value record: key string, u32 value type, raw payload."""
    return s(key) + struct.pack("<I", vtype) + payload


def arr(itype: int, count: int, items: bytes = b"") -> bytes:
    """Array payload: u32 item type, u64 count, items."""
    return struct.pack("<IQ", itype, count) + items


def tensor_info(name: str, dims: list[int], ggml_type: int = F32, offset: int = 0, n_dims: int | None = None) -> bytes:
    """One tensor-info record."""
    return (s(name) + struct.pack("<I", len(dims) if n_dims is None else n_dims)
            + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ggml_type, offset))


def gguf_bytes(kvs: list[bytes] = (), tensors: list[bytes] = (), data: bytes = b"", n_kv: int | None = None,
               n_tensors: int | None = None, version: int = 3, alignment: int = 32) -> bytes:
    """A whole GGUF file: header, key/values, tensor infos, padding to ``alignment``, ``data``."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    pad = (-len(body)) % alignment if tensors else 0
    return body + b"\0" * pad + data


def g1_bytes() -> bytes:
    """Case G1: magic, version 3, 0 tensors, 1 kv, a one-byte key, ARRAY of UINT8 with count 2^62 (49 bytes)."""
    b = gguf_bytes([kv("k", ARRAY, arr(UINT8, 1 << 62))])
    assert len(b) == 49
    return b


def find_kv(raw: bytes, key: str) -> int:
    """Offset of the u32 value type that follows ``key`` in a GGUF file."""
    needle = s(key)
    i = raw.find(needle)
    if i < 0:
        raise KeyError(key)
    return i + len(needle)


def patch_kv(path: Path, key: str, vtype: int, payload: bytes) -> Path:
    """Rewrite ``key``'s value type and value in place; the new payload must have the old size."""
    raw = bytearray(path.read_bytes())
    at = find_kv(bytes(raw), key)
    old_type = struct.unpack_from("<I", raw, at)[0]
    old_size = {UINT32: 4, INT32: 4, FLOAT32: 4, UINT64: 8, INT64: 8, FLOAT64: 8, BOOL: 1, UINT8: 1}[old_type]
    assert len(payload) == old_size, (key, old_type, len(payload))
    raw[at:at + 4] = struct.pack("<I", vtype)
    raw[at + 4:at + 4 + old_size] = payload
    path.write_bytes(bytes(raw))
    return path
