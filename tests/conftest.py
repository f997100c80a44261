"""Shared fixtures: the real SmolLM2-135M GGUF loaded once per session, and HF transformers
on the same file (fp32) as the independent reference."""

from __future__ import annotations

import os

import pytest

# CLI runs choose torch's thread count from the cores idle at that moment; tests keep one fixed
# count (torch's own default) so results never depend on what else the machine is doing
if "INFERTRACE_THREADS" not in os.environ:
    import torch

    os.environ["INFERTRACE_THREADS"] = str(torch.get_num_threads())


@pytest.fixture(scope="session")
def smol_path():
    from infertrace.model.weights import default_model_path

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
