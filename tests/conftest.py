"""Shared test set-up. On machines without CUDA, Triton kernels run in the interpreter."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Keep the converted-model cache inside the test session unless the caller chose one.
os.environ.setdefault("TOKENMILL_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "tokenmill"))

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm():
    """tokenmill's load of the embedded default (SmolLM2-135M-Instruct GGUF), fp32 on the CPU."""
    from tokenmill.loader import load_model

    return load_model(None, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def hf_smollm():
    """HF transformers' own load of the same GGUF file, fp32."""
    from transformers import AutoModelForCausalLM

    from tokenmill.loader.resolve import embedded_model_path

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()
