"""Small text forms shared by the terminal and HTML views (no rich, no markup): token pieces and
integer lists. Below every other module of ``present/`` so none of them imports another's view."""

from __future__ import annotations

from typing import Sequence

from infertrace.safe_text import has_unsafe, visible

_VISIBLE = {"\n": "⏎", "\t": "⇥", "\r": "␍"}


def piece_text(piece: str | None) -> str:
    """Quoted, visible form of a token piece: ``' Paris'``, ``'⏎⏎'``; control bytes as ``\\xNN``
    (C1 and bidi controls too, as :func:`infertrace.safe_text.visible`)."""
    if piece is None:
        return "-"
    out = []
    for ch in piece:
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif has_unsafe(ch):  # C0, DEL, C1, bidi controls: visible escapes (safe_text.visible)
            out.append(visible(ch))
        else:
            out.append(ch)
    body = "".join(out)
    return f'"{body}"' if "'" in body and '"' not in body else f"'{body}'"


def int_list_text(xs: Sequence[int] | None, most: int = 64) -> str:
    """``str(list(xs))`` (``[0, 1, 2]``), or ``[0, 1, …, 99] (100)`` beyond ``most`` items."""
    if xs is None:
        return "None"
    xs = list(xs)
    if len(xs) <= most:
        return str(xs)
    return "[" + ", ".join([str(x) for x in xs[:most - 2]] + ["…", str(xs[-1])]) + f"] ({len(xs)})"
