"""gguf-py imported without its optional Mistral tokenizer hook (startup time).

``gguf/__init__.py`` imports ``gguf.vocab``, which tries ``mistral_common`` (for converting Mistral
tokenizers, a path infertrace never takes) and falls back cleanly when it is missing. Where
``mistral_common`` is installed that import pulls in pydantic and ``torch.export``: measured
0.3-0.5 s of CPU per process on this machine (``python -c "import torch, gguf"``: 1.55-1.72 s user
vs 1.21-1.30 s with it blocked). :func:`gguf` imports gguf-py once with that optional import made to
fail (``sys.modules["mistral_common"] = None``, Python's documented way to block an import), then
removes the block, so a later ``import mistral_common`` elsewhere in the process works as usual.
"""

from __future__ import annotations

import sys
from types import ModuleType


def gguf() -> ModuleType:
    """The ``gguf`` package (gguf-py), imported on first call as the module docstring says."""
    mod = sys.modules.get("gguf")
    if mod is not None:
        return mod
    blocked = "mistral_common" not in sys.modules
    if blocked:
        sys.modules["mistral_common"] = None  # type: ignore[assignment]  # the optional import fails -> gguf's fallback
    try:
        import gguf as mod
    finally:
        if blocked and sys.modules.get("mistral_common", 0) is None:
            del sys.modules["mistral_common"]
    return mod
