"""Saved traces: one directory per run, written by ``run --save DIR`` and read by ``show``,
``diff``, ``report`` and ``dump-kv DIR``.

Layout::

    DIR/trace.json            manifest: RunTrace.to_dict() without timings, plus "store"
                              (keep, tensor layers, tensor index {name: {dtype, shape}})
    DIR/tensors.safetensors   only with keep="tensors": names like step3/layer0/q_pre_rope
    DIR/timing.json           per-step time_ms (machine-dependent, kept out of trace.json)

Same run, same bytes: trace.json is written with sorted keys, one-space ``indent=1`` and
Python's shortest round-trip float repr (platform independent); timings live only in
timing.json; safetensors orders its header deterministically and gets no timestamps.
Loading validates before trusting: every problem is an :class:`InfertraceError` (exit 2)
with one line naming the file and what to do.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from infertrace.errors import ConfigError, InfertraceError
from infertrace.runtimes.api import names
from infertrace.safe_io import MAX_MANIFEST_BYTES, TORCH_TO_ST, parse_json, read_regular, safetensors_header
from infertrace.safe_text import visible
from infertrace.trace.records import (SCHEMA_VERSION, DecodeRec, HiddenRec, KVRec, MaskRec, PositionsRec, ReqStep,
                                      RowStat, RunTrace, StepTrace, checked_threads)
from infertrace.trace.upgrade import RENAMED_V1, threads_v1, upgrade

MANIFEST, TENSORS, TIMING = "trace.json", "tensors.safetensors", "timing.json"
#: what a saved trace directory may hold (``--force`` replaces only such a directory)
TRACE_FILES = frozenset({MANIFEST, TENSORS, TIMING, "report.html"})
KEEP = ("summary", "tensors")
#: who computed a trace (the manifest's ``runtime``)
RUNTIMES = names()  # the runtimes of the registry (runtimes/api.py)
#: per-step fields that depend on the machine, not on the run; stored in timing.json
TIMING_FIELDS = ("time_ms",)


# ----------------------------------------------------------------------------- writing


def canonical_json(obj: Any, indent: int | None = 1) -> str:
    """Deterministic JSON text: sorted keys, ``repr`` floats (shortest round trip), UTF-8
    kept as is, a final newline. Equal objects give equal text on every platform."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, indent=indent, allow_nan=True,
                      separators=(",", ": ") if indent is not None else (",", ":")) + "\n"


def manifest_dict(trace: RunTrace, store: dict[str, Any] | None = None) -> dict[str, Any]:
    """``trace.to_dict()`` without the timing fields (they are not part of the run's content),
    plus the ``store`` section (keep, tensor index)."""
    d = trace.to_dict()
    d.pop("threads", None)  # machine facts: timing.json
    for st in d["steps"]:
        for k in TIMING_FIELDS:
            st.pop(k, None)
    d["store"] = store or {"keep": "summary", "tensor_layers": [], "tensors": {}}
    return d


@dataclass(frozen=True)
class TensorFile:
    """A ``tensors.safetensors`` image, already serialised on the engine side
    (:func:`infertrace.capture.tensors.encode_tensors`), so saving needs no torch.

    Attributes:
        data: the safetensors bytes (header + little-endian tensor data, ``{"format": "pt"}`` metadata).
        index: ``{name: {"dtype": torch dtype name, e.g. "float32", "shape": [int]}}``, sorted by name;
            becomes the manifest's tensor index, which :func:`load_tensors` checks the file against.
        layers: sorted layers the tensors were taken from (``--layers``).
    """

    data: bytes
    index: dict[str, dict[str, Any]]
    layers: list[int]


