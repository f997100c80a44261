"""Terminal-safe text: control characters from files made visible before they reach a terminal.

Strings that come from a trace, a GGUF file or a tokenizer (token pieces, prompts, metadata,
tensor names, dict keys) may hold terminal control sequences: ``ESC ] 52 ; c ; … BEL`` writes
the clipboard, ``ESC [ 2 J`` clears the screen, C1 bytes (U+0080..U+009F) are 8-bit escapes,
bidi overrides (U+202A..U+202E, U+2066..U+2069) reorder what the reader sees. Everything the
CLI prints from a file goes through :func:`visible` (or :class:`SafeConsole`, which applies
it to every segment Rich writes), so such characters print as ``\\x1b``, ``\\x9b``,
``\\u202e``: visible, inert, one line.

Rich markup is never interpreted in file strings: :func:`SafeConsole` has ``markup=False``
(program text that wants a style passes a :class:`rich.text.Text`).
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from rich.console import Console
from rich.segment import Segment

#: C0 controls, DEL, C1 controls, bidi embeddings/overrides/isolates, line/paragraph separators,
#: zero-width marks that can hide or reorder text.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]")
#: the same without newline (program text may break lines; a segment never carries file newlines
#: once the file strings were passed through :func:`visible`)
_UNSAFE_BUT_NL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]")


def _esc(m: re.Match) -> str:
    c = ord(m.group(0))
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def visible(s: Any) -> str:
    """``str(s)`` with every control / bidi character written as ``\\xNN`` or ``\\uNNNN``.

    Newline, tab and carriage return are escaped too (``\\x0a``): a file string prints on one line.
    Printable text (including non-ASCII letters and emoji) is unchanged.
    """
    return _UNSAFE.sub(_esc, s if isinstance(s, str) else str(s))


def visible_lines(s: Any) -> str:
    """Like :func:`visible` but keeps ``\\n`` (for multi-line program output that embeds file text)."""
    return _UNSAFE_BUT_NL.sub(_esc, s if isinstance(s, str) else str(s))


def has_unsafe(s: str) -> bool:
    """True when ``s`` holds a character :func:`visible` would escape."""
    return _UNSAFE.search(s) is not None


class SafeConsole(Console):
    """A :class:`rich.console.Console` that never interprets markup and writes no raw control
    character from text: every text segment Rich renders passes :func:`visible_lines` (Rich's own
    style and cursor codes are control segments and pass unchanged).

    A safety net under :func:`visible`: widths are measured before this runs, so callers still
    escape file strings where they build the renderable (then nothing changes here).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs["markup"] = False
        kwargs.setdefault("emoji", False)
        super().__init__(*args, **kwargs)

    def on_broken_pipe(self) -> None:
        """Reader went away (``infertrace show DIR | head``): stop quietly, exit code 141 (SIGPIPE)."""
        from infertrace.errors import quiet_broken_pipe

        quiet_broken_pipe()

    def render(self, renderable: Any, options: Any = None) -> Iterable[Segment]:  # type: ignore[override]
        for seg in super().render(renderable, options):
            if seg.control or not _UNSAFE_BUT_NL.search(seg.text):
                yield seg
            else:
                yield Segment(visible_lines(seg.text), seg.style, seg.control)


_UNSAFE_JSON = re.compile("[\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]")


def json_text(obj: Any, **kwargs: Any) -> str:
    """``json.dumps(obj, ensure_ascii=False, **kwargs)`` with DEL, C1 and bidi characters written as
    ``\\uNNNN`` escapes too (JSON already escapes C0): the same JSON value, safe on a terminal."""
    import json

    text = json.dumps(obj, ensure_ascii=False, **kwargs)
    return _UNSAFE_JSON.sub(lambda m: f"\\u{ord(m.group(0)):04x}", text)
