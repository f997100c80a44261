"""llama.cpp at run time, through llama-cpp-python's low-level ctypes API: decode one ``llama_batch``
per engine step and capture the graph inputs and the cache as llama.cpp itself has them.

What is read, and from where (llama.cpp as vendored by llama-cpp-python 0.3.x):

* an eval callback (``cb_eval`` / ``cb_eval_user_data`` of ``llama_context_params``; llama.cpp
  ``examples/eval-callback``): for every graph node the scheduler asks ``ask=true`` first; we answer
  yes for the nodes we want, and after each computed node (``ask=false``) read it and its sources
  (graph inputs are leaves, so they are reached as ``src[i]`` of the nodes that consume them):
  ``inp_tokens`` I32 ``[N]``, ``embd`` F32 ``ne=[H, N]`` (the embedding output = ``inpL``),
  ``inp_pos`` I32 ``[N]``, ``attn_inp_kq_mask`` (F16 with flash attention, else F32,
  ``ne=[n_kv, n_tokens, 1, n_stream]``, ``src/llama-graph.cpp`` ``build_attn_inp_kq_mask``),
  ``attn_inp_k_idxs`` / ``attn_inp_v_idxs`` I64 (the cell of every current token,
  ``src/llama-kv-cache.cpp`` ``build_input_k_idxs``), ``out_ids`` I32 ``[n_outputs]``
  (``build_inp_out_ids``), ``Qcur-{il}`` / ``Kcur-{il}`` / ``Vcur-{il}`` of one layer (first node
  of a name = the projection, last = after RoPE) and that layer's cache after the write
  (``cache_k_l{il} (view)``, the ``ggml_set_rows`` result);
* models with sliding-window layers (Gemma 3): llama.cpp's iSWA graph (``build_attn_inp_kv_iswa``)
  builds ``attn_inp_kq_mask`` / ``attn_inp_k_idxs`` / ``attn_inp_v_idxs`` once per pool under the
  same names; the copy a windowed layer consumes (its ``cache_k_l{il}`` / ``-{il}`` node) is kept as
  ``NAME_swa``; ``cache_k_l{il}`` ``ne[1]`` gives each pool's size;
* hybrid models: the recurrent cells of every ubatch from ``build_rs`` (``rs_s_copy`` I32 ``[n_rs]``,
  ``rs_z`` and ``head`` from view offsets; :meth:`LlamaCppContext._rs_meta`);
* ``llama_get_logits_ith`` for the rows flagged in the batch;
* the memory API: ``llama_memory_seq_pos_min`` / ``_max`` per sequence, ``llama_memory_seq_rm``.

Tensors are read with ``ggml_backend_tensor_get`` from the wheel's ``libggml`` (bound here with
ctypes; the fields ``type``/``ne``/``nb``/``src``/``name`` of ``struct ggml_tensor`` are read
through a ctypes mirror of its layout in ``ggml/include/ggml.h``).
"""

from __future__ import annotations

import ctypes
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from infertrace.errors import InfertraceError
from infertrace.model.taps import ATTN_OUT, MLP_OUT, RESID_POST

GGML_MAX_DIMS, GGML_MAX_OP_PARAMS, GGML_MAX_SRC, GGML_MAX_NAME = 4, 64, 10, 64
#: ggml_type -> numpy dtype for the types the inputs and caches use
GGML_NP = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}
GGML_TYPE_NAME = {0: "f32", 1: "f16", 24: "i8", 25: "i16", 26: "i32", 27: "i64", 28: "f64", 30: "bf16"}
INPUTS = ("inp_tokens", "inp_pos", "attn_inp_kq_mask", "attn_inp_kq_mask_swa", "attn_inp_k_idxs", "attn_inp_v_idxs",
          "out_ids", "rs_s_copy")
#: inputs llama.cpp's iSWA graph builds twice under one name (``build_attn_inp_kv_iswa``: base pool and SWA pool);
#: the copy a windowed layer consumes is stored as ``NAME_swa``
PER_POOL = ("attn_inp_kq_mask", "attn_inp_k_idxs", "attn_inp_v_idxs")
_LAYER_RE = re.compile(r"(?:cache_[kv]_l|-)(\d+)(?:\D|$)")
#: ``enum ggml_tensor_flag`` (``ggml/include/ggml.h``): set by ``ggml_set_input`` on every graph input
GGML_TENSOR_FLAG_INPUT = 1