def save_trace(trace: RunTrace, directory: str | Path, tensors: TensorFile | None = None, *,
               replace: bool = True) -> dict[str, int]:
    """Write ``trace`` (and ``tensors``, when given) to ``directory``, atomically.

    The files are written into a fresh private directory next to ``directory``
    (:func:`infertrace.safe_io.fresh_dir_beside`), which is then renamed into place
    (:func:`infertrace.safe_io.publish_dir`): a reader never sees half a trace, and of two
    writers racing for one new directory exactly one wins.

    Args:
        trace: the run (live or loaded).
        directory: must not exist (missing parent directories are created), or be an empty
            directory, or (``replace``) hold only the files of a saved trace (replaced as a whole).
        tensors: the serialised tensors (:func:`infertrace.capture.tensors.encode_tensors` of the
            ``{name: torch.Tensor}`` that :func:`infertrace.runner.run_requests` fills); None =
            ``keep summary`` (manifest only).
        replace: replace an existing trace in ``directory`` (``run --save --force``).

    Returns:
        ``{file name: size in bytes}`` of what was written.

    Raises:
        InfertraceError: the directory is taken (by another writer, or holds something else),
            or cannot be created or written.
        TypeError: ``tensors`` is not a :class:`TensorFile` (a dict of torch tensors must be encoded first).
    """
    if tensors is not None and not isinstance(tensors, TensorFile):
        raise TypeError("save_trace(tensors=...) takes a TensorFile: encode the {name: tensor} dict with "
                        "infertrace.capture.tensors.encode_tensors(tensors, layers)")
    from infertrace.safe_io import DirTaken, fresh_dir_beside, publish_dir

    d = Path(directory)
    shown = visible(str(d))
    tmp: Path | None = None
    try:
        d.parent.mkdir(parents=True, exist_ok=True)  # run --save runs/first with no runs/ yet
        tmp = fresh_dir_beside(d)
        written: dict[str, int] = {}
        index = {}
        if tensors is not None:
            index = tensors.index
            (tmp / TENSORS).write_bytes(tensors.data)
            written[TENSORS] = len(tensors.data)
        store = {"keep": "tensors" if tensors is not None else "summary",
                 "tensor_layers": list(tensors.layers) if tensors is not None else [], "tensors": index}
        text = canonical_json(manifest_dict(trace, store)).encode("utf-8")
        (tmp / MANIFEST).write_bytes(text)
        written[MANIFEST] = len(text)
        timing = canonical_json({"steps": [{"step": s.step, "time_ms": s.time_ms} for s in trace.steps],
                                 **({"threads": trace.threads} if trace.threads else {})}).encode()
        (tmp / TIMING).write_bytes(timing)
        written[TIMING] = len(timing)
        publish_dir(tmp, d, replace, TRACE_FILES)
        tmp = None
    except DirTaken as e:
        raise InfertraceError(f"--save {shown}: {visible(str(e))}; the directory is taken, choose another"
                              + ("" if replace else " (or pass --force to replace a trace)")) from None
    except OSError as e:
        raise InfertraceError(f"cannot write trace to {shown}: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return written


# ----------------------------------------------------------------------------- reading


def _where(directory: Path) -> str:
    return str(directory / MANIFEST)


def _json_error(path: Path | str, text: str, e: json.JSONDecodeError) -> InfertraceError:
    if not text.strip():
        return InfertraceError(f"{path}: empty file (truncated?); re-save the trace with infertrace run --save")
    if e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string"):
        end = text.rstrip()
        return InfertraceError(f"{path}: truncated JSON (the text stops at line {end.count(chr(10)) + 1} before the document "
                               "is complete); re-save the trace with infertrace run --save")
    return InfertraceError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})")


def _required(cls: type) -> list[str]:
    return [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]  # type: ignore[misc]


def _check(obj: Any, cls: type, where: str, strict: bool = True) -> None:
    """InfertraceError naming ``where`` when ``obj`` is not a dict holding ``cls``'s required keys
    (``strict``: and no key ``cls`` does not know, since ``cls(**obj)`` would fail on it)."""
    if not isinstance(obj, dict):
        raise InfertraceError(f"{where}: expected an object, got {type(obj).__name__}")
    for k in _required(cls):
        if k not in obj:
            raise InfertraceError(f"{where}: missing key {k!r}")
    unknown = set(obj) - {f.name for f in fields(cls)}
    if strict and unknown:
        raise InfertraceError(f"{where}: unknown key {sorted(unknown)[0]!r} (written by a different infertrace?)")


def _check_list(obj: Any, where: str) -> list:
    if not isinstance(obj, list):
        raise InfertraceError(f"{where}: expected a list, got {type(obj).__name__}")
    return obj


