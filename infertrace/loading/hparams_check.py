"""Strict typing and bounds of hyper-parameters, before a :class:`ModelConfig` is built.

The config builders convert with ``int()`` / ``float()``, which would truncate ``2.5`` layers to 2,
turn ``true`` into 1 and accept ``Infinity`` (Python's ``json`` parses ``Infinity`` and ``NaN``).
These checks run on the raw values first: integer fields must be integers (not floats, bools or
strings), float fields finite real numbers, sizes within :mod:`infertrace.loading.limits`, and the
layer count no larger than the layers whose tensors are actually present — so a ``block_count``
of 2^31 is refused before any per-layer name is built.

Field names: HF ``LlamaConfig`` / ``MistralConfig`` / ``Qwen2Config`` / ``Gemma*Config``; GGUF
``{arch}.*`` keys as in gguf-py ``gguf/constants.py`` ``Keys.LLM`` / ``Keys.Attention`` / ``Keys.Rope``.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable

from infertrace.errors import InfertraceError
from infertrace.loading.limits import MAX_CTX_TRAIN, MAX_DIM, MAX_LAYERS, MAX_VOCAB

_INF = float("inf")
#: HF int fields: (name, min, max). None is accepted where HF allows null.
HF_INT_FIELDS = (
    ("num_hidden_layers", 1, MAX_LAYERS), ("hidden_size", 1, MAX_DIM), ("intermediate_size", 1, MAX_DIM),
    ("num_attention_heads", 1, MAX_DIM), ("num_key_value_heads", 1, MAX_DIM), ("head_dim", 1, MAX_DIM),
    ("vocab_size", 1, MAX_VOCAB), ("max_position_embeddings", 1, MAX_CTX_TRAIN), ("sliding_window", 0, MAX_CTX_TRAIN),
    ("max_window_layers", 0, MAX_LAYERS), ("sliding_window_pattern", 1, MAX_LAYERS),
    ("query_pre_attn_scalar", 1, MAX_DIM),
)
#: HF float fields: (name, lower bound, lower bound inclusive).
HF_FLOAT_FIELDS = (("rope_theta", 0.0, False), ("rms_norm_eps", 0.0, False), ("rope_local_base_freq", 0.0, False),
                   ("attn_logit_softcapping", 0.0, False), ("final_logit_softcapping", 0.0, False))
HF_BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
HF_ROPE_INT_FIELDS = (("original_max_position_embeddings", 1, MAX_CTX_TRAIN),)
HF_ROPE_FLOAT_FIELDS = (("factor", 0.0, False), ("low_freq_factor", 0.0, False), ("high_freq_factor", 0.0, False),
                        ("rope_theta", 0.0, False))

#: GGUF ``{arch}.`` key suffixes holding integers: (suffix, min, max).
GGUF_INT_KEYS = (
    ("block_count", 1, MAX_LAYERS), ("embedding_length", 1, MAX_DIM), ("feed_forward_length", 1, MAX_DIM),
    ("attention.head_count", 1, MAX_DIM), ("attention.head_count_kv", 1, MAX_DIM), ("attention.key_length", 1, MAX_DIM),
    ("attention.value_length", 1, MAX_DIM), ("rope.dimension_count", 0, MAX_DIM), ("context_length", 1, MAX_CTX_TRAIN),
    ("vocab_size", 1, MAX_VOCAB), ("rope.scaling.original_context_length", 1, MAX_CTX_TRAIN),
    ("attention.sliding_window", 0, MAX_CTX_TRAIN),
)
#: GGUF ``{arch}.`` key suffixes holding floats: (suffix, lower bound, inclusive).
GGUF_FLOAT_KEYS = (
    ("rope.freq_base", 0.0, False), ("attention.layer_norm_rms_epsilon", 0.0, False), ("attention.layer_norm_epsilon", 0.0, False),
    ("rope.scaling.factor", 0.0, False), ("rope.freq_base_swa", 0.0, False),
    ("attn_logit_softcapping", 0.0, False), ("final_logit_softcapping", 0.0, False),
)

_LAYER_RE = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:blk|layers)\.(\d+)\.")  # language_model.: Qwen3.5 multimodal layout


def _type_name(v: Any) -> str:
    return {bool: "a boolean", str: "a string", float: "a float", list: "a list", dict: "an object",
            type(None): "null"}.get(type(v), type(v).__name__)


def check_int(where: str, name: str, v: Any, lo: int, hi: int) -> int:
    """``v`` must be a Python ``int`` (not ``bool``) with ``lo <= v <= hi``.

    Raises:
        InfertraceError: wrong type or out of range; the message names the field and the limit.
    """
    if isinstance(v, bool) or not isinstance(v, int):
        shown = repr(v) if isinstance(v, (int, float)) else _type_name(v)
        raise InfertraceError(f"{where} has an invalid value: {name} must be an integer, got {shown}; fix the model's config")
    if not lo <= v <= hi:
        raise InfertraceError(f"{where} has an invalid value: {name} is {v}, outside the supported range {lo}..{hi}; the model file is broken")
    return v


def check_float(where: str, name: str, v: Any, lo: float = -_INF, inclusive: bool = True) -> float:
    """``v`` must be an ``int`` or ``float`` (not ``bool``), finite, and above ``lo`` (``>=`` when ``inclusive``).

    Raises:
        InfertraceError: wrong type, NaN/infinite, or out of range.
    """
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InfertraceError(f"{where} has an invalid value: {name} must be a number, got {_type_name(v)}; fix the model's config")
    try:
        f = float(v)
    except OverflowError:
        raise InfertraceError(f"{where} has an invalid value: {name} is too large to be a float; the model file is broken") from None
    if not math.isfinite(f):
        raise InfertraceError(f"{where} has an invalid value: {name} is {f}; it must be a finite number")
    if f < lo or (f == lo and not inclusive):
        raise InfertraceError(f"{where} has an invalid value: {name} is {f:g}; it must be {'>=' if inclusive else '>'} {lo:g}")
    return f


def layers_present(names: Iterable[str]) -> int:
    """Number of layers whose tensors appear: ``1 + max N`` over ``blk.N.*`` / ``model.layers.N.*`` names (0 if none)."""
    top = -1
    for n in names:
        m = _LAYER_RE.match(n)
        if m and len(m.group(1)) <= 9:
            top = max(top, int(m.group(1)))
    return top + 1


def check_layer_count(where: str, key: str, n_layer: Any, names: Iterable[str]) -> None:
    """The declared layer count is an integer in ``1..MAX_LAYERS`` and no larger than the layers present.

    Runs before any per-layer tensor name is built, so a count of 2^31 costs nothing.

    Raises:
        InfertraceError: one line naming the key, the tensors found and the limit.
    """
    n = check_int(where, key, n_layer, 1, MAX_LAYERS)
    have = layers_present(names)
    if n > have:
        raise InfertraceError(
            f"{where} has an invalid value: {key} is {n} but the file only has tensors for {have} layer(s)"
            f"{f' (blk.0..blk.{have - 1})' if have else ''}; "
            "the checkpoint is incomplete or its config is wrong")


def check_gguf_hparams(meta: dict[str, Any], where: str = "GGUF metadata") -> None:
    """Type and range of the ``{arch}.*`` hyper-parameters in decoded GGUF metadata.

    Args:
        meta: ``{key: python value}`` as gguf-py ``ReaderField.contents()`` returns them.

    Raises:
        InfertraceError: a wrong type (e.g. ``block_count`` stored as FLOAT32 or BOOL), a non-finite or
            non-positive float, or a size over its limit (the layer count against the tensors present is
            :func:`check_layer_count`, run once the architecture is known to be supported).
    """
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        if arch is None:
            return  # the config builder reports the missing architecture
        raise InfertraceError(f"{where} has an invalid value: general.architecture must be a string, got {_type_name(arch)}; the file is broken")
    for suffix, lo, hi in GGUF_INT_KEYS:
        k = f"{arch}.{suffix}"
        if k in meta:
            check_int(where, k, meta[k], lo, hi)
    for suffix, lo, inclusive in GGUF_FLOAT_KEYS:
        k = f"{arch}.{suffix}"
        if k in meta:
            check_float(where, k, meta[k], lo, inclusive)
    k = f"{arch}.rope.scaling.type"
    if k in meta and not isinstance(meta[k], str):
        raise InfertraceError(f"{where} has an invalid value: {k} must be a string, got {_type_name(meta[k])}")


def check_hf_config(raw: dict[str, Any], where: str = "config.json") -> None:
    """Strict types of the fields of an HF ``config.json`` the loader reads.

    Ints must be JSON integers (``2.5``, ``true`` and ``"2"`` are refused, not converted),
    floats finite numbers (Python's json reads ``Infinity`` / ``NaN``), bools JSON booleans,
    ``rope_scaling`` an object or null, ``architectures`` a list of strings.

    Raises:
        InfertraceError: one line naming the field.
    """
    for name, lo, hi in HF_INT_FIELDS:
        if raw.get(name) is not None:
            check_int(where, name, raw[name], lo, hi)
    for name, lo, inclusive in HF_FLOAT_FIELDS:
        if raw.get(name) is not None:
            check_float(where, name, raw[name], lo, inclusive)
    for name in HF_BOOL_FIELDS:
        if raw.get(name) is not None and not isinstance(raw[name], bool):
            raise InfertraceError(f"{where} has an invalid value: {name} must be true or false, got {_type_name(raw[name])}")
    archs = raw.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise InfertraceError(f"{where} has an invalid value: architectures must be a list of strings")
    for name in ("model_type", "_name_or_path"):
        if raw.get(name) is not None and not isinstance(raw[name], str):
            raise InfertraceError(f"{where} has an invalid value: {name} must be a string, got {_type_name(raw[name])}")
    for rname in ("rope_scaling", "rope_parameters"):
        rs = raw.get(rname)
        if rs is None:
            continue
        if not isinstance(rs, dict):
            raise InfertraceError(f"{where} has an invalid value: {rname} must be an object or null, got {_type_name(rs)}")
        for key in ("rope_type", "type"):
            if rs.get(key) is not None and not isinstance(rs[key], str):
                raise InfertraceError(f"{where} has an invalid value: {rname}.{key} must be a string, got {_type_name(rs[key])}")
        for name, lo, hi in HF_ROPE_INT_FIELDS:
            if rs.get(name) is not None:
                check_int(where, f"{rname}.{name}", rs[name], lo, hi)
        for name, lo, inclusive in HF_ROPE_FLOAT_FIELDS:
            if rs.get(name) is not None:
                check_float(where, f"{rname}.{name}", rs[name], lo, inclusive)


def check_config_bounds(cfg: Any) -> None:
    """Bounds of a built ``ModelConfig`` (whatever file it came from), called by ``ModelConfig.validate``.

    Integer fields are ints (not bools) within the limits; ``rope_theta``, ``rms_eps`` and the
    RoPE scaling factors finite and > 0; ``rope_freq_factors`` (GGUF ``rope_freqs.weight``) finite and > 0.

    Raises:
        InfertraceError: one line naming the field and the limit.
    """
    where = f"{'GGUF metadata' if getattr(cfg, 'source', '') == 'gguf' else 'config.json'}"
    for name, lo, hi in (("n_layer", 1, MAX_LAYERS), ("n_embd", 1, MAX_DIM), ("n_ff", 1, MAX_DIM), ("n_head", 1, MAX_DIM),
                         ("n_head_kv", 1, MAX_DIM), ("head_dim", 1, MAX_DIM), ("vocab_size", 1, MAX_VOCAB),
                         ("n_ctx_train", 1, MAX_CTX_TRAIN), ("rope_dim", 0, MAX_DIM)):
        if hasattr(cfg, name):
            check_int(where, name, getattr(cfg, name), lo, hi)
    for name in ("rope_theta", "rms_eps"):
        if hasattr(cfg, name):
            check_float(where, name, getattr(cfg, name), 0.0, inclusive=False)
    rs = getattr(cfg, "rope_scaling", None)
    if rs is not None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            check_float(where, f"rope scaling {name}", getattr(rs, name), 0.0, inclusive=False)
        check_int(where, "rope scaling original_max_position_embeddings", rs.original_max_position_embeddings, 1, MAX_CTX_TRAIN)
    ff = getattr(cfg, "rope_freq_factors", None)
    if ff is not None and hasattr(cfg, "rope_dim") and len(ff) != cfg.rope_dim // 2:
        raise InfertraceError(f"{where} has an invalid value: rope_freqs.weight has {len(ff)} entries but the rotary "
                              f"dimension {cfg.rope_dim} needs {cfg.rope_dim // 2}; the model file is broken")
    if ff is not None and not all(math.isfinite(x) and x > 0 for x in ff):
        raise InfertraceError(f"{where} has an invalid value: rope_freqs.weight holds a non-finite or non-positive "
                              "frequency divisor; the model file is broken")
