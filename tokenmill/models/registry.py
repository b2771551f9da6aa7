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
    # How HF reads the config's `sliding_window` for this architecture: "none" (never used), "all"
    # (every layer, Mistral), "layers" (only if `use_sliding_window`, on the layers that
    # `layer_types` or `max_window_layers` name, Qwen2/Qwen3).
    sliding_window: str = "none"


_ARCHITECTURES = {
    spec.name: spec
    for spec in (
        ArchitectureSpec("LlamaForCausalLM"),
        ArchitectureSpec("MistralForCausalLM", sliding_window="all"),
        ArchitectureSpec("Qwen2ForCausalLM", force_qkv_bias=True, sliding_window="layers"),
        ArchitectureSpec("Qwen3ForCausalLM", qk_norm=True, sliding_window="layers"),
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