def validate_manifest(d: Any, path: str, consistency: bool = True) -> dict[str, Any]:
    """Check the structure :meth:`RunTrace.from_dict` relies on; the message names the field.

    An older schema is upgraded first (:func:`infertrace.trace.upgrade.upgrade`, in memory), then
    checked as the current one.

    Returns:
        the manifest at :data:`SCHEMA_VERSION` (``d`` itself when it already was; else a new dict).

    Raises:
        InfertraceError: not an object, a schema newer than :data:`SCHEMA_VERSION`, missing or
            mistyped keys, a schema 1 field name in a schema 2 trace.
    """
    if not isinstance(d, dict):
        raise InfertraceError(f"{path}: expected a JSON object at the top, got {type(d).__name__}")
    if "schema_version" not in d:
        raise InfertraceError(f"{path}: missing key 'schema_version' (not an infertrace trace?)")
    v = d["schema_version"]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise InfertraceError(f"{path}: schema_version must be a positive integer, got {json.dumps(v)}")
    if v > SCHEMA_VERSION:
        shown_v = str(v) if v < 10 ** 12 else f"{str(v)[:12]}… ({len(str(v))} digits)"  # a file's number: bounded in the line
        raise InfertraceError(f"trace schema {shown_v} is newer than this infertrace supports ({SCHEMA_VERSION}); upgrade infertrace")
    if v == SCHEMA_VERSION:
        if "engine" in d:
            raise InfertraceError(f"{path}: 'engine' is the schema 1 name of 'runtime'; a schema {v} trace has 'runtime' only")
        if isinstance(d.get("options"), dict) and "engine" in d["options"]:
            raise InfertraceError(f"{path}: 'options.engine' is the schema 1 name of 'options.settings'; a schema {v} "
                                  "trace has 'options.settings' only")
        _validate_current(d, path, consistency)
        return d
    d = upgrade(d, path)
    try:
        _validate_current(d, path, consistency)
    except InfertraceError as e:  # a message naming a renamed field says so (the file spells it the old way)
        if not any(new in e.message for new in RENAMED_MESSAGES):
            raise
        raise InfertraceError(f"{e.message} (a schema {v} trace, read as schema {SCHEMA_VERSION}: {RENAMED_NOTE})",
                              e.exit_code) from None
    return d


#: how a message names the fields schema 2 renamed, and the note a schema 1 trace's message gets
RENAMED_MESSAGES = ("options.settings", "'runtime'")
RENAMED_NOTE = ", ".join(f"its {old} is {new}" for old, new in RENAMED_V1 if old != "runtime")


def _validate_current(d: dict[str, Any], path: str, consistency: bool) -> None:
    """:func:`validate_manifest` of a manifest at :data:`SCHEMA_VERSION`."""
    for k in ("model", "config", "options", "steps", "requests"):
        if k not in d:
            raise InfertraceError(f"{path}: missing key {k!r}")
    if d.get("runtime", "infertrace") not in RUNTIMES:
        raise InfertraceError(f"{path}: 'runtime' must be one of {', '.join(RUNTIMES)}")
    for k in ("model", "config", "options"):
        if not isinstance(d[k], dict):
            raise InfertraceError(f"{path}: {k!r} must be an object")
    for i, r in enumerate(_check_list(d["requests"], f"{path}: requests")):
        if not isinstance(r, dict) or "seq_id" not in r:
            raise InfertraceError(f"{path}: requests[{i}]: missing key 'seq_id'")
    parts = {"hidden": HiddenRec, "positions": PositionsRec, "mask": MaskRec, "kv": KVRec, "decode": DecodeRec}
    for i, st in enumerate(_check_list(d["steps"], f"{path}: steps")):
        w = f"{path}: steps[{i}]"
        _check(st, StepTrace, w, strict=False)
        for j, b in enumerate(_check_list(st["batch"], f"{w}.batch")):
            _check(b, ReqStep, f"{w}.batch[{j}]")
        for name, cls in parts.items():
            if st.get(name) is not None:
                _check(st[name], cls, f"{w}.{name}")
        if st.get("hidden") is not None:
            for j, r in enumerate(_check_list(st["hidden"]["rows"], f"{w}.hidden.rows")):
                _check(r, RowStat, f"{w}.hidden.rows[{j}]")
    store = d.get("store", {})
    if not isinstance(store, dict) or store.get("keep", "summary") not in KEEP:
        raise InfertraceError(f"{path}: 'store' must be an object with keep summary or tensors")
    from infertrace.trace.schema import validate_trace

    validate_trace(d, path, consistency)  # types, ranges, sizes and cross-field consistency of every record


def read_manifest(directory: str | Path, consistency: bool = True) -> dict[str, Any]:
    """The validated manifest dict of a saved trace (``directory`` or its ``trace.json``), at the
    current schema (a schema 1 trace is upgraded in memory: :func:`infertrace.trace.upgrade.upgrade`).

    ``consistency=False`` skips only the cross-field consistency checks (types, sizes and limits
    are always checked): ``infertrace check`` reports those as invariant violations itself.

    Raises:
        InfertraceError: missing directory or file, unreadable, invalid or truncated JSON,
            newer schema, missing keys.
    """
    d = Path(directory)
    if d.name == MANIFEST and not d.is_dir():
        d = d.parent
    shown = visible(str(d))
    if not d.exists():
        raise InfertraceError(f"trace directory {shown} does not exist; save one with infertrace run --save {shown}")
    if not d.is_dir():
        raise InfertraceError(f"{shown} is not a trace directory (expected a directory holding {MANIFEST})")
    p = d / MANIFEST
    if not p.exists():
        raise InfertraceError(f"{shown}: no {MANIFEST} here, not a saved trace (write one with infertrace run --save {shown})")
    where = visible(str(p))
    data = read_regular(p, MAX_MANIFEST_BYTES, "trace.json (limit MAX_MANIFEST_BYTES)")
    try:
        obj = parse_json(data, where)
    except json.JSONDecodeError as e:
        raise _json_error(where, e.doc, e) from None
    return validate_manifest(obj, where, consistency)


