"""The memory is only the memory, enforced statically (``ast``) and on small hand-worked steps:

* no string-keyed ``extra`` on memory inputs: no ``.extra`` anywhere in the package, no ``extra``
  field on any inputs class; what a runtime or a pool adds is a frozen dataclass (``native``,
  ``swa_pool``);
* ``kv/`` imports nothing from ``trace/`` (nor from ``capture/``, where its views live), and
  ``capture/kv_views.py`` imports nothing from ``kv/``;
* no module-level function in ``kv/`` changes an object it was handed (an assignment to, or an
  in-place call on, an attribute or item of a parameter: the sequence operations are methods of the
  class whose state they change), and nothing in ``kv/`` assigns another object's ``_private`` attribute;
* the :class:`~infertrace.kv.base.Memory` protocol's method list, so it only shrinks deliberately,
  and no memory class still carries a presentation view.

Mirrors llama.cpp ``src/llama-memory.h``: ``llama_memory_i`` holds the memory's operations, the
per-ubatch view is a separate ``llama_memory_context_i``.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from infertrace.capture import kv_views, mask_views
from infertrace.errors import InfertraceError
from infertrace.kv import base
from infertrace.kv.base import ChunkSpec
from infertrace.kv.cells import CellsKV
from infertrace.kv.iswa import IswaCellsKV, IswaInputs, SwaCellsPool
from infertrace.kv.paged import PagedKV
from infertrace.kv.prefix_cache import CachingCellsKV, SharedPagedKV
from infertrace.kv.recurrent import HybridKV, RecurrentState
from infertrace.kv.streams import CellsStreamsKV, StreamsInputs
from infertrace.runtimes.llamacpp.native import LlamaCppStepNative
from tests.unit.test_layering import imports_of

ROOT = Path(__file__).resolve().parents[3]
PKG = ROOT / "infertrace"
KV_FILES = sorted((PKG / "kv").glob("*.py"))

#: the Memory protocol's methods (34 before the views moved to capture/kv_views.py: placement, heads,
#: step_summary, dump_writes, dump_values)
MEMORY_METHODS = [
    "can_fit", "prepare", "write", "attend", "release", "forget",
    "seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "seq_pos_min", "seq_pos_max", "shift_out",
    "checkpoint", "restore", "rewind",
    "lookup", "note_tokens", "note_rewind", "take_events",
    "seq_len", "read", "logical_mask", "snapshot", "describe", "phys_layer", "holds_values", "recurrent_state",
    "written_blocks",  # holds_values: a read-back memory (llama.cpp, vLLM) holds one layer's K/V
]
VIEWS = ("placement", "heads", "step_summary", "dump_writes", "dump_values")
MEMORIES = (CellsKV, IswaCellsKV, SwaCellsPool, CachingCellsKV, CellsStreamsKV, PagedKV, SharedPagedKV, HybridKV)
#: in-place methods: called on a parameter's attribute they change the object handed in
IN_PLACE = {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "sort", "add", "discard"}


def _py_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.py"))


# ----------------------------------------------------------------------------- typed fields, not `extra`


def test_no_extra_attribute_anywhere_in_the_package():
    bad = [f"{f.relative_to(ROOT)}:{n.lineno}" for f in _py_files(PKG)
           for n in ast.walk(ast.parse(f.read_text(encoding="utf-8")))
           if isinstance(n, ast.Attribute) and n.attr == "extra"]
    assert bad == [], f"memory inputs carry typed fields, not a string-keyed extra dict: {bad}"


@pytest.mark.parametrize("cls", [base.AttnInputs, base.CellsInputs, base.PagedInputs, StreamsInputs])
def test_inputs_have_no_extra_field_and_a_typed_native_section(cls):
    names = {f.name for f in dataclasses.fields(cls)}
    assert "extra" not in names and "native" in names


def test_the_typed_step_sections_are_frozen():
    sp = base.SwaPoolStep("101", "seq 0: 0..99", 512)
    nat = LlamaCppStepNative(kq_mask_ne=[256, 2, 1, 1])
    for obj, name in ((sp, "reused"), (nat, "out_ids")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, None)
    assert "swa_pool" in {f.name for f in dataclasses.fields(base.CellsInputs)}


# ----------------------------------------------------------------------------- imports


def test_kv_imports_nothing_from_trace_or_capture():
    bad = [f"{f.relative_to(ROOT)}:{line}: {mod}" for f in KV_FILES for line, mod in imports_of(f, ROOT)
           if mod.startswith(("infertrace.trace", "infertrace.capture"))]
    assert bad == []


@pytest.mark.parametrize("name", ["kv_views.py", "mask_views.py"])
def test_the_views_import_no_memory_class(name):
    f = PKG / "capture" / name
    assert [mod for _, mod in imports_of(f, ROOT) if mod.startswith(("infertrace.kv", "infertrace.engine"))] == []


def test_only_the_views_read_a_memorys_layout():
    views = {PKG / "capture" / "kv_views.py", PKG / "capture" / "mask_views.py"}
    reads = re.compile(r"\bkv\.layout\b|\(\s*[\w.]*kv\s*,\s*\"layout\"")  # kv.layout, getattr(kv, "layout")
    bad = [f"{f.relative_to(ROOT)}:{n}" for f in _py_files(PKG) if f not in views and f.parent.name != "kv"
           for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1) if reads.search(line)]
    assert bad == []
    assert reads.search('lay = getattr(kv, "layout", None)') and reads.search("if self.kv.layout == 'paged':")


@pytest.mark.parametrize("cls", [base.CellsInputs, base.PagedInputs, StreamsInputs, IswaInputs], ids=lambda c: c.__name__)
def test_inputs_classes_carry_no_trace_view_but_the_verify_record(cls):
    assert [v for v in ("mask_record", "swa_record", "summary") if hasattr(cls, v)] == []


# ----------------------------------------------------------------------------- who changes the memory's state


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, (ast.Assign,)):
        out = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        out = [node.target]
    else:
        return []
    flat: list[ast.AST] = []
    while out:
        t = out.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            out += t.elts
        else:
            flat.append(t)
    return flat


def _root(node: ast.AST) -> tuple[str | None, int]:
    """The name an attribute / item chain starts from and the chain's length (``kv.pos[i]``: ``kv``, 2)."""
    depth = 0
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
        depth += 1
    return (node.id if isinstance(node, ast.Name) else None), depth


