"""Bounds on every size a model file controls, and safe opening of model files.

A model file is untrusted input: each count, length and hyper-parameter it holds is checked
against one of these limits (and against the bytes actually present) before memory is allocated
or a loop starts. Each limit is generous for real checkpoints (the largest public Llama-family
models have < 200 layers, < 300k vocabulary entries, a few thousand tensors) and is named in
the error message when a file exceeds it.

Only regular files are read: a FIFO, a character device (``/dev/zero``) or a socket given as a
model file is refused without blocking (opened with ``O_NONBLOCK`` and checked with ``fstat``,
so a path swapped between the check and the open cannot make us block either).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from infertrace.errors import InfertraceError

#: layers (``block_count`` / ``num_hidden_layers``); Llama-3.1-405B has 126.
MAX_LAYERS = 1024
#: tensors in one GGUF file (llama.cpp's largest converted models have a few thousand).
MAX_GGUF_TENSORS = 65_536
#: key/value pairs in one GGUF header.
MAX_GGUF_KV = 65_536
#: array elements over all GGUF key/values together (a 262k vocabulary with scores and types is ~0.8M).
#: gguf-py builds about 1 KB of Python objects per element, so this also bounds its memory (~1 GB).
MAX_GGUF_ARRAY_ELEMENTS = 1 << 20
#: nesting of GGUF arrays (llama.cpp reads none; gguf-py flattens them).
MAX_GGUF_ARRAY_DEPTH = 4
#: bytes of one GGUF key.
MAX_GGUF_KEY_BYTES = 4096
#: bytes of a GGUF tensor name (ggml ``GGML_MAX_NAME`` = 64 including the NUL).
MAX_GGUF_TENSOR_NAME_BYTES = 63
#: dimensions of a GGUF tensor (ggml ``GGML_MAX_DIMS``).
MAX_GGUF_DIMS = 4
#: vocabulary entries (rows of ``token_embd``; tokenizer ids).
MAX_VOCAB = 1 << 22
#: bytes of one vocabulary entry (SmolLM2's longest is 162; whitespace runs and HTML pieces stay < 1 KiB).
MAX_TOKEN_BYTES = 4096
#: sum of squared token lengths: the cost of deriving SentencePiece merges from the vocabulary.
MAX_TOKEN_WORK = 1 << 31
#: hidden size, feed-forward size, head count, head dim: any one of them.
MAX_DIM = 1 << 20
#: trained context (``context_length`` / ``max_position_embeddings``).
MAX_CTX_TRAIN = 1 << 24
#: bytes of a JSON file of an HF model directory other than tokenizer.json.
MAX_JSON_BYTES = 64 << 20
#: bytes of tokenizer.json / a chat template file.
MAX_TOKENIZER_JSON_BYTES = 512 << 20
MAX_TEMPLATE_FILE_BYTES = 4 << 20
#: bytes of a ``--prompts`` JSONL file (read from a pipe too, so it is bounded while reading).
MAX_PROMPTS_FILE_BYTES = 64 << 20


def _label(what: str, shown: object) -> str:
    """``"config.json /m/config.json"`` reads badly: name the file once when ``what`` is its name."""
    return str(shown) if what == Path(str(shown)).name else f"{what} {shown}"


def open_regular(path: str | Path, what: str = "model file") -> int:
    """Open ``path`` read-only without blocking and return the fd of a regular file.

    Args:
        path: the file to open (symlinks are followed, as ``open`` does).
        what: how the message names the file (``"model file"``, ``"config.json"`` ...).

    Returns:
        An ``os`` file descriptor (the caller closes it).

    Raises:
        InfertraceError: missing, unreadable, or not a regular file (FIFO, device, socket, directory).
    """
    p = Path(path)
    lab = _label(what, p)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InfertraceError(f"{lab} does not exist") from None
    except IsADirectoryError:
        raise InfertraceError(f"{lab} is a directory, not a regular file") from None
    except OSError as e:
        raise InfertraceError(f"cannot open {lab}: {e.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        os.close(fd)
        raise InfertraceError(f"cannot stat {lab}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
                else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a directory" if stat.S_ISDIR(mode) else "not a regular file")
        raise InfertraceError(f"{lab} is {kind}; only regular files are read")
    if getattr(os, "O_NONBLOCK", 0):
        os.set_blocking(fd, True)
    return fd


def require_regular_file(path: str | Path, what: str = "model file") -> int:
    """Check that ``path`` is a regular file (without blocking) and return its size in bytes.

    Raises:
        InfertraceError: as :func:`open_regular`.
    """
    fd = open_regular(path, what)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def read_bounded_bytes(path: str | Path, max_bytes: int, what: str) -> bytes:
    """Read a whole regular file of at most ``max_bytes`` bytes.

    Raises:
        InfertraceError: not a regular file, or larger than ``max_bytes`` (the message names the limit).
    """
    fd = open_regular(path, what)
    lab = _label(what, Path(path).name)
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > max_bytes:
            raise InfertraceError(f"{lab} is {size} bytes, over the limit of {max_bytes} bytes; the file is not a real {what or 'model file'}")
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew while we read it
        raise InfertraceError(f"{lab} is over the limit of {max_bytes} bytes")
    return data


def read_json_file(path: str | Path, what: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse a bounded JSON file; every failure is one :class:`InfertraceError` line.

    Catches what ``json.loads`` raises besides ``JSONDecodeError`` on hostile input: nesting
    deeper than Python's recursion limit (``RecursionError``), integers over Python's
    digit limit (``ValueError``), invalid UTF-8.

    Raises:
        InfertraceError: not a regular file, too large, not UTF-8, not JSON, too deeply nested.
    """
    data = read_bounded_bytes(path, max_bytes, what)
    lab = _label(what, Path(path).name)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise InfertraceError(f"{lab} is not UTF-8 text; the file is corrupt") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InfertraceError(f"{lab} is not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise InfertraceError(f"{lab} is nested too deeply to parse; the file is not a real {what or 'model file'}") from None
    except ValueError as e:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        raise InfertraceError(f"{lab} holds an invalid value ({str(e).splitlines()[0][:100]})") from None
