"""``infertrace inspect MODEL``: what the loader sees in a GGUF file or HF directory.

Architecture and name, every :class:`~infertrace.model.config.ModelConfig` field, the
tokenizer facts (model, pre-tokenizer, vocabulary, BOS/EOS/EOG, add_bos, chat template),
the load notes (Q/K un-permutation) and the tensor table with totals per type. Loads through
:func:`infertrace.loading.weights.load_checkpoint`, so it reports exactly what ``run`` would use
and fails with the same one-line errors.
"""

import re
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Annotated, Any

import typer
from rich import box
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from infertrace.cli.common import progress_display, stdout_console
from infertrace.ranges import ranges_text
from infertrace.safe_text import visible, json_text
from infertrace.fmt import human_bytes
from infertrace.present.render import piece_text

if TYPE_CHECKING:
    from infertrace.loading.weights import Checkpoint, TensorInfo

HELP = "Show a model's architecture, config, tokenizer, load notes and tensor table (GGUF file or HF directory)."

_BLK = re.compile(r"^blk\.([0-9]{1,9})\.(.+)$|^model\.layers\.([0-9]{1,9})\.(.+)$")  # ASCII digits: int() takes them all


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def tokenizer_facts(tok: Any) -> dict[str, Any]:
    """JSON-ready tokenizer summary; ids come with their vocabulary text."""
    def named(i: Any) -> Any:
        return None if i is None else {"id": int(i), "text": tok.token_text(int(i))}

    tmpl = getattr(tok, "chat_template", None)
    return {
        "model": tok.model, "pre": tok.pre, "algorithm": getattr(tok, "algorithm", None), "vocab_size": tok.vocab_size,
        "bos": named(tok.bos_id), "eos": named(tok.eos_id), "eog": [named(i) for i in sorted(tok.eog_ids)],
        "add_bos": tok.add_bos, "add_space_prefix": getattr(tok, "add_space_prefix", None),
        "chat_template": bool(tmpl), "chat_template_chars": len(tmpl) if tmpl else 0,
        "warnings": list(getattr(tok, "warnings", []) or []),
    }


def type_totals(tensors: list["TensorInfo"]) -> list[dict[str, Any]]:
    """Per tensor type: count, elements, bytes and bits per weight (largest first)."""
    tot: dict[str, dict[str, Any]] = {}
    for t in tensors:
        d = tot.setdefault(t.type, {"type": t.type, "tensors": 0, "elements": 0, "bytes": 0})
        d["tensors"] += 1
        d["elements"] += _numel(t.shape)
        d["bytes"] += t.n_bytes
    for d in tot.values():
        d["bits_per_weight"] = round(8 * d["bytes"] / d["elements"], 3) if d["elements"] else 0.0
    return sorted(tot.values(), key=lambda d: -d["bytes"])


def grouped_tensors(tensors: list["TensorInfo"]) -> list[tuple[str, "TensorInfo", int]]:
    """Collapse per-layer tensors with the same suffix, type and shape into one row
    ``blk.{0..29}.attn_q.weight``; returns ``(display name, example, count)`` in file order."""
    groups: dict[tuple, list[int]] = {}
    order: list[tuple] = []
    first: dict[tuple, "TensorInfo"] = {}
    for t in tensors:
        m = _BLK.match(t.name)
        if m:
            layer, suffix = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
            prefix = "blk" if m.group(1) is not None else "model.layers"
            key = (prefix, suffix, t.type, tuple(t.shape))
            if key not in groups:
                groups[key], first[key] = [], t
                order.append(key)
            groups[key].append(int(layer))
        else:
            key = (t.name,)
            groups[key], first[key] = [], t
            order.append(key)
    rows = []
    for key in order:
        if len(key) == 1:
            rows.append((key[0], first[key], 1))
        else:
            rows.append((f"{key[0]}.{{{ranges_text(groups[key])}}}.{key[1]}", first[key], len(groups[key])))
    return rows


def inspect_facts(ck: "Checkpoint") -> dict[str, Any]:
    """Everything ``inspect`` shows, JSON-ready."""
    meta = {k: v for k, v in ck.metadata.items() if not str(k).startswith("tokenizer.chat_template")}
    return {
        "path": str(ck.path), "file": ck.path.name, "format": ck.config.source,
        "format_version": ck.metadata.get("GGUF.version"), "architecture": ck.config.arch, "name": ck.config.name,
        "config": ck.config.to_dict(), "tokenizer": tokenizer_facts(ck.tokenizer), "notes": list(ck.notes),
        "tensors": [{"name": t.name, "type": t.type, "shape": t.shape, "bytes": t.n_bytes} for t in ck.tensors],
        "totals": type_totals(ck.tensors), "metadata": meta,
    }


