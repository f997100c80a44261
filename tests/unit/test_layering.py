"""The layering, enforced statically: the trace layer (``infertrace/trace``) and the presentation
layer (``infertrace/present``) import neither torch nor the engine side (engine, capture, model,
kv, attention, runner), at module level or inside a function, and neither does any infertrace
module they reach; ``trace`` does not import ``present`` (records sit below their views).

The walk reads the source (``ast``), so it sees the lazy imports a run would reach only on some
path; the subprocess check of ``tests/real_models/test_startup.py`` sees what one command really imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: the torch-free layers and what each may import from infertrace (prefixes of module names)
LAYERS = {
    "infertrace.trace": ("infertrace.trace",),
    "infertrace.present": ("infertrace.present", "infertrace.trace"),
}
#: torch-free shared modules any layer may use
SHARED = ("infertrace.errors", "infertrace.fmt", "infertrace.limits", "infertrace.ranges", "infertrace.safe_io", "infertrace.safe_text",
          "infertrace.quant.choice",  # the kernel chooser's rule, by dtype name: check asks which kernels a trace may name
          "infertrace.runtimes.api")  # the runtime registry (torch-free data): the store accepts the engines it names
#: third-party modules that load torch or a model runtime
FORBIDDEN = ("torch", "triton", "transformers", "accelerate", "llama_cpp", "safetensors.torch")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(name: str, root: Path) -> bool:
    return (root / Path(*name.split(".")) / "__init__.py").exists()


def imports_of(path: Path, root: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, anywhere in the file (module level, functions,
    ``TYPE_CHECKING`` blocks), as absolute names: ``(line, module)``. ``from X import y`` yields
    ``X`` and, when ``X.y`` is a module or package under ``root``, ``X.y`` too."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if (root / Path(*sub.split("."))).with_suffix(".py").exists() or _is_package(sub, root):
                    out.append((node.lineno, sub))
    return out


def torch_loads(path: Path) -> list[int]:
    """Lines where ``path`` has a library load torch for it without an import statement:
    ``framework="pt"`` (safetensors' ``safe_open``/``load``)."""
    return [n.value.lineno for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path)))
            if isinstance(n, ast.keyword) and n.arg == "framework" and isinstance(n.value, ast.Constant)
            and n.value.value == "pt"]


def _file_of(module: str, root: Path) -> Path | None:
    p = root / Path(*module.split("."))
    if p.with_suffix(".py").exists():
        return p.with_suffix(".py")
    return p / "__init__.py" if (p / "__init__.py").exists() else None


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(root: Path, layers: dict[str, tuple[str, ...]] = LAYERS, shared: tuple[str, ...] = SHARED,
               forbidden: tuple[str, ...] = FORBIDDEN) -> list[str]:
    """``"file:line: what"`` for every import that breaks the layering under ``root`` (the
    directory holding the ``infertrace`` package): a layer's module importing an infertrace
    module outside its allowed prefixes and :data:`SHARED`, or any module reached from a layer
    (itself, a shared module, or one those import) importing a :data:`FORBIDDEN` module or an
    infertrace module outside the layers and :data:`SHARED`, or asking safetensors for torch
    (``framework="pt"``)."""
    bad: list[str] = []
    seen: set[Path] = set()
    todo: list[Path] = []
    for layer, allowed in layers.items():
        for f in sorted((root / Path(*layer.split("."))).rglob("*.py")):
            todo.append(f)
            for line, mod in imports_of(f, root):
                if _under(mod, ("infertrace",)) and not _under(mod, allowed + shared):
                    bad.append(f"{f.relative_to(root)}:{line}: {layer} imports {mod}")
    inside = tuple(layers) + shared
    while todo:  # every infertrace module reachable from the layers stays free of torch and of the engine side
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        bad += [f"{f.relative_to(root)}:{line}: loads torch (framework='pt')" for line in torch_loads(f)]
        for line, mod in imports_of(f, root):
            if _under(mod, forbidden):
                bad.append(f"{f.relative_to(root)}:{line}: imports {mod}")
            elif _under(mod, ("infertrace",)) and not _under(mod, inside) and mod != "infertrace":
                bad.append(f"{f.relative_to(root)}:{line}: reaches {mod}")  # not followed: reported here
            elif _under(mod, ("infertrace",)) and (g := _file_of(mod, root)) is not None:
                todo.append(g)
                parent = mod.rpartition(".")[0]  # importing a.b.c runs a/__init__ and a/b/__init__
                while parent:
                    if (p := _file_of(parent, root)) is not None:
                        todo.append(p)
                    parent = parent.rpartition(".")[0]
    return sorted(set(bad))


