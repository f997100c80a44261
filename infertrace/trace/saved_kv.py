"""``dump-kv --step N DIR``: the KV cache after step N of a *saved* trace, as the same dump dict
a live ``dump-kv`` builds (:mod:`infertrace.trace.kv_dump`), so one renderer prints both.

The layout (cell map or block tables, writes) comes from the step record
(:func:`infertrace.trace.kv_dump.dump_from_step`, ``KVRec.physical``). K/V values for ``--layer`` /
``--head`` come from the saved tensors (``step{N}/layer{L}/seq{S}/k_cache``, ``v_cache``:
every request's cache after the step, by position), placed at their physical cell or slot;
a trace saved with ``--keep summary`` has none, and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from infertrace.errors import InfertraceError
from infertrace.trace.kv_dump import dump_from_step
from infertrace.trace.store import load_tensors, read_manifest, trace_from_manifest


def values_from_tensors(tt: Any, st: Any, layer: int, head: int, positions: Sequence[int] | None, full: bool,
                        n_first: int = 4) -> dict[str, Any]:
    """K/V rows of kv head ``head`` in ``layer`` for every request cached after step ``st``,
    in the shape :func:`infertrace.capture.kv_views.read_values` returns (``source = "trace"``).

    Args:
        tt: the trace's :class:`~infertrace.trace.store.TraceTensors`; ``step{N}/layer{L}/seq{S}/k_cache``
            and ``v_cache`` are ``[len, n_kv_heads, head_dim]`` (the request's cache after step N, by
            position; float32, float16, or bfloat16 read as float32).
        st: the :class:`~infertrace.trace.records.StepTrace` (its ``kv.physical`` places each
            position at its cell, or slot ``= block * tokens_per_block + offset``).
        positions: logical positions (None = all cached); ``full``: all ``head_dim`` values,
            else the first ``n_first``.

    Returns:
        ``{"layer", "head", "full", "n_values", "source": "trace", "requests": [{"seq_id", "len",
        "rows": [{"pos", "cell"|"slot", "block", "offset", "k": [float], "v": [float]}]}]}``.

    Raises:
        InfertraceError: the layer was not kept, head out of range, positions not cached.
    """
    from infertrace.ranges import ranges_text

    pre = f"step{st.step}/layer{layer}/"
    names = [n for n in tt.names(pre) if n.endswith("/k_cache")]
    if not names:
        kept = ", ".join(map(str, tt.layers)) or "none"
        raise InfertraceError(f"layer {layer} was not kept in this trace (tensors kept for layers {kept}); "
                              f"re-save with --layers {layer}")
    ph = st.kv.physical if st.kv is not None else {}
    where: dict[tuple[int, int], dict[str, int]] = {}
    if ph.get("kind") == "cells":
        for c in ph.get("cells", []):
            for s in c["seq_ids"]:
                where[(s, c["pos"])] = {"cell": c["cell"]}
    elif ph.get("kind") == "paged":
        B = int(ph["tokens_per_block"])
        for s, r in ph.get("requests", {}).items():
            for p in range(int(r["len"])):
                b = r["block_table"][p // B]
                where[(int(s), p)] = {"slot": b * B + p % B, "block": b, "offset": p % B}
    wanted = None if positions is None else set(positions)
    reqs, n_values = [], n_first
    for n in sorted(names, key=lambda x: int(x[len(pre) + 3:].split("/")[0])):
        sid = int(n[len(pre) + 3:].split("/")[0])
        k, v = tt.array(n), tt.array(n[: -len("k_cache")] + "v_cache")  # [len, n_kv, hd] numpy
        if k.ndim != 3 or tuple(v.shape) != tuple(k.shape):
            raise InfertraceError(f"{n}: k_cache {list(k.shape)} / v_cache {list(v.shape)} are not two [len, n_kv_heads, "
                                  "head_dim] tensors of one shape; the trace is damaged, re-save it")
        if not 0 <= head < k.shape[1]:
            raise InfertraceError(f"--head {head} out of range: the cache holds kv heads 0..{k.shape[1] - 1}")
        n_values = k.shape[2] if full else min(n_first, k.shape[2])
        rows = []
        for p in range(k.shape[0]):
            if wanted is not None and p not in wanted:
                continue
            rows.append({"pos": p, **where.get((sid, p), {}), "k": k[p, head, :n_values].astype("float32").tolist(),
                         "v": v[p, head, :n_values].astype("float32").tolist()})
        reqs.append({"seq_id": sid, "len": int(k.shape[0]), "rows": rows})
    if positions is not None and reqs and not any(r["rows"] for r in reqs):
        lens = ", ".join(f"seq {r['seq_id']}: 0..{r['len'] - 1}" for r in reqs)
        raise InfertraceError(f"--positions {ranges_text(positions)}: no request has those positions cached at this step ({lens})")
    return {"layer": layer, "head": head, "full": full, "n_values": n_values, "source": "trace", "requests": reqs}


def dump_saved(directory: str | Path, step: int, layer: int | None = None, head: int | None = None,
               positions: Sequence[int] | None = None, full: bool = False) -> dict[str, Any]:
    """The dump dict of step ``step`` of the trace saved in ``directory``.

    Without ``layer``/``head`` the values are those the record kept (``KVRec.layer_view``);
    with either, they are read from the saved tensors.

    Raises:
        InfertraceError: broken trace, step not in the trace, no kv record, ``--keep summary``
            trace asked for values, layer not kept.
    """
    m = read_manifest(directory)
    trace = trace_from_manifest(m, str(Path(directory) / "trace.json"))
    st = next((s for s in trace.steps if s.step == step), None)
    if st is None:
        have = f"0..{trace.steps[-1].step}" if trace.steps else "none"
        raise InfertraceError(f"step {step} out of range: the trace has steps {have}")
    d = dump_from_step(st)
    tt = load_tensors(directory, m)  # checked even when no value is asked for: a truncated file is reported
    if layer is not None or head is not None:
        if tt is None:
            raise InfertraceError(f"{directory} was saved with --keep summary: it holds no K/V values; re-run with "
                                  "--save DIR --keep tensors --layers L, or run dump-kv live with the same options")
        d["values"] = values_from_tensors(tt, st, layer or 0, head or 0, positions, full)
    elif tt is not None and st.kv is not None:  # tensors kept: show every cached position of the record's layer
        try:
            d["values"] = values_from_tensors(tt, st, (st.kv.layer_view or {}).get("layer", 0), 0, positions, full)
        except InfertraceError:
            pass  # that layer's tensors were not kept: keep the record's values
    d["attention"] = st.attention
    return d