def _kv_table(rows: list[tuple[str, Any]]) -> Table:
    t = Table(box=None, show_header=False, padding=(0, 1), pad_edge=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    for k, v in rows:
        t.add_row(visible(k), v if isinstance(v, Text) else Text(visible(v)))  # file strings: control chars visible
    return t


_STATUS_STYLE = {"honoured": "green", "not applicable": "dim", "refused": "bold red"}


def settings_table(rows: list[dict[str, Any]]) -> Table:
    """Every forward-pass setting the family layer decided: key, value, honoured / not applicable
    / refused, and how (``ModelConfig.settings``). ``run`` refuses a model with a refused row."""
    n_ref = sum(r["status"] == "refused" for r in rows)
    title = "forward-pass settings" + (f" ({n_ref} refused: run will not start)" if n_ref else " (all honoured or not applicable)")
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1))
    for col in ("setting", "value", "status", "how"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(Text(str(r["key"])), Text(str(r["value"])), Text(r["status"], style=_STATUS_STYLE.get(r["status"], "")),
                  Text(str(r["note"])))
    return t


def render_inspect(console: Any, f: dict[str, Any], all_tensors: bool) -> None:
    """Print the facts of :func:`inspect_facts`."""
    c = f["config"]
    fmt = f"GGUF v{f['format_version']}" if f["format"] == "gguf" else "HF directory (safetensors)"
    console.print(Panel(_kv_table([("architecture", Text(visible(c["arch"]), style="cyan")), ("name", repr(f["name"]) if f["name"] else Text("(not set in the file)", style="dim")),
                                   ("format", fmt), ("path", f["path"])]),
                        title=Text(visible(f["file"]), style="bold"), title_align="left", box=box.ROUNDED))
    cfg_rows = []
    for k, v in c.items():
        if k == "settings":
            continue
        if k == "swa_layers":
            v = ranges_text([i for i, x in enumerate(v) if x]) if any(v) else "-"
            k = "swa_layers (windowed)"
        elif k == "rope_scaling":
            v = ", ".join(f"{a}={b}" for a, b in v.items())
        elif k == "rope_freq_factors" and v is not None:
            v = f"{len(v)} per-pair divisors: {', '.join(f'{x:g}' for x in v[:4])} …"
        cfg_rows.append((k, v))
    tk = f["tokenizer"]

    def named(d: Any) -> str:
        return "-" if d is None else f"{d['id']} {piece_text(d['text'])}"

    tok_rows = [("model", tk["model"]), ("pre", tk["pre"]), ("algorithm", tk["algorithm"]), ("vocab size", tk["vocab_size"]),
                ("bos", named(tk["bos"])), ("eos", named(tk["eos"])), ("eog", ", ".join(named(d) for d in tk["eog"]) or "-"),
                ("add_bos", tk["add_bos"]), ("add_space_prefix", tk["add_space_prefix"]),
                ("chat template", f"present ({tk['chat_template_chars']} chars)" if tk["chat_template"] else "absent")]
    tok_rows += [("warning", w) for w in tk["warnings"]]
    console.print(Panel(_kv_table(cfg_rows), title=Text.assemble(("config", "bold"), " (ModelConfig)"), title_align="left", box=box.ROUNDED))
    console.print(settings_table(c.get("settings", [])))
    console.print(Panel(_kv_table(tok_rows), title=Text("tokenizer", style="bold"), title_align="left", box=box.ROUNDED))
    if f["notes"]:
        console.print(Panel(Group(*[Text("• " + visible(n)) for n in f["notes"]]), title=Text("load notes", style="bold"), title_align="left",
                            box=box.ROUNDED))
    shape_note = "ggml ne order" if f["format"] == "gguf" else "torch order"
    t = Table(title=f"tensors ({len(f['tensors'])}; shape in {shape_note})", title_justify="left", box=box.SIMPLE_HEAD,
              show_edge=False, padding=(0, 1))
    for col, j in (("name", "left"), ("type", "left"), ("shape", "left"), ("bytes each", "right"), ("count", "right")):
        t.add_column(col, justify=j, overflow="fold")
    from infertrace.loading.weights import TensorInfo

    infos = [TensorInfo(d["name"], d["type"], d["shape"], d["bytes"]) for d in f["tensors"]]
    rows = [(i.name, i, 1) for i in infos] if all_tensors else grouped_tensors(infos)
    for name, ti, n in rows:
        t.add_row(Text(visible(name)), visible(ti.type), str(list(ti.shape)), f"{ti.n_bytes:,}", f"×{n}" if n > 1 else "")
    console.print(t)
    tt = Table(title="totals per type", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1))
    for col in ("type", "tensors", "elements", "bytes", "bits/weight"):
        tt.add_column(col, justify="left" if col == "type" else "right")
    for d in f["totals"]:
        tt.add_row(visible(d["type"]), str(d["tensors"]), f"{d['elements']:,}", human_bytes(d["bytes"], 2), f"{d['bits_per_weight']:.2f}")
    tt.add_row("all", str(len(infos)), f"{sum(d['elements'] for d in f['totals']):,}",
               human_bytes(sum(d["bytes"] for d in f["totals"]), 2), "", style="bold")
    console.print(tt)


def inspect(
    model: Annotated[Optional[Path], typer.Argument(help="GGUF file, HF model directory, or a model name: smollm2-135m (default), gemma3-270m.", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the facts as JSON on stdout.")] = False,
    all_tensors: Annotated[bool, typer.Option("--all-tensors", help="One row per tensor instead of per-layer groups.")] = False,
) -> None:
    """Load ``model`` as ``run`` would (same one-line errors) and print what the loader saw."""
    from infertrace.loading.registry import resolve_model
    from infertrace.loading.weights import load_checkpoint  # numpy/gguf: only when run

    with progress_display(enabled=not as_json) as progress:
        asm = progress.add_task("preparing model", total=None)
        model = resolve_model(model, lambda d, n, label: progress.update(asm, completed=d, total=n, description=label))
        progress.remove_task(asm)
        task = progress.add_task(f"loading {visible(model.name)}", total=None)
        ck = load_checkpoint(model, header_only=True, progress=lambda d, n, name: progress.update(task, completed=d, total=n,
                                                                               description=f"reading {visible(name)}"))
    facts = inspect_facts(ck)
    if as_json:
        typer.echo(json_text(facts, default=str))
        return
    render_inspect(stdout_console(), facts, all_tensors)
