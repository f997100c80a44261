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
