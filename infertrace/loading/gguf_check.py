"""Validation pre-pass over a GGUF header, before gguf-py parses it.

gguf-py's :class:`gguf.GGUFReader` stays the reader of record, but it trusts every count in the
file: an array count of 2^62 in a 49-byte file makes it loop (and allocate) without bound,
and misaligned, wrapping or overlapping tensor offsets become garbage values. This module
walks the header cheaply with :mod:`struct` over a read-only ``mmap`` of the file and checks
every count, length and offset against the bytes actually left, and against the limits of
:mod:`infertrace.loading.limits`, before a single array is built.

Layout checked (GGUF v2/v3; llama.cpp ``ggml/src/gguf.cpp`` ``gguf_init_from_file_impl``). Every
number is little-endian, or every number big-endian (a file written for a big-endian host, e.g.
gguf-py's ``GGUFWriter(endianess=GGUFEndian.BIG)`` or ``gguf_convert_endian.py``): the byte order is
told from the version field as gguf-py's ``GGUFReader`` tells it (a version whose low 16 bits are 0
is byte-swapped) and the whole walk reads in that order::

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x  (string key | u32 value_type | value)
    n_tensors x (string name | u32 n_dims | n_dims x u64 ne | u32 ggml_type | u64 offset)
    padding to general.alignment | tensor data

    string = u64 length | bytes;  array = u32 item_type | u64 count | count x item
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from infertrace.errors import InfertraceError
from infertrace.loading.limits import (MAX_GGUF_ARRAY_DEPTH, MAX_GGUF_ARRAY_ELEMENTS, MAX_GGUF_DIMS, MAX_GGUF_KEY_BYTES,
                                     MAX_GGUF_KV, MAX_GGUF_TENSOR_NAME_BYTES, MAX_GGUF_TENSORS, open_regular)

GGUF_DEFAULT_ALIGNMENT = 32
#: GGUFValueType -> fixed byte size (None: string / array, walked separately).
_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_TYPE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32", 7: "BOOL",
               8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}
_HEADER = struct.Struct("<4sIQQ")


def gguf_byte_order(version_le: int) -> str | None:
    """The byte order of a GGUF file from its version field read little-endian: ``"<"`` for a
    supported version (2, 3), ``">"`` when the byte-swapped value is one (a big-endian file: gguf-py's
    ``GGUFReader`` test, ``version & 0xFFFF == 0``), None otherwise."""
    if version_le in (2, 3):
        return "<"
    if version_le & 0xFFFF == 0 and int.from_bytes(version_le.to_bytes(4, "little"), "big") in (2, 3):
        return ">"
    return None


@dataclass
class GGUFTensorEntry:
    """One tensor-info record of the header: name, ggml ``ne`` dims, ggml type id, byte range."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int  # relative to the data section
    n_bytes: int


@dataclass
class GGUFHeaderFacts:
    """What the pre-pass learned: counts, alignment, where tensor data starts, tensor records."""

    version: int
    n_tensors: int
    n_kv: int
    alignment: int
    data_offset: int
    file_size: int
    tensors: list[GGUFTensorEntry] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    byte_order: str = "<"  # "<" little-endian, ">" big-endian (every number of the file)
    #: key -> (value type, first byte of the value, byte after it): where each value's bytes lie
    spans: dict[str, tuple[int, int, int]] = field(default_factory=dict)


class _Broken(Exception):
    """Internal: the header is invalid; ``args[0]`` is the reason."""


