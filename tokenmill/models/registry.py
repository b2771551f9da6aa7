"""Which model class implements which HF `architectures` entry (the architecture table itself is in
models/config.py, which parses config.json without importing any model)."""

from tokenmill.errors import UnsupportedArchitectureError
from tokenmill.models.config import _ARCHITECTURES
from tokenmill.models.llama import LlamaForCausalLM


def get_model_class(arch_name: str):
    # Every supported architecture is a Llama-family decoder; the differences live in the config.
    if arch_name not in _ARCHITECTURES:
        raise UnsupportedArchitectureError(f"unsupported architecture {arch_name!r}")
    return LlamaForCausalLM
