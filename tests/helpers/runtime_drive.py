"""A small driver for any :class:`~infertrace.runtimes.api.Runtime` until the one loop
(``infertrace/runtimes/loop.py::record_run``) lands: add every request, ``step()`` until None, build the
:class:`~infertrace.trace.records.RunTrace` from ``header()`` / ``requests()``. Test-only."""

from __future__ import annotations

from typing import Any

from infertrace.engine.drive import EncodedRequest
from infertrace.engine.options import EngineOptions, SamplingParams
from infertrace.loading.model import model_identity
from infertrace.runtimes.api import RunSettings, runtime_class
from infertrace.trace.records import VARIABLES, RunTrace


def record(name: str, loaded: Any, prompts: list[list[int]], max_new_tokens: int = 3, native: dict | None = None,
           layer: int = 0, params: SamplingParams | list[SamplingParams] | None = None, **kw: Any) -> RunTrace:
    """Run ``prompts`` (token ids) through runtime ``name`` and return its trace (``params``: one for all, or one
    per prompt; ``kw`` go to the runtime)."""
    cls = runtime_class(name)
    settings = RunSettings(opts=EngineOptions(), layer=layer, show=VARIABLES, native=native or {})
    rt = cls(loaded, settings, **kw)
    try:
        ps = params if isinstance(params, list) else [params or SamplingParams(max_new_tokens=max_new_tokens)] * len(prompts)
        for ids, p in zip(prompts, ps):
            rt.add_request(EncodedRequest(list(ids), p, 0, ""))
        steps = []
        while (rec := rt.step()) is not None:
            if cls.info.native and rec.native is not None:
                setattr(rec.trace, cls.info.native, dict(rec.native))
            steps.append(rec.trace)
        h = rt.header()
        options = {"backend": h.backend, "attention": h.attention, "dtype": settings.dtype, "device": settings.device,
                   "settings": dict(h.settings), "layer": h.layer if h.layer is not None else layer,
                   "show": list(settings.show), **dict(h.options)}
        return RunTrace(model=model_identity(loaded.ckpt), config=loaded.config.to_dict(), options=options,
                        notes=list(loaded.ckpt.notes) + list(h.notes), steps=steps, requests=rt.requests(), runtime=name)
    finally:
        rt.close()
