"""The layout of tests/, enforced: every test file sits in the folder of its subject (tests/unit/<package>/,
tests/cli/, tests/real_models/, tests/runtimes/<runtime>/, tests/hostile/, tests/fuzz/), none directly in
tests/ (only ``conftest.py`` and ``__init__.py`` there), no file is named after an issue or a test
campaign, every folder is a package (so ``tests.helpers.<module>`` imports from anywhere), and the
markers the folders imply are registered in pyproject.toml and added by tests/conftest.py."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tests.conftest import FOLDER_MARKS, markers_for

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

#: the folders a test file may sit in (first path part below tests/); unit/ has one folder per package
FOLDERS = {"unit", "cli", "real_models", "runtimes", "hostile", "fuzz", "helpers"}
#: words that name an issue or a campaign instead of a subject ("test_issue23_breaker.py")
CAMPAIGN = re.compile(r"issue|breaker|adversar|campaign|reprobe|re_probe|hostile|round\d|sprint", re.I)


def _py_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_python_file_directly_in_tests():
    loose = [p.name for p in TESTS.glob("*.py") if p.name not in ("conftest.py", "__init__.py")]
    assert loose == [], (f"move {loose} into a subfolder of tests/ (tests/unit/<package>/, tests/cli/, "
                         "tests/real_models/, tests/runtimes/<runtime>/, tests/hostile/, tests/fuzz/)")


def test_every_file_sits_in_a_known_folder():
    bad = [str(p.relative_to(TESTS)) for p in _py_files()
           if p.parent != TESTS and p.relative_to(TESTS).parts[0] not in FOLDERS]
    assert bad == []


def test_unit_folders_name_an_infertrace_package():
    packages = {p.name for p in (ROOT / "infertrace").iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in (TESTS / "unit").iterdir() if p.is_dir() and p.name != "__pycache__"}
    # core/ holds the tests of infertrace's top-level modules (threads.py, errors.py, ...)
    assert folders - packages - {"core"} == set()


def test_runtime_folders_name_a_runtime():
    runtimes = {p.name for p in (ROOT / "infertrace" / "runtimes").iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in (TESTS / "runtimes").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= runtimes, folders - runtimes


def test_no_file_is_named_after_an_issue_or_a_campaign():
    bad = [str(p.relative_to(TESTS)) for p in _py_files()
           if p.name.startswith("test_") and CAMPAIGN.search(p.stem)]
    assert bad == [], f"name these by their subject (what they test), not by issue or campaign: {bad}"


@pytest.mark.parametrize("name", ["test_issue22_hostile.py", "test_issue23_breaker.py", "test_hostile_models.py",
                                  "test_qwen35_hostile.py"])
def test_the_campaign_rule_catches_the_old_names(name):
    assert CAMPAIGN.search(Path(name).stem)


def test_every_folder_is_a_package():
    missing = [str(d.relative_to(TESTS)) for d in [TESTS, *(p for p in TESTS.rglob("*") if p.is_dir())]
               if d.name != "__pycache__" and not d.name.startswith(".") and any(d.glob("*.py"))
               and not (d / "__init__.py").exists()]
    assert missing == []


def test_test_file_basenames_are_unique():
    seen: dict[str, list[str]] = {}
    for p in _py_files():
        if p.name.startswith("test_"):
            seen.setdefault(p.name, []).append(str(p.relative_to(TESTS)))
    assert {n: w for n, w in seen.items() if len(w) > 1} == {}


def test_markers_are_registered():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    names = {m.split(":")[0] for m in cfg["tool"]["pytest"]["ini_options"]["markers"]}
    implied = {m for ms in FOLDER_MARKS.values() for m in ms}
    assert {"model", "hf", "vllm", "slow", "needs_llamacpp", "needs_vllm", "needs_cuda"} | implied <= names


def test_folder_markers():
    assert markers_for(("runtimes", "vllm"), set(), set()) == {"slow", "needs_vllm", "vllm"}
    assert markers_for(("runtimes", "llamacpp"), set(), set()) == {"slow", "needs_llamacpp"}
    assert markers_for(("real_models",), set(), {"model"}) == {"slow"}
    assert markers_for(("unit", "kv"), {"tmp_path"}, set()) == set()
    assert markers_for(("unit", "kv"), {"llama_cpp", "hf_smol"}, set()) == {"needs_llamacpp", "model", "hf"}
    assert markers_for(("hostile",), set(), {"vllm"}) == {"needs_vllm"}


def test_markers_reach_the_collected_items(request):
    """This file's own items carry no folder marker; the collected session has needs_vllm on the vLLM runtime
    tests (checked on the session's items, so it holds whichever subset ran)."""
    assert not any(m.name in ("needs_vllm", "needs_llamacpp", "slow") for m in request.node.iter_markers())
    for item in request.session.items:
        rel = Path(str(item.path)).resolve().relative_to(TESTS).parts
        if rel[:2] == ("runtimes", "vllm"):
            assert item.get_closest_marker("needs_vllm") is not None, item.nodeid
        if rel[:2] == ("runtimes", "llamacpp"):
            assert item.get_closest_marker("needs_llamacpp") is not None, item.nodeid
