"""Which model class implements which HF `architectures` entry."""

from dataclasses import dataclass

from tokenmill.errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class ArchitectureSpec:
    name: str
    # Qwen2 always has biases on q/k/v (its config has no `attention_bias` field).
    force_qkv_bias: bool = False
    # Qwen3 normalises each head of q and k with an RMSNorm before rotary.
    qk_norm: bool = False


_ARCHITECTURES = {
    spec.name: spec
    for spec in (
        ArchitectureSpec("LlamaForCausalLM"),
        ArchitectureSpec("MistralForCausalLM"),
        ArchitectureSpec("Qwen2ForCausalLM", force_qkv_bias=True),
        ArchitectureSpec("Qwen3ForCausalLM", qk_norm=True),
    )
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve_architecture(architectures: list[str]) -> ArchitectureSpec:
    for name in architectures:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    raise UnsupportedArchitectureError(
        f"unsupported architecture {architectures}; tokenmill supports {supported_architectures()}"
    )


def get_model_class(arch_name: str):
    from tokenmill.models.llama import LlamaForCausalLM

    # Every supported architecture is a Llama-family decoder; the differences live in the config.
    if arch_name not in _ARCHITECTURES:
        raise UnsupportedArchitectureError(f"unsupported architecture {arch_name!r}")
    return LlamaForCausalLM
