"""Rich rendering of a ``dump-kv`` dict (:mod:`infertrace.trace.kv_dump`): the cache right after one step.

A pure function of the dict (live run or saved trace render the same way). ``cells``: header
like llama.cpp's ``find_slot`` debug print (``n``/used/head/size), one line per stretch of
cells, a character map (``.`` empty, seq_id, ``M`` several owners), per-seq pos min/max.
``paged``: pool usage, free list head, per-request block tables with the positions each block
holds, the step's slot mapping. Then the K/V values when the dict has them.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.text import Text

from infertrace.ranges import ranges_text
from infertrace.fmt import human_bytes
from infertrace.present.render import DIM, _facts, _table, floats
from infertrace.trace.schema import N_KV_PAD_MAX

_ITEM = {"float32": 4, "bfloat16": 2, "float16": 2}


def _storage_line(d: dict[str, Any]) -> str:
    s, L = d["physical_shape"], d["n_layer"]
    n = 1
    for x in s:
        n *= x
    item = _ITEM.get(d["dtype"], 4)
    if d["backend"] == "cells":
        per = n * 2 * item
        return (f"k_l, v_l per layer [{s[0]} cells, {s[1]} kv heads, {s[2]}] {d['dtype']} × {L} layers "
                f"({human_bytes(per)} per layer, {human_bytes(per * L)} in all)")
    per = n * item
    return (f"pool per layer [{s[0]} blocks, 2 (K,V), {s[2]} kv heads, {s[3]} tokens/block, {s[4]}] {d['dtype']} × {L} layers "
            f"({human_bytes(per)} per layer, {human_bytes(per * L)} in all)")


def _window_line(d: dict[str, Any]) -> Text | None:
    """Which layers are windowed and what that means for this cache (None: no windowed layer)."""
    ph = d.get("physical") or {}
    if d["backend"] == "cells":
        W, layers = int(ph.get("n_swa") or 0), list(ph.get("swa_layers") or [])
    else:
        aw = ph.get("attention_window") or {}
        layers = sorted(int(k) for k in aw)
        W = int(next(iter(aw.values()))) if aw else 0
    if not W or not layers:
        return None
    sp = ph.get("swa_pool") if d["backend"] == "cells" else None
    if sp:  # llama.cpp's iSWA cache (kv/iswa.py)
        how = (f"windowed layers live in a separate SWA pool of {sp['size']} cells (used {sp['used']}, head {sp['head']}, "
               f"n_kv {sp['n_kv']}) and read kq_mask_swa over it; a cell that left every window is reused; the others read "
               "kq_mask over this pool")
    elif d["backend"] == "cells":
        how = "one cell pool; windowed layers read kq_mask_swa (cells with pos_q - pos >= n_swa dropped), the others kq_mask"
    else:
        how = "windowed layers get attention_window_size in the metadata; blocks stay allocated"
    return Text(f"layers {ranges_text(layers)} windowed, W={W}: query at p sees keys p-W+1..p (as HF and llama.cpp); {how}",
                style="magenta")


def _batch_line(d: dict[str, Any]) -> Text:
    if d["idle"]:
        return Text("idle: nothing scheduled (waiting for arrivals), nothing written", style=DIM)
    where = "cells" if d["backend"] == "cells" else "slots"
    by = {w["seq_id"]: w for w in d["writes"]}
    parts = []
    for b in d["batch"]:
        w = by.get(b["seq_id"], {})
        parts.append(f"seq {b['seq_id']} {b['phase']} C={b['C']} T={b['T']} pos {ranges_text(w.get('pos', []))} "
                     f"→ {where} {ranges_text(w.get(where, []))}")
    n = sum(b["T"] for b in d["batch"])
    return Text(f"N={n}: " + " · ".join(parts))


def _cells_view(d: dict[str, Any]) -> list[RenderableType]:
    ph, lay = d["physical"], d["layout"]
    if ph.get("streams") is not None:  # non-unified KV: the streams' heads, then the map of the global rows
        from infertrace.present.render_streams import streams_state

        line = (f"size {ph['size']} ({ph.get('n_stream')} streams × {ph.get('stream_size')}) · used {ph['used']} · "
                f"head, used_max_p1 and n_kv per stream (above; a stream's n_kv is its used_max_p1 padded to a "
                f"multiple of {N_KV_PAD_MAX}, at least {N_KV_PAD_MAX}, at most the stream size; the graph reads the "
                "largest of the ubatch's streams)")
        parts0: list[RenderableType] = [streams_state(d["physical"])]
    else:
        line = (f"size {ph['size']} · used {ph['used']} · head {ph.get('head_before', ph['head'])} → "
                f"{ph.get('head_after', ph['head'])} · n = used_max_p1 {lay['used_max_p1']} · n_kv {ph['n_kv']} "
                f"(cells the graph reads: used_max_p1 padded to a multiple of {N_KV_PAD_MAX}, at least "
                f"{N_KV_PAD_MAX}, at most size)")
        parts0 = []
    parts: list[RenderableType] = parts0 + [_facts([("cells", line)])] + _layout_parts(lay)
    seqs = ph.get("seqs", {})
    if ph.get("prefix_cache"):  # kv/prefix_cache.py: finished sequences keep their cells for reuse
        parts.append(Text(f"prefix cache: retained (finished, reusable) seqs {ph.get('retained', [])}; a cell with "
                          "several seq_ids is shared (seq_cp), freed when its last owner goes", style="italic"))
    if seqs:
        parts.append(_facts([(f"seq {s}", f"cells {v['cells']} · pos {v['pos']}") for s, v in seqs.items()],
                            label_style="bold cyan"))
    return parts


def _layout_parts(lay: dict[str, Any], cell_word: str = "cells") -> list[RenderableType]:
    """The stretches table and the character map of a :func:`~infertrace.trace.kv_dump.cells_layout`."""
    t = _table(cell_word, "seq_id", "pos", "")
    for s in lay["stretches"]:
        if not s["seq_ids"]:
            t.add_row(s["cells"], Text("empty", style=DIM), Text("-", style=DIM),
                      Text(f"({s['last'] - s['first'] + 1} cells)", style=DIM))
        else:
            t.add_row(s["cells"], ",".join(str(x) for x in s["seq_ids"]), s["pos"], "")
    parts: list[RenderableType] = [
        Text(f"stretches (consecutive {cell_word} with the same owner and consecutive positions):", style="italic"), t]
    m = lay["map"]
    g = Text(f"cell map, {cell_word} 0..{lay['map_cells'] - 1} ('.' empty, seq_id, M = several seqs):\n", style="italic")
    for i in range(0, len(m), 64):
        g.append(f"  {i:>5} ", style=DIM)
        line = m[i:i + 64]
        for j in range(0, len(line), 8):
            for ch in line[j:j + 8]:
                g.append(ch, style=DIM if ch == "." else "bold cyan")
            g.append(" ")
        g.append("\n")
    g.rstrip()
    if lay.get("map_cells_total", lay["map_cells"]) > lay["map_cells"]:
        g.append(f"\n  … {lay['map_cells_total'] - lay['map_cells']} more cells not drawn", style=DIM)
    parts.append(g)
    return parts


def _paged_view(d: dict[str, Any]) -> list[RenderableType]:
    ph = d["physical"]
    B = ph["tokens_per_block"]
    reqs = ph.get("requests", {})
    tokens = sum(v["len"] for v in reqs.values())
    parts: list[RenderableType] = [_facts([
        ("pool", f"{ph['used_blocks']} / {ph['num_blocks']} blocks used · {ph['free_blocks']} free · "
                 f"tokens_per_block {B} · {tokens} tokens in {ph['used_blocks'] * B} reserved slots"),
        ("free list", f"head {ph['free_list_head']}{' …' if ph['free_blocks'] > len(ph['free_list_head']) else ''} "
                      + ("(next blocks handed out, least recently freed first; a hashed block is evicted when handed out)"
                       if ph.get("prefix_cache") else "(next blocks handed out, lowest id first)")),
    ])]
    t = _table("seq", "len", "block table", "block: logical positions")
    for s, v in reqs.items():
        t.add_row(s, str(v["len"]), str(v["block_table"]), " · ".join(f"{b['block']}: {b['pos']}" + _block_note(b) for b in v["blocks"]))
    if not reqs:
        t.add_row("-", "", "", Text("no request holds blocks", style=DIM))
    parts += [Text("block tables (block offsets per request):", style="italic"), t]
    if ph.get("prefix_cache"):  # kv/prefix_cache.py: hashed full blocks, ref counts, LRU free queue
        parts.append(Text(f"prefix cache: {ph.get('cached_blocks', 0)} hashed full blocks can be hit, "
                          f"{ph.get('cached_free_blocks', 0)} of them in the free queue (no owner; evicted least recently "
                          "freed first); (ref n) = owners of a shared block, #hash = its content hash", style="italic"))
    if d["writes"]:
        sm = _table("seq", "pos", "slot", "= block·B + offset")
        for w in d["writes"]:
            for p, slot in zip(w["pos"], w["slots"]):
                sm.add_row(str(w["seq_id"]), str(p), str(slot), f"{slot // B}·{B} + {slot % B}")
        parts += [Text(f"slot mapping of step {d['step']}'s writes: slot(p) = table[p // B]·B + p % B", style="italic"), sm]
    return parts


def _values_view(d: dict[str, Any]) -> RenderableType:
    v = d["values"]
    loc = "cell" if d["backend"] == "cells" else "slot"
    what = "all" if v["full"] else f"first {v['n_values']}"
    src = {"trace": "recorded in the trace", "state file": "as saved in the llama.cpp state file, dequantised to float32"}.get(
        v.get("source"), "read back from the backend at its physical location")
    loc = "row" if v.get("source") == "state file" else loc
    kcol = "K (after RoPE)" if v.get("source") == "state file" else "K (rotated)"  # a state file: Hadamard undone too
    t = _table("seq", "pos", loc, f"{kcol}, {what} values", f"V, {what} values")
    for r in v["requests"]:
        for row in r["rows"]:
            t.add_row(str(r["seq_id"]), str(row["pos"]), str(row.get(loc, row.get("cell", "-"))), floats(row["k"]), floats(row["v"]))
    t.columns[3].overflow = t.columns[4].overflow = "fold"
    return Group(Text(f"K/V values: layer {v['layer']}, kv head {v['head']} ({src})", style="italic"), t)


def _block_note(b: dict[str, Any]) -> str:
    """`` (ref 2) #3f9a0c`` for a shared / hashed block (prefix cache), else nothing."""
    out = f" (ref {b['ref']})" if isinstance(b.get("ref"), int) and b["ref"] > 1 else ""
    return out + (f" #{str(b['hash'])[:6]}" if b.get("hash") else "")