def _params(fn: ast.FunctionDef) -> set[str]:
    a = fn.args
    return {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs} | ({a.vararg.arg} if a.vararg else set()) | \
        ({a.kwarg.arg} if a.kwarg else set())


def mutations_outside_classes(path: Path) -> list[str]:
    """``"file:line: what"`` for every module-level function of ``path`` that assigns to an attribute or
    item of one of its parameters, or calls an in-place method (``append``, torch ``fill_`` ...) on one."""
    bad = []
    for fn in ast.parse(path.read_text(encoding="utf-8")).body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        params = _params(fn)
        for n in ast.walk(fn):
            for t in _targets(n):
                name, depth = _root(t)
                if depth and name in params:
                    bad.append(f"{path.name}:{t.lineno}: {fn.name} assigns {ast.unparse(t)}")
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                name, depth = _root(n.func.value)
                meth = n.func.attr
                if name in params and depth >= 1 and (meth in IN_PLACE or (meth.endswith("_") and not meth.startswith("_"))):
                    bad.append(f"{path.name}:{n.lineno}: {fn.name} calls {ast.unparse(n.func)}")
    return bad


def private_writes(path: Path) -> list[str]:
    """``"file:line: what"`` for every assignment to ``X._name`` with ``X`` not ``self`` (or ``cls``)."""
    bad = []
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        for t in _targets(n):
            node = t
            while isinstance(node, ast.Subscript):
                node = node.value
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                name, _ = _root(node.value)
                if name not in ("self", "cls"):
                    bad.append(f"{path.name}:{t.lineno}: {ast.unparse(t)}")
    return bad


def test_no_function_outside_a_memory_class_changes_a_memory():
    bad = [b for f in KV_FILES for b in mutations_outside_classes(f)]
    assert bad == [], bad


def test_nothing_in_kv_writes_another_objects_private_attribute():
    assert [b for f in KV_FILES for b in private_writes(f)] == []


def test_the_mutation_rule_catches_the_old_free_function_form(tmp_path):
    f = tmp_path / "old_seq_ops.py"
    f.write_text("def cells_seq_keep(kv, seq_id):\n    kv.head = 0\n    kv.seq[:, seq_id] = True\n    kv.pos.fill_(-1)\n"
                 "    kv._n = 1\n\n\ndef fine(x):\n    y = x.clone()\n    y[0] = 1\n    return y\n")
    got = mutations_outside_classes(f)
    assert [g.split(": ", 1)[1] for g in got] == ["cells_seq_keep assigns kv.head", "cells_seq_keep assigns kv.seq[:, seq_id]",
                                                 "cells_seq_keep assigns kv._n", "cells_seq_keep calls kv.pos.fill_"]
    assert private_writes(f) == ["old_seq_ops.py:5: kv._n"]


