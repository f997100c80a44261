"""vLLM's own output (its logger, warnings, progress bars, C++ prints) goes to a log file, not into the panels.

vLLM configures its ``vllm`` logger at import with a stream handler on ``sys.stdout``; its weight loading
draws tqdm bars on stderr; torch and the CPU backend print from C++ straight to file descriptors 1 and 2.
:func:`vllm_log` sends all of them to one file for the duration of a run and names the file in one line on
stderr when the run is over (a refusal stays one ``error:`` line: the log's path is appended to it when vLLM
wrote anything); infertrace's own progress and notes (Python's ``sys.stderr``) still reach the terminal.

The file: ``$INFERTRACE_VLLM_LOG`` when set, else ``infertrace-vllm-<pid>.log`` in the temporary directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator

from infertrace.errors import InfertraceError


def log_path() -> Path:
    """Where vLLM's output goes (``$INFERTRACE_VLLM_LOG`` or ``<tmp>/infertrace-vllm-<pid>.log``)."""
    env = os.environ.get("INFERTRACE_VLLM_LOG")
    return Path(env) if env else Path(tempfile.gettempdir()) / f"infertrace-vllm-{os.getpid()}.log"


def _vllm_handlers() -> list[logging.StreamHandler]:
    """The stream handlers of the ``vllm`` logger and its children (file handlers excluded)."""
    names = ["vllm"] + [n for n in logging.root.manager.loggerDict if n.startswith("vllm.")]
    return [h for n in names for h in getattr(logging.getLogger(n), "handlers", [])
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]


def _real_fd(stream: object, fd: int) -> bool:
    try:
        return stream.fileno() == fd  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # a test runner's captured stream
        return False


@contextlib.contextmanager
def vllm_log(console: Any = None, announce: bool = True) -> Iterator[Path]:
    """Redirect vLLM's output to :func:`log_path` while the block runs (appending; the file is created
    with mode 0600 and never followed when it is a symlink): file descriptors 1 and 2, ``sys.stdout`` and
    ``sys.stderr`` (vLLM's logger handlers bind to them at its import, its tqdm bars write to them) and
    Python warnings. ``console`` (a rich Console: our progress display) keeps writing to the terminal.

    Yields:
        the log file's path. On exit the descriptors, the streams, the console's file and
        ``warnings.showwarning`` are restored; vLLM's handlers keep the log (it logs again at shutdown).
        ``announce``: the path is named in one stderr line after a run that completed.

    Raises:
        InfertraceError: the block's own, with `` (vLLM's own log: PATH)`` appended when the log grew.
    """
    path = log_path()
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)
    log = os.fdopen(fd, "a", buffering=1, encoding="utf-8", errors="replace")
    start_size, ok = os.fstat(fd).st_size, False
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {n: os.dup(n) for n in (1, 2)}
    old_out, old_err, old_show = sys.stdout, sys.stderr, warnings.showwarning
    old_file = getattr(console, "_file", None)
    term = os.fdopen(os.dup(saved[2]), "w", buffering=1) if _real_fd(sys.stderr, 2) else old_err
    handlers = [(h, h.stream) for h in _vllm_handlers()]  # vLLM imported before (a test session)
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = log
        if console is not None:
            console.file = term
        for h, _ in handlers:
            h.setStream(log)
        warnings.showwarning = lambda m, c, f, ln, file=None, line=None: log.write(warnings.formatwarning(m, c, f, ln, line))
        yield path
    except InfertraceError as e:
        log.flush()
        if os.fstat(log.fileno()).st_size > start_size and "vLLM's own log" not in e.message:
            raise InfertraceError(f"{e.message} (vLLM's own log: {path})", e.exit_code) from None
        raise
    else:
        ok = True
    finally:
        for h, s in handlers:
            h.setStream(s)
        warnings.showwarning = old_show
        if console is not None:
            console.file = old_file
        sys.stdout, sys.stderr = old_out, old_err
        for n, d in saved.items():
            os.dup2(d, n)
            os.close(d)
        if term is not old_err:
            term.close()
        log.flush()
    if announce and ok:
        print(f"vLLM's own log (its warnings and progress bars): {path}", file=sys.stderr)
