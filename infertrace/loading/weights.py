"""Checkpoint loading: GGUF (gguf-py) and HF directories (safetensors), into one layout.

The engine's weight names are llama.cpp's (``tok_embd``, ``blk.{i}.attn_q`` ...) without the
``.weight`` suffix; all tensors are ``[out, in]`` row-major torch tensors (HF orientation)
in the requested dtype. Q/K rows are un-permuted once here, so the engine always rotates
with half-split (``neox``) pairing (design rule 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from infertrace.errors import InfertraceError
from infertrace.safe_text import visible
from infertrace.model.config import ModelConfig
from infertrace.loading.gguf_check import check_gguf_header, check_gguf_tokenizer_fields, gguf_byte_order, gguf_file_byte_order
from infertrace.loading.hparams_check import check_hf_config, check_layer_count, check_gguf_hparams
from infertrace.loading.limits import MAX_JSON_BYTES, read_json_file, require_regular_file
from infertrace.loading.registry import MODEL_NAMES
from infertrace.model.families import (config_from_gguf, config_from_hf, expected_tensors, family_for_hf, family_of,
                                       hf_to_engine_name, layer_number)
from infertrace.model.families.base import REFUSED

if TYPE_CHECKING:  # torch loads only when tensor data is read (header_only = inspect stays torch-free)
    import torch

#: progress(done, total, tensor_name)
Progress = Callable[[int, int, str], None]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")



@dataclass
class TensorInfo:
    """One row of ``inspect``'s tensor table: name as stored, type (``Q4_1``, ``F32``, ``BF16``...),
    ``shape`` (ggml ``ne`` order for GGUF, torch order for safetensors) and ``n_bytes`` in the file."""

    name: str
    type: str
    shape: list[int]  # ggml ne order for GGUF, torch order for safetensors
    n_bytes: int


@dataclass
class Checkpoint:
    """A loaded model: config, engine-ready weights, tokenizer and file facts.

    Attributes:
        config: the frozen :class:`ModelConfig`.
        weights: ``{engine name: tensor [out, in] or [n]}`` in ``dtype``.
        tokenizer: :class:`infertrace.tokenizer.vocab.Tokenizer`.
        path: the file or directory loaded.
        tensors: per-tensor facts for display.
        metadata: scalar header fields (GGUF key/values or config.json), for display.
        notes: load-time facts the trace states (e.g. the Q/K un-permutation).
    """

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Any
    path: Path
    tensors: list[TensorInfo] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def load_checkpoint(path: str | Path, dtype: torch.dtype | None = None, progress: Progress | None = None,
                    header_only: bool = False) -> Checkpoint:
    """Load a GGUF file or an HF model directory.

    Args:
        path: ``*.gguf`` file, or a directory with ``config.json`` + ``model.safetensors``
            (or ``model.safetensors.index.json`` shards) + ``tokenizer.json``.
        dtype: dtype of the returned weights (None = ``torch.float32``; dequantised GGUF
            tensors are float32 first).
        progress: optional callback ``(done, total, name)`` while dequantising.
        header_only: read metadata, tokenizer and the tensor table but no tensor data
            (``weights`` stays empty); what ``inspect`` needs, instant on large files.

    Raises:
        InfertraceError: missing path, pickle checkpoint, wrong magic, truncated file,
            unsupported architecture / quant type / tokenizer.
    """
    if dtype is None and not header_only:
        import torch

        dtype = torch.float32
    p = Path(path)
    if not p.exists():
        raise InfertraceError(f"model not found: {p}; pass a .gguf file, an HF model directory or a "
                              f"registered name ({', '.join(MODEL_NAMES)})")
    if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES:
        raise InfertraceError(
            f"refusing to load pickle checkpoint {p.name}: unpickling can run arbitrary code; convert it to safetensors or GGUF"
        )
    if p.is_dir():
        return _load_hf_dir(p, dtype, progress, header_only)
    return _load_gguf(p, dtype, progress, header_only)


# ----------------------------------------------------------------------------- GGUF


def read_gguf(p: Path):
    """Open ``p`` with :class:`gguf.GGUFReader` after checking the magic.

    Raises:
        InfertraceError: wrong magic, truncated or otherwise unreadable file.
    """
    from infertrace.loading.gguf_lib import gguf

    GGUFReader = gguf().GGUFReader

    if not p.is_file():
        raise InfertraceError(f"{p} is not a regular file; pass a .gguf file or an HF model directory")
    with open(p, "rb") as fh:
        magic = fh.read(4)
        version = int.from_bytes(fh.read(4), "little")
    if magic != b"GGUF":
        raise InfertraceError(
            f"{p.name} is not a GGUF file (magic {magic!r}, expected b'GGUF'); pass a .gguf file or an HF model directory"
        )
    if gguf_byte_order(version) is None:  # 2 or 3, in either byte order (a big-endian file reads as 0x0300_0000)
        raise InfertraceError(f"{p.name} is GGUF version {version}, which is not supported (versions 2 and 3); convert it with a current llama.cpp")
    check_gguf_header(p)  # counts, lengths, offsets vs the file size, before gguf-py trusts them
    try:
        return GGUFReader(str(p), "r")
    except Exception as e:  # noqa: BLE001 - numpy/struct errors from a short file
        raise InfertraceError(
            f"cannot read GGUF {p.name}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else 'unreadable'} "
            "- the file is truncated or corrupt; download it again"
        ) from None


def _read_checked_gguf(p: Path):
    """:func:`read_gguf` (magic, version, :func:`check_gguf_header`) plus
    :func:`check_gguf_tokenizer_fields`: what must pass before a header is cached.

    Raises:
        InfertraceError: the first problem, one line.
    """
    reader = read_gguf(p)
    check_gguf_tokenizer_fields(reader, p.name)  # value types and sizes of tokenizer.* before they are used
    return reader


def _load_gguf(p: Path, dtype: torch.dtype, progress: Progress | None, header_only: bool = False) -> Checkpoint:
    """A GGUF file: header (checked), config, tokenizer, then the tensors in the engine's layout."""
    header, meta, big_endian = _gguf_header(p)
    mm = np.memmap(p, mode="r")
    cfg = _gguf_config(p, header, meta, mm, header_only)
    tokenizer = _gguf_tokenizer(p, header)
    infos = [TensorInfo(t.name, t.type_name, list(t.shape), int(t.n_bytes)) for t in header.tensors]
    weights: dict[str, torch.Tensor] = {}
    if not header_only:
        weights = _gguf_tensors(header, mm, progress, p.name if big_endian else None)
        _gguf_to_engine_layout(cfg, weights)
        _check_weights(cfg, weights, p.name)
        weights = {k: v.to(dtype) for k, v in weights.items()}
    return Checkpoint(cfg, weights, tokenizer, p, infos, meta, _gguf_notes(cfg, meta, big_endian))