def trace_from_manifest(m: dict[str, Any], where: str = MANIFEST) -> RunTrace:
    """Build the :class:`RunTrace` (the ``store`` section is ignored).

    Raises:
        InfertraceError: values of the wrong type that :func:`validate_manifest` let through.
    """
    try:
        return RunTrace.from_dict(m)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InfertraceError(f"{where}: malformed record ({type(e).__name__}: {e})") from None


def load_trace(directory: str | Path, timings: bool = True, manifest: dict[str, Any] | None = None) -> RunTrace:
    """Load a saved trace. Tensors are not read here: see :func:`load_tensors` (lazy).

    Args:
        directory: a directory written by :func:`save_trace` (or its ``trace.json``).
        timings: merge ``time_ms`` back from ``timing.json`` when present.
        manifest: the already read :func:`read_manifest` dict (else it is read here).

    Raises:
        InfertraceError: see :func:`read_manifest`.
    """
    m = manifest if manifest is not None else read_manifest(directory)
    d = Path(directory)
    d = d.parent if d.is_file() else d
    tr = trace_from_manifest(m, _where(d))
    if timings and (d / TIMING).is_file():
        rt: Any = None
        try:
            doc = parse_json(read_regular(d / TIMING, 64 << 20, "timing.json"), TIMING)
            t = {s["step"]: float(s["time_ms"]) for s in doc["steps"]}
            rt = doc["threads"] if "threads" in doc else threads_v1(doc.get("runtime"))  # schema 1: "runtime"
        except (InfertraceError, ValueError, KeyError, TypeError, AttributeError, OverflowError):
            t = {}  # timings are informational; a broken timing.json only loses them
        for st in tr.steps:
            st.time_ms = t.get(st.step, st.time_ms)
        tr.threads = checked_threads(rt)
    return tr


class TraceTensors:
    """Lazy access to ``tensors.safetensors`` (memory-mapped; a tensor is read when asked), through
    numpy: no torch (:func:`infertrace.capture.tensors.read_tensor` gives a torch tensor).

    Attributes:
        index: ``{name: {"dtype": str, "shape": [..]}}`` from the manifest.
        layers: the layers whose tensors were kept.
        path: the ``tensors.safetensors`` file.

    Raises:
        InfertraceError: (constructor) the file's own header fails :func:`infertrace.safe_io.safetensors_header`
            (truncated, offsets outside the file, overlapping), a tensor of ``index`` is missing from it or
            has another dtype/shape there, or safetensors cannot open it.
    """

    def __init__(self, path: Path, index: dict[str, Any], layers: list[int]):
        self.path, self.index, self.layers = path, index, layers
        shown = visible(str(path))
        try:  # our own bounded header check first: offsets inside the file, no overlap, sizes = shape × dtype
            header = safetensors_header(path)
        except InfertraceError as e:
            raise InfertraceError(f"{e.message}; the file may be truncated; re-save the trace with "
                                  "infertrace run --save --keep tensors") from None
        for name in sorted(index):
            if name not in header:
                raise InfertraceError(f"{shown}: tensor {visible(name)!r} listed in {MANIFEST} is missing from the file")
            want, got = index[name], header[name]
            if TORCH_TO_ST.get(want["dtype"]) != got["dtype"] or list(want["shape"]) != list(got["shape"]):
                raise InfertraceError(f"{shown}: tensor {visible(name)!r} is {got['dtype']} {got['shape']} in the file but "
                                      f"{visible(want['dtype'])} {want['shape']} in {MANIFEST}; the two files do not belong together")
        try:
            from safetensors import safe_open

            self._f = safe_open(str(path), framework="np")  # numpy: reading a trace needs no torch
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise InfertraceError(f"{shown}: cannot read tensors ({_one(e)}); the file may be truncated; "
                                  "re-save the trace with infertrace run --save --keep tensors") from None
        # bf16 (numpy has none) is read by hand from the checked header: data begins after the
        # 8-byte length and the header JSON
        self._header = header
        with open(path, "rb") as f:
            self._data_start = 8 + int.from_bytes(f.read(8), "little")

    def names(self, prefix: str = "") -> list[str]:
        """Sorted tensor names starting with ``prefix`` (e.g. ``"step3/layer0/"``)."""
        return sorted(k for k in self.index if k.startswith(prefix))

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def array(self, name: str) -> Any:
        """The tensor ``name`` as a numpy array (no torch): its saved dtype, except ``bfloat16``
        (numpy has none), which comes back as the exactly equal ``float32`` values.

        Raises:
            InfertraceError: no such tensor, or the file cannot be read.
        """
        import numpy as np

        if name not in self.index:
            raise InfertraceError(f"{visible(str(self.path))}: no tensor {visible(name)!r} in this trace")
        try:
            info = self._header.get(name) or {}
            if info.get("dtype") == "BF16":  # bf16 = the high 16 bits of a float32
                lo, hi = (int(x) for x in info["data_offsets"])
                shape = [int(x) for x in info["shape"]]
                if hi - lo != 2 * int(np.prod(shape, dtype=np.int64)):
                    raise ValueError("bf16 data size does not match its shape")
                raw = np.fromfile(self.path, dtype="<u2", count=(hi - lo) // 2, offset=self._data_start + lo)
                return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)
            return self._f.get_tensor(name)
        except Exception as e:  # noqa: BLE001
            raise InfertraceError(f"{visible(str(self.path))}: cannot read tensor {visible(name)!r} ({visible(_one(e))})") from None



