"""llama.cpp's own MTP draft head through llama-cpp-python's low-level bindings: the target context
exposes ``t_h_nextn`` (the hidden state after ``output_norm``, staging API ``llama_set_embeddings_nextn``
/ ``llama_get_embeddings_nextn`` from ``src/llama-ext.h``, exported C++ symbols), and an
``LLAMA_CONTEXT_TYPE_MTP`` context on the same model (loaded with ``load_mtp``) runs ``graph_mtp`` over
rows pairing the token at p+1 with the target's hidden at p, at position p+1, the hidden state riding
as the row's embedding -- what ``common/speculative.cpp`` ``common_speculative_impl_draft_mtp::process``
does (``batch.set_embd`` -> ``llama_batch_ext_set_embd_token``)."""

from __future__ import annotations

import ctypes

import numpy as np


def _staging(lib):
    """The staging API's functions, or None when this build does not export them."""
    try:
        s = getattr(lib, "_Z26llama_set_embeddings_nextnP13llama_contextbb")
        g = getattr(lib, "_Z26llama_get_embeddings_nextnP13llama_context")
    except AttributeError:
        return None
    s.argtypes, s.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
    g.argtypes, g.restype = [ctypes.c_void_p], ctypes.POINTER(ctypes.c_float)
    return s, g


def llama_cpp_mtp(path: str, ids: list[int], pending: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(h [n, H] target hidden after output_norm, logits [V] of the MTP row of the pending token)``,
    or None when the bindings lack the MTP API."""
    from llama_cpp import llama_cpp as C

    api = _staging(C._lib)
    if api is None or not hasattr(C, "llama_batch_ext_init") or not hasattr(C, "LLAMA_CONTEXT_TYPE_MTP"):
        return None
    set_nextn, get_nextn = api
    C.llama_backend_init()
    mp = C.llama_model_default_params()
    mp.load_mtp = True
    model = C.llama_model_load_from_file(path.encode(), mp)
    assert model, path
    H, V = C.llama_model_n_embd(model), C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
    n = len(ids)

    def params(mtp: bool):
        cp = C.llama_context_default_params()
        cp.n_ctx = cp.n_batch = 64
        cp.n_threads = cp.n_threads_batch = 1
        if mtp:
            cp.ctx_type = C.LLAMA_CONTEXT_TYPE_MTP
        return cp

    ctx = C.llama_init_from_model(model, params(False))
    dft = C.llama_init_from_model(model, params(True))
    b = C.llama_batch_init(n, 0, 1)
    be = C.llama_batch_ext_init(dft)
    try:
        set_nextn(ctx, True, False)
        for i, t in enumerate(ids):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, i, 1, 1
            b.seq_id[i][0] = 0
        b.n_tokens = n
        assert C.llama_decode(ctx, b) == 0
        h = np.ctypeslib.as_array(get_nextn(ctx), shape=(n * H,)).reshape(n, H).copy()  # [n, H]
        toks = list(ids[1:]) + [pending]
        for k in range(n):
            idx = C.llama_batch_ext_add_token(be, 0, toks[k])
            pos = C.llama_pos(k + 1)
            C.llama_batch_ext_set_pos(be, idx, ctypes.byref(pos))
            e = C.llama_embd(h[k].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, H)
            assert C.llama_batch_ext_set_embd_token(be, idx, e)
            C.llama_batch_ext_set_output_logits(be, idx, k == n - 1)
        assert C.llama_process(dft, 1, be) == 0  # LLAMA_PROCESS_TYPE_DECODE
        logits = np.ctypeslib.as_array(C.llama_get_logits_ith(dft, -1), shape=(V,)).copy()  # [V]
    finally:
        C.llama_batch_ext_free(be)
        C.llama_batch_free(b)
        C.llama_free(dft)
        C.llama_free(ctx)
        C.llama_model_free(model)
    return h, logits