def _gguf_header(p: Path) -> tuple[Any, dict[str, Any], bool]:
    """The header (metadata + tensor table) from the cache when the file is unchanged, else from
    gguf.GGUFReader (then cached); returns it, its display metadata and whether the file is
    big-endian (case G2).

    Checks: on a miss :func:`_read_checked_gguf` runs check_gguf_header (in read_gguf) and
    check_gguf_tokenizer_fields before the entry is written; a hit needs the SHA-256 of the same
    header bytes and its content equal to the file's header (gguf_meta._verified, which runs
    check_gguf_header, cheap, O(header), on every hit).
    """
    from infertrace.loading.gguf_meta import load_header

    try:
        header, _reader = load_header(p, _read_checked_gguf)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, MemoryError) as e:  # hostile metadata
        raise InfertraceError(f"cannot read GGUF {p.name}: invalid metadata ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:120] if str(e) else '?'}); the file is broken") from None
    facts = (header.facts or check_gguf_header(p)) if header.from_cache else None
    big_endian = (facts.byte_order if facts is not None else gguf_file_byte_order(p)) == ">"
    return header, dict(header.display), big_endian


def _gguf_config(p: Path, header: Any, meta: dict[str, Any], mm: np.ndarray, header_only: bool) -> ModelConfig:
    """The config from the header (with ``rope_freqs.weight``), its refusals (raised unless
    ``header_only``) and the tensor table checked against it (names and shapes, no data read)."""
    names = {t.name for t in header.tensors}
    tensors = {t.name: t for t in header.tensors}
    freq_factors = None
    if "rope_freqs.weight" in tensors:
        rf = tensors["rope_freqs.weight"]
        if rf.type_name not in ("F32", "F16"):
            raise InfertraceError(f"{p.name}: rope_freqs.weight must be F32 or F16, not {rf.type_name}; the file is broken")
        freq_factors = tuple(float(x) for x in np.asarray(header.tensor_data(rf, mm), dtype=np.float32).ravel())
    meta_for_cfg = dict(meta)
    meta_for_cfg["tokenizer.ggml.tokens"] = list(range(header.n_tokens))
    check_gguf_hparams(meta_for_cfg)  # strict types and finite floats before int()/float() convert them
    cfg = config_from_gguf(meta_for_cfg, names, freq_factors)
    check_layer_count("GGUF metadata", f"{cfg.arch}.block_count", cfg.n_layer, names)  # before per-layer names are built
    metas = {(t.name[: -len(".weight")] if t.name.endswith(".weight") else t.name):
             _Shape(tuple(int(x) for x in reversed(list(t.shape)))) for t in header.tensors}  # shapes only, torch order
    metas.pop("rope_freqs", None)
    cfg = drop_absent_mtp(cfg, metas)
    cfg = refuse_stray_tensors(cfg, metas, {})
    if not header_only:
        raise_refusals(cfg, p.name)
    _check_weights(cfg, metas, p.name)
    return cfg


