"""Range text, the compact form of an integer set (``[0,1,2,5]`` <-> ``"0..2,5"``): written by the
KV backends, the recorder and the renderers, validated by the trace schema, parsed by ``check``
and the dump of a saved trace. One grammar, here: ``"-"`` (the empty set) or comma-separated
parts ``a`` / ``a..b`` (``a <= b``, ascending, as :func:`ranges_text` writes them).

Torch-free, so the trace and presentation layers import it without the engine.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

#: a range text as :func:`ranges_text` writes it (no sign, no leading zero, at most 9 digits a number)
RANGE_RE = re.compile(r"-|(?:0|[1-9][0-9]{0,8})(?:\.\.(?:0|[1-9][0-9]{0,8}))?(?:,(?:0|[1-9][0-9]{0,8})(?:\.\.(?:0|[1-9][0-9]{0,8}))?)*")
#: one part as :func:`parse_ranges` reads it (leading zeros and surrounding blanks tolerated)
_PART_RE = re.compile(r"(\d+)(?:\.\.(\d+))?")
#: the most integers :func:`parse_ranges` expands (a bound on untrusted text)
MAX_PARSED = 1_000_000


def ranges_text(positions: Sequence[int]) -> str:
    """Compact text of sorted ints: ``[0,1,2,5]`` -> ``"0..2,5"``; empty -> ``"-"``."""
    ps = sorted(positions)
    if not ps:
        return "-"
    out, start, prev = [], ps[0], ps[0]
    for p in ps[1:]:
        if p == prev + 1:
            prev = p
            continue
        out.append(f"{start}..{prev}" if prev > start else f"{start}")
        start = prev = p
    out.append(f"{start}..{prev}" if prev > start else f"{start}")
    return ",".join(out)


def range_count(text: str, below: int, max_chars: int) -> int:
    """How many integers a range text (``"0..2,5"``, ``"-"``) stands for, without expanding it;
    -1 when it is malformed (not :data:`RANGE_RE`, longer than ``max_chars``, a part ``a..b``
    with ``b < a``, or a value ``>= below``)."""
    if len(text) > max_chars or not RANGE_RE.fullmatch(text):
        return -1
    if text == "-":
        return 0
    n = 0
    for part in text.split(","):
        a, _, b = part.partition("..")
        lo, hi = int(a), int(b or a)
        if hi < lo or hi >= below:
            return -1
        n += hi - lo + 1
    return n


def parse_ranges(text: Any) -> list[int]:
    """``"0..2,5"`` -> ``[0, 1, 2, 5]``; ``"-"`` -> ``[]``.

    Raises:
        ValueError: not a string, a malformed part, ``b < a``, or more than :data:`MAX_PARSED` values.
    """
    if not isinstance(text, str):
        raise ValueError(f"expected range text, got {type(text).__name__}")
    if text == "-":
        return []
    out: list[int] = []
    for part in text.split(","):
        m = _PART_RE.fullmatch(part.strip())
        if not m:
            raise ValueError(f"bad range {part!r}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        if hi < lo or hi - lo > MAX_PARSED or len(out) > MAX_PARSED:
            raise ValueError(f"bad range {part!r}")
        out.extend(range(lo, hi + 1))
    return out
