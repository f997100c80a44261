"""Shared pieces of ``infertrace check``: the violation record, value guards, range intervals, what a row
keeps, and the facts the run's header fixes for every step (``run_facts``, ``config_problem``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from infertrace.ranges import ranges_text


@dataclass
class Violation:
    """The first broken invariant: where (step, seq_id, variable) and what."""

    step: int | None
    seq_id: int | None
    variable: str
    rule: str
    detail: str

    def line(self) -> str:
        where = f"step {self.step}" + (f" seq {self.seq_id}" if self.seq_id is not None else "")
        return f"violation: {where} {self.variable}: {self.rule}: {self.detail}"


class _Bad(Exception):
    def __init__(self, v: Violation):
        self.v = v


#: the positions a hybrid step's record lists (capture/hybrid_rec.py MAX_POS): position_ids' columns, inp_pos only up to N
HYBRID_LISTED = 16


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _d(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def _l(x: Any) -> list:
    return x if isinstance(x, list) else []


def _show(v: Any) -> str:
    """A value for a violation line, bounded (the trace is untrusted; the CLI escapes it)."""
    t = repr(v) if not isinstance(v, str) else repr(v)
    return t if len(t) <= 60 else t[:57] + "..."


def _layers(ls: list[int]) -> str:
    return ",".join(map(str, ls)) or "none"


def intervals(text: Any) -> list[tuple[int, int]]:
    """The integer set of a range text (``"0..3,7"``) as merged ascending intervals ``[(0, 3), (7, 7)]``,
    without expanding it (a hostile ``"0..99999999"`` costs nothing); ``"-"`` is ``[]``.

    Raises:
        ValueError: not a string, a malformed part, ``b < a``.
    """
    if not isinstance(text, str) or len(text) > 1 << 20:
        raise ValueError(f"expected range text, got {type(text).__name__}")
    if text == "-":
        return []
    parts = []
    for part in text.split(","):
        a, sep, b = part.strip().partition("..")
        if not (a.isdigit() and (not sep or b.isdigit())) or len(a) > 12 or len(b) > 12:
            raise ValueError(f"bad range {part[:40]!r}")
        lo, hi = int(a), int(b) if sep else int(a)
        if hi < lo:
            raise ValueError(f"bad range {part[:40]!r}")
        parts.append((lo, hi))
    parts.sort()
    out: list[tuple[int, int]] = []
    for lo, hi in parts:
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def intervals_of(values: list[int]) -> list[tuple[int, int]]:
    """:func:`intervals` of a list of ints."""
    return intervals(ranges_text(sorted(set(values))))


def kept_len(r: dict[str, Any]) -> int:
    """Positions a request holds after its step: ``C + T``, or ``C + accepted path`` after a verify."""
    sp = r.get("spec")
    if isinstance(sp, dict) and isinstance(sp.get("accepted_nodes"), list):
        return r["C"] + len(sp["accepted_nodes"])
    return r["C"] + r["T"]


def run_facts(m: dict[str, Any]) -> dict[str, Any]:
    """What the run's header fixes for every step (the facts the recorder wrote the steps from):
    ``n_layer``; the window ``W`` (``config.sliding_window``, 0 when no layer is windowed) and the
    windowed layers (``config.swa_layers``: ModelConfig.windowed_layers); ``layer_types`` (hybrid
    models) and the KV pool the options configure (``pool``, ``pool_src``)."""
    cfg = m.get("config") if isinstance(m.get("config"), dict) else {}
    n_layer = cfg.get("n_layer") if _int(cfg.get("n_layer")) else 0
    sw = cfg.get("sliding_window")
    flags = cfg.get("swa_layers") if isinstance(cfg.get("swa_layers"), list) else []
    W = sw if _int(sw) and sw > 0 else 0
    win = [i for i in range(min(n_layer, len(flags))) if flags[i] is True] if W else []
    lt = cfg.get("layer_types") if isinstance(cfg.get("layer_types"), list) else None
    opts = m.get("options") if isinstance(m.get("options"), dict) else {}
    eng = opts.get("settings") if isinstance(opts.get("settings"), dict) else {}
    vl = opts.get("vllm") if isinstance(opts.get("vllm"), dict) else None
    pool: dict[str, Any] = {}
    B, nb, ctx = eng.get("tokens_per_block"), eng.get("num_blocks"), eng.get("ctx_size")
    if vl is not None:  # --runtime vllm: vLLM's own pool (block 0 its null block)
        pool = {"num_blocks": vl.get("num_blocks") if _int(vl.get("num_blocks")) else None,
                "tokens_per_block": vl.get("block_size") if _int(vl.get("block_size")) else None}
        src = "options.vllm num_blocks / block_size"
    else:
        if _int(B) and B > 0:
            pool["tokens_per_block"] = B
            pool["num_blocks"] = nb if _int(nb) else (-(-ctx // B) if _int(ctx) else None)
        ns = eng.get("n_seq_max")
        if _int(ctx) and eng.get("kv_unified") is False and _int(ns) and ns > 0:
            # --kv-unified off: n_seq_max streams of llama.cpp's n_ctx_seq = pad256(pad256(ctx) / n_seq_max) cells
            pool["size"] = ns * (-(-((-(-ctx // 256) * 256) // ns) // 256) * 256)
        elif _int(ctx):
            pool["size"] = ctx
        src = ("options.settings num_blocks / tokens_per_block" if _int(nb)
               else "options.settings ctx_size / tokens_per_block, rounded up, or ctx_size (--kv-unified off: n_seq_max × "
               "pad256(pad256(ctx_size) / n_seq_max))")
    return {"n_layer": n_layer, "W": W if win else 0, "windowed": win, "layer_types": lt, "pool": pool, "pool_src": src}


def config_problem(m: dict[str, Any]) -> str | None:
    """What in the run's config cannot describe a model, else None: ``swa_layers`` not one flag per
    layer, ``layer_types`` not one of linear_attention / full_attention per layer, a window on no layer's
    flag list."""
    cfg = m.get("config") if isinstance(m.get("config"), dict) else {}
    n = cfg.get("n_layer")
    flags, lt, sw = cfg.get("swa_layers"), cfg.get("layer_types"), cfg.get("sliding_window")
    if sw is not None and not (_int(sw) and sw >= 0):
        return f"config.sliding_window {_show(sw)} is not a window size in tokens"
    if flags is not None and (not isinstance(flags, list) or any(not isinstance(x, bool) for x in flags)
                              or (flags and len(flags) != n)):
        return f"config.swa_layers must be one true/false flag per layer (n_layer = {_show(n)})"
    if lt is not None and (not isinstance(lt, list) or len(lt) != n
                           or any(t not in ("linear_attention", "full_attention") for t in lt)):
        return f"config.layer_types {_show(lt)} must be n_layer = {_show(n)} entries of linear_attention / full_attention"
    return None


#: ``--kv-dtype`` names (llama.cpp cache types) -> the torch dtype names the trace records
KV_DTYPE_NAMES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