# ----------------------------------------------------------------------------- the protocol, narrowed


def _protocol_methods() -> list[str]:
    tree = ast.parse((PKG / "kv" / "base.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Memory")
    return [f.name for f in cls.body if isinstance(f, ast.FunctionDef)]


def test_memory_protocol_method_list():
    assert _protocol_methods() == MEMORY_METHODS, "the Memory protocol changed: update MEMORY_METHODS deliberately"


@pytest.mark.parametrize("cls", MEMORIES, ids=lambda c: c.__name__)
def test_no_memory_class_carries_a_view(cls):
    assert [v for v in VIEWS if hasattr(cls, v)] == []
    assert getattr(cls, "layout", None) in ("cells", "cells_iswa", "cells_streams", "paged", "hybrid")


# ----------------------------------------------------------------------------- the views, on hand-worked steps


def test_views_of_a_cells_step():
    kv = CellsKV(1, 1, 2, 8, 4)
    inp = kv.prepare([ChunkSpec(0, 0, 3), ChunkSpec(1, 0, 2)])  # find_slot from head 0: cells 0..2, then 3..4
    assert kv_views.placement(kv, inp) == [{"cells": "0..2"}, {"cells": "3..4"}]
    assert kv_views.heads(kv, inp) == {"head_before": 0, "head_after": 5}
    writes, hd = kv_views.dump_writes(kv, inp, {0: [0, 1, 2], 1: [3, 4]})
    assert writes == [{"seq_id": 0, "pos": [0, 1, 2], "cells": [0, 1, 2]}, {"seq_id": 1, "pos": [0, 1], "cells": [3, 4]}]
    s = kv_views.step_summary(kv, inp)
    assert (s["storage"], s["used"], s["head"], s["cells"]) == ([8, 1, 2], 5, 5, {"0": "0..2", "1": "3..4"})
    assert (s["kq_mask_ne"], s["n_kv"]) == ([8, 5, 1, 1], 8)  # n_kv: 5 used cells padded to 256, capped at size 8
    conv, _, cells, paged = mask_views.mask_record(inp, 8, 8)
    assert conv == "cells" and paged is None and cells["cell_pos"] == [0, 1, 2, 0, 1, -1, -1, -1]
    assert cells["rows"][3] == ["-inf", "-inf", "-inf", "0", "-inf", "-inf", "-inf", "-inf"]  # seq 1, pos 0: its cell 3 only


def test_views_of_a_paged_step_and_a_hybrid_reads_its_attention_part():
    kv = PagedKV(1, 1, 2, num_blocks=4, tokens_per_block=4)
    inp = kv.prepare([ChunkSpec(0, 0, 3), ChunkSpec(1, 0, 2)])  # free list lowest first: seq 0 block 0, seq 1 block 1
    assert kv_views.placement(kv, inp) == [{"slot_mapping": [0, 1, 2], "block_table": [0]},
                                           {"slot_mapping": [4, 5], "block_table": [1]}]
    assert kv_views.heads(kv, inp) == {}
    conv, _, cells, paged = mask_views.mask_record(inp, 8, 8)
    assert (conv, cells, paged["seq_lens"], paged["kv_lens"], paged["cu_seqlens"]) == ("paged", None, [3, 2], [3, 2], [0, 3, 5])
    assert kv_views.step_summary(kv, inp)["used_blocks"] == 2
    assert kv_views.conventions(kv)["tensors"] == "pool per layer" and "tensors" not in kv.describe()
    hyb = HybridKV(PagedKV(1, 1, 2, num_blocks=4, tokens_per_block=4),
                   RecurrentState([1], 4, 2, 1, 2, 2, 2, "paged"), kv_layers=[0])
    hinp = hyb.prepare([ChunkSpec(0, 0, 5)])  # 5 tokens over blocks of 4: blocks 0 and 1
    assert kv_views.placement(hyb, hinp) == [{"slot_mapping": [0, 1, 2, 3, 4], "block_table": [0, 1]}]


def test_a_memory_of_unknown_layout_is_refused():
    class Odd:
        layout = "tape"

    with pytest.raises(InfertraceError, match="no view of a memory of layout 'tape'"):
        kv_views.placement(Odd(), None)
