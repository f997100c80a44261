"""User-facing errors: one line saying what is wrong and what to do.

Every error a user can cause (bad file, bad option, prompt too long, broken trace)
is raised as :class:`InfertraceError`; the CLI prints ``error: <message>`` and exits
with code 2 (no traceback unless ``--debug``).
"""

from __future__ import annotations


class InfertraceError(Exception):
    """A problem with the user's input, reported as one line plus an exit code.

    Args:
        message: what is wrong and what to do, one line.
        exit_code: process exit code the CLI uses (2 = bad input, 1 = check failed).
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class ConfigError(InfertraceError):
    """One engine config field has a value the engine cannot run, said in the library's words
    (the configs of :mod:`infertrace.engine.config` raise it; the CLI names the field's flag).

    Attributes:
        field: ``<config>.<field>`` (``cache.tokens_per_block``, ``speculative.spec_tree``, ...).
        reason: what is wrong, without the field's name (``must be >= 1 (got 0)``).

    The message (``str(e)``) is ``"<field>: <reason>"``.
    """

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


#: exit code when the reader of stdout went away (a shell reports SIGPIPE deaths as 128 + 13)
BROKEN_PIPE_EXIT = 141


def quiet_broken_pipe() -> None:
    """Handle a closed stdout (``infertrace show DIR | head -1``): point stdout at /dev/null so
    the interpreter's final flush cannot fail again, then exit :data:`BROKEN_PIPE_EXIT` with no
    message (what a C tool killed by SIGPIPE looks like to the shell)."""
    import os
    import sys

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (e.g. a test runner's buffer)
        pass
    raise SystemExit(BROKEN_PIPE_EXIT)
