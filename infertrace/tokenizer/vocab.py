"""Tokenizer built from GGUF metadata (or an HF model directory) on top of HF ``tokenizers``.

What this mirrors:

* llama.cpp ``src/llama-vocab.cpp`` (``llama_vocab::impl::load`` / ``tokenize`` /
  ``token_to_piece``): token attributes from ``tokenizer.ggml.token_type``, the
  pre-tokenizer regexes chosen by ``tokenizer.ggml.pre``, the BOS rule, the text-based
  end-of-generation (EOG) detection, and ``tokenizer_st_partition`` (special tokens are cut
  out of the text first, longest first; control/unknown tokens only when ``parse_special``,
  user-defined tokens always).
* HF transformers' GGUF tokenizer conversion (``integrations/gguf/gguf_tokenizer_mapping.py``,
  formerly ``GGUFGPTConverter`` / ``GGUFLlamaConverter``): ``gpt2`` files become a byte-level
  BPE over the file's tokens and merges; ``llama`` files become a SentencePiece-style BPE
  whose merges are derived from the token scores, with ``<0xXX>`` byte fallback.

The BPE (and Unigram) algorithms themselves run in the HF ``tokenizers`` library; this module
only wires the pieces together the way llama.cpp does.

Known, deliberate differences from llama.cpp (kept small):

* ``decode`` is lossless: llama.cpp's ``clean_spaces`` pass (drops the space in " ?", " ."
  ... for some BPE pre-tokenizers) is not applied.
* per-model ``lstrip``/``rstrip`` token attributes (phi-3, jina) are not applied.
* ``tokenizer.ggml.add_eos_token`` is not applied by :meth:`Tokenizer.encode`.
* a ``gpt2`` file without ``bos/eos`` ids gets ``None`` instead of llama.cpp's legacy id 11.
* a ``llama`` file without merges whose normal-token scores are fractional (SentencePiece
  *Unigram* log-probabilities, not BPE ranks) is run with the ``tokenizers`` Unigram model
  (Viterbi, as SentencePiece does); llama.cpp runs its greedy score merge on every ``llama``
  vocab, so such files may tokenize rare strings differently.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from infertrace.errors import InfertraceError

if TYPE_CHECKING:  # pragma: no cover
    import gguf

__all__ = [
    "Tokenizer",
    "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_UNKNOWN",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_USER_DEFINED",
    "TOKEN_TYPE_UNUSED",
    "TOKEN_TYPE_BYTE",
]

# llama.cpp ``llama_token_type`` / gguf-py ``TokenType`` values of ``tokenizer.ggml.token_type``.
TOKEN_TYPE_UNDEFINED = 0
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

SUPPORTED_MODELS = ("gpt2", "llama")

SPM_SPACE = "\u2581"  # "▁", SentencePiece's escaped space

# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, copied as data from llama.cpp ``llm_tokenizer_bpe`` (llama-vocab.cpp).
# Each list is applied in order; every regex splits the pieces left by the previous one and the
# text between matches is kept as its own piece (HF ``Split(behavior="isolated")`` does the same).
# Where llama.cpp rewrote a regex for std::regex, the original from tokenizer.json is used
# (Oniguruma, which ``tokenizers`` uses, supports it directly).
# ---------------------------------------------------------------------------------------------
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_PORO = r" ?[^(\s|.,!?…。，、।۔،)]+"

_PRE_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_PRE_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _RE_GPT2, r"[0-9][0-9][0-9]")
_PRE_STARCODER = (r"\p{N}", _RE_GPT2)  # starcoder, refact, command-r, smollm, codeshell, exaone, minerva
_PRE_GPT2 = (_RE_GPT2,)


def _pre(regexes: tuple[str, ...], *, add_bos: bool = False, ignore_merges: bool = False, clean_spaces: bool = True):
    return {"regexes": regexes, "add_bos": add_bos, "ignore_merges": ignore_merges, "clean_spaces": clean_spaces}


#: ``tokenizer.ggml.pre`` -> regexes and the flags llama.cpp sets with it (llama_vocab::impl::load).
PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "default": _pre(_PRE_DEFAULT),
    **{
        name: _pre((_RE_LLAMA3,), add_bos=True, ignore_merges=True)
        for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
    },
    "dbrx": _pre((_RE_LLAMA3,)),
    "smaug-bpe": _pre((_RE_LLAMA3,)),
    "glm4": _pre((_RE_LLAMA3,)),
    "chatglm-bpe": _pre((_RE_LLAMA3,)),
    "falcon": _pre(_PRE_FALCON),
    "mpt": _pre(_PRE_GPT2),
    **{
        name: _pre(_PRE_GPT2)
        for name in (
            "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
            "mellum", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "olmo", "jais",
        )
    },
    "trillion": _pre(_PRE_GPT2, clean_spaces=False),
    "granite-docling": _pre(_PRE_GPT2, clean_spaces=False),
    "starcoder": _pre(_PRE_STARCODER),
    "refact": _pre(_PRE_STARCODER),
    "command-r": _pre(_PRE_STARCODER, clean_spaces=False),
    "smollm": _pre(_PRE_STARCODER, clean_spaces=False),
    "codeshell": _pre(_PRE_STARCODER),
    "exaone": _pre(_PRE_STARCODER),
    "minerva-7b": _pre(_PRE_STARCODER),
    **{name: _pre((_RE_QWEN2,), clean_spaces=False) for name in ("qwen2", "deepseek-r1-qwen", "kormo", "hunyuan")},
    "megrez": _pre((_RE_QWEN2,)),
    "stablelm2": _pre((_RE_QWEN2,)),
    "tekken": _pre((_RE_TEKKEN,), add_bos=True, ignore_merges=True, clean_spaces=False),
    **{name: _pre((_RE_GPT4O,), clean_spaces=False) for name in ("gpt-4o", "llama4", "minimax-m2")},
    "poro-chat": _pre((_RE_PORO,), clean_spaces=False),
    "bloom": _pre((_RE_PORO,)),
    "gpt3-finnish": _pre((_RE_PORO,)),
    "viking": _pre((_RE_PORO, r"\p{N}"), clean_spaces=False),
}

# Texts llama.cpp treats as end-of-generation / EOT / FIM tokens (llama_vocab::impl::load).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
})
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
    "_<EOT>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)

_BYTE_TOKEN_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table (used by byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_BYTE_ENCODER = _bytes_to_unicode()
_BYTE_DECODER = {c: b for b, c in _BYTE_ENCODER.items()}


# ---------------------------------------------------------------------------------------------
# GGUF metadata reading
# ---------------------------------------------------------------------------------------------
def _gguf_value(reader: "gguf.GGUFReader", key: str) -> Any:
    """One metadata value as a Python object, or None when the key is absent.

    String arrays are decoded leniently (invalid UTF-8 -> U+FFFD) so a bad token cannot make
    the whole file unreadable.
    """
    if isinstance(reader, dict):  # already decoded by this function (infertrace.loading.gguf_meta's cache)
        return reader.get(key)
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        from infertrace.loading.gguf_lib import gguf as _gguf_lib

        _gguf = _gguf_lib()

        types = list(field.types)
        if types and types[0] == _gguf.GGUFValueType.ARRAY and types[-1] == _gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if types and types[0] == _gguf.GGUFValueType.STRING:
            return bytes(field.parts[-1]).decode("utf-8", errors="replace")
        return field.contents()
    except Exception as exc:  # pragma: no cover - corrupt file
        raise InfertraceError(f"cannot read GGUF metadata key '{key}': {exc}") from exc


def _derive_spm_merges(tokens: list[str], scores: list[float], skip: set[int]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split ``(l, r)`` of a token whose
    halves are both tokens, best (highest) score of the merged token first.

    This is the fact HF's GGUF converter relies on (``generate_merges``) and it matches llama.cpp's
    ``llm_tokenizer_spm``, which repeatedly merges the adjacent pair whose concatenation is the
    highest-scoring token.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for tid, tok in enumerate(tokens):
        if tid in skip or len(tok) < 2:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is None or ri is None or li in skip or ri in skip:
                continue
            ranked.append((-scores[tid], tid, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _looks_unigram(scores: list[float], types: list[int]) -> bool:
    """True when normal-token scores are fractional log-probabilities (SentencePiece Unigram)
    rather than BPE ranks (SentencePiece BPE writes integer scores 0, -1, -2, ...)."""
    normal = [s for s, t in zip(scores, types) if t == TOKEN_TYPE_NORMAL]
    if not normal or all(s == 0.0 for s in normal):
        return False
    fractional = sum(1 for s in normal if not math.isfinite(s) or abs(s - round(s)) > 1e-4)
    return fractional > len(normal) // 2


# ----------------------------------------------------------------------------- from_gguf, by part


def _gguf_vocab(reader: Any) -> tuple[str, str | None, list[str], list[int], list[float]]:
    """``(model, pre, tokens, token_types, scores)`` of ``tokenizer.ggml.*``, checked: a supported
    model, tokens present, arrays of one length, token texts unique (empty ones renamed
    ``[EMPTY_i]`` as llama.cpp does). Missing types: all normal; missing scores: all 0.

    Raises:
        InfertraceError: no or an unsupported ``tokenizer.ggml.model``, no tokens, lengths that
            disagree, a duplicate token text.
    """
    model = _gguf_value(reader, "tokenizer.ggml.model")
    if model is None:
        raise InfertraceError(
            "GGUF has no tokenizer.ggml.model key; this file carries no tokenizer "
            "(use --hf-dir with tokenizer.json, or re-convert with llama.cpp's convert_hf_to_gguf.py)"
        )
    if model not in SUPPORTED_MODELS:
        raise InfertraceError(
            f"unsupported tokenizer model '{model}' in GGUF (supported: {', '.join(SUPPORTED_MODELS)}); "
            "infertrace only handles Llama-family byte-level BPE and SentencePiece vocabularies"
        )
    pre = _gguf_value(reader, "tokenizer.ggml.pre")
    tokens = _gguf_value(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise InfertraceError("GGUF has no tokenizer.ggml.tokens; cannot build the tokenizer")
    n = len(tokens)
    types = _gguf_value(reader, "tokenizer.ggml.token_type")
    if types is None:
        types = [TOKEN_TYPE_NORMAL] * n
    scores = _gguf_value(reader, "tokenizer.ggml.scores")
    if scores is None:
        scores = [0.0] * n
    if len(types) != n or len(scores) != n:
        raise InfertraceError(
            f"GGUF tokenizer arrays disagree: {n} tokens, {len(types)} token types, {len(scores)} scores"
        )
    types = [int(t) for t in types]
    scores = [float(s) for s in scores]
    # llama.cpp renames empty tokens so every text is unique.
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    if len(set(tokens)) != n:
        seen: set[str] = set()
        dup = next(t for t in tokens if t in seen or seen.add(t))  # type: ignore[func-returns-value]
        raise InfertraceError(f"GGUF tokenizer.ggml.tokens has duplicate token {dup!r}; the file is corrupt")
    return model, pre, tokens, types, scores


def _gguf_special_ids(reader: Any, model: str, n: int, warnings: list[str]) -> dict[str, int | None]:
    """Special token ids (``bos``, ``eos``, ``unk``, ``pad``, ``eot``, ``eom``, ``fim_*``) from
    ``tokenizer.ggml.*_token_id``; defaults as llama.cpp for SPM (bos 1, eos 2, unk 0). An id
    outside the vocabulary of ``n`` tokens falls back to the default, with a warning."""
    if model == "llama":
        defaults: dict[str, int | None] = {"bos": 1, "eos": 2, "unk": 0, "pad": None}
    else:
        defaults = {"bos": None, "eos": None, "unk": None, "pad": None}
    ids: dict[str, int | None] = {}
    for name, key in (
        ("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"), ("pad", "padding_token_id"),
        ("eot", "eot_token_id"), ("eom", "eom_token_id"), ("fim_pad", "fim_pad_token_id"),
        ("fim_rep", "fim_rep_token_id"), ("fim_sep", "fim_sep_token_id"),
    ):
        value = _gguf_value(reader, f"tokenizer.ggml.{key}")
        default = defaults.get(name)
        if default is not None and default >= n:
            default = None
        if value is None:
            ids[name] = default
        elif not 0 <= int(value) < n:
            warnings.append(f"bad special token tokenizer.ggml.{key} = {value} (vocab has {n}); using {default}")
            ids[name] = default
        else:
            ids[name] = int(value)
    return ids


@dataclass(frozen=True)
class _PreTokenizer:
    """The pre-tokenizer of a GGUF vocabulary and the flags that come with it (llama.cpp
    ``llama_vocab::impl::load``, per ``tokenizer.ggml.pre``)."""

    regexes: tuple[str, ...]
    add_space_prefix: bool
    clean_spaces: bool
    ignore_merges: bool
    add_bos_default: bool


def _gguf_pre_tokenizer(reader: Any, model: str, pre: str | None, warnings: list[str]) -> _PreTokenizer:
    """``gpt2``: the regexes and flags of :data:`PRE_TOKENIZERS` for ``pre`` (``default`` with a
    warning when unknown, as llama.cpp); ``llama``: no regexes, space prefix and BOS on.
    ``tokenizer.ggml.add_space_prefix`` overrides the space prefix."""
    add_space_prefix = model == "llama"
    clean_spaces = False
    ignore_merges = False
    add_bos_default = model == "llama"
    regexes: tuple[str, ...] = ()
    if model == "gpt2":
        spec = PRE_TOKENIZERS.get(pre) if pre else None
        if spec is None:
            warnings.append(
                f"missing or unrecognized pre-tokenizer type {pre!r} (tokenizer.ggml.pre); using 'default' "
                "as llama.cpp does; token ids may differ from the model's own tokenizer"
            )
            spec = PRE_TOKENIZERS["default"]
        regexes = spec["regexes"]
        add_bos_default = spec["add_bos"]
        ignore_merges = spec["ignore_merges"]
        clean_spaces = spec["clean_spaces"]
    asp = _gguf_value(reader, "tokenizer.ggml.add_space_prefix")
    if asp is not None:
        add_space_prefix = bool(asp)
    return _PreTokenizer(regexes, add_space_prefix, clean_spaces, ignore_merges, add_bos_default)


def _gguf_add_bos(reader: Any, add_bos_default: bool, bos_id: int | None, warnings: list[str]) -> bool:
    """The BOS rule: ``tokenizer.ggml.add_bos_token`` when present, else ``add_bos_default``
    (off, with a warning, when there is no BOS id).

    Raises:
        InfertraceError: ``add_bos_token`` true without a valid BOS id.
    """
    add_bos_key = _gguf_value(reader, "tokenizer.ggml.add_bos_token")
    if add_bos_key is not None:
        add_bos = bool(add_bos_key)
        if add_bos and bos_id is None:
            raise InfertraceError(
                "GGUF sets tokenizer.ggml.add_bos_token=true but has no valid tokenizer.ggml.bos_token_id"
            )
        return add_bos
    add_bos = add_bos_default
    if add_bos and bos_id is None:
        warnings.append("no BOS token id in the GGUF; not adding BOS")
        add_bos = False
    return add_bos


# ----------------------------------------------------------------------------- from_hf_dir, by part


def _hf_read_files(path: pathlib.Path) -> tuple[pathlib.Path, dict[str, Any], _HFTokenizer, dict[str, Any]]:
    """``(tokenizer.json path, its JSON, the tokenizers backend, tokenizer_config.json or {})``, bounded.

    Raises:
        InfertraceError: ``tokenizer.json`` missing, over :data:`~infertrace.loading.limits.MAX_TOKENIZER_JSON_BYTES`,
            unreadable, or either file not a JSON object.
    """
    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise InfertraceError(f"no tokenizer.json in {path}; an HF model directory needs one")
    from infertrace.loading.limits import MAX_TOKENIZER_JSON_BYTES

    if tj.stat().st_size > MAX_TOKENIZER_JSON_BYTES:
        raise InfertraceError(f"{tj} is {tj.stat().st_size} bytes, over the limit of {MAX_TOKENIZER_JSON_BYTES}")
    try:
        raw = json.loads(tj.read_text(encoding="utf-8"))
        backend = _HFTokenizer.from_file(str(tj))
    except Exception as exc:
        raise InfertraceError(f"cannot read {tj}: {exc}") from exc
    cfg: dict[str, Any] = {}
    cfg_path = path / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except Exception as exc:
            raise InfertraceError(f"cannot read {cfg_path}: {exc}") from exc

    if not isinstance(raw, dict) or not isinstance(cfg, dict):
        raise InfertraceError(f"{tj if not isinstance(raw, dict) else cfg_path} must hold a JSON object")
    return tj, raw, backend, cfg


def _hf_model_kind(raw: dict[str, Any], tj: pathlib.Path) -> tuple[str, str, bool]:
    """``(model, algorithm, byte_fallback)``: ``gpt2`` for a byte-level BPE, ``llama`` for a
    SentencePiece-style BPE or Unigram.

    Raises:
        InfertraceError: any other tokenizer model (e.g. WordPiece).
    """
    model_type = (raw.get("model") or {}).get("type")
    pipeline = json.dumps([raw.get("pre_tokenizer"), raw.get("decoder")])
    if model_type == "BPE" and "ByteLevel" in pipeline:
        model = "gpt2"
    elif model_type in ("BPE", "Unigram"):
        model = "llama"
    else:
        raise InfertraceError(
            f"unsupported tokenizer model '{model_type}' in {tj} (supported: byte-level BPE, SentencePiece BPE/Unigram)"
        )
    algorithm = "unigram" if model_type == "Unigram" else "bpe"
    byte_fallback = bool((raw.get("model") or {}).get("byte_fallback"))
    return model, algorithm, byte_fallback


def _hf_vocab(backend: _HFTokenizer, raw: dict[str, Any], tj: pathlib.Path, model: str,
              byte_fallback: bool) -> tuple[list[str], list[int]]:
    """Token texts and llama.cpp token types by id: added tokens marked ``special`` are control
    tokens, other added tokens user-defined, ``<0xXX>`` byte tokens (``llama`` with byte
    fallback) byte tokens, ids without a token unused.

    Raises:
        InfertraceError: token ids beyond :data:`~infertrace.loading.limits.MAX_VOCAB`.
    """
    from infertrace.loading.limits import MAX_VOCAB

    vocab = backend.get_vocab(with_added_tokens=True)
    size = max(backend.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
    if size > MAX_VOCAB:
        raise InfertraceError(f"{tj} has token ids up to {size - 1}, over the vocabulary limit of {MAX_VOCAB}")
    tokens = [""] * size
    types = [TOKEN_TYPE_UNUSED] * size
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = TOKEN_TYPE_NORMAL
        if model == "llama" and byte_fallback and _BYTE_TOKEN_RE.match(text):
            types[i] = TOKEN_TYPE_BYTE
    for added in raw.get("added_tokens") or []:
        i = added.get("id")
        if isinstance(i, int) and 0 <= i < size:
            tokens[i] = added.get("content", tokens[i])
            types[i] = TOKEN_TYPE_CONTROL if added.get("special") else TOKEN_TYPE_USER_DEFINED
    return tokens, types


def _hf_special_ids(cfg: dict[str, Any], raw: dict[str, Any], backend: _HFTokenizer,
                    types: list[int]) -> tuple[int | None, int | None, int | None, int | None]:
    """``(bos, eos, unk, pad)`` ids named in ``tokenizer_config.json`` (unk: else the model's
    ``unk_token``); a normal unk token is marked unknown in ``types`` (changed in place)."""

    def tok_id(name: str) -> int | None:
        value = cfg.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if not isinstance(value, str):
            return None
        return backend.token_to_id(value)

    bos_id, eos_id, unk_id, pad_id = (tok_id(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token"))
    if unk_id is None:
        unk_name = (raw.get("model") or {}).get("unk_token")
        unk_id = backend.token_to_id(unk_name) if isinstance(unk_name, str) else None
    if unk_id is not None and types[unk_id] == TOKEN_TYPE_NORMAL:
        types[unk_id] = TOKEN_TYPE_UNKNOWN
    return bos_id, eos_id, unk_id, pad_id


def _hf_add_bos(cfg: dict[str, Any], backend: _HFTokenizer, bos_id: int | None, warnings: list[str]) -> bool:
    """The BOS rule: ``add_bos_token`` of the config, else what the ``tokenizer.json``
    post-processor does to an empty text (off, with a warning, when no BOS is configured)."""
    if "add_bos_token" in cfg:
        add_bos = bool(cfg["add_bos_token"])
    else:
        probe = backend.encode("", add_special_tokens=True).ids
        add_bos = bos_id is not None and bool(probe) and probe[0] == bos_id
    if add_bos and bos_id is None:
        warnings.append("add_bos_token is true but no bos_token is configured; not adding BOS")
        add_bos = False
    return add_bos


def _hf_chat_template(path: pathlib.Path, cfg: dict[str, Any]) -> str | None:
    """``chat_template.jinja`` when present (bounded), else ``chat_template`` of the config (a
    list of named templates: ``default``, else the first).

    Raises:
        InfertraceError: ``chat_template.jinja`` over :data:`~infertrace.loading.limits.MAX_TEMPLATE_FILE_BYTES`.
    """
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        from infertrace.loading.limits import MAX_TEMPLATE_FILE_BYTES

        if jinja_file.stat().st_size > MAX_TEMPLATE_FILE_BYTES:
            raise InfertraceError(f"{jinja_file} is over the limit of {MAX_TEMPLATE_FILE_BYTES} bytes")
        return jinja_file.read_text(encoding="utf-8")
    tmpl = cfg.get("chat_template")
    if isinstance(tmpl, list):
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default") or next(iter(named.values()), None)
    return tmpl if isinstance(tmpl, str) else None


class Tokenizer:
    """Text <-> token ids for Llama-family models, the way llama.cpp's ``llama_vocab`` does it.

    Build it with :meth:`from_gguf` or :meth:`from_hf_dir`.

    Attributes:
        model: ``"gpt2"`` (byte-level BPE) or ``"llama"`` (SentencePiece-style, ``▁`` spaces).
        pre: ``tokenizer.ggml.pre`` (None for HF directories or when absent).
        bos_id, eos_id: special ids, or None.
        eog_ids: ids that end generation (eos, eot, eom, ``<|im_end|>``, ``<|endoftext|>`` ...),
            as llama.cpp computes ``special_eog_ids``.
        add_bos: resolved rule for adding BOS in :meth:`encode`.
        chat_template: jinja source, or None.
        vocab_size: number of token ids.
        warnings: human-readable notes collected while loading and encoding.
        add_space_prefix: ``llama`` models prepend one space to each text fragment (llama.cpp).
        algorithm: backend model used: ``"bpe"`` or ``"unigram"``.
        clean_spaces: llama.cpp's detokenizer flag for this pre-tokenizer (recorded, not applied).
    """

    model: str
    pre: str | None
    bos_id: int | None
    eos_id: int | None
    eog_ids: frozenset[int]
    add_bos: bool
    chat_template: str | None
    vocab_size: int
    warnings: list[str]

    def __init__(
        self,
        *,
        model: str,
        pre: str | None,
        tokens: list[str],
        token_types: list[int],
        backend: _HFTokenizer | Callable[[], _HFTokenizer],
        bos_id: int | None,
        eos_id: int | None,
        unk_id: int | None,
        pad_id: int | None,
        eog_ids: frozenset[int],
        add_bos: bool,
        add_space_prefix: bool,
        chat_template: str | None,
        algorithm: str,
        clean_spaces: bool,
        warnings: list[str],
    ) -> None:
        """Internal: use :meth:`from_gguf` or :meth:`from_hf_dir`."""
        self.model = model
        self.pre = pre
        self._tokens = tokens
        self._types = token_types
        self._backend_or_build = backend  # a callable builds it on first encode (inspect never pays for it)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.unk_id = unk_id
        self.pad_id = pad_id
        self.eog_ids = eog_ids
        self.add_bos = add_bos
        self.add_space_prefix = add_space_prefix
        self.chat_template = chat_template
        self.algorithm = algorithm
        self.clean_spaces = clean_spaces
        self.vocab_size = len(tokens)
        self.warnings = warnings
        self._compiled_template: Any = None

        # llama.cpp ``cache_special_tokens``: control, user-defined and unknown tokens, longest first.
        special = [
            i
            for i, t in enumerate(token_types)
            if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN) and tokens[i]
        ]
        special.sort(key=lambda i: (-len(tokens[i].encode("utf-8")), i))
        self._special_cache = special
        self._piece_memo: dict[int, bytes] = {}  # token id -> piece bytes, filled on first use

    @property
    def _backend(self) -> _HFTokenizer:
        """The ``tokenizers`` backend, built on first use when construction was deferred."""
        b = self._backend_or_build
        if callable(b) and not isinstance(b, _HFTokenizer):
            b = self._backend_or_build = b()
        return b

    def _piece(self, token_id: int) -> bytes:
        """:meth:`_piece_bytes` of a checked id, memoised."""
        p = self._piece_memo.get(token_id)
        if p is None:
            p = self._piece_memo[token_id] = self._piece_bytes(token_id)
        return p

    # -----------------------------------------------------------------------------------------
    # construction
    # -----------------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader: "gguf.GGUFReader") -> "Tokenizer":
        """Build the tokenizer described by a GGUF file's ``tokenizer.*`` metadata.

        Mirrors llama.cpp ``llama_vocab::impl::load`` (llama-vocab.cpp): ``tokenizer.ggml.model``
        ``gpt2`` -> byte-level BPE from ``tokens`` + ``merges`` with the pre-tokenizer regexes of
        ``tokenizer.ggml.pre``; ``llama`` -> SentencePiece-style BPE from ``tokens`` + ``scores``
        (merges derived from scores, as HF's GGUF converter does), ``<0xXX>`` byte fallback and
        ``add_space_prefix`` (default true). Token kinds come from ``tokenizer.ggml.token_type``.

        BOS rule: ``tokenizer.ggml.add_bos_token`` when present; otherwise true for ``llama``
        and for the ``gpt2`` pre-tokenizers llama.cpp marks (llama3 family, tekken), else false.

        Args:
            reader: an open ``gguf.GGUFReader``, or the ``tokenizer.*`` values it decodes to
                (:attr:`infertrace.loading.gguf_meta.GGUFHeader.values`, e.g. from the cache).

        Returns:
            Tokenizer

        Raises:
            InfertraceError: unsupported ``tokenizer.ggml.model`` (e.g. ``bert``, ``rwkv``),
                missing ``tokenizer.ggml.model`` / ``tokens`` / ``merges`` (gpt2), array lengths
                that disagree, duplicate token texts, or ``add_bos_token`` true without a BOS id.
        """
        warnings: list[str] = []
        model, pre, tokens, types, scores = _gguf_vocab(reader)
        ids = _gguf_special_ids(reader, model, len(tokens), warnings)
        pt = _gguf_pre_tokenizer(reader, model, pre, warnings)
        add_bos = _gguf_add_bos(reader, pt.add_bos_default, ids["bos"], warnings)

        # --- backend ---
        merges_raw = _gguf_value(reader, "tokenizer.ggml.merges")
        if model == "gpt2":
            if merges_raw is None:
                raise InfertraceError("GGUF tokenizer model 'gpt2' has no tokenizer.ggml.merges; cannot build BPE")
            backend, dropped = cls._byte_level_backend(tokens, merges_raw, pt.regexes, pt.ignore_merges)
            algorithm = "bpe"
        else:
            backend, dropped, algorithm = cls._spm_backend(
                tokens, scores, types, merges_raw, ids["unk"], pt.add_space_prefix
            )
        if dropped:
            warnings.append(f"ignored {dropped} merges whose parts are not in the vocabulary")

        eog, types = _eog_ids(tokens, types, ids, warnings)
        chat_template = _gguf_value(reader, "tokenizer.chat_template")
        return cls(
            model=model,
            pre=pre,
            tokens=tokens,
            token_types=types,
            backend=backend,
            bos_id=ids["bos"],
            eos_id=ids["eos"],
            unk_id=ids["unk"],
            pad_id=ids["pad"],
            eog_ids=eog,
            add_bos=add_bos,
            add_space_prefix=pt.add_space_prefix,
            chat_template=chat_template,
            algorithm=algorithm,
            clean_spaces=pt.clean_spaces,
            warnings=warnings,
        )

    @staticmethod
    def _byte_level_backend(
        tokens: list[str], merges_raw: list[str], regexes: tuple[str, ...], ignore_merges: bool
    ) -> tuple[_HFTokenizer, int]:
        """Merges filtered now (their count of dropped ones is a load warning); the BPE backend
        itself is returned as a builder, run on the first :meth:`encode`."""
        vocab = {t: i for i, t in enumerate(tokens)}
        merges: list[tuple[str, str]] = []
        dropped = 0
        for m in merges_raw:
            pos = m.find(" ", 1)  # llama.cpp splits at the first space after position 0
            if pos < 0:
                dropped += 1
                continue
            left, right = m[:pos], m[pos + 1 :]
            if left in vocab and right in vocab and (left + right) in vocab:
                merges.append((left, right))
            else:
                dropped += 1

        def build() -> _HFTokenizer:
            tok = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
            tok.normalizer = None
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
            tok.decoder = decoders.ByteLevel()
            return tok

        return build, dropped  # type: ignore[return-value]

    @staticmethod
    def _spm_backend(
        tokens: list[str],
        scores: list[float],
        types: list[int],
        merges_raw: list[str] | None,
        unk_id: int | None,
        add_space_prefix: bool,
    ) -> tuple[_HFTokenizer, int, str]:
        dropped = 0
        has_bytes = any(t == TOKEN_TYPE_BYTE for t in types)
        if merges_raw is None and _looks_unigram(scores, types):
            model = models.Unigram(list(zip(tokens, scores)), unk_id=unk_id, byte_fallback=has_bytes)
            algorithm = "unigram"
        else:
            vocab = {t: i for i, t in enumerate(tokens)}
            if merges_raw is not None:
                merges = []
                for m in merges_raw:
                    left, _, right = m.partition(" ")
                    if left in vocab and right in vocab and (left + right) in vocab:
                        merges.append((left, right))
                    else:
                        dropped += 1
            else:
                skip = {i for i, t in enumerate(types) if t in (TOKEN_TYPE_BYTE, TOKEN_TYPE_UNUSED)}
                merges = _derive_spm_merges(tokens, scores, skip)
            unk = tokens[unk_id] if unk_id is not None else None
            model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=has_bytes)
            algorithm = "bpe"
        tok = _HFTokenizer(model)
        # llama.cpp: prefix every text fragment with one space (add_space_prefix), then escape
        # spaces as "▁"; the whole fragment is one word (no pre-tokenizer split).
        steps = [normalizers.Prepend(SPM_SPACE)] if add_space_prefix else []
        steps.append(normalizers.Replace(" ", SPM_SPACE))
        tok.normalizer = normalizers.Sequence(steps)
        tok.pre_tokenizer = None
        tok.decoder = decoders.Sequence([decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
        return tok, dropped, algorithm

    @classmethod
    def from_hf_dir(cls, path: pathlib.Path) -> "Tokenizer":
        """Build the tokenizer of an HF model directory (``tokenizer.json`` + ``tokenizer_config.json``).

        The ``tokenizers`` pipeline in ``tokenizer.json`` is used as-is for plain text; special
        tokens are cut out first the way llama.cpp does (added tokens marked ``special`` count as
        control tokens, the others as user-defined). ``chat_template``, ``add_bos_token``,
        ``bos_token`` and ``eos_token`` come from ``tokenizer_config.json`` (``chat_template.jinja``
        is read when present). Without ``add_bos_token`` the BOS rule is read from the
        ``tokenizer.json`` post-processor.

        Args:
            path: the model directory.

        Returns:
            Tokenizer

        Raises:
            InfertraceError: ``tokenizer.json`` missing or unreadable, or a tokenizer that is
                neither byte-level BPE nor SentencePiece-style (e.g. WordPiece).
        """
        path = pathlib.Path(path)
        tj, raw, backend, cfg = _hf_read_files(path)
        model, algorithm, byte_fallback = _hf_model_kind(raw, tj)
        tokens, types = _hf_vocab(backend, raw, tj, model, byte_fallback)
        bos_id, eos_id, unk_id, pad_id = _hf_special_ids(cfg, raw, backend, types)

        warnings: list[str] = []
        add_bos = _hf_add_bos(cfg, backend, bos_id, warnings)

        # Special tokens are cut out by Tokenizer._partition; the backend must treat them as text.
        backend.encode_special_tokens = True

        chat_template = _hf_chat_template(path, cfg)
        ids = {"bos": bos_id, "eos": eos_id, "unk": unk_id, "pad": pad_id}
        eog, types = _eog_ids(tokens, types, ids, warnings)
        return cls(
            model=model,
            pre=None,
            tokens=tokens,
            token_types=types,
            backend=backend,
            bos_id=bos_id,
            eos_id=eos_id,
            unk_id=unk_id,
            pad_id=pad_id,
            eog_ids=eog,
            add_bos=add_bos,
            add_space_prefix=model == "llama",
            chat_template=chat_template,
            algorithm=algorithm,
            clean_spaces=False,
            warnings=warnings,
        )

    # -----------------------------------------------------------------------------------------
    # encode / decode
    # -----------------------------------------------------------------------------------------
    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """llama.cpp ``tokenizer_st_partition``: cut special tokens out of ``text``.

        Returns a list of raw text fragments (str) and token ids (int). Tokens are tried longest
        first; control and unknown tokens only when ``parse_special``, user-defined always.
        """
        frags: list[str | int] = [text]
        for tid in self._special_cache:
            if not parse_special and self._types[tid] in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
                continue
            needle = self._tokens[tid]
            if needle not in text:
                continue
            out: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or needle not in frag:
                    out.append(frag)
                    continue
                for k, part in enumerate(frag.split(needle)):
                    if k:
                        out.append(tid)
                    if part:
                        out.append(part)
            frags = out
        return frags

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` (llama.cpp ``llama_tokenize`` with ``add_special`` = BOS rule).

        Special tokens are cut out first (``_partition``); each remaining fragment goes through
        the byte-level or SentencePiece BPE of the ``tokenizers`` backend. If the text already
        starts with the BOS token, the added BOS is dropped (never two BOS ids) and a message is
        appended to :attr:`warnings`.

        Args:
            text: input text.
            add_bos: add BOS; None -> :attr:`add_bos` (the model's rule).
            parse_special: match control tokens such as ``<|im_start|>`` in the text.

        Returns:
            list[int]

        Raises:
            InfertraceError: BOS requested but the vocabulary has no BOS token.
        """
        use_bos = self.add_bos if add_bos is None else bool(add_bos)
        if use_bos and self.bos_id is None:
            raise InfertraceError("cannot add BOS: this tokenizer has no BOS token id")
        out: list[int] = [self.bos_id] if use_bos else []  # type: ignore[list-item]
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
            else:
                out.extend(self._backend.encode(frag, add_special_tokens=False).ids)
        if use_bos and len(out) >= 2 and out[1] == self.bos_id:
            out.pop(0)
            self.warnings.append("text already starts with the BOS string; not adding a second BOS")
        return out

    def _check_id(self, token_id: int) -> int:
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            try:
                token_id = int(token_id)
            except Exception as exc:
                raise InfertraceError(f"token id {token_id!r} is not an integer") from exc
        if not 0 <= token_id < self.vocab_size:
            raise InfertraceError(f"token id {token_id} out of range (vocab size {self.vocab_size})")
        return token_id

    def _piece_bytes(self, token_id: int) -> bytes:
        """Bytes of one token, as llama.cpp ``token_to_piece(special=true)`` renders them."""
        text = self._tokens[token_id]
        kind = self._types[token_id]
        if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_USER_DEFINED):
            return text.encode("utf-8")
        if kind in (TOKEN_TYPE_UNUSED, TOKEN_TYPE_UNDEFINED):
            return b""
        if self.model == "llama":
            if kind == TOKEN_TYPE_BYTE:
                m = _BYTE_TOKEN_RE.match(text)
                return bytes([int(m.group(1), 16)]) if m else text.encode("utf-8")
            return text.replace(SPM_SPACE, " ").encode("utf-8")
        out = bytearray()
        for ch in text:
            b = _BYTE_DECODER.get(ch)
            if b is None:
                out += ch.encode("utf-8")
            else:
                out.append(b)
        return bytes(out)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (llama.cpp ``llama_detokenize`` with ``unparse_special=true``).

        Control tokens are rendered as their text; byte-level / ``<0xXX>`` pieces are joined as
        bytes and decoded as UTF-8 (invalid sequences -> U+FFFD). For ``llama`` models with
        ``add_space_prefix`` the one leading space of the first token is removed. No
        ``clean_spaces`` post-processing (decode is lossless).

        Raises:
            InfertraceError: an id outside ``[0, vocab_size)``.
        """
        chunks = [self._piece(self._check_id(i)) for i in ids]
        if chunks and self.model == "llama" and self.add_space_prefix and chunks[0].startswith(b" "):
            chunks[0] = chunks[0][1:]
        return b"".join(chunks).decode("utf-8", errors="replace")

    def piece(self, token_id: int) -> str:
        """Readable text of one token for display, e.g. ``" Paris"`` (llama.cpp ``token_to_piece``).

        Byte-level and ``▁`` spellings are decoded; a token holding part of a UTF-8 character
        shows the bytes escaped (``"\\xe4"``).

        Raises:
            InfertraceError: an id outside ``[0, vocab_size)``.
        """
        return self._piece(self._check_id(token_id)).decode("utf-8", errors="backslashreplace")

    def is_control(self, token_id: int) -> bool:
        """True for control tokens (``token_type`` 3, plus EOG-looking tokens llama.cpp forces to control).

        Raises:
            InfertraceError: an id outside ``[0, vocab_size)``.
        """
        return self._types[self._check_id(token_id)] == TOKEN_TYPE_CONTROL

    def token_text(self, token_id: int) -> str:
        """The raw vocabulary string of a token (e.g. ``"ĠParis"`` or ``"▁Paris"``)."""
        return self._tokens[self._check_id(token_id)]

    def token_type(self, token_id: int) -> int:
        """llama.cpp token type of a token (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte)."""
        return self._types[self._check_id(token_id)]

    # -----------------------------------------------------------------------------------------
    # chat template
    # -----------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the model's jinja chat template, as HF ``apply_chat_template(tokenize=False)``.

        Uses :func:`infertrace.tokenizer.chat_env.chat_environment` (HF's sandboxed environment:
        ``{% generation %}`` tag, ``loopcontrols``, ``raise_exception``, ``strftime_now``,
        ``dict``, ``namespace``, a ``tojson`` filter that does not HTML-escape); variables ``messages``, ``add_generation_prompt``,
        ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, ``tools`` (None),
        ``documents`` (None). Message keys whose value is None are dropped, as HF does.

        Raises:
            InfertraceError: no chat template in the model, a template syntax error, or the
                template's own ``raise_exception``.
        """
        if not self.chat_template:
            raise InfertraceError("this model has no chat template (tokenizer.chat_template); pass a raw prompt instead")
        import jinja2

        from infertrace.tokenizer.chat_env import chat_environment

        if self._compiled_template is None:
            env = chat_environment()  # HF's: {% generation %}, loopcontrols, dict, namespace, tojson ...
            try:
                self._compiled_template = env.from_string(self.chat_template)
            except jinja2.exceptions.TemplateSyntaxError as exc:
                raise InfertraceError(f"chat template does not parse: {exc}") from exc
            except RecursionError:
                raise InfertraceError("chat template does not parse: it is nested deeper than Python allows") from None

        def name(token_id: int | None) -> str | None:
            return self._tokens[token_id] if token_id is not None else None

        clean = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        try:
            return self._compiled_template.environment.render(
                self._compiled_template,
                messages=clean,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                bos_token=name(self.bos_id),
                eos_token=name(self.eos_id),
                unk_token=name(self.unk_id),
                pad_token=name(self.pad_id),
            )
        except jinja2.exceptions.TemplateError as exc:
            raise InfertraceError(f"chat template failed: {exc}") from exc

    def __repr__(self) -> str:
        return (
            f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, add_bos={self.add_bos}, eog_ids={sorted(self.eog_ids)})"
        )