def test_trace_and_present_layers_are_torch_free_and_engine_free():
    assert violations(ROOT) == []


def test_the_layers_exist_and_are_walked():
    """The check is not vacuous: both layers hold the modules docs/architecture.md names."""
    for layer, names in (("trace", ("records", "schema", "store", "check", "diff", "kv_dump", "saved_kv")),
                         ("present", ("render", "render_kv", "report", "report_views"))):
        for n in names:
            assert (ROOT / "infertrace" / layer / f"{n}.py").exists() or (ROOT / "infertrace" / layer / n / "__init__.py").exists(), \
                (layer, n)  # a module or a package (trace/check is one: a module per convention)
    mods = {m for _, m in imports_of(ROOT / "infertrace" / "present" / "report.py", ROOT)}
    assert {"infertrace.present.report_views", "infertrace.trace.records"} <= mods


def _fake_tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in {"infertrace/__init__.py": "", "infertrace/trace/__init__.py": "",
                      "infertrace/present/__init__.py": "", "infertrace/errors.py": "", **files}.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


@pytest.mark.parametrize("files, expected", [
    ({"infertrace/trace/store.py": "def save():\n    import torch\n"},
     "infertrace/trace/store.py:2: imports torch"),
    ({"infertrace/trace/store.py": "def save():\n    from safetensors.torch import save\n"},
     "infertrace/trace/store.py:2: imports safetensors.torch"),
    ({"infertrace/trace/store.py": "from safetensors import safe_open\ndef get(p):\n    return safe_open(p, framework='pt')\n"},
     "infertrace/trace/store.py:3: loads torch (framework='pt')"),
    ({"infertrace/present/render.py": "from infertrace.engine.engine import Engine\n"},
     "infertrace/present/render.py:1: infertrace.present imports infertrace.engine.engine"),
    ({"infertrace/present/render.py": "from ..capture import recorder\n"},
     "infertrace/present/render.py:1: infertrace.present imports infertrace.capture"),
    ({"infertrace/trace/diff.py": "from infertrace.present import render\n",
      "infertrace/present/render.py": ""},
     "infertrace/trace/diff.py:1: infertrace.trace imports infertrace.present"),
    ({"infertrace/trace/diff.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from infertrace.kv.base import AttnInputs\n"},
     "infertrace/trace/diff.py:3: infertrace.trace imports infertrace.kv.base"),
    ({"infertrace/present/render.py": "from infertrace.errors import InfertraceError\n",
      "infertrace/errors.py": "def f():\n    import torch\n"},  # a shared module reached from a layer
     "infertrace/errors.py:2: imports torch"),
    ({"infertrace/trace/diff.py": "import infertrace.safe_io\n",
      "infertrace/safe_io.py": "from infertrace.runner import load_model\n"},  # a shared module reaching the engine
     "infertrace/safe_io.py:1: reaches infertrace.runner"),
], ids=["lazy-torch", "safetensors-torch", "safetensors-framework-pt", "engine", "relative-capture", "trace-imports-present", "type-checking-kv",
        "shared-module-torch", "shared-module-engine"])
def test_the_check_catches_a_bad_import(tmp_path, files, expected):
    root = _fake_tree(tmp_path, files)
    assert expected in violations(root)


def test_the_check_accepts_numpy_and_shared_modules(tmp_path):
    root = _fake_tree(tmp_path, {
        "infertrace/trace/store.py": "import numpy as np\nfrom safetensors import safe_open\nfrom infertrace.errors import InfertraceError\n",
        "infertrace/present/render.py": "from rich.text import Text\nfrom infertrace.trace import store\nfrom . import report\n",
        "infertrace/present/report.py": "from markupsafe import Markup\n"})
    assert violations(root) == []


# ----------------------------------------------------------------------------- no import cycles (issue 18)

#: packages of the memory (llama_memory_i kinds) and what they must never import: the engine drives them
MEMORY_MUST_NOT_IMPORT = ("infertrace.engine", "infertrace.runner", "infertrace.capture", "infertrace.cli",
                          "infertrace.compare", "infertrace.runtimes")
