"""Compact text of integer sets (``[0,1,2,5]`` -> ``"0..2,5"``), shared by the KV backends, the
trace renderers and ``inspect``. Torch-free, so presentation can import it without the engine.
"""

from __future__ import annotations

from typing import Sequence


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