def _eog_ids(
    tokens: list[str], types: list[int], ids: dict[str, int | None], warnings: list[str]
) -> tuple[frozenset[int], list[int]]:
    """llama.cpp's ``special_eog_ids``: FIM pad/repo/sep, tokens whose text is an EOG marker,
    then eos/eot/eom. Tokens found by text are forced to control type, as llama.cpp does.

    Returns the EOG id set and the (possibly updated) token types.
    """
    types = list(types)
    index = {t: i for i, t in enumerate(tokens)}
    forced: list[int] = []

    def by_text(name: str, texts: tuple[str, ...]) -> None:
        if ids.get(name) is not None:
            return
        for text in texts:
            if text in index:
                ids[name] = index[text]
                forced.append(index[text])
                return

    by_text("eot", _EOT_TEXTS)
    by_text("eom", _EOM_TEXTS)
    by_text("fim_pad", _FIM_PAD_TEXTS)
    by_text("fim_rep", _FIM_REP_TEXTS)
    by_text("fim_sep", _FIM_SEP_TEXTS)

    eog: set[int] = set()
    for name in ("fim_pad", "fim_rep", "fim_sep"):
        if ids.get(name) is not None:
            eog.add(ids[name])  # type: ignore[arg-type]
    for text in _EOG_TEXTS:
        i = index.get(text)
        if i is not None:
            eog.add(i)
            forced.append(i)
    for name in ("eos", "eot", "eom"):
        if ids.get(name) is not None:
            eog.add(ids[name])  # type: ignore[arg-type]
    for i in forced:
        if types[i] != TOKEN_TYPE_CONTROL:
            warnings.append(f"control-looking token {i} {tokens[i]!r} was not control-type; treating it as control")
            types[i] = TOKEN_TYPE_CONTROL
    # o200k_harmony: "<|end|>" is not EOG when "<|return|>" and "<|call|>" are.
    texts = {tokens[i]: i for i in eog}
    if "<|return|>" in texts and "<|call|>" in texts and "<|end|>" in texts:
        end = texts["<|end|>"]
        eog.discard(end)
        types[end] = TOKEN_TYPE_USER_DEFINED
    return frozenset(eog), types