#: infertrace tap -> the llama.cpp graph nodes that hold it, first present wins (``cb(cur, NAME, il)`` in
#: ``src/models/*.cpp``): ``attn_out`` = the attention block after ``wo`` (``attn_out-N``; Gemma 3: after its
#: post-attention norm, ``attn_post_norm-N``), ``mlp_out`` = the FFN after ``ffn_down`` (``ffn_out-N``; Gemma 3:
#: ``ffn_post_norm-N``), ``resid_post`` = the layer output ``l_out-N``. llama.cpp computes the last layer only
#: for the output rows once ``inp_out_ids`` is applied (``ggml_get_rows`` before ``ffn_inp`` / the post norm):
#: a node with fewer rows than the ubatch's tokens is not a tap of that step.
TAP_NODES = {ATTN_OUT: ("attn_post_norm", "attn_out"), MLP_OUT: ("ffn_post_norm", "ffn_out"), RESID_POST: ("l_out",)}
#: the per-layer Q/K/V nodes read with the block outputs (first node of a name = the projection, last = after RoPE)
QKV_NODES = ("Qcur", "Kcur", "Vcur")
TAP_NODE_NAMES = tuple(n for names in TAP_NODES.values() for n in names) + QKV_NODES


def tap_node(name: str, il: int) -> str:
    """The graph node name of ``name`` (a :data:`TAP_NODE_NAMES` entry) in layer ``il``: ``"l_out-5"``."""
    return f"{name}-{il}"


def consumer_layer(name: str, src_names: list[str]) -> int | None:
    """The model layer of a graph node that consumes a per-pool input: from ``cache_k_l{il}`` /
    ``cache_v_l{il}`` in its own or its sources' names (``ggml_set_rows`` into the cache, the
    attention node reading the cache view) or a ``-{il}`` suffix (``kq_soft_max-{il}``); None if
    neither names a layer."""
    for n in [name, *src_names]:
        if n.startswith("cache_") or n.rsplit("-", 1)[-1].isdigit():
            m = _LAYER_RE.search(n)
            if m:
                return int(m.group(1))
    return None


class GgmlTensor(ctypes.Structure):
    """Prefix of ``struct ggml_tensor`` (``ggml/include/ggml.h``) up to ``name``."""


GgmlTensor._fields_ = [
    ("type", ctypes.c_int),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
    ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
    ("op", ctypes.c_int),
    ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
    ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(GgmlTensor) * GGML_MAX_SRC),
    ("view_src", ctypes.POINTER(GgmlTensor)),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * GGML_MAX_NAME),
]


#: byte offsets in ``struct ggml_tensor`` of the fields the fast ask path reads
_OFF_NAME, _OFF_SRC, _OFF_FLAGS = GgmlTensor.name.offset, GgmlTensor.src.offset, GgmlTensor.flags.offset
_PTR = ctypes.sizeof(ctypes.c_void_p)
_INPUTS_B = frozenset(n.encode() for n in INPUTS)
_INPUTS_ORDER = tuple(n.encode() for n in INPUTS)  # the C filter's input slots (ask_filter.Filt.inp / done)
_INPUT_INDEX = {n: i for i, n in enumerate(INPUTS)}
_RS_PREFIXES = (b"cache_r_l", b"rs_s_copy")
_string_at, _i32_at = ctypes.string_at, ctypes.c_int32.from_address


def _ptr_at(a: int) -> int | None:
    return ctypes.c_void_p.from_address(a).value


def import_llama_cpp() -> Any:
    """``llama_cpp`` or an InfertraceError naming the extra to install."""
    try:
        import llama_cpp
    except ImportError:
        raise InfertraceError("--runtime llama.cpp needs llama-cpp-python: run `make setup-dev` in the infertrace checkout (or `.venv/bin/pip install -e '.[llamacpp]'` there)") from None
    return llama_cpp


def _ggml_lib(llama_cpp: Any) -> ctypes.CDLL:
    """``libggml`` of the wheel with ``ggml_backend_tensor_get`` / ``ggml_nbytes`` typed."""
    from llama_cpp import _ggml

    lib = _ggml.libggml
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    return lib