def _one(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


def load_tensors(directory: str | Path, manifest: dict[str, Any] | None = None) -> TraceTensors | None:
    """Open the saved tensors lazily; None when the trace was saved with ``--keep summary``.

    Raises:
        InfertraceError: keep says tensors but the file is missing, truncated or unreadable.
    """
    d = Path(directory)
    d = d.parent if d.is_file() else d
    m = manifest if manifest is not None else read_manifest(d)
    store = m.get("store", {})
    if store.get("keep", "summary") != "tensors":
        return None
    p = d / TENSORS
    if not p.exists():
        raise InfertraceError(f"{d}: {MANIFEST} says tensors were kept but {TENSORS} is missing")
    return TraceTensors(p, store.get("tensors", {}), list(store.get("tensor_layers", [])))


def load_saved(directory: str | Path) -> tuple[RunTrace, TraceTensors | None]:
    """:func:`load_trace` plus :func:`load_tensors` (opened lazily, header checked): a trace
    whose tensors file is missing or truncated is reported even when only records are needed.

    Raises:
        InfertraceError: see :func:`read_manifest` and :func:`load_tensors`.
    """
    m = read_manifest(directory)
    tensors = load_tensors(directory, m)
    return load_trace(directory, manifest=m), tensors


def parse_layers(text: str | None, n_layer: int | None = None) -> list[int] | None:
    """``"0,5"`` / ``"0..3"`` / ``"all"`` -> sorted layer list (None when ``text`` is None).

    Raises:
        ConfigError: ``run.tensor_layers``: malformed text or a layer outside ``0..n_layer-1`` (the CLI names --layers).
    """
    if text is None:
        return None
    out: set[int] = set()
    every = False
    for part in text.split(","):
        part = part.strip().lower()
        if part == "all":  # without n_layer (syntax check before loading) it adds nothing yet
            every = True
            out.update(range(n_layer or 0))
            continue
        a, sep, b = part.partition("..")
        try:
            lo, hi = int(a), int(b) if sep else int(a)
        except ValueError:
            raise ConfigError("run.tensor_layers", f"{text!r}: {part!r} is not a layer number or range (use 0,5 or 0..3 or all)") from None
        if lo < 0 or hi < lo:
            raise ConfigError("run.tensor_layers", f"{text!r}: {part!r} is not a valid layer range")
        if hi >= (n_layer if n_layer is not None else 4096):
            lim = f"the model has layers 0..{n_layer - 1}" if n_layer is not None else "no model has that many layers"
            raise ConfigError("run.tensor_layers", f"{hi} out of range: {lim}")
        out.update(range(lo, hi + 1))
    if not out and not every:
        raise ConfigError("run.tensor_layers", f"{text!r}: no layer given")
    if n_layer is not None and out and max(out) >= n_layer:
        raise ConfigError("run.tensor_layers", f"{max(out)} out of range: the model has layers 0..{n_layer - 1}")
    return sorted(out)