#: the engine's must-nots: the runner and the CLI sit above it
ENGINE_MUST_NOT_IMPORT = ("infertrace.runner", "infertrace.cli", "infertrace.compare", "infertrace.runtimes")


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the infertrace modules it imports (module level, lazy, ``TYPE_CHECKING``), plus the
    parent packages whose ``__init__`` an import runs."""
    graph: dict[str, set[str]] = {}
    for f in sorted((root / "infertrace").rglob("*.py")):
        name = _module_name(f, root)
        deps: set[str] = set()
        for _, mod in imports_of(f, root):
            while mod and _under(mod, ("infertrace",)):
                if _file_of(mod, root) is not None and mod != name and not _under(name, (mod,)):
                    deps.add(mod)
                mod = mod.rpartition(".")[0]
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(import_graph(ROOT)) == []


def test_cycle_check_finds_a_lazy_cycle(tmp_path):
    root = _fake_tree(tmp_path, {"infertrace/a.py": "def f():\n    from infertrace import b\n",
                                 "infertrace/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import infertrace.a\n"})
    assert cycles(import_graph(root)) == [["infertrace.a", "infertrace.b"]]


@pytest.mark.parametrize("package, must_not", [("infertrace.kv", MEMORY_MUST_NOT_IMPORT),
                                               ("infertrace.engine", ENGINE_MUST_NOT_IMPORT)])
def test_lower_rooms_do_not_import_upward(package, must_not):
    bad = [f"{f.relative_to(ROOT)}:{line}: imports {mod}"
           for f in sorted((ROOT / Path(*package.split("."))).rglob("*.py"))
           for line, mod in imports_of(f, ROOT) if _under(mod, must_not)]
    assert bad == []


# ----------------------------------------------------------------------------- the recorder reads plain data (issue 27)
#: what no module of infertrace/capture imports (module level, lazily or under TYPE_CHECKING), nor any module the
#: recorder, the probe or the step data reach: the probe reads the live step by duck typing on the memory protocol,
#: the recorder builds the trace from :class:`~infertrace.capture.step_data.StepData` alone
CAPTURE_MUST_NOT_IMPORT = ("infertrace.kv", "infertrace.engine")
#: the modules whose whole import closure stays clear of the memory and the engine
RECORDER_SIDE = ("infertrace/capture/recorder.py", "infertrace/capture/probe.py", "infertrace/capture/step_data.py")


def reached(starts: list[Path], root: Path) -> dict[str, list[str]]:
    """Every infertrace module reachable from ``starts`` (lazy and ``TYPE_CHECKING`` imports included, with the
    packages whose ``__init__`` an import runs) -> one chain of files leading to it."""
    chain: dict[str, list[str]] = {}
    todo = [(f, [str(f.relative_to(root))]) for f in starts]
    seen: set[Path] = set()
    while todo:
        f, via = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for _, mod in imports_of(f, root):
            while mod and _under(mod, ("infertrace",)):
                g = _file_of(mod, root)
                if g is not None and mod not in chain:
                    chain[mod] = via + [mod]
                    todo.append((g, via + [mod]))
                mod = mod.rpartition(".")[0]
    return chain


def test_capture_imports_neither_the_memory_nor_the_engine():
    bad = [f"{f.relative_to(ROOT)}:{line}: imports {mod}"
           for f in sorted((ROOT / "infertrace" / "capture").rglob("*.py"))
           for line, mod in imports_of(f, ROOT) if _under(mod, CAPTURE_MUST_NOT_IMPORT)]
    assert bad == []
    chains = reached([ROOT / p for p in RECORDER_SIDE], ROOT)
    assert [" -> ".join(v) for m, v in sorted(chains.items()) if _under(m, CAPTURE_MUST_NOT_IMPORT)] == []
    assert {"infertrace.capture.probe", "infertrace.capture.step_data", "infertrace.trace.records"} <= set(chains)


def test_capture_check_catches_a_type_checking_or_lazy_import(tmp_path):
    root = _fake_tree(tmp_path, {
        "infertrace/capture/__init__.py": "", "infertrace/kv/__init__.py": "", "infertrace/kv/base.py": "",
        "infertrace/engine/__init__.py": "", "infertrace/engine/step.py": "",
        "infertrace/capture/recorder.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from infertrace.kv.base import Memory\n",
        "infertrace/capture/probe.py": "def f():\n    from infertrace import helper\n",
        "infertrace/helper.py": "import infertrace.engine.step\n", "infertrace/capture/step_data.py": ""})
    chains = reached([root / p for p in RECORDER_SIDE], root)
    assert chains["infertrace.kv.base"] == ["infertrace/capture/recorder.py", "infertrace.kv.base"]
    assert chains["infertrace.engine.step"] == ["infertrace/capture/probe.py", "infertrace.helper", "infertrace.engine.step"]


# ----------------------------------------------------------------------------- the Runtime seam (issue 27)
# 1. No runtime name ("infertrace", "llama.cpp", "vllm", "hf") is compared or branched on outside
#    infertrace/runtimes/: a comparison (==, !=, in, not in, match) of such a string with any expression but a
#    sampler order or a file format (DATA: order == "llama.cpp", fmt in ("hf", "gguf") are data); reading a trace
#    section (opts.get("vllm")) is not a comparison. Instead of branching on a name, code asks the registry
#    (runtimes/api.py) or the trace's native section instead.
# 2. No class subclasses Engine (variation is injected: a cache config, a sampler, a scheduler).
# 3. No assignment to .kv / .scheduler.kv / .memory of an engine or scheduler after construction (outside the
#    owning class's own __init__).
# (Zero import cycles: test_no_import_cycles above, lazy imports included.)
# Each allow-list entry says why it stays; an entry that matches nothing any more fails the test.

NAMES = {"infertrace", "llama.cpp", "vllm", "hf"}
#: what a runtime name's string may also be compared with as data: a sampler order (``hf`` / ``llama.cpp``),
#: a checkpoint format or source (``hf`` / ``gguf``)
DATA = ("order", "fmt", "format", "source")

#: (file relative to the repo, rule) -> why it stays
ALLOW: dict[tuple[str, str], str] = {}


def _files() -> list[Path]:
    """Every module of the package."""
    return sorted(p for p in (ROOT / "infertrace").rglob("*.py") if "__pycache__" not in p.parts)


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _tree(p: Path) -> ast.Module:
    return ast.parse(p.read_text(encoding="utf-8"), filename=str(p))


def _names_in(node: ast.AST) -> set[str]:
    """The runtime-name string constants of ``node`` (a constant, or a tuple / list / set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES:
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_names_in(e) for e in node.elts)) if node.elts else set()
    return set()