def render_kv_dump(console: Console, d: dict[str, Any]) -> None:
    """Print a dump dict (from :func:`infertrace.runner.dump_kv_at_step` or
    :func:`infertrace.trace.kv_dump.dump_from_step`) as one panel: storage and step facts, the
    window line, the cells map and stretches (as llama.cpp's ``LLAMA_KV_CACHE_DEBUG`` print) or
    the pool, free list and block tables (TensorRT-LLM ``KVCacheManager``), then K/V values when
    the dict has them. Pure function of the dict; the CLI passes a
    :class:`infertrace.safe_text.SafeConsole`, which makes control characters visible."""
    be = d["backend"]
    conv = "llama.cpp-style cells" if be == "cells" else "TensorRT-LLM/vLLM-style paged pool"
    facts = [("storage", _storage_line(d)), (f"step {d['step']}", _batch_line(d))]
    win = _window_line(d)
    if win:
        facts.append(("window", win))
    parts: list[RenderableType] = [_facts(facts)]
    parts += _cells_view(d) if be == "cells" else _paged_view(d)
    if d.get("finished"):
        freed = "cells" if be == "cells" else "blocks"
        parts.append(Text(" · ".join(f"seq {s} finished ({r})" for s, r in d["finished"].items())
                          + f": its {freed} are freed right after this step (shown here still held)", style="yellow"))
    if d.get("values"):
        parts.append(_values_view(d))
    rs = (d.get("physical") or {}).get("recurrent_cells")
    if rs:  # --runtime llama.cpp on a hybrid model: llama_memory_recurrent's cells per ubatch of the step
        parts.append(Text("llama.cpp recurrent cells (build_rs): " + " · ".join(
            f"ubatch {r['ubatch']}: cells {r.get('head', '?')}..{r.get('head', 0) + r.get('n_rs', 1) - 1} (head, n_rs "
            f"{r.get('n_rs', '?')}), rs_z {r['rs_z']} (the cell zeroed for new sequences; -1 none), s_copy {r['s_copy']} "
            "(the cell each reads its state from)" for r in rs[:8]), style="magenta"))
    if isinstance(d.get("state"), dict):  # hybrid models: the fixed-size GDN state beside the growing KV
        from infertrace.present.render_hybrid import state_view

        parts += state_view(d["state"])
    console.print(Panel(Group(*parts), title=Text.assemble((f"kv cache after step {d['step']}", "bold"), f" · {be} ({conv})"),
                        title_align="left", box=box.ROUNDED))