class _Walker:
    """Bounded cursor over the header bytes; every read checks the bytes left first."""

    def __init__(self, buf: mmap.mmap | bytes, size: int, order: str = "<"):
        self.buf, self.size, self.pos = buf, size, 0
        self.array_elements = 0
        self.u32_fmt, self.u64_fmt = order + "I", order + "Q"

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.left():
            raise _Broken(f"{what} needs {n} bytes at offset {self.pos} but only {self.left()} are left")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = struct.unpack_from(self.u32_fmt, self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = struct.unpack_from(self.u64_fmt, self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str, max_bytes: int | None = None) -> bytes:
        n = self.u64(f"length of {what}")
        if max_bytes is not None and n > max_bytes:
            raise _Broken(f"{what} is {n} bytes long, over the limit of {max_bytes}")
        self.need(n, what)
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return s

    def skip_string(self, what: str) -> None:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        self.pos += n

    def value(self, vtype: int, what: str, depth: int = 0) -> None:
        """Skip one value of ``vtype``, checking every count against the bytes left."""
        size = _SCALAR_SIZE.get(vtype)
        if size is not None:
            self.need(size, what)
            self.pos += size
            return
        if vtype == _STRING:
            self.skip_string(what)
            return
        if vtype != _ARRAY:
            raise _Broken(f"{what} has unknown value type {vtype} (known: 0..12)")
        if depth >= MAX_GGUF_ARRAY_DEPTH:
            raise _Broken(f"{what} nests arrays deeper than the limit of {MAX_GGUF_ARRAY_DEPTH}")
        itype = self.u32(f"item type of {what}")
        count = self.u64(f"element count of {what}")
        if itype not in _TYPE_NAMES:
            raise _Broken(f"{what} is an array of unknown value type {itype} (known: 0..12)")
        isize = _SCALAR_SIZE.get(itype)
        # smallest encoding of one item: its fixed size, 8 (string length), 12 (array type + count)
        min_item = isize if isize is not None else (8 if itype == _STRING else 12)
        if count * min_item > self.left():
            raise _Broken(f"{what} claims {count} {_TYPE_NAMES[itype]} elements (at least {count * min_item} bytes) "
                          f"but only {self.left()} bytes are left in the file")
        self.array_elements += count
        if self.array_elements > MAX_GGUF_ARRAY_ELEMENTS:
            raise _Broken(f"{what} brings the array elements of the header to {self.array_elements}, over the limit of {MAX_GGUF_ARRAY_ELEMENTS}")
        if isize is not None:
            self.pos += count * isize
            return
        for i in range(count):
            self.value(itype, f"{what}[{i}]", depth + 1)


def gguf_file_byte_order(path: str | Path) -> str | None:
    """:func:`gguf_byte_order` of the file at ``path`` (reads its first 8 bytes; None: not GGUF v2/v3)."""
    with open(path, "rb") as fh:
        head = fh.read(8)
    if len(head) < 8 or head[:4] != b"GGUF":
        return None
    return gguf_byte_order(int.from_bytes(head[4:8], "little"))


def _fail(p: Path, reason: str) -> InfertraceError:
    return InfertraceError(f"cannot read GGUF {p.name}: {reason}; the file is truncated or corrupt - download it again")


def check_gguf_header(path: str | Path) -> GGUFHeaderFacts:
    """Walk the GGUF header of ``path`` and check it against the file size and the limits.

    Checks, in file order: magic, version 2 or 3 (in either byte order); ``n_tensors`` <= ``MAX_GGUF_TENSORS`` and
    ``n_kv`` <= ``MAX_GGUF_KV`` (and each fits the bytes left at their minimum encoded size);
    each key: length, UTF-8, unique, known value type; each string length and array count
    (times its element size, nested arrays recursively) against the bytes left, total array
    elements <= ``MAX_GGUF_ARRAY_ELEMENTS``; ``general.alignment`` a UINT32 power of two;
    each tensor: name length <= 63 bytes, UTF-8, unique; ``n_dims`` <= 4; every dim >= 1;
    ggml type known to gguf-py with ``ne[0]`` a multiple of its block size; offset aligned;
    data inside the file; no two tensors overlapping.

    Args:
        path: the ``.gguf`` file (must be a regular file; a FIFO or device is refused).

    Returns:
        :class:`GGUFHeaderFacts`.

    Cost: O(header bytes) with no allocation proportional to a count the file claims.

    Raises:
        InfertraceError: one line naming the first problem found (and the limit, when a limit is hit).
    """
    p = Path(path)
    fd = open_regular(p, "model file")
    try:
        size = os.fstat(fd).st_size
        if size < _HEADER.size:
            raise _fail(p, f"the file is {size} bytes, shorter than a GGUF header ({_HEADER.size} bytes)")
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
            try:
                return _walk(mm, size)
            except _Broken as e:
                raise _fail(p, str(e.args[0])) from None
    finally:
        os.close(fd)


def _unique_name(w: _Walker, what: str, limit: int, seen: set[str], kind: str) -> str:
    """A length-bounded UTF-8 string (a key or a tensor name) not seen before; added to ``seen``.

    Raises:
        _Broken: longer than ``limit`` bytes, past the end, not UTF-8, or a repeat.
    """
    raw = w.string(what, limit)
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _Broken(f"{what} is not UTF-8") from None
    if name in seen:
        raise _Broken(f"{kind} {name!r} appears twice")
    seen.add(name)
    return name


def _walk(buf: mmap.mmap | bytes, size: int) -> GGUFHeaderFacts:
    from infertrace.loading.gguf_lib import gguf

    GGML_QUANT_SIZES, GGMLQuantizationType = gguf().GGML_QUANT_SIZES, gguf().GGMLQuantizationType

    magic, version, n_tensors, n_kv = _HEADER.unpack_from(buf, 0)
    if magic != b"GGUF":
        raise _Broken(f"magic {magic!r}, expected b'GGUF'")
    order = gguf_byte_order(version)
    if order is None:
        raise _Broken(f"version {version} (supported: 2, 3)")
    if order == ">":
        version, n_tensors, n_kv = struct.unpack_from(">IQQ", buf, 4)
    w = _Walker(buf, size, order)
    w.pos = _HEADER.size
    if n_kv > MAX_GGUF_KV:
        raise _Broken(f"the header claims {n_kv} key/value pairs, over the limit of {MAX_GGUF_KV}")
    if n_tensors > MAX_GGUF_TENSORS:
        raise _Broken(f"the header claims {n_tensors} tensors, over the limit of {MAX_GGUF_TENSORS}")
    # minimum encoded sizes: kv = key length (8) + type (4) + 1 byte value; tensor info = 8 + 4 + 4 + 8
    if n_kv * 13 + n_tensors * 24 > w.left():
        raise _Broken(f"the header claims {n_kv} key/value pairs and {n_tensors} tensors, which cannot fit in the "
                      f"{w.left()} bytes left")
    facts = GGUFHeaderFacts(version, n_tensors, n_kv, GGUF_DEFAULT_ALIGNMENT, 0, size, byte_order=order)
    seen: set[str] = set()
    for i in range(n_kv):
        key = _unique_name(w, f"key #{i}", MAX_GGUF_KEY_BYTES, seen, "key")
        vtype = w.u32(f"value type of {key!r}")
        start = w.pos
        if key == "general.alignment":
            if vtype != _UINT32:
                raise _Broken(f"general.alignment has type {_TYPE_NAMES.get(vtype, vtype)}, expected UINT32")
            align = w.u32("general.alignment")
            if align == 0 or align & (align - 1):
                raise _Broken(f"general.alignment is {align}, not a power of two")
            facts.alignment = align
            facts.spans[key] = (vtype, start, w.pos)
            continue
        w.value(vtype, f"value of {key!r}")
        facts.spans[key] = (vtype, start, w.pos)
    facts.keys = list(seen)
    names: set[str] = set()
    for i in range(n_tensors):
        name = _unique_name(w, f"the name of tensor #{i}", MAX_GGUF_TENSOR_NAME_BYTES, names, "tensor")
        n_dims = w.u32(f"n_dims of {name!r}")
        if n_dims > MAX_GGUF_DIMS:
            raise _Broken(f"tensor {name!r} has {n_dims} dimensions, over the limit of {MAX_GGUF_DIMS} (ggml GGML_MAX_DIMS)")
        dims = tuple(w.u64(f"dims of {name!r}") for _ in range(n_dims))
        if any(d < 1 for d in dims):
            raise _Broken(f"tensor {name!r} has shape {list(dims)}; every dimension must be >= 1")
        gtype = w.u32(f"type of {name!r}")
        offset = w.u64(f"offset of {name!r}")
        try:
            qtype = GGMLQuantizationType(gtype)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise _Broken(f"tensor {name!r} has unknown ggml type {gtype}") from None
        if dims and dims[0] % block:
            raise _Broken(f"tensor {name!r} has ne[0] = {dims[0]}, not a multiple of the {qtype.name} block size {block}")
        n_elem = 1
        for d in dims:
            n_elem *= d
        n_bytes = n_elem // block * type_size
        if n_bytes > size:  # also bounds the element count before anything reshapes it
            raise _Broken(f"tensor {name!r} of shape {list(dims)} ({qtype.name}) needs {n_bytes} bytes, more than the whole file ({size} bytes)")
        facts.tensors.append(GGUFTensorEntry(name, dims, gtype, offset, n_bytes))
    data_offset = -(-w.pos // facts.alignment) * facts.alignment
    facts.data_offset = data_offset
    end_prev, prev = 0, None
    for t in sorted(facts.tensors, key=lambda t: t.offset):
        if t.offset % facts.alignment:
            raise _Broken(f"tensor {t.name!r} has offset {t.offset}, not a multiple of the alignment {facts.alignment}")
        end = data_offset + t.offset + t.n_bytes
        if end > size:
            raise _Broken(f"tensor {t.name!r} ends at byte {end}, past the end of the file ({size} bytes)")
        if t.offset < end_prev:
            raise _Broken(f"tensor {t.name!r} (offset {t.offset}) overlaps tensor {prev!r} (ends at offset {end_prev})")
        end_prev, prev = t.offset + t.n_bytes, t.name
    return facts


#: tokenizer keys and the GGUF value types they may hold (``[ARRAY, item]`` for arrays).
_INT_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
_TOKENIZER_ARRAYS = {"tokenizer.ggml.tokens": {_STRING}, "tokenizer.ggml.merges": {_STRING},
                     "tokenizer.ggml.token_type": _INT_TYPES, "tokenizer.ggml.scores": {6, 12} | _INT_TYPES}
_TOKENIZER_STRINGS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
_TOKENIZER_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "eot_token_id",
                  "eom_token_id", "fim_pad_token_id", "fim_rep_token_id", "fim_sep_token_id")
_TOKENIZER_FLAGS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.add_eos_token")


def check_gguf_tokenizer_fields(reader: object, name: str) -> None:
    """Value types and sizes of the ``tokenizer.*`` keys of an open :class:`gguf.GGUFReader`.

    Strings must be STRING, token arrays ARRAY of STRING (each token at most
    ``MAX_TOKEN_BYTES``, the sum of squared token lengths - the cost of deriving SentencePiece
    merges - at most ``MAX_TOKEN_WORK``), types / ids integers, scores numbers, flags BOOL or integers;
    the vocabulary at most ``MAX_VOCAB`` entries (llama.cpp ``llama_vocab::impl::load`` reads the same keys).

    Raises:
        InfertraceError: one line naming the key.
    """
    from infertrace.loading.limits import MAX_TOKEN_BYTES, MAX_TOKEN_WORK, MAX_VOCAB

    fields = getattr(reader, "fields")

    def types(key: str) -> list[int] | None:
        f = fields.get(key)
        return None if f is None else [int(t) for t in f.types]

    def bad(key: str, want: str, got: list[int]) -> InfertraceError:
        shown = "/".join(_TYPE_NAMES.get(t, str(t)) for t in got) or "an empty array"
        return InfertraceError(f"cannot read GGUF {name}: {key} must be {want}, got {shown}; the file is broken")

    for key in _TOKENIZER_STRINGS:
        t = types(key)
        if t is not None and t != [_STRING]:
            raise bad(key, "a STRING", t)
    for key in (*(f"tokenizer.ggml.{k}" for k in _TOKENIZER_IDS), *_TOKENIZER_FLAGS):
        t = types(key)
        if t is not None and not (len(t) == 1 and (t[0] in _INT_TYPES or t[0] == 7)):
            raise bad(key, "an integer or BOOL", t)
    for key, items in _TOKENIZER_ARRAYS.items():
        t = types(key)
        if t is None:
            continue
        f = fields[key]
        n = len(f.data)
        if n and (len(t) != 2 or t[0] != _ARRAY or t[1] not in items):
            raise bad(key, f"an ARRAY of {'/'.join(_TYPE_NAMES[i] for i in sorted(items))}", t)
        if n > MAX_VOCAB:
            raise InfertraceError(f"cannot read GGUF {name}: {key} has {n} entries, over the limit of {MAX_VOCAB}")
        if key == "tokenizer.ggml.tokens" and n:
            lens = [len(f.parts[i]) for i in f.data]
            longest = max(lens)
            if longest > MAX_TOKEN_BYTES:
                raise InfertraceError(f"cannot read GGUF {name}: a token of {longest} bytes is over the limit of {MAX_TOKEN_BYTES}")
            work = sum(x * x for x in lens)
            if work > MAX_TOKEN_WORK:
                raise InfertraceError(f"cannot read GGUF {name}: the token texts are too long together (sum of squared "
                                      f"lengths {work}, over the limit of {MAX_TOKEN_WORK})")
