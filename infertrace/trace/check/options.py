"""The run's options against its steps and config: speculation, draft layers, the layers named, quant
kernels the chooser returns, ``kv.dtype``.
"""

from __future__ import annotations

from typing import Any

from infertrace.quant.choice import possible_kernels
from infertrace.trace.check.base import _d, _int, KV_DTYPE_NAMES, _show


def options_problem(m: dict[str, Any]) -> str | None:
    """What in the run's options contradicts its steps or config, else None: verify rows (a batch
    row's ``spec``) while ``options.settings.speculative`` says no speculation ran; ``draft_layers``
    not fewer than the model's ``n_layer`` (the draft is the target's first layers)."""
    opts = m.get("options") if isinstance(m.get("options"), dict) else {}
    eng = opts.get("settings") if isinstance(opts.get("settings"), dict) else {}
    n_layer = (m.get("config") or {}).get("n_layer") if isinstance(m.get("config"), dict) else None
    steps = m.get("steps") if isinstance(m.get("steps"), list) else []
    if "speculative" in eng and eng.get("speculative") in (None, False, "off", "none"):
        for st in steps:
            rows = st.get("batch") if isinstance(st, dict) and isinstance(st.get("batch"), list) else []
            if any(isinstance(r, dict) and r.get("spec") for r in rows):
                return (f"step {st.get('step')!r} verifies speculative drafts but options.settings.speculative is "
                        f"{_show(eng.get('speculative'))}")
    dl = eng.get("draft_layers")
    if dl is not None and (not _int(dl) or dl < 1 or (_int(n_layer) and dl >= n_layer)):
        return f"options.settings.draft_layers {_show(dl)} must be 1..n_layer - 1 (n_layer = {_show(n_layer)})"
    return None


def layers_problem(m: dict[str, Any]) -> str | None:
    """What names a layer the model does not have, else None: ``config.n_layer`` not a positive int;
    ``options.layer``, ``store.tensor_layers``, a step's ``kv.layer_view.layer`` outside 0..n_layer-1;
    a step's ``kv.layers`` (the layers the cache holds) other than n_layer (a model without linear layers)."""
    cfg = m.get("config") if isinstance(m.get("config"), dict) else {}
    n = cfg.get("n_layer")
    if not (_int(n) and n > 0):
        return f"config.n_layer {_show(n)} is not a positive layer count"
    opts = m.get("options") if isinstance(m.get("options"), dict) else {}
    named = [("options.layer", opts.get("layer"))]
    store = m.get("store") if isinstance(m.get("store"), dict) else {}
    named += [("store.tensor_layers", x) for x in (store.get("tensor_layers") or [])]
    for st in m.get("steps") if isinstance(m.get("steps"), list) else []:
        kv = st.get("kv") if isinstance(st, dict) and isinstance(st.get("kv"), dict) else {}
        lv = kv.get("layer_view")
        if isinstance(lv, dict):
            named.append((f"step {st.get('step')!r} kv.layer_view.layer", lv.get("layer")))
        if _int(kv.get("layers")) and not cfg.get("layer_types") and kv["layers"] != n:
            return f"step {st.get('step')!r} kv.layers {kv['layers']} but config.n_layer {n}"
    for what, x in named:
        if x is not None and not (_int(x) and 0 <= x < n):
            return f"{what} {_show(x)} is not a layer 0..{n - 1} of config.n_layer {n}"
    return None


def kernels_problem(m: dict[str, Any]) -> str | None:
    """What in ``options.weights.kernels`` no kernel chooser run could have written, else None: each
    GGUF type's kernels (a comma-joined set when matrices of one type took different kernels) must be
    ones :func:`~infertrace.quant.source.choose_kernel` returns for that type with the run's
    ``options.dtype`` activations, for a shape the int4 tile packs or one it does not."""
    opts = _d(m.get("options"))
    w = _d(opts.get("weights"))
    ks = w.get("kernels")
    if not isinstance(ks, dict) or not ks:
        return None
    if w.get("weights") != "quant":
        return f"options.weights.kernels are listed but options.weights.weights is {w.get('weights')!r}, not quant"
    dt = opts.get("dtype")
    if dt not in ("float32", "bfloat16", "float16"):
        return f"options.dtype {str(dt)[:20]!r} is not a compute dtype (float32, bfloat16, float16)"
    for t, k in ks.items():
        can = possible_kernels(t, dt)
        if not can:
            return f"options.weights.kernels names GGUF type {t[:20]!r}, which has no quantised kernel"
        got = set(str(k).split(","))
        if not got <= can:
            return (f"options.weights.kernels[{t[:20]!r}] is {str(k)[:40]!r}, but the kernel chooser returns "
                    f"{' or '.join(sorted(can))} for {t} with {opts.get('dtype')} activations")
    return None


# ----------------------------------------------------------------------------- dtype, kernels
def kv_dtype_rules(c: Any, s: int, st: dict) -> None:
    """``kv.dtype`` against the options (module docstring)."""
    kv = _d(st.get("kv"))
    opts = _d(c.m.get("options"))
    from infertrace.runtimes.api import REGISTRY

    runtime = REGISTRY.get(str(c.m.get("runtime") or "infertrace"))
    if isinstance(opts.get("llama_cpp"), dict):  # llama.cpp's cache type (type_k), as the context reports it
        kd = _d(opts.get("llama_cpp")).get("type_k")
        want = KV_DTYPE_NAMES.get(kd)
    elif runtime is not None and runtime.kv_dtype:  # a runtime whose cache dtype is ours to set (--kv-dtype)
        kd = _d(opts.get("settings")).get("kv_dtype")
        want = KV_DTYPE_NAMES.get(kd) if kd is not None else opts.get("dtype")
    else:
        return
    if "dtype" not in kv:
        return
    c.n_checks += 1
    if want is not None and kv["dtype"] != want:
        c.fail(s, None, "kv", "kv dtype as configured", f"kv.dtype is {str(kv['dtype'])[:20]!r} but options give "
               + (f"kv_dtype {kd!r} = {want}" if kd is not None else f"no kv_dtype: the compute dtype {want}"))
