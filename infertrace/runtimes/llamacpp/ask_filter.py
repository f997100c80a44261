"""The eval callback's ``ask`` answers in C: llama.cpp's scheduler asks about every graph node (~950 a
token on SmolLM2-135M) whether the callback wants to see it computed, and a Python callback pays a
C -> Python transition per question however little it does. This module compiles (once, with the
system's C compiler, into infertrace's cache directory) a small filter that answers those questions in
C and calls the Python callback only where Python has work: the nodes the trace keeps (a set of
names), the consumers of a graph input not read yet this ubatch, the recurrent-state nodes whose
views are read at ask time, and every computed node it said yes to (``ask=false``).

The answers are those of :meth:`~infertrace.runtimes.llamacpp.capture.LlamaCppContext._ask_fast`, the
Python path it replaces (and which stays the path when no compiler is found or
``INFERTRACE_NO_CEXT=1``): the trace is the same either way
(``tests/runtimes/llamacpp/test_llamacpp_ask_filter.py``).

ggml side (``ggml/src/ggml-backend.cpp`` ``ggml_backend_sched_compute_splits``): with ``callback_eval``
set, each node is asked ``ask=true``; nodes answered false are computed together up to the next node
answered true, which is then handed over ``ask=false`` once computed.

The shared object is built from :data:`SOURCE` only (no user input reaches the compiler), named by the
source's hash, written to a temporary name and moved into place, and loaded only when it is a regular
file owned by this user (a symlink or another user's file there is refused and the Python path used).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

#: input names and Python-decided prefixes the filter holds at most (the wanted node names are unbounded)
MAX_NAMES = 24

SOURCE = r"""
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

typedef bool (*eval_cb)(void *t, bool ask, void *ud);

struct filt {
    eval_cb py;             /* the Python callback: every ask=false, and the asks it must decide */
    int64_t active;         /* 0: every question goes to Python (first ubatch, iSWA models) */
    int64_t off_name, off_src, off_flags, max_src, input_flag;
    int64_t n_want, n_inp, n_pre;
    const char **want;      /* node names the trace keeps (n_want of them: every --keep tensors layer's) */
    const char *inp[24];    /* graph-input names */
    const char *pre[24];    /* name prefixes Python decides (recurrent-state views) */
    int64_t pre_len[24];
    uint8_t done[24];       /* done[i]: inp[i] kept this ubatch (set by Python, cleared per decode) */
};

