"""The dense, padded batch as HF builds it: ``[B, T]`` ``input_ids`` / ``attention_mask`` with pad columns and the
``position_ids`` generate() derives from the mask.

Mirrors transformers 5.19 ``generation/utils.py``: ``_prepare_position_ids_for_generation`` (prefill:
``attention_mask.long().cumsum(-1) - 1``, then ``masked_fill(attention_mask == 0, 0)``: pad columns get 0) and
``_update_model_kwargs_for_generation`` (decode: the mask grows by a column of ones; position ids grow by
``position_ids[..., -1:] + 1``). Torch tensors, int64, on CPU.
"""

from __future__ import annotations

import torch

from infertrace.errors import InfertraceError

PADDINGS = ("left", "right")


def check_padding(value: object) -> str:
    """``value`` as a padding side.

    Raises:
        InfertraceError: not ``left`` / ``right`` (one line naming the choices).
    """
    if value not in PADDINGS:
        raise InfertraceError(f"padding must be left or right (got {str(value)[:40]!r}); HF generate() wants left "
                              "padding for decoder-only models")
    return str(value)


def pad_batch(prompts: list[list[int]], padding: str, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded batch of ``prompts`` as a tokenizer with ``padding_side = padding`` builds it.

    Returns:
        ``input_ids`` ``[B, T]`` int64 (pad columns hold ``pad_id``) and ``attention_mask`` ``[B, T]`` int64
        (1 = real token, 0 = pad), ``T`` the longest prompt.
    """
    B, T = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, T), pad_id, dtype=torch.long)  # [B, T]
    am = torch.zeros((B, T), dtype=torch.long)  # [B, T]
    for b, p in enumerate(prompts):
        cols = slice(T - len(p), T) if padding == "left" else slice(0, len(p))
        ids[b, cols] = torch.tensor(p, dtype=torch.long)
        am[b, cols] = 1
    return ids, am


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """HF ``_prepare_position_ids_for_generation``: ``cumsum(mask) - 1``, pad columns filled with 0.

    ``attention_mask`` ``[B, L]`` -> ``position_ids`` ``[B, L]`` int64: a real token's position is the number of
    real tokens before it in its row, whatever the padding side.
    """
    pos = attention_mask.long().cumsum(-1) - 1  # [B, L]
    return pos.masked_fill(attention_mask == 0, 0)  # [B, L]


def generate_next_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """HF ``_update_model_kwargs_for_generation``: the next decode column's position ids ``[B, 1]`` =
    ``position_ids[..., -1:] + 1`` (the last column's position + 1: a right-padded row's last column is a pad
    at 0, so generate() would feed it position 1)."""
    return position_ids[..., -1:] + 1  # [B, 1]


def real_columns(attention_mask_row: list[int]) -> list[int]:
    """The columns of one row whose mask is 1 (its real tokens, in order)."""
    return [j for j, m in enumerate(attention_mask_row) if m]