def _who(src: str) -> bool:
    """True unless the expression is one of the :data:`DATA` kinds (a sampler order, a file format)."""
    return not any(w in src.lower() for w in DATA)


def name_branches(p: Path) -> list[str]:
    """``file:line`` of every comparison of a runtime name with an expression naming who computed."""
    text = p.read_text(encoding="utf-8")
    out = []
    for node in ast.walk(_tree(p)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            lits = [s for s in sides if _names_in(s)]
            others = [s for s in sides if not _names_in(s)]
            if lits and any(_who(ast.get_source_segment(text, s) or "") for s in others):
                out.append(f"{_rel(p)}:{node.lineno}")
        elif isinstance(node, ast.Match):
            subject = ast.get_source_segment(text, node.subject) or ""
            pats = [c.pattern for c in node.cases]
            if _who(subject) and any(isinstance(x, ast.MatchValue) and _names_in(x.value) for x in pats):
                out.append(f"{_rel(p)}:{node.lineno}")
    return out


def engine_subclasses(p: Path) -> list[str]:
    out = []
    for node in ast.walk(_tree(p)):
        if isinstance(node, ast.ClassDef):
            for b in node.bases:
                name = b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                if name == "Engine":
                    out.append(f"{_rel(p)}:{node.lineno} class {node.name}(Engine)")
    return out


def _memory_target(t: ast.AST) -> bool:
    """``X.kv`` / ``X.memory`` where X is an engine or scheduler (``eng``, ``self.engine``, ``x.scheduler``)."""
    if not isinstance(t, ast.Attribute) or t.attr not in ("kv", "memory"):
        return False
    base = ast.unparse(t.value).lower()
    return any(w in base for w in ("eng", "scheduler", "sched"))


def memory_swaps(p: Path) -> list[str]:
    """Assignments to an engine's or scheduler's memory outside an ``__init__`` of the class that owns it
    (``self.kv = ...`` in ``Engine.__init__`` builds it; ``eng.kv = ...`` anywhere swaps it)."""
    out = []
    tree = _tree(p)

    def visit(node: ast.AST, in_init: bool) -> None:
        for child in ast.iter_child_nodes(node):
            init = in_init or (isinstance(child, ast.FunctionDef) and child.name == "__init__")
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and child.name != "__init__":
                init = False
            if isinstance(child, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                for t in targets:
                    if _memory_target(t) and not (in_init and ast.unparse(t).startswith("self.")
                                                  and ast.unparse(t).count(".") == 1):
                        out.append(f"{_rel(p)}:{child.lineno} {ast.unparse(t)} = ...")
            visit(child, init)

    visit(tree, False)
    return out


def memory_classes(root: Path) -> set[str]:
    """Names of the memory classes defined in ``infertrace/kv/``: ``Memory``, ``MemoryDefaults`` and every class
    there deriving from one of them (directly or through another kv class)."""
    bases: dict[str, set[str]] = {}
    for f in sorted((root / "infertrace" / "kv").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                                    for b in node.bases}
    mem = {"Memory", "MemoryDefaults"} & set(bases)
    while True:
        more = {c for c, bs in bases.items() if c not in mem and bs & mem}
        if not more:
            return mem
        mem |= more


def memory_subclasses(p: Path) -> list[str]:
    """Classes of ``p`` deriving from a memory class of the repository's ``infertrace/kv/`` (:func:`memory_classes`)."""
    mem = memory_classes(Path(__file__).resolve().parents[2])
    out = []
    for node in ast.walk(_tree(p)):
        if isinstance(node, ast.ClassDef):
            for b in node.bases:
                name = b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                if name in mem:
                    out.append(f"{_rel(p)}:{node.lineno} class {node.name}({name})")
    return out


def step_record_patches(p: Path) -> list[str]:
    """Assignments (``=``, ``+=``, annotated) to the last step record or anything under it: ``X.steps[-1] = ...``,
    ``X.steps[-1].vllm = ...``, ``X.steps[-1].vllm["served"] = ...`` (a runtime's section travels in the step
    data the recorder reads: ``StepContext`` -> ``StepData`` -> ``Recorder.record``)."""
    out = []
    for node in ast.walk(_tree(p)):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in (e for t in targets for e in ast.walk(t)):  # a tuple target's elements too
                if isinstance(t, (ast.Attribute, ast.Subscript)) and _patches_last_step(t):
                    out.append(f"{_rel(p)}:{node.lineno} {ast.unparse(t)} = ...")
                    break
    return out


def _patches_last_step(t: ast.AST) -> bool:
    """``t`` is ``<x>.steps[-1]`` or an attribute / item under it."""
    while isinstance(t, (ast.Attribute, ast.Subscript)):
        if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr == "steps"
                and ast.unparse(t.slice) == "-1"):
            return True
        t = t.value
    return False


def _allowed(found: list[str], rule: str) -> list[str]:
    return [f for f in found if (f.split(":", 1)[0], rule) not in ALLOW]


def test_no_runtime_name_branches_outside_runtimes() -> None:
    found = [x for p in _files() if not _rel(p).startswith("infertrace/runtimes/") for x in name_branches(p)]
    assert _allowed(found, "name") == [], "ask the registry (runtimes/api.py) or the trace's native section"


def test_no_engine_subclass() -> None:
    found = [x for p in _files() for x in engine_subclasses(p)]
    assert _allowed(found, "subclass") == [], "inject a scheduler, sampler or cache config into Engine instead"


def test_engine_step_is_the_one_loop_and_short() -> None:
    """``Engine.step`` is the one step loop (issue 27 item 3): nothing outside ``engine/engine.py`` defines a
    ``step`` beside an ``Engine`` base, and it stays readable in one screen (at most 80 lines)."""
    tree = _tree(ROOT / "infertrace/engine/engine.py")
    eng = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    step = next(n for n in eng.body if isinstance(n, ast.FunctionDef) and n.name == "step")
    assert step.end_lineno - step.lineno + 1 <= 80, "split a helper out of Engine.step"
    assert [x for p in _files() for x in engine_subclasses(p)] == []  # so no class overrides Engine.step


def test_no_memory_swapped_after_construction() -> None:
    found = [x for p in _files() for x in memory_swaps(p)]
    assert _allowed(found, "memory") == [], "pass a cache config (engine/parts.py MemoryConfig) to Engine"


def test_no_runtime_subclasses_a_memory_to_be_read() -> None:
    """A runtime hands the recorder data (the probe reads any memory by duck typing): a read-back cache holds a
    memory by composition (``VllmKV``, ``LlamaCppKV``, ``LlamaCppStreamsKV``) instead of posing as one."""
    found = [x for p in _files() if _rel(p).startswith("infertrace/runtimes/") for x in memory_subclasses(p)]
    assert _allowed(found, "memory_subclass") == [], "hold a CellsKV / PagedKV mirror by composition instead"
    assert {"CellsKV", "PagedKV", "CellsStreamsKV", "IswaCellsKV", "HybridKV"} <= memory_classes(ROOT)


def test_no_step_record_patched_after_record() -> None:
    """The recorder writes a step record once, from the step's data (issue 27): no runtime patches
    ``tracer.steps[-1]`` afterwards (vLLM's section is ``StepContext.vllm`` -> ``StepData.vllm``)."""
    found = [x for p in _files() for x in step_record_patches(p)]
    assert _allowed(found, "step_patch") == [], "hand the section to the recorder in the step context instead"


def test_allow_list_entries_still_needed() -> None:
    """An entry whose exception is gone must be removed (the list only shrinks)."""
    rules = {"name": name_branches, "subclass": engine_subclasses, "memory": memory_swaps,
             "memory_subclass": memory_subclasses, "step_patch": step_record_patches}
    stale = [k for k in ALLOW if not rules[k[1]](ROOT / k[0])]
    assert stale == []


# ----------------------------------------------------------------------------- room sizes (issue 27)
# 4. No function or method under infertrace/ is longer than MAX_FUNCTION_LINES, counted from its ``def`` line to its
#    last line (decorators excluded; docstring, comments and nested functions included: ast
#    ``end_lineno - lineno + 1``), except the Triton kernels (LONG_EXEMPT: the @triton.jit programs and the
#    factory that builds them; their launcher is measured) and the LONG_ALLOW entries.
# 5. No module of the trace/check package is longer than MAX_CHECK_MODULE_LINES (one module per convention).

MAX_FUNCTION_LINES = 80
MAX_CHECK_MODULE_LINES = 400
#: (file, function) not measured, with every function nested in it (why)
LONG_EXEMPT = {("infertrace/attention/triton_paged.py", "_kernels"):
               "the Triton kernels: one @triton.jit program each, defined inside this factory (triton imported lazily)"}
#: (file relative to the repo, qualified name) -> why it stays longer than MAX_FUNCTION_LINES
LONG_ALLOW: dict[tuple[str, str], str] = {}


def long_functions(p: Path, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """``(qualified name, lines)`` of every function or method of ``p`` longer than ``limit`` lines (from
    the ``def`` line to the last, decorators excluded), nested ones included (``Class.method.inner``)."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = child.end_lineno - child.lineno + 1
                if n > limit:
                    out.append((prefix + child.name, n))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(_tree(p), "")
    return out


def _exempt(rel: str, name: str) -> bool:
    """True for a Triton kernel (:data:`LONG_EXEMPT`'s function or one nested in it)."""
    return any(rel == f and (name == fn or name.startswith(fn + ".")) for f, fn in LONG_EXEMPT)


def test_no_function_over_80_lines() -> None:
    found = [f"{_rel(p)}: {name} ({n} lines)" for p in _files() for name, n in long_functions(p)
             if (_rel(p), name) not in LONG_ALLOW and not _exempt(_rel(p), name)]
    assert found == [], f"split into named helpers of at most {MAX_FUNCTION_LINES} lines"


def test_long_function_allow_list_entries_still_needed() -> None:
    """An entry whose function is gone or now short enough must be removed (the list only shrinks)."""
    assert all(LONG_ALLOW.values()) and not set(LONG_EXEMPT) & set(LONG_ALLOW)
    stale = [k for k in LONG_ALLOW if k[1] not in {name for name, _ in long_functions(ROOT / k[0])}]
    assert stale == []


def test_the_exempt_kernels_exist_and_are_long() -> None:
    """An exemption must name a function that exists and needs it."""
    assert [k for k in LONG_EXEMPT if k[1] not in {n for n, _ in long_functions(ROOT / k[0])}] == []


def check_module_sizes(root: Path, limit: int = MAX_CHECK_MODULE_LINES) -> list[str]:
    """``"file: N lines"`` of every module of ``infertrace/trace/check`` longer than ``limit`` lines."""
    out = []
    for p in sorted((root / "infertrace" / "trace" / "check").rglob("*.py")):
        n = len(p.read_text(encoding="utf-8").splitlines())
        if n > limit:
            out.append(f"{p.relative_to(root).as_posix()}: {n} lines")
    return out


def test_trace_check_modules_stay_small() -> None:
    assert (ROOT / "infertrace" / "trace" / "check" / "__init__.py").exists()  # a package, so the walk is not vacuous
    assert check_module_sizes(ROOT) == [], "split the convention's rules into their own module"


# ----------------------------------------------------------------------------- the detectors detect


def _write(tmp: Path, text: str) -> Path:
    p = tmp / "m.py"
    p.write_text(text, encoding="utf-8")
    return p


@pytest.fixture
def at_root(tmp_path):
    """ROOT pointed at ``tmp_path`` while the detectors read a file written there."""
    old = globals()["ROOT"]
    globals()["ROOT"] = tmp_path
    yield tmp_path
    globals()["ROOT"] = old


def test_detectors_catch_each_violation(at_root: Path) -> None:
    bad = _write(at_root, "class E(Engine):\n    pass\n"
                          "def f(trace, eng, opts):\n"
                          "    if trace.runtime == 'vllm':\n        pass\n"
                          "    if m.get('runtime', 'infertrace') in ('llama.cpp', 'x'):\n        pass\n"
                          "    eng.kv = eng.scheduler.kv = 1\n"
                          "    if opts.sampler_order == 'llama.cpp':\n        pass\n"
                          "    x = opts.get('vllm')\n")
    assert name_branches(bad) == ["m.py:4", "m.py:6"]  # the sampler order and the section read are data
    assert engine_subclasses(bad) == ["m.py:1 class E(Engine)"]
    assert [x.split(" ", 1)[1] for x in memory_swaps(bad)] == ["eng.kv = ...", "eng.scheduler.kv = ..."]
    assert memory_subclasses(_write(at_root, "import x\nclass A(x.PagedKV):\n    pass\nclass B(Mirror):\n    pass\n")) \
        == ["m.py:2 class A(PagedKV)"]


def test_step_record_patch_detector(at_root: Path) -> None:
    bad = _write(at_root, "def f(tracer, rec_, st):\n"
                          "    tracer.steps[-1].vllm = 1\n"
                          "    rec_.steps[-1].vllm['served'] = 2\n"
                          "    self.steps[-1] = 3\n"
                          "    a, tracer.steps[-1].hf = 4, 5\n"
                          "    tracer.steps[-1].time_ms += 1.0\n"
                          "    x = tracer.steps[-1].vllm\n"  # reads are fine
                          "    tracer.steps[0].vllm = 6\n"  # not the last record: another rule's business
                          "    st.vllm = 7\n")
    assert [x.split(" ", 1)[0] for x in step_record_patches(bad)] == ["m.py:2", "m.py:3", "m.py:4", "m.py:5", "m.py:6"]
    assert step_record_patches(_write(at_root, "steps = []\nsteps.append(1)\non_step(tracer.steps[-1])\n")) == []


def test_memory_built_in_own_init_is_not_a_swap(at_root: Path) -> None:
    ok = _write(at_root, "class Engine:\n    def __init__(self):\n        self.kv = make()\n")
    assert memory_swaps(ok) == []


def _function(name: str, lines: int) -> str:
    """A function of exactly ``lines`` lines (its ``def`` line included)."""
    return f"def {name}():\n" + "    x = 0\n" * (lines - 1)


def test_long_function_detector_counts_lines(at_root: Path) -> None:
    p = _write(at_root, "import functools\n\n\n@functools.cache\n@functools.wraps(print)\n" + _function("at_limit", 80)
               + _function("over", 81) + "class C:\n    async def m(self):\n        def inner():\n"
               + "            x = 0\n" * 80 + "        return inner\n")
    assert long_functions(p) == [("over", 81), ("C.m", 83), ("C.m.inner", 81)]  # decorators not counted: at_limit is 80


def test_check_module_size_detector(tmp_path: Path) -> None:
    d = tmp_path / "infertrace" / "trace" / "check"
    d.mkdir(parents=True)
    (d / "small.py").write_text("x = 0\n" * 400)
    (d / "big.py").write_text("x = 0\n" * 401)
    assert check_module_sizes(tmp_path) == ["infertrace/trace/check/big.py: 401 lines"]