def _gguf_tokenizer(p: Path, header: Any) -> Any:
    """The tokenizer from the header's ``tokenizer.*`` values (checked by check_gguf_tokenizer_fields;
    on a cache hit the same header bytes passed it)."""
    from infertrace.tokenizer.vocab import Tokenizer

    try:
        return Tokenizer.from_gguf(header.values)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, MemoryError) as e:  # hostile metadata
        raise InfertraceError(f"cannot read GGUF {p.name}: invalid tokenizer metadata ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:120] if str(e) else '?'}); the file is broken") from None


def _gguf_tensors(header: Any, mm: np.ndarray, progress: Progress | None,
                  big_endian_file: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor but ``rope_freqs`` as float32 ``[out, in]`` / ``[n]`` (gguf-py's dequantisation),
    engine-named (``.weight`` dropped), data memory-mapped at the offsets gguf-py computed.
    ``big_endian_file``: the file's name when it is big-endian (quantised blocks swapped back first).

    Raises:
        InfertraceError: a quant type gguf-py cannot dequantise, or corrupt data.
    """
    import torch
    from infertrace.loading.gguf_lib import gguf

    GGMLQuantizationType = gguf().GGMLQuantizationType

    from infertrace.loading.dequant import blocks_to_little_endian, dequantize

    weights: dict[str, torch.Tensor] = {}
    total = len(header.tensors)
    for i, t in enumerate(header.tensors):
        if t.name == "rope_freqs.weight":
            continue
        qtype = GGMLQuantizationType(t.type_id)
        data = header.tensor_data(t, mm)
        try:
            if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                arr = np.asarray(data, dtype=np.float32)  # a big-endian file: gguf-py's view is '>f4' / '>f2'
            elif big_endian_file is not None:
                with np.errstate(all="ignore"):
                    arr = dequantize(blocks_to_little_endian(data, qtype, t.name, big_endian_file), qtype)
            else:
                with np.errstate(all="ignore"):  # broken scales give inf/nan; the engine reports non-finite logits
                    arr = dequantize(data, qtype)  # gguf-py's values, a fresh float32 array
        except NotImplementedError:
            raise InfertraceError(
                f"tensor {t.name} has quant type {qtype.name}, which gguf-py cannot dequantise; requantise the model (e.g. Q8_0, Q4_K)"
            ) from None
        except (ValueError, IndexError, TypeError) as e:
            raise InfertraceError(f"cannot dequantise tensor {t.name} ({qtype.name}): {e}; the file is corrupt") from None
        shape = [int(x) for x in reversed(list(t.shape))]  # ggml ne -> torch order
        if not arr.flags.writeable or arr.dtype != np.float32:  # F32: a view of the read-only memmap
            arr = np.array(arr, dtype=np.float32)
        ten = torch.from_numpy(arr.reshape(shape))  # [out, in]
        name = t.name[: -len(".weight")] if t.name.endswith(".weight") else t.name
        weights[name] = ten
        if progress:
            progress(i + 1, total, t.name)
    return weights


def _gguf_to_engine_layout(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """In place: Q/K rows (and biases) un-permuted when the converter stored them for adjacent-pair
    RoPE, then the family's own conversion (e.g. Qwen3.5 V heads: llama.cpp's tiled order -> HF's grouped)."""
    from infertrace.model.rope import unpermute_from_norm

    for i in range(cfg.n_layer if cfg.rope_pairing_in_file == "norm" else 0):
        for n, heads in (("attn_q", cfg.n_head), ("attn_k", cfg.n_head_kv)):
            weights[f"blk.{i}.{n}"] = unpermute_from_norm(weights[f"blk.{i}.{n}"], heads)  # [heads*hd, H]
            if f"blk.{i}.{n}.bias" in weights:  # case R5: the converter permutes the bias like the rows
                weights[f"blk.{i}.{n}.bias"] = unpermute_from_norm(weights[f"blk.{i}.{n}.bias"], heads)  # [heads*hd]
    fam = family_of(cfg)
    if fam.gguf_weights is not None:
        fam.gguf_weights(cfg, weights)


def _gguf_notes(cfg: ModelConfig, meta: dict[str, Any], big_endian: bool = False) -> list[str]:
    """What the trace states about this GGUF's tensors: Q/K pairing, the family's conversions, defaults."""
    notes = [
        "GGUF Q/K rows (and Q/K biases) are stored permuted for adjacent-pair RoPE (llama.cpp 'norm'); "
        "un-permuted at load (Q with head_count, K with head_count_kv), engine rotates half-split pairs ('neox', as HF)"
        if cfg.rope_pairing_in_file == "norm" else
        f"GGUF {cfg.arch}: Q/K rows in half-split order (llama.cpp NEOX RoPE, not permuted by the converter); used as stored"
    ]
    fam = family_of(cfg)
    if fam.load_notes is not None:
        notes += fam.load_notes(cfg, "gguf", meta)
    if big_endian:  # case G2
        notes.append("GGUF in big-endian byte order (written for a big-endian host): header read big-endian, tensor values "
                     "and quantised blocks' fp16 scales byte-swapped at load (the layouts of gguf-py's GGUFReader and "
                     "gguf_convert_endian.py)")
    if cfg.rope_theta_is_default:
        notes.append(f"llama.rope.freq_base absent: using default theta {cfg.rope_theta:g}")
    if cfg.tie_embeddings:
        notes.append("no output.weight: lm head tied to token_embd")
    return notes


@dataclass(frozen=True)
class _Shape:
    """A tensor's shape without its data (what :func:`_check_weights` reads)."""

    shape: tuple[int, ...]


def refuse_stray_tensors(cfg: ModelConfig, names: dict[str, Any], file_names: dict[str, str]) -> ModelConfig:
    """Record every tensor the decoder would not read as a ``refused`` setting (never a silent drop).

    Args:
        cfg: the config built from the header.
        names: engine names present in the file (values unused).
        file_names: engine name -> name in the file, for the message (defaults to the engine name).

    Returns:
        ``cfg`` with one ledger row per stray tensor kind (first example named).
    """
    exp = expected_tensors(cfg)
    stray = [n for n in names if n not in exp and not _extra_layer(cfg, n)]
    if not stray:
        return cfg
    rows, kinds = list(cfg.settings), {}
    for n in stray:
        kinds.setdefault(n.split(".", 2)[-1] if n.startswith("blk.") else n, []).append(n)
    for kind, ns in kinds.items():
        ex = file_names.get(ns[0], ns[0])
        rows.append((f"tensor {ex}", f"{len(ns)} in file", REFUSED,
                     f"the {cfg.family} forward pass as configured would not read it (a dropped tensor changes the math)"))
    return replace(cfg, settings=tuple(rows))


def drop_absent_mtp(cfg: ModelConfig, names: Any) -> ModelConfig:
    """``cfg`` without its MTP blocks when the file declares them (HF ``mtp_num_hidden_layers``, GGUF
    ``nextn_predict_layers``) but holds none of their tensors (a trunk-only conversion, llama.cpp's
    ``--no-mtp``; a fine-tune saved without the head): ``mtp_layers`` 0 and a ledger row saying so.
    A file holding only part of them fails :func:`_check_weights` (incomplete checkpoint)."""
    if not cfg.mtp_layers:
        return cfg
    from infertrace.model.layout import NEXTN_SLOTS

    if any(f"blk.{cfg.n_layer}.{s}" in names for s in NEXTN_SLOTS):
        return cfg
    rows = [r for r in cfg.settings if r[0] not in ("mtp_num_hidden_layers", f"{cfg.arch}.nextn_predict_layers")]
    rows.append(("mtp head", "declared, no tensors", "not applicable",
                 "the file declares an MTP block but holds no MTP tensors; --speculative mtp is refused"))
    return replace(cfg, mtp_layers=0, settings=tuple(rows))


def _extra_layer(cfg: ModelConfig, n: str) -> bool:
    parts = n.split(".")
    il = layer_number(parts[1]) if n.startswith("blk.") and len(parts) > 1 else None
    return il is not None and il >= cfg.n_layer + cfg.mtp_layers  # past the main blocks and the MTP blocks


def raise_refusals(cfg: ModelConfig, where: str) -> None:
    """Raise the first ``refused`` setting of ``cfg`` (the settings ledger) as one line (no silent math).

    Raises:
        InfertraceError: ``cfg.refusals`` is not empty; the message names ``where`` (the file) and
            how many more settings are refused.
    """
    ref = cfg.refusals
    if ref:
        more = f" (+{len(ref) - 1} more)" if len(ref) > 1 else ""
        raise InfertraceError(f"{where}: {ref[0]}{more}; infertrace refuses to run math it would get wrong "
                              "(`infertrace inspect` lists every setting)")


def _check_names(cfg: ModelConfig, names: set[str], where: str) -> None:
    """Raise :class:`InfertraceError` when an engine-named tensor the config implies is absent."""
    missing = [n for n in expected_tensors(cfg) if n not in names]
    if missing:
        raise InfertraceError(f"{where} lacks tensor {missing[0]} ({len(missing)} missing); the checkpoint is incomplete")


def _check_weights(cfg: ModelConfig, w: dict[str, Any], where: str) -> None:
    """Every tensor the config implies exists with the shape it implies (torch order ``[out, in]``).

    ``w`` maps engine names to anything with ``.shape`` (real or meta tensors).

    Raises:
        InfertraceError: a missing tensor or a shape that disagrees with the config.
    """
    _check_names(cfg, set(w), where)
    for n in w:  # "blk.x.attn_q.weight", "blk.": a per-layer name without a layer number no runtime writes
        if n.startswith("blk.") and (n.count(".") < 2 or layer_number(n.split(".")[1]) is None):
            raise InfertraceError(f"{where}: tensor {visible(n)[:80]!r} has no layer number after 'blk.' (1 to 9 ASCII digits); "
                                  "the file is not a valid model")
    n_blk = cfg.n_layer + cfg.mtp_layers  # MTP blocks follow the main blocks (blk.{n_layer}.*)
    extra = sorted({n.split(".")[1] for n in w if n.startswith("blk.") and int(n.split(".")[1]) >= n_blk}, key=int)
    if extra:
        raise InfertraceError(f"{where} has tensors for layer {extra[0]} but the config says {cfg.n_layer} layers"
                              f"{f' + {cfg.mtp_layers} MTP' if cfg.mtp_layers else ''}; the checkpoint is inconsistent")
    exp = dict(expected_tensors(cfg))
    exp.setdefault("output", (cfg.vocab_size, cfg.n_embd))
    for n, shp in exp.items():
        if n in w and tuple(w[n].shape) != shp:
            raise InfertraceError(
                f"{where}: tensor {n} has shape {list(w[n].shape)}, the config implies {list(shp)}; the checkpoint is inconsistent"
            )


# ----------------------------------------------------------------------------- HF


def _load_hf_dir(d: Path, dtype: torch.dtype, progress: Progress | None, header_only: bool = False) -> Checkpoint:
    """An HF directory: config.json (checked), the safetensors shards, engine names, the family's
    conversions, the tokenizer."""
    raw = _hf_config_json(d)
    sd, infos = _read_safetensors(_hf_shards(d), header_only, progress)
    cfg = config_from_hf(raw, tie_default="lm_head.weight" not in sd)
    check_layer_count("config.json", "num_hidden_layers", cfg.n_layer, sd)  # before per-layer names are built
    fam = family_for_hf(raw)
    w, file_names, ignored, not_loaded = _hf_engine_names(fam, cfg, sd)
    cfg = drop_absent_mtp(cfg, w)
    cfg = refuse_stray_tensors(cfg, w, file_names)
    if not header_only:
        raise_refusals(cfg, d.name)
    if fam.hf_weights is not None:
        w = fam.hf_weights(cfg, w)  # into llama.cpp's stored convention (e.g. zero-centred norms as 1 + w)
    _check_weights(cfg, w, d.name)
    w = {} if header_only else {k: v.to(dtype) for k, v in w.items()}
    tokenizer = _hf_tokenizer(d)
    notes = ["HF checkpoint: Q/K rows already in half-split ('neox') order"]
    if fam.load_notes is not None:
        notes += fam.load_notes(cfg, "hf", raw)
    notes += [f"not a weight, skipped: {k}" for k in ignored]
    notes += [f"not loaded: {k}" for k in not_loaded[:8]] + ([f"not loaded: {len(not_loaded) - 8} more"] if len(not_loaded) > 8 else [])
    if cfg.tie_embeddings:
        notes.append("tie_word_embeddings: lm head tied to embed_tokens")
    return Checkpoint(cfg, w, tokenizer, d, infos, raw, notes)


def _hf_config_json(d: Path) -> dict[str, Any]:
    """``config.json`` of ``d``: a regular file of bounded size holding an object of strict field types.

    Raises:
        InfertraceError: missing, not an object, or a field of the wrong type.
    """
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise InfertraceError(f"{d} has no config.json; pass a .gguf file or an HF model directory")
    raw = read_json_file(cfg_path, "config.json")  # regular file, bounded size, depth and integer length
    if not isinstance(raw, dict):
        raise InfertraceError(f"{cfg_path} must hold a JSON object, got {type(raw).__name__}")
    check_hf_config(raw)  # strict field types before int()/float() could truncate or accept Infinity
    return raw


def _hf_shards(d: Path) -> list[Path]:
    """The safetensors files of ``d``: ``model.safetensors`` or the shards its index lists (inside ``d``).

    Raises:
        InfertraceError: no safetensors (pickle weights are refused), a broken index, a shard outside ``d``.
    """
    index = d / "model.safetensors.index.json"
    if (d / "model.safetensors").exists():
        return [d / "model.safetensors"]
    if index.exists():
        try:
            wm = read_json_file(index, "safetensors index", MAX_JSON_BYTES)["weight_map"]
        except (KeyError, TypeError):
            raise InfertraceError(f"{index} is broken (no weight_map)") from None
        if not isinstance(wm, dict) or not all(isinstance(f, str) for f in wm.values()):
            raise InfertraceError(f"{index} is broken (weight_map must map tensor names to file names)")
        files = [d / f for f in sorted(set(wm.values()))]
        outside = [f for f in files if f.resolve().parent != d.resolve()]
        if outside:
            raise InfertraceError(f"{index} points outside the model directory ({outside[0].name}); refusing to read it")
        return files
    pick = [f.name for f in d.iterdir() if f.suffix in PICKLE_SUFFIXES]
    if pick:
        raise InfertraceError(
            f"{d} only has pickle weights ({pick[0]}); refusing to unpickle - convert to safetensors"
        )
    raise InfertraceError(f"{d} has no model.safetensors or model.safetensors.index.json")


def _read_safetensors(files: list[Path], header_only: bool, progress: Progress | None
                      ) -> tuple[dict[str, torch.Tensor], list[TensorInfo]]:
    """Every tensor of ``files`` by its HF key (``header_only``: meta tensors, shapes without data) and
    the tensor table for display.

    Raises:
        InfertraceError: a listed shard missing, not a regular file, truncated or corrupt.
    """
    import torch
    from safetensors import safe_open

    sd: dict[str, torch.Tensor] = {}
    infos: list[TensorInfo] = []
    for f in files:
        if not f.exists():
            raise InfertraceError(f"shard {f.name} listed in the index is missing")
        require_regular_file(f, "safetensors file")  # a FIFO or device must not block or stream forever
        try:
            with safe_open(str(f), framework="pt") as fh:
                keys = list(fh.keys())
                for k in keys:
                    if header_only:
                        sl = fh.get_slice(k)
                        shape, dt = list(sl.get_shape()), str(sl.get_dtype()).lower()
                        t = torch.empty(shape, dtype=torch.float32, device="meta")  # [shape] no data
                        nbytes = int(np.prod(shape)) * {"f32": 4, "bf16": 2, "f16": 2}.get(dt, 4)
                    else:
                        t = fh.get_tensor(k)
                        dt, nbytes = str(t.dtype).replace("torch.", ""), t.numel() * t.element_size()
                    sd[k] = t
                    infos.append(TensorInfo(k, dt, list(t.shape), nbytes))
                    if progress:
                        progress(len(sd), max(len(sd), len(keys)), k)
        except InfertraceError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises SafetensorError
            raise InfertraceError(f"cannot read {f.name}: {e}; the file is truncated or corrupt") from None
    return sd, infos


def _hf_engine_names(fam: Any, cfg: ModelConfig, sd: dict[str, torch.Tensor]
                     ) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str], list[str]]:
    """HF keys -> engine names. Returns ``(weights, engine name -> file key, ignored, not loaded)``:
    keys the family skips are not loaded (with its reason), a saved ``rotary_emb.inv_freq`` buffer and
    a tied ``lm_head`` are ignored, any other unknown key is kept as ``(unmapped) KEY`` (refused later)."""
    w: dict[str, torch.Tensor] = {}
    file_names: dict[str, str] = {}
    ignored: list[str] = []
    not_loaded: list[str] = []
    for k, t in sd.items():
        why = fam.hf_skip(cfg, k) if fam.hf_skip is not None else None
        if why:
            not_loaded.append(f"{k}: {why}")
            continue
        n = fam.hf_name(cfg, k) if fam.hf_name is not None else None
        n = n if n is not None else hf_to_engine_name(fam, k)
        if n is None and k.endswith("rotary_emb.inv_freq"):
            ignored.append(k)  # a non-persistent buffer some old checkpoints saved; HF recomputes it too
            continue
        n = n if n is not None else f"(unmapped) {k}"
        w[n], file_names[n] = t, k
    if cfg.tie_embeddings and "output" in w:
        w.pop("output")
        ignored.append("lm_head.weight (tie_word_embeddings: the head is token_embd, as HF ties it)")
    return w, file_names, ignored, not_loaded


def _hf_tokenizer(d: Path) -> Any:
    """The tokenizer of ``d`` (``tokenizer.json`` + ``tokenizer_config.json``).

    Raises:
        InfertraceError: broken tokenizer files.
    """
    from infertrace.tokenizer.vocab import Tokenizer

    try:
        return Tokenizer.from_hf_dir(d)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:  # hostile tokenizer files
        raise InfertraceError(f"cannot read the tokenizer of {d.name}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:120] if str(e) else '?'}; the files are broken") from None
