"""The GGUF -> HF conversion cache of ``run --runtime vllm``, trusted only after it is verified.

A cache entry (``$XDG_CACHE_HOME/infertrace/vllm-hf-v2/<sha256 of the GGUF>``) is what vLLM loads and
computes with while the trace names the GGUF file, so a planted entry — a symlink to another model's
conversion, a symlinked ``model.safetensors``, another shape's files — would make the trace lie.
An entry is used only when all of this holds, checked before vLLM starts:

* the cache root and the entry are real directories (``lstat``: never a symlink), owned by this
  user and writable by no one else (written ``0700``);
* the entry holds exactly the files its manifest (:data:`MANIFEST`, written by :func:`write_manifest`
  when the conversion finished) names, each a regular file (not a symlink, one hard link, owned by
  this user, not group/other-writable, opened with ``O_NOFOLLOW``) of the recorded size and SHA-256;
* the manifest's source SHA-256 is the GGUF's (the entry's name says so too) and it has the
  format this code writes;
* the entry carries no chat template (vLLM renders one at start-up without limits; the conversion
  does not copy the GGUF's: :func:`strip_chat_template`).

Anything else is refused in one line naming the entry and what is wrong, with what to do (remove it;
the next run converts again). The cost is one SHA-256 pass over the converted files (~1 s for the
540 MB of SmolLM2-135M in float32).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from infertrace.errors import InfertraceError

#: the manifest file of an entry (written last, before the entry is renamed into place)
MANIFEST = "infertrace-manifest.json"
MANIFEST_FORMAT = 1
#: a manifest larger than this is not read
MAX_MANIFEST_BYTES = 1 << 20
#: files of an HF directory that hold a chat template (transformers writes one of them)
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates")
#: files an entry must hold
NEEDED = ("config.json", "model.safetensors")


def cache_root() -> Path:
    """``<cache_dir>/vllm-hf-v2`` (v2: entries with a manifest; older entries without one are left alone), created ``0700`` when missing, checked to be a real directory of
    this user that no one else can write.

    Raises:
        InfertraceError: it cannot be created, or is a symlink / not a directory / someone else's /
            group- or other-writable.
    """
    from infertrace.loading.registry import cache_dir

    root = cache_dir() / "vllm-hf-v2"
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(root):
            os.mkdir(root, 0o700)
    except OSError as e:
        raise InfertraceError(f"cannot create the vLLM conversion cache {root}: {e.strerror}; "
                              "set XDG_CACHE_HOME to a writable directory") from None
    why = _dir_problem(root)
    if why:
        raise InfertraceError(f"the vLLM conversion cache {root} {why}; remove it (infertrace creates it again) "
                              "or set XDG_CACHE_HOME")
    return root


def _dir_problem(d: Path) -> str | None:
    """Why ``d`` is not a private directory of this user (None when it is)."""
    st = os.lstat(d)
    return ("is a symlink" if stat.S_ISLNK(st.st_mode) else "is not a directory" if not stat.S_ISDIR(st.st_mode)
            else f"belongs to uid {st.st_uid}, not this user" if st.st_uid != os.getuid()
            else "is writable by other users" if st.st_mode & 0o022 else None)


def sha256_nofollow(p: Path, chunk: int = 1 << 22) -> tuple[str, os.stat_result]:
    """SHA-256 of a regular file opened with ``O_NOFOLLOW`` (a symlink fails), and its ``fstat``."""
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{p.name} is not a regular file")
        h = hashlib.sha256()
        for b in iter(lambda: f.read(chunk), b""):
            h.update(b)
    return h.hexdigest(), st


def strip_chat_template(d: Path) -> None:
    """Remove every chat template transformers wrote into the HF directory ``d`` (the
    ``chat_template`` key of ``tokenizer_config.json`` and the template files): vLLM renders the
    tokenizer's template at start-up (``LLM.__init__`` -> ``renderer.warmup``) with no limits, and
    infertrace hands vLLM token ids (``--chat`` is rendered by our own limited sandbox), so vLLM
    needs none."""
    import shutil

    for name in TEMPLATE_FILES:
        p = d / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif os.path.lexists(p):
            p.unlink()
    cfg = d / "tokenizer_config.json"
    if cfg.is_file():
        doc = json.loads(cfg.read_text(encoding="utf-8"))
        if isinstance(doc, dict) and "chat_template" in doc:
            del doc["chat_template"]
            cfg.write_text(json.dumps(doc, indent=2, ensure_ascii=False), encoding="utf-8")


def write_manifest(d: Path, source_sha: str, source_name: str, converter: str) -> None:
    """Make ``d`` private (dir ``0700``, files ``0600``) and write :data:`MANIFEST`: the source
    GGUF's SHA-256 and name, the converter, and each file's size and SHA-256."""
    os.chmod(d, 0o700)
    files: dict[str, dict[str, Any]] = {}
    for e in sorted(os.scandir(d), key=lambda e: e.name):
        if e.name == MANIFEST:
            continue
        if not e.is_file(follow_symlinks=False):
            raise InfertraceError(f"the conversion wrote {e.name}, which is not a regular file; report this")
        os.chmod(e.path, 0o600)
        digest, st = sha256_nofollow(Path(e.path))
        files[e.name] = {"sha256": digest, "size": st.st_size}
    doc = {"format": MANIFEST_FORMAT, "source": {"sha256": source_sha, "name": source_name}, "converter": converter,
           "files": files}
    fd = os.open(d / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, sort_keys=True)


def _refuse(entry: Path, why: str) -> InfertraceError:
    return InfertraceError(f"the vLLM conversion cache entry {entry} {why}; it was not written by infertrace for this "
                           f"file: remove it (rm -r '{entry}') and run again to convert the GGUF anew")


def _read_manifest(entry: Path) -> dict[str, Any]:
    try:
        fd = os.open(entry / MANIFEST, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise _refuse(entry, f"has no {MANIFEST}") from None
    except OSError as e:
        raise _refuse(entry, f"has an unreadable {MANIFEST} ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
            raise _refuse(entry, f"has a {MANIFEST} that is not a regular file of at most {MAX_MANIFEST_BYTES} bytes")
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _refuse(entry, f"has a {MANIFEST} that is not JSON") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    src = doc.get("source") if isinstance(doc, dict) else None
    if (doc.get("format") != MANIFEST_FORMAT or not isinstance(src, dict) or not isinstance(files, dict)
            or not all(isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("sha256"), str)
                       and isinstance(v.get("size"), int) for k, v in files.items())):
        raise _refuse(entry, f"has a {MANIFEST} of another format")
    return doc


def verify_entry(entry: Path, source_sha: str) -> None:
    """Check the cache entry ``entry`` of the GGUF whose SHA-256 is ``source_sha`` (see the module
    docstring) before vLLM reads it.

    Raises:
        InfertraceError: one line naming the entry, what is wrong, and to remove it.
    """
    why = _dir_problem(entry)
    if why:
        raise _refuse(entry, why)
    doc = _read_manifest(entry)
    if doc["source"].get("sha256") != source_sha or entry.name != source_sha:
        raise _refuse(entry, f"was converted from another file (source sha256 {str(doc['source'].get('sha256'))[:16]}...)")
    files = doc["files"]
    names = {e.name for e in os.scandir(entry)} - {MANIFEST}
    if names != set(files):
        extra, missing = sorted(names - set(files)), sorted(set(files) - names)
        raise _refuse(entry, f"holds {'files its manifest does not name: ' + ', '.join(extra[:3]) if extra else ''}"
                             f"{'; ' if extra and missing else ''}{'misses ' + ', '.join(missing[:3]) if missing else ''}")
    missing = [n for n in NEEDED if n not in files]
    if missing or any(n in files for n in TEMPLATE_FILES):
        raise _refuse(entry, f"misses {missing[0]}" if missing else "carries a chat template")
    for name, want in sorted(files.items()):
        _verify_file(entry, name, want)
    try:
        cfg = json.loads((entry / "tokenizer_config.json").read_text(encoding="utf-8")) if "tokenizer_config.json" in files else {}
    except (OSError, ValueError):
        raise _refuse(entry, "has an unreadable tokenizer_config.json") from None
    if isinstance(cfg, dict) and "chat_template" in cfg:
        raise _refuse(entry, "carries a chat template")


def _verify_file(entry: Path, name: str, want: dict[str, Any]) -> None:
    p = entry / name
    st = os.lstat(p)
    why = ("is a symlink" if stat.S_ISLNK(st.st_mode) else "is not a regular file" if not stat.S_ISREG(st.st_mode)
           else "has other hard links" if st.st_nlink != 1 else f"belongs to uid {st.st_uid}" if st.st_uid != os.getuid()
           else "is writable by other users" if st.st_mode & 0o022
           else f"is {st.st_size} bytes, its manifest says {want['size']}" if st.st_size != want["size"] else None)
    if why is None:
        try:
            digest, _ = sha256_nofollow(p)
        except OSError as e:
            raise _refuse(entry, f"has an unreadable {name} ({e.strerror or e})") from None
        why = "does not have the SHA-256 its manifest records" if digest != want["sha256"] else None
    if why:
        raise _refuse(entry, f"holds {name}, which {why}")
