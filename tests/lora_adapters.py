"""LoRA adapters for the tests, made with the `peft` package on an HF model and saved as PEFT saves
them (adapter_config.json + adapter_model.safetensors). Every A and B is random and non-zero (PEFT's
default leaves B at zero, which would test nothing)."""

import copy
import os
from typing import Sequence

import torch

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(hf_model, path, rank: int = 8, alpha: float = 16.0, target_modules: Sequence[str] = ALL_MODULES,
                 seed: int = 0, std: float = 0.05, use_rslora: bool = False) -> str:
    """Save a LoRA adapter of `hf_model` (left untouched) to `path`; returns the path."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        bias="none", use_rslora=use_rslora, init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(hf_model), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    peft_model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def peft_reference(hf_model, adapter_path: str):
    """HF transformers + PEFT: `hf_model` (a copy of it) with the adapter applied, in eval mode."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(hf_model), adapter_path).eval()


def adapter_files(path) -> list[str]:
    return sorted(os.listdir(path))