def render_state_dump(console: Console, d: dict[str, Any]) -> None:
    """Print a ``dump-kv --state`` dict (:func:`infertrace.runtimes.llamacpp.state_dump.state_dump`): the
    file's facts, per stream its cells (stretches and map as for a trace, rows of the file: llama.cpp
    saves no cell indices) and per sequence the positions it holds, then K/V values as dump-kv shows
    them. Pure function of the dict."""
    toks = d["tokens"]
    shown = ", ".join(str(t) for t in toks[:16]) + (f", … ({len(toks)} in all)" if len(toks) > 16 else "")
    facts = [("file", f"{d['file']} · {human_bytes(d['bytes'])} · llama.cpp sequence state ('ggsq' v{d['version']})"),
             ("tokens", f"{len(toks)} saved with the slot: [{shown}]"),
             ("storage", f"{d['n_layer']} layers · K {d['types']['k']} · V {d['types']['v']} · [{d['n_kv_heads']} kv heads, "
                         f"{d['head_dim']}] per cell")]
    for name, pc in d["pools"].items():
        what = {"kv": "", "base": "base cache (full-attention layers): ", "swa": "SWA cache (windowed layers): "}.get(name, "")
        facts.append(("cache" if name == "kv" else name,
                      f"{what}layers {pc['layers']} · {pc['n_cells']} cells saved · {pc['n_stream']} stream(s)"))
    n_main = next(iter(d["pools"].values()))["n_cells"] if d["pools"] else 0
    if n_main != len(toks):
        facts.append(("note", Text(f"{n_main} cells for {len(toks)} tokens: the cache does not hold exactly the "
                                   "saved tokens (a token not yet decoded, or cells removed)", style="yellow")))
    if "swa" in d["pools"]:
        facts.append(("window", Text("the SWA cache saves only the cells still inside a sequence's window "
                                     "(llama_kv_cache::state_write skips is_masked_swa cells)", style="magenta")))
    parts: list[RenderableType] = [_facts(facts)]
    for s in d["streams"]:
        v = "transposed (V^T per channel: no flash attention)" if s["v_trans"] else "rows (flash attention)"
        label = f"stream {s['stream']}" if s.get("pool", "kv") == "kv" else f"{s['pool']} stream {s['stream']}"
        parts.append(_facts([(label, f"{s['n_cells']} cells in the file · V stored as {v} · a row "
                              "number is the cell's order in the file (llama.cpp saves no cell index)")]))
        parts += _layout_parts(s["layout"], "rows")
        parts.append(_facts([(f"seq {k}", f"rows {x['cells']} · pos {x['pos']}") for k, x in s["seqs"].items()],
                            label_style="bold cyan"))
    if not d["streams"]:
        parts.append(Text("the file holds no cells (the slot was empty when saved)", style=DIM))
    if d.get("values"):
        parts.append(Text(f"K order: {d['k_order']}", style=DIM))
        rot = d.get("attn_rot") or {}
        if rot.get("k") or rot.get("v"):
            parts.append(Text(f"llama.cpp stored this quantised cache rotated (Hadamard, K blocks of {rot.get('k') or '-'}, "
                              f"V blocks of {rot.get('v') or '-'}); shown un-rotated. A server run with "
                              "LLAMA_ATTN_ROT_DISABLE=1 did not rotate: set it here too", style="yellow"))
        parts.append(_values_view({**d, "backend": "cells"}))
    console.print(Panel(Group(*parts), title=Text.assemble(("llama.cpp slot state", "bold"), " · cells"),
                        title_align="left", box=box.ROUNDED))
