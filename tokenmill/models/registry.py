"""Which model class implements which HF `architectures` entry (the architecture table itself is in
models/config.py, which parses config.json without importing any model)."""

from tokenmill.models.config import architecture_spec
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.moe import MoeForCausalLM


def get_model_class(arch_name: str):
    # One decoder for every family (the differences live in the config); the mixture-of-experts
    # families swap the MLP of their sparse layers for experts.
    spec = architecture_spec(arch_name)  # UnsupportedArchitectureError for others
    return MoeForCausalLM if spec.moe is not None else LlamaForCausalLM
