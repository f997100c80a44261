"""Small text formatting shared by every layer: byte sizes and values clipped for one-line messages.

Torch-free and engine-free (the trace and presentation layers import it; ``tests/unit/test_layering.py``
lists it among the shared modules). Range text (``"0..2,5"``) is :mod:`infertrace.ranges`;
terminal escaping of file strings is :mod:`infertrace.safe_text`.
"""

from __future__ import annotations

from typing import Any

_DECIMAL = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float, nd: int = 1, binary: bool = False) -> str:
    """A byte count as text.

    Args:
        n: bytes.
        nd: decimals of the scaled value.
        binary: powers of 1024 (``1536`` -> ``"1.5 KiB"``, as llama.cpp's ``MiB`` logs; used by the
            KV memory budget) instead of decimal units (``98362432`` -> ``"98.4 MB"``; file and trace
            sizes). Below one unit: ``"512 B"``.
    """
    if binary:
        for unit in _BINARY:
            if abs(n) < 1024 or unit == _BINARY[-1]:
                return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{nd}f} {unit}"
            n /= 1024
    for unit, k in _DECIMAL:
        if n >= k:
            return f"{n / k:.{nd}f} {unit}"
    return f"{n} B"


def clip(s: str, width: int, tail: str = "…") -> str:
    """``s`` when at most ``width`` characters, else its first ``width - len(tail)`` characters and ``tail``."""
    return s if len(s) <= width else s[: width - len(tail)] + tail


def short(v: Any, width: int = 60, tail: str = "…") -> str:
    """A value for a one-line message: strings quoted (``repr``), anything else ``str``, :func:`clip`-ped."""
    return clip(repr(v) if isinstance(v, str) else str(v), width, tail)
