"""A cached GGUF header checked against the file's own header bytes on every cache hit.

The header cache (:mod:`infertrace.loading.gguf_meta`) is found by the file's path, size and
mtime and used only when the SHA-256 of the file's header bytes is the recorded one — but that
digest says the *file* is unchanged, not that the cached *content* came from it: an entry whose
tensor table (a type, a shape, an offset) or metadata was edited after it was written still
carries the right digest. So on every hit the content itself is compared with the file:

* the tensor table is re-derived from :func:`~infertrace.loading.gguf_check.check_gguf_header`'s
  walk of the file (which runs on every load anyway) exactly as gguf-py's ``GGUFReader`` derives
  it (``_build_tensors``: numpy dtype per ggml type, byte shape for quantised types, the file's
  byte order) and must equal the cached table entry for entry;
* the metadata keys must be the file's keys, and every cached value (the ``inspect`` view and
  the ``tokenizer.*`` values the tokenizer is built from) is encoded back into GGUF bytes with the
  value type the file gives and must equal the file's bytes of that value.

A value that cannot be encoded back exactly (a NaN payload, invalid UTF-8 read leniently, a
nested array) makes the entry unverifiable: it is then a miss, and gguf-py parses the file
again — never a wrong header. Cost: O(header bytes), a few tens of ms for a 49k-token vocabulary.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

#: metadata arrays the header cache shows as a count only (the tokenizer's), re-encoded from the file on a hit
LARGE_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")

#: GGUF scalar value type -> struct / numpy format character
_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
#: the pseudo-keys gguf-py's reader adds to ``fields`` (not key/value records of the file)
PSEUDO_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")


class _Unverifiable(Exception):
    """Internal: the cached value cannot be encoded back into GGUF bytes."""


def _scalar(vtype: int, v: Any, order: str) -> bytes:
    if vtype == 7:
        if not isinstance(v, bool):
            raise _Unverifiable
    elif vtype in (6, 12):
        if not isinstance(v, float) or v != v:  # NaN payloads do not round-trip: unverifiable
            raise _Unverifiable
    elif not isinstance(v, int) or isinstance(v, bool):
        raise _Unverifiable
    try:
        return struct.pack(order + _FMT[vtype], v)
    except (struct.error, OverflowError):
        raise _Unverifiable from None


def _string(v: Any, order: str) -> bytes:
    if not isinstance(v, str):
        raise _Unverifiable
    try:
        b = v.encode("utf-8")  # a value decoded with U+FFFD replacements encodes differently: a mismatch
    except UnicodeEncodeError:
        raise _Unverifiable from None
    return struct.pack(order + "Q", len(b)) + b


def encode_value(vtype: int, v: Any, raw: bytes, order: str) -> bytes:
    """``v`` encoded as a GGUF value of ``vtype`` (arrays take their item type from ``raw``, the
    file's bytes of the value); raises :class:`_Unverifiable` when it cannot be encoded exactly."""
    if vtype in _FMT:
        return _scalar(vtype, v, order)
    if vtype == _STRING:
        return _string(v, order)
    if vtype != _ARRAY or not isinstance(v, list) or len(raw) < 12:
        raise _Unverifiable
    (itype,) = struct.unpack_from(order + "I", raw, 0)
    head = struct.pack(order + "IQ", itype, len(v))
    if itype == _STRING:
        return head + b"".join(_string(x, order) for x in v)
    if itype not in _FMT:
        raise _Unverifiable  # nested arrays: gguf-py flattens them, they do not round-trip
    kinds = (bool,) if itype == 7 else (float,) if itype in (6, 12) else (int,)
    if not all(isinstance(x, kinds) and (itype == 7 or not isinstance(x, bool)) for x in v):
        raise _Unverifiable
    if itype in (6, 12) and any(x != x for x in v):
        raise _Unverifiable
    try:
        body = np.array(v, dtype=np.dtype(_FMT[itype]).newbyteorder(order)).tobytes()
    except (OverflowError, ValueError):
        raise _Unverifiable from None
    return head + body


def expected_tensors(facts: Any) -> list[dict[str, Any]]:
    """The tensor table as gguf-py's ``GGUFReader._build_tensors`` computes it from the walked
    header ``facts`` (:class:`~infertrace.loading.gguf_check.GGUFHeaderFacts`): one dict per
    tensor with the fields of :class:`~infertrace.loading.gguf_meta.TensorEntry`."""
    from infertrace.loading.gguf_lib import gguf

    g = gguf()
    Q = g.GGMLQuantizationType
    plain = {Q.F16: "f2", Q.F32: "f4", Q.F64: "f8", Q.I8: "i1", Q.I16: "i2", Q.I32: "i4", Q.I64: "i8"}
    out = []
    for t in facts.tensors:
        q = Q(t.ggml_type)
        np_shape = list(reversed(t.dims))  # numpy order
        if q in plain:
            np_dtype = np.dtype(plain[q]).newbyteorder(facts.byte_order).str
        else:
            block, type_size = g.GGML_QUANT_SIZES[q]
            np_dtype, np_shape = "|u1", np_shape[:-1] + [np_shape[-1] // block * type_size]
        out.append({"name": t.name, "type_id": int(t.ggml_type), "type_name": q.name, "shape": list(t.dims),
                    "n_bytes": t.n_bytes, "data_offset": facts.data_offset + t.offset, "np_dtype": np_dtype,
                    "np_shape": np_shape})
    return out


def cached_header_matches_file(h: Any, facts: Any, buf: Any) -> bool:
    """True when the cached header ``h`` (:class:`~infertrace.loading.gguf_meta.GGUFHeader`) is
    what the file says: same data offset, same tensor table, same keys, and every cached value
    equal to the file's bytes of it (``buf``: the file's bytes, e.g. a read-only mmap; ``facts``:
    the walk of the same file). False — the caller re-parses — for any difference or any value
    that cannot be checked."""
    from dataclasses import asdict

    if h.header_len != facts.data_offset or [asdict(t) for t in h.tensors] != expected_tensors(facts):
        return False
    if set(h.display) != set(facts.spans) | set(PSEUDO_KEYS) or not set(h.values) <= set(facts.spans):
        return False
    if [h.display[k] for k in PSEUDO_KEYS] != [facts.version, facts.n_tensors, facts.n_kv]:
        return False
    try:
        for key, (vtype, start, end) in facts.spans.items():
            raw = bytes(buf[start:end])
            shown = h.display[key]
            if key in LARGE_ARRAYS:
                count = struct.unpack_from(facts.byte_order + "Q", raw, 4)[0] if vtype == _ARRAY and len(raw) >= 12 else -1
                if shown != f"<{count} entries>":
                    return False
            elif encode_value(vtype, shown, raw, facts.byte_order) != raw:
                return False
            if key in h.values and encode_value(vtype, h.values[key], raw, facts.byte_order) != raw:
                return False
            if key.startswith("tokenizer.") and key not in h.values:
                return False
    except _Unverifiable:
        return False
    tok = h.values.get("tokenizer.ggml.tokens")
    return h.n_tokens == (len(tok) if isinstance(tok, list) else 0)
