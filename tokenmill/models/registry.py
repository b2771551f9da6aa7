"""Which model class implements which HF `architectures` entry (the architecture table itself is in
models/config.py, which parses config.json without importing any model)."""

from tokenmill.models.config import architecture_spec
from tokenmill.models.deepseek import DeepseekForCausalLM
from tokenmill.models.gemma import GemmaForCausalLM
from tokenmill.models.gpt_oss import GptOssForCausalLM
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.moe import MoeForCausalLM
from tokenmill.models.phi3 import Phi3ForCausalLM

# Families whose checkpoints need a loader of their own (the rest differ only in config data).
_CLASSES = {"Phi3ForCausalLM": Phi3ForCausalLM, "Gemma2ForCausalLM": GemmaForCausalLM,
            "Gemma3ForCausalLM": GemmaForCausalLM, "GptOssForCausalLM": GptOssForCausalLM,
            "DeepseekV2ForCausalLM": DeepseekForCausalLM, "DeepseekV3ForCausalLM": DeepseekForCausalLM}


def get_model_class(arch_name: str):
    # One decoder for every family (the differences live in the config); the mixture-of-experts
    # families swap the MLP of their sparse layers for experts.
    spec = architecture_spec(arch_name)  # UnsupportedArchitectureError for others
    if spec.name in _CLASSES:
        return _CLASSES[spec.name]
    return MoeForCausalLM if spec.moe is not None else LlamaForCausalLM