@dataclass
class Captured:
    """One ``llama_decode`` = one ubatch (n_ubatch >= N): the tensors llama.cpp built, as numpy
    arrays in ggml ``ne`` order reversed (numpy shape = ``ne[::-1]`` trimmed), plus ``ne``/dtype."""

    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    ne: dict[str, list[int]] = field(default_factory=dict)
    dtype: dict[str, str] = field(default_factory=dict)
    first: dict[str, np.ndarray] = field(default_factory=dict)  # first node of a repeated name (pre-RoPE Q/K)
    n_ubatch_calls: int = 0
    #: hybrid models, per ubatch: llama.cpp's recurrent cells ``{"ubatch", "head", "n_rs", "rs_z", "s_copy"}``
    #: (``llm_graph_context::build_rs``: cells ``head..head+n_rs-1`` hold the ubatch's sequences in order,
    #: ``rs_z`` the cell zeroed for new sequences (-1: none), ``s_copy[i]`` the cell cell ``head+i`` reads from)
    rs: list[dict[str, Any]] = field(default_factory=list)


#: ``--llamacpp-flash-attn`` -> ``llama_flash_attn_type`` (``include/llama.h``)
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
#: ggml_type names of the K/V cache types llama.cpp accepts (``ggml/include/ggml.h``)
CACHE_TYPE_NAME = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 20: "iq4_nl", 30: "bf16"}


def check_flash_attn(value: str) -> str:
    """``auto``, ``on`` or ``off`` (case-insensitive).

    Raises:
        InfertraceError: anything else, naming ``--llamacpp-flash-attn``.
    """
    v = str(value).strip().lower()
    if v not in FLASH_ATTN:
        raise InfertraceError(f"--llamacpp-flash-attn must be one of auto, on, off (got {value!r})")
    return v


#: the no-op log callback llama.cpp holds a pointer to (see LlamaCppContext._silence)
_QUIET_LOG_CB: Any = None


