"""The architecture description tokenmill's models are built from, parsed from an HF config dict."""

from dataclasses import dataclass, field
from typing import Any, Optional

from tokenmill.errors import ModelLoadError, UnsupportedArchitectureError


@dataclass
class RopeConfig:
    theta: float = 10000.0
    # "default" or "llama3" (the other HF rope types are not implemented).
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # Per-frequency divisors (GGUF files store llama3 scaling this way, as a tensor).
    freq_factors: Optional[list[float]] = None


@dataclass
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    # The dtype the checkpoint was saved in ("bfloat16", ...), if the config says.
    torch_dtype: Optional[str] = None
    # Every layer attends only to the last `sliding_window` positions (None: full attention).
    sliding_window: Optional[int] = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * h * i + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h


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


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes "rope_parameters"; older configs have rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind not in ("default", "llama3"):
        raise ModelLoadError(f"rope scaling type {kind!r} is not supported (supported: default, llama3)")
    return RopeConfig(
        theta=float(theta),
        kind=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=int(merged.get("original_max_position_embeddings", 8192)),
        freq_factors=cfg.get("rope_freq_factors"),
    )


def _sliding_window_from_hf(cfg: dict[str, Any], style: str, num_layers: int) -> Optional[int]:
    """The window every layer attends within, read as HF reads it for the architecture (`style`, see
    ArchitectureSpec). A window on only some of the layers is refused: the engine runs one window
    for all layers (or none)."""
    window = cfg.get("sliding_window") if style != "none" else None
    if style == "layers" and not cfg.get("use_sliding_window", False):
        window = None
    if window is None:
        return None
    if int(window) < 1:
        raise ModelLoadError(f"config.json: sliding_window must be >= 1, got {window!r}")
    if style == "layers":
        first = int(cfg.get("max_window_layers", 28))  # HF's default: layers from this one on slide
        kinds = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                           for i in range(num_layers)]
        sliding = sum(kind == "sliding_attention" for kind in kinds)
        if sliding == 0:
            return None
        if sliding != len(kinds):
            raise ModelLoadError(
                f"config.json: the sliding window ({window}) applies to {sliding} of {len(kinds)} layers "
                "(layer_types / max_window_layers); tokenmill supports a window on all layers or on none")
    return int(window)


def arch_config_from_hf(cfg: dict[str, Any]) -> ModelArchConfig:
    """Parse an HF config.json dict; raises ModelLoadError naming what is missing."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ModelLoadError("config.json has no 'architectures' field")
    spec = resolve_architecture(archs)
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        eos = cfg.get("eos_token_id")
        return ModelArchConfig(
            architecture=spec.name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=spec.force_qkv_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=spec.qk_norm,
            rope=_rope_from_hf(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else (list(eos) if isinstance(eos, list) else [int(eos)]),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_window=_sliding_window_from_hf(cfg, spec.sliding_window, num_layers),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks the field {e.args[0]!r}") from None