bool infertrace_ask(void *t, bool ask, void *ud) {
    struct filt *f = (struct filt *) ud;
    if (!ask || !f->active) return f->py(t, ask, NULL);
    const char *nm = (const char *) t + f->off_name;
    for (int64_t i = 0; i < f->n_want; i++) if (strncmp(nm, f->want[i], 64) == 0) return true;
    for (int64_t i = 0; i < f->n_pre; i++) if (strncmp(nm, f->pre[i], f->pre_len[i]) == 0) return f->py(t, ask, NULL);
    for (int64_t s = 0; s < f->max_src; s++) {
        const char *src = *(const char * const *) ((const char *) t + f->off_src + s * (int64_t) sizeof(void *));
        if (!src) return false;
        if (*(const int32_t *) (src + f->off_flags) & f->input_flag) {
            for (int64_t j = 0; j < f->n_inp; j++)
                if (!f->done[j] && strncmp(src + f->off_name, f->inp[j], 64) == 0) return true;
        }
    }
    return false;
}
"""


class Filt(ctypes.Structure):
    """``struct filt`` of :data:`SOURCE`."""

    _fields_ = [("py", ctypes.c_void_p), ("active", ctypes.c_int64), ("off_name", ctypes.c_int64),
                ("off_src", ctypes.c_int64), ("off_flags", ctypes.c_int64), ("max_src", ctypes.c_int64),
                ("input_flag", ctypes.c_int64), ("n_want", ctypes.c_int64), ("n_inp", ctypes.c_int64),
                ("n_pre", ctypes.c_int64), ("want", ctypes.POINTER(ctypes.c_char_p)), ("inp", ctypes.c_char_p * MAX_NAMES),
                ("pre", ctypes.c_char_p * MAX_NAMES), ("pre_len", ctypes.c_int64 * MAX_NAMES),
                ("done", ctypes.c_uint8 * MAX_NAMES)]


_LIB: Any = None
_TRIED = False


def _so_path() -> Path:
    from infertrace.loading.registry import cache_dir

    h = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    return cache_dir() / "cext" / f"ask_filter-{h}.so"


def _safe_file(p: Path) -> bool:
    """A regular file (not a symlink) owned by this user, not writable by others."""
    try:
        st = os.lstat(p)
    except OSError:
        return False
    import stat

    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _build(target: Path) -> bool:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.parent.is_symlink():
        return False
    with tempfile.TemporaryDirectory(dir=target.parent) as d:
        src, out = Path(d) / "f.c", Path(d) / "f.so"
        src.write_text(SOURCE)
        try:
            r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)], capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
        if r.returncode != 0 or not out.is_file():
            return False
        os.chmod(out, 0o644)
        os.replace(out, target)  # atomic: a concurrent process sees the old file or the whole new one
    return True


def load() -> Any:
    """The compiled filter library (``infertrace_ask`` typed), or None: ``INFERTRACE_NO_CEXT=1``, no C
    compiler, the build failed, or the cached file is not ours (see the module docstring). Never raises."""
    global _LIB, _TRIED
    if os.environ.get("INFERTRACE_NO_CEXT", "") not in ("", "0"):
        return None
    if _TRIED:
        return _LIB
    _TRIED = True
    try:
        p = _so_path()
        if not p.exists() and not os.path.islink(p) and not _build(p):
            return None
        if not _safe_file(p):
            return None
        lib = ctypes.CDLL(str(p))
        lib.infertrace_ask.restype = ctypes.c_bool
        lib.infertrace_ask.argtypes = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p]
        _LIB = lib
    except Exception:  # any failure: the Python path
        _LIB = None
    return _LIB


def _names(arr: Any, names: list[bytes]) -> int:
    if len(names) > MAX_NAMES:
        raise ValueError("too many names for the ask filter")
    for i, n in enumerate(names):
        arr[i] = n
    return len(names)


def make_filter(py_cb: Any, want: frozenset[bytes], inputs: tuple[bytes, ...], prefixes: tuple[bytes, ...],
                offsets: tuple[int, int, int], max_src: int, input_flag: int) -> tuple[Any, Filt] | None:
    """``(C function pointer to install as cb_eval, its user data struct)`` or None (no library).

    Args:
        py_cb: the ctypes ``ggml_backend_sched_eval_callback`` the filter forwards to.
        want / inputs / prefixes: as ``_want_b``, ``_INPUTS_B``, ``_RS_PREFIXES`` of capture.py.
        offsets: byte offsets of ``name``, ``src`` and ``flags`` in ``struct ggml_tensor``.

    The caller keeps both objects (and the name bytes, held by the struct) alive for the context's life,
    sets ``filt.active`` and clears ``filt.done`` per decode.
    """
    lib = load()
    if lib is None:
        return None
    f = Filt()
    f.py = ctypes.cast(py_cb, ctypes.c_void_p).value
    f.off_name, f.off_src, f.off_flags = offsets
    f.max_src, f.input_flag = max_src, input_flag
    f._keep = (sorted(want), list(inputs), list(prefixes))  # type: ignore[attr-defined]  # the bytes c_char_p points to
    want_arr = (ctypes.c_char_p * max(1, len(f._keep[0])))(*f._keep[0])  # type: ignore[attr-defined]
    f._want_arr = want_arr  # type: ignore[attr-defined]  # kept alive with the struct
    f.want, f.n_want = ctypes.cast(want_arr, ctypes.POINTER(ctypes.c_char_p)), len(f._keep[0])  # type: ignore[attr-defined]
    f.n_inp = _names(f.inp, f._keep[1])  # type: ignore[attr-defined]
    f.n_pre = _names(f.pre, f._keep[2])  # type: ignore[attr-defined]
    for i, p in enumerate(prefixes):
        f.pre_len[i] = len(p)
    return lib.infertrace_ask, f