class LlamaCppContext:
    """A llama.cpp model + context with the capture callback installed.

    Args:
        path: GGUF file.
        n_ctx: cells of the cache (llama.cpp pads it to a multiple of 256).
        n_batch: ``n_batch`` = ``n_ubatch`` (>= the largest step, so one step = one ubatch).
        n_seq_max: distinct sequences.
        layer: the layer whose Q/K/V and cache are captured.
        n_threads: CPU threads (``n_threads`` = ``n_threads_batch``).
        flash_attn: ``auto`` (llama.cpp's default: on where the backend supports it), ``on`` or
            ``off`` (``llama_context_params.flash_attn_type``). Flash attention changes the numbers
            (ggml-cpu: Q rounded to F16 and an F16 output accumulator for fewer than 64 queries,
            ``ggml_compute_forward_flash_attn_ext_f16``; without it the softmax output is rounded
            to F16 for ``kqv = V·softmax(KQ)``); which one ran is read back from the graph
            (:attr:`flash_attn_used`: ``attn_inp_kq_mask`` is F16 iff ``cparams.flash_attn``).
        swa_layers: the model's sliding-window layers (Gemma 3): llama.cpp builds its iSWA cache and
            names both pools' inputs alike; what those layers consume is kept as ``attn_inp_kq_mask_swa``,
            ``attn_inp_k_idxs_swa``, ``attn_inp_v_idxs_swa`` (:data:`PER_POOL`).
        swa_full: ``llama_context_params.swa_full`` (False: the small SWA pool, as llama-cli /
            llama-server's default ``common_params.swa_full``; llama.cpp's C default is true).
        tap_layers: layers whose Q/K/V and block outputs are read as well (:data:`TAP_NODES`); none by
            default, so the default trace asks for no more nodes than ``layer``'s.

    Raises:
        InfertraceError: package missing, the file is not GGUF, llama.cpp refuses the file, an
            unknown ``flash_attn``.
    """

    def __init__(self, path: Path, n_ctx: int, n_batch: int, n_seq_max: int, layer: int = 0, n_threads: int = 2,
                 flash_attn: str = "auto", kv_unified: bool = True, swa_layers: Any = (), swa_full: bool = False,
                 tap_layers: Any = ()):
        flash_attn = check_flash_attn(flash_attn)
        llama_cpp = import_llama_cpp()
        self.L = llama_cpp
        p = Path(path)
        if not p.is_file() or p.suffix.lower() != ".gguf":
            raise InfertraceError(f"--runtime llama.cpp needs a GGUF file; {p.name} is not one")
        self._silence()
        llama_cpp.llama_backend_init()
        self.ggml = _ggml_lib(llama_cpp)
        mp = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(p).encode(), mp)
        if not self.model:
            from infertrace.loading.gguf_check import gguf_file_byte_order

            if gguf_file_byte_order(p) == ">" and sys.byteorder == "little":  # case G2: gguf.cpp reads host order only
                raise InfertraceError(f"llama.cpp cannot load {p.name}: it is a big-endian GGUF and llama.cpp reads only its "
                                      "host's (little-endian) byte order; convert it (gguf-py gguf_convert_endian.py FILE "
                                      "little) or run without --runtime llama.cpp")
            raise InfertraceError(f"llama.cpp cannot load {p.name}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.layer = layer
        self.swa_layers = frozenset(int(i) for i in swa_layers)
        #: cells of each layer's K cache as llama.cpp allocated it (``cache_k_l{il}`` ``ne[1]``): the base
        #: pool's size for full-attention layers, the SWA pool's for windowed ones
        self.cache_cells: dict[int, int] = {}
        self._rs_layer: str | None = None  # the first recurrent layer (hybrid models), as named in cache_r_l{il}
        self.cap = Captured()
        #: the fast ask path (:meth:`_ask_fast`): on after a first ubatch read the slow way showed every input
        #: flagged INPUT (and gave every layer's cache size); never for iSWA models (per-pool input names)
        self._fast, self._flags_ok = False, True
        self._want_layer = {f"Qcur-{layer}", f"Kcur-{layer}", f"Vcur-{layer}", f"cache_k_l{layer} (view)",
                            f"cache_v_l{layer} (view)", "embd", "inp_scaled",  # inp_scaled: embd x sqrt(H) (Gemma)
                            # non-unified: ggml_set_rows into the streams merged to [n_embd_gqa, kv_size * n_stream] (cpy_k)
                            f"cache_k_l{layer} (reshaped) (view)", f"cache_v_l{layer} (reshaped) (view)"}
        #: layers whose block outputs are read (``--keep tensors --layers``): :data:`TAP_NODES` of each
        self.tap_layers = tuple(sorted({int(i) for i in tap_layers}))
        self._want_layer |= {tap_node(n, il) for il in self.tap_layers for n in TAP_NODE_NAMES}
        self._want_b = frozenset(n.encode() for n in self._want_layer)
        self._cb = llama_cpp.ggml_backend_sched_eval_callback(self._eval)  # kept alive for the context's life
        cp = llama_cpp.llama_context_default_params()
        self._install_callback(cp)
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_batch
        cp.n_seq_max = max(1, n_seq_max)
        cp.kv_unified = bool(kv_unified)  # True: one stream (the cells backend); False: one per sequence (kv/streams.py)
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.no_perf = True
        cp.swa_full = bool(swa_full)
        cp.flash_attn_type = FLASH_ATTN[flash_attn]
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise InfertraceError("llama.cpp cannot create a context (lower --ctx-size or --max-batch-tokens)")
        self.n_ctx = int(llama_cpp.llama_n_ctx(self.ctx))
        #: cells per stream (llama.cpp ``n_ctx_seq``: ``n_ctx`` unified, else ``pad(n_ctx / n_seq_max, 256)``)
        self.n_ctx_seq = int(llama_cpp.llama_n_ctx_seq(self.ctx))
        self.n_batch = n_batch
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.flash_attn = flash_attn
        #: whether flash attention ran (None before the first decode; from the kq_mask type)
        self.flash_attn_used: bool | None = None
        L = llama_cpp
        self._settings = {
            "flash_attn_type": flash_attn, "type_k": CACHE_TYPE_NAME.get(int(cp.type_k), str(int(cp.type_k))),
            "type_v": CACHE_TYPE_NAME.get(int(cp.type_v), str(int(cp.type_v))), "n_ctx": self.n_ctx,
            "n_batch": int(L.llama_n_batch(self.ctx)), "n_ubatch": int(L.llama_n_ubatch(self.ctx)),
            "n_seq_max": int(L.llama_n_seq_max(self.ctx)), "n_threads": int(L.llama_n_threads(self.ctx)),
            "n_threads_batch": int(L.llama_n_threads_batch(self.ctx)), "kv_unified": bool(cp.kv_unified),
            "offload_kqv": bool(cp.offload_kqv), "op_offload": bool(cp.op_offload), "swa_full": bool(cp.swa_full),
            "n_ctx_seq": self.n_ctx_seq, "n_gpu_layers": int(mp.n_gpu_layers), "gpu_offload": bool(L.llama_supports_gpu_offload()),
            "use_extra_bufts": bool(mp.use_extra_bufts),
            "system_info": L.llama_print_system_info().decode("utf-8", "replace").strip()[:1000],
        }

    def settings(self) -> dict[str, Any]:
        """The context settings that change llama.cpp's numbers, as the trace header records them.

        Returns:
            ``{"flash_attn": "on" | "off" | None (no decode yet), "flash_attn_type": "auto" | "on" |
            "off" (asked), "type_k"/"type_v": cache ggml types, "n_ctx", "n_batch", "n_ubatch",
            "n_seq_max", "n_threads", "n_threads_batch", "kv_unified", "offload_kqv", "op_offload",
            "swa_full", "n_gpu_layers", "gpu_offload": bool (a GPU backend is built in), "use_extra_bufts":
            bool (CPU weight repacking: other matmul kernels),
            "system_info": llama_print_system_info (the CPU features ggml-cpu computes with)}``.
        """
        used = self.flash_attn_used
        return {"flash_attn": None if used is None else ("on" if used else "off"), **self._settings}

    def _silence(self) -> None:
        """Install a no-op llama.cpp log callback. It is process-global in llama.cpp, so the ctypes
        callback is kept alive at module level: one owned by this context would dangle after the
        context is freed and crash the next llama.cpp log call (e.g. a later ``llama_cpp.Llama``)."""
        global _QUIET_LOG_CB
        L = self.L
        if _QUIET_LOG_CB is None:
            @L.llama_log_callback
            def _quiet(level, text, user_data):  # noqa: ANN001 - ctypes signature
                return None

            _QUIET_LOG_CB = _quiet
        self._log_cb = _QUIET_LOG_CB
        L.llama_log_set(self._log_cb, ctypes.c_void_p(0))

    # ------------------------------------------------------------------ callback
    def _install_callback(self, cp: Any) -> None:
        """``cb_eval``: the C ask filter of :mod:`~infertrace.runtimes.llamacpp.ask_filter` in front of
        :meth:`_eval` when it could be built (the same answers, no Python call per node), else :meth:`_eval`."""
        from infertrace.runtimes.llamacpp import ask_filter

        got = ask_filter.make_filter(self._cb, self._want_b, _INPUTS_ORDER, _RS_PREFIXES,
                                     (_OFF_NAME, _OFF_SRC, _OFF_FLAGS), GGML_MAX_SRC, GGML_TENSOR_FLAG_INPUT)
        #: the C filter's state (None: Python answers every question); ``active`` mirrors :attr:`_fast`
        self._filt = None if got is None else got[1]
        if got is None:
            cp.cb_eval, cp.cb_eval_user_data = self._cb, None
            return
        self._c_cb = self.L.ggml_backend_sched_eval_callback(ctypes.cast(got[0], ctypes.c_void_p).value)
        cp.cb_eval, cp.cb_eval_user_data = self._c_cb, ctypes.c_void_p(ctypes.addressof(self._filt))

    def _read(self, tp: Any) -> tuple[np.ndarray, list[int], str] | None:
        t = tp.contents
        if t.type not in GGML_NP or not t.buffer:
            return None
        ne = [int(t.ne[i]) for i in range(GGML_MAX_DIMS)]
        n = int(np.prod(ne))
        nbytes = int(self.ggml.ggml_nbytes(ctypes.cast(tp, ctypes.c_void_p)))
        dt = np.dtype(GGML_NP[t.type])
        if nbytes != n * dt.itemsize:  # a strided view: not one of ours
            return None
        buf = np.empty(n, dtype=dt)
        self.ggml.ggml_backend_tensor_get(ctypes.cast(tp, ctypes.c_void_p), buf.ctypes.data, 0, nbytes)
        shape = [d for d in reversed(ne)]
        while len(shape) > 1 and shape[0] == 1:
            shape = shape[1:]
        return buf.reshape(shape), ne, GGML_TYPE_NAME.get(t.type, str(t.type))

    def _keep(self, name: str, tp: Any) -> None:
        got = self._read(tp)
        if got is None:
            return
        arr, ne, dt = got
        if name not in self.cap.first:
            self.cap.first[name] = arr
        self.cap.tensors[name], self.cap.ne[name], self.cap.dtype[name] = arr, ne, dt
        j = _INPUT_INDEX.get(name)
        if j is not None and self._filt is not None:
            self._filt.done[j] = 1  # the C filter stops asking for this input's consumers (_ask_fast's "not read yet")

    def _eval(self, addr: Any, ask: bool, user_data: Any) -> bool:
        """``ggml_backend_sched_eval_callback``: ``ask`` -> whether we want to see this node once
        computed (it is wanted, or it consumes an input not read yet this ubatch); else read it.

        llama.cpp asks about every node of the graph (~950 a token on SmolLM2-135M), so the answer is
        the tracer's cost: after the first ubatch (:meth:`_ask_fast`) a node's sources are looked at
        only when ggml flags one as a graph input, read straight from the struct's memory."""
        if ask and self._fast:
            try:
                got = self._ask_fast(addr)
            except Exception:  # never let a Python error unwind through C
                return True
            if got is not None:
                return got
        try:
            tp = ctypes.cast(addr, ctypes.POINTER(GgmlTensor))
            t = tp.contents
            name = t.name.decode("utf-8", "replace")
            srcs, names = [], []
            for i in range(GGML_MAX_SRC):
                s = t.src[i]
                if not s:
                    break
                names.append(s.contents.name.decode("utf-8", "replace"))
            for i, sname in enumerate(names):
                if ask and sname.startswith("cache_k_l") and sname[9:].isdigit() and int(sname[9:]) not in self.cache_cells:
                    self.cache_cells[int(sname[9:])] = int(t.src[i].contents.ne[1])  # [n_embd_k_gqa, kv_size, n_stream]
                if sname in PER_POOL and self.swa_layers and consumer_layer(name, names) in self.swa_layers:
                    sname += "_swa"  # the SWA pool's copy (build_attn_inp_kv_iswa)
                if sname in INPUTS + tuple(f"{n}_swa" for n in PER_POOL) and sname not in self.cap.tensors:
                    srcs.append((sname, t.src[i]))
            rs = self._rs_meta(t, name, names, ask)
            if ask:
                for sname, sp in srcs:  # what the fast path relies on: every graph input carries ggml's INPUT flag
                    self._flags_ok &= bool(sp.contents.flags & GGML_TENSOR_FLAG_INPUT)
                return name in self._want_layer or bool(srcs) or rs
            if name in self._want_layer:
                self._keep(name, tp)
            for sname, s in srcs:
                self._keep(sname, s)
        except Exception:  # never let a Python error unwind through C
            return True
        return True

    def _ask_fast(self, addr: int) -> bool | None:
        """The ``ask`` answer of :meth:`_eval` without building ctypes structs: the node's name and source
        pointers read at their offsets, names compared as bytes; a source's name is read only when its
        ``flags`` has ``GGML_TENSOR_FLAG_INPUT`` (weights and intermediate nodes never do). None: decide on
        the full path (a recurrent-state node, whose views :meth:`_rs_meta` reads)."""
        nm = _string_at(addr + _OFF_NAME)
        if nm in self._want_b:
            return True
        if nm.startswith(_RS_PREFIXES):
            return None
        for i in range(GGML_MAX_SRC):
            p = _ptr_at(addr + _OFF_SRC + i * _PTR)
            if not p:
                return False
            if _i32_at(p + _OFF_FLAGS).value & GGML_TENSOR_FLAG_INPUT:
                sname = _string_at(p + _OFF_NAME)
                if sname in _INPUTS_B and sname.decode() not in self.cap.tensors:
                    return True
        return False

    def _rs_meta(self, t: Any, name: str, names: list[str], ask: bool) -> bool:
        """Recurrent cells of the ubatch, read (at ``ask`` time, graph order) from the first recurrent
        layer's ``build_rs`` nodes: the zeroing view ``cache_r_l{il} (reshaped) (view)`` (size
        ``state_size * (rs_z >= 0)`` at ``rs_z`` rows: starts the ubatch's record), ``rs_s_copy`` I32
        ``[n_rs]`` (an input, already set) through its first view, and the extra-states copy destination
        ``cache_r_l{il} (view)`` (``n_rs - n_seqs`` rows at ``head + n_seqs``: completes it).
        Returns False (no node is needed after compute)."""
        if not ask or not name.startswith(("cache_r_l", "rs_s_copy")):
            return False
        il = name[9:].split(" ", 1)[0] if name.startswith("cache_r_l") else None
        if il is not None and self._rs_layer is None and il.isdigit():
            self._rs_layer = il
        cur = self.cap.rs[-1] if self.cap.rs and "head" not in self.cap.rs[-1] else None
        row = int(t.nb[1])
        if name.endswith("(reshaped) (view)") and il == self._rs_layer and cur is None and t.src[0]:  # view_1d(states, .., rs_z*nb[1])
            srow = int(t.src[0].contents.nb[1])  # one state row of the reshaped states [state_size, size]
            self.cap.rs.append({"ubatch": len(self.cap.rs),
                                "rs_z": int(t.view_offs) // srow if int(t.ne[0]) > 0 and srow else -1})
        elif name == "rs_s_copy (view)" and cur is not None and "s_copy" not in cur and int(t.view_offs) == 0:
            got = self._read(t.src[0])
            if got is not None:
                cur["s_copy"] = got[0].reshape(-1).astype(int).tolist()
        elif (cur is not None and il == self._rs_layer and name.endswith(" (view)") and "(reshaped)" not in name
              and "s_copy" in cur and row and names and names[0] == f"cache_r_l{il}"):
            n_rs = len(cur["s_copy"])  # ggml_view_2d(s, .., n_rs - n_seqs, .., (head + n_seqs) * nb[1])
            cur["n_rs"], cur["head"] = n_rs, int(t.view_offs) // row - (n_rs - int(t.ne[1]))
        return False

    # ------------------------------------------------------------------ decode
    def decode(self, tokens: list[int], pos: list[int], seq: list[int], logits: list[bool]) -> Captured:
        """One ``llama_decode`` of a batch (packed order as given) and what it captured.

        Returns:
            :class:`Captured` with the tensors above and ``tensors["logits"]`` float32
            ``[n_outputs, n_vocab]`` from ``llama_get_logits_ith`` (rows in batch order).

        Raises:
            InfertraceError: llama_decode failed (cache full, inconsistent positions).
        """
        L, N = self.L, len(tokens)
        batch = L.llama_batch_init(N, 0, 1)
        try:
            for i in range(N):
                batch.token[i], batch.pos[i] = tokens[i], pos[i]
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq[i]
                batch.logits[i] = bool(logits[i])
            batch.n_tokens = N
            self.cap = Captured()
            if self._filt is not None:
                ctypes.memset(ctypes.addressof(self._filt.done), 0, ctypes.sizeof(self._filt.done))
            rc = L.llama_decode(self.ctx, batch)
            self._fast = self._flags_ok and not self.swa_layers and bool(self.cache_cells)
            if self._filt is not None:
                self._filt.active = int(self._fast)
            if rc != 0:
                raise InfertraceError(f"llama_decode returned {rc} (1: no KV slot; <0: error); raise --ctx-size")
            rows = []
            for i in range(N):
                if logits[i]:
                    ptr = L.llama_get_logits_ith(self.ctx, i)
                    rows.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())
            self.cap.tensors["logits"] = np.stack(rows) if rows else np.zeros((0, self.n_vocab), np.float32)
            if self.flash_attn_used is None and "attn_inp_kq_mask" in self.cap.dtype:  # F16 iff cparams.flash_attn
                self.flash_attn_used = self.cap.dtype["attn_inp_kq_mask"] == "f16"
        finally:
            L.llama_batch_free(batch)
        return self.cap

    def seq_pos_range(self, seq_id: int) -> tuple[int, int]:
        """``(llama_memory_seq_pos_min, llama_memory_seq_pos_max)``; ``(-1, -1)`` when empty."""
        return (int(self.L.llama_memory_seq_pos_min(self.mem, seq_id)), int(self.L.llama_memory_seq_pos_max(self.mem, seq_id)))

    def seq_rm(self, seq_id: int) -> None:
        """``llama_memory_seq_rm(mem, seq_id, -1, -1)``: free every cell of the sequence."""
        self.L.llama_memory_seq_rm(self.mem, seq_id, -1, -1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """``llama_memory_seq_cp(mem, src, dst, p0, p1)`` (non-unified: a whole-stream copy, applied at the
        next decode's memory update; a partial range aborts the process inside llama.cpp)."""
        self.L.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.L.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.L.llama_model_free(self.model)
            self.model = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
