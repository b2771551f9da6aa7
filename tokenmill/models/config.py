"""The architecture description tokenmill's models are built from, parsed from an HF config dict."""

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from tokenmill.errors import ModelLoadError, UnsupportedArchitectureError


@dataclass
class RopeConfig:
    theta: float = 10000.0
    # "default", "linear", "llama3", "longrope" or "yarn" (the other HF rope types are not implemented).
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # Per-frequency divisors (GGUF files store llama3 scaling this way, as a tensor).
    freq_factors: Optional[list[float]] = None
    # LongRoPE (Phi-3): per-frequency divisors for contexts up to original_max_position (short) and
    # beyond it (long), and the factor cos/sin are multiplied by (HF's attention_factor).
    short_factor: Optional[list[float]] = None
    long_factor: Optional[list[float]] = None
    attention_factor: float = 1.0
    # YaRN: the rotation counts that bound the blend between interpolated and original frequencies,
    # and whether those bounds are rounded outward to whole dimensions (HF's `truncate`, default on).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP: its experts, routing and which decoder layers have it."""

    num_experts: int
    top_k: int
    # Each expert's MLP width (Qwen's moe_intermediate_size; Mixtral's and OLMoE's intermediate_size).
    intermediate_size: int
    # The k routing weights are rescaled to sum to 1 (Qwen's and OLMoE's norm_topk_prob; Mixtral always).
    renormalize: bool
    # Qwen2-MoE's shared expert (a dense MLP of this width beside the experts, gated by a sigmoid); 0: none.
    shared_expert_intermediate_size: int = 0
    # Layer i is sparse when (i + 1) % sparse_step == 0 and i is not in dense_layers (Qwen's
    # decoder_sparse_step and mlp_only_layers); the others have a dense MLP of the model's intermediate_size.
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()
    # gpt-oss: the router and every expert's gate/up and down projections have biases, and the
    # experts' activation is the clamped SwiGLU (kernels/fused_moe.py's ClampedSwiGLU) when
    # swiglu_limit is set (None: silu(gate) * up).
    bias: bool = False
    swiglu_limit: Optional[float] = None
    swiglu_alpha: float = 1.702
    # DeepSeek's routing (kernels/fused_moe.py GroupedTopK): "softmax" or "sigmoid" scores (V3); the
    # experts in num_groups groups of which only the topk_groups best are chosen from, a group scored by
    # its best expert ("max", V2) or its two best ("top2_sum", V3); V3's per-expert bias added to the
    # scores for the choice only; the weights multiplied by routed_scaling_factor.
    scoring: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    score_correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    # The shared expert is scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE) or added as is (DeepSeek).
    shared_expert_gated: bool = True

    @property
    def grouped_routing(self) -> bool:
        """Routing beyond softmax-top-k (DeepSeek's): FusedMoE takes a GroupedTopK."""
        return (self.scoring != "softmax" or self.num_groups > 1 or self.score_correction_bias
                or self.routed_scaling_factor != 1.0)

    def is_sparse(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention: keys and values come from one compressed latent per
    token (kv_lora_rank wide) and a rope'd key part shared by the heads (qk_rope_head_dim)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # q goes through a low-rank pair q_a_proj / q_a_layernorm / q_b_proj (V3, V2); None: one q_proj (V2-Lite)
    q_lora_rank: Optional[int] = None
    # The checkpoint's rope dims are interleaved pairs (x0, x1), (x2, x3)... (V2; V3's rope_interleave);
    # the loader permutes them to rotate-half order (the rotary kernels' layout; q.k is unchanged).
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """One token's row of the latent KV cache: the latent, then the rope'd key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


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
    # True: q and k are normalised per head (Qwen3); False: over all heads at once, before they are
    # split into heads (OLMoE's q_norm / k_norm of width heads x head_dim).
    qk_norm_per_head: bool = True
    # q, k and v are clamped to [-clip_qkv, clip_qkv] after the projection (and q/k norm); OLMoE.
    clip_qkv: Optional[float] = None
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    # The dtype the checkpoint was saved in ("bfloat16", ...), if the config says.
    torch_dtype: Optional[str] = None
    # Every layer attends only to the last `sliding_window` positions (None: full attention).
    sliding_window: Optional[int] = None
    # Mixture-of-experts MLPs (None: every layer has a dense MLP of intermediate_size).
    moe: Optional[MoEConfig] = None
    # Rotary turns only the first fraction of each head's dims (Phi-4-mini: 0.75); the rest pass through.
    partial_rotary_factor: float = 1.0
    # RMSNorms per decoder layer (Gemma: before and after both attention and the MLP).
    norms_per_layer: int = 2
    # Which layers take `sliding_window` (Gemma's interleaved local and global layers); None: all of them.
    sliding_layers: Optional[tuple[bool, ...]] = None
    # The rotary of the sliding layers when it differs from the global layers' (Gemma 3's local base).
    local_rope: Optional[RopeConfig] = None
    # q.k is multiplied by this (None: head_dim ** -0.5); Gemma's query_pre_attn_scalar ** -0.5.
    attn_scale: Optional[float] = None
    # Gemma 2's tanh soft-capping of attention scores and of the final logits: cap * tanh(x / cap).
    attn_logit_softcap: Optional[float] = None
    final_logit_softcap: Optional[float] = None
    # gpt-oss: the attention output projection has a bias, and each q head a learned sink logit.
    o_bias: bool = False
    attention_sinks: bool = False
    # Multi-head latent attention (DeepSeek-V2 / V3; head_dim is then the rope'd width); None: q/k/v heads.
    mla: Optional[MLAConfig] = None

    def layer_window(self, layer: int) -> Optional[int]:
        """The sliding window of decoder layer `layer` (None: it attends to the whole context)."""
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def _attention_parameters(self) -> int:
        """One layer's attention, its q/k norms and its two RMSNorms."""
        h = self.hidden_size
        if self.mla is not None:
            return self._mla_parameters() + self.norms_per_layer * h
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim if self.qk_norm_per_head else self.q_size + self.kv_size
        attn += h if self.o_bias else 0
        attn += self.num_heads if self.attention_sinks else 0
        return attn + self.norms_per_layer * h

    def _mla_parameters(self) -> int:
        m, h, heads = self.mla, self.hidden_size, self.num_heads
        q = (h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim if m.q_lora_rank
             else h * heads * m.qk_head_dim)
        kv = h * m.cache_width + m.kv_lora_rank + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + heads * m.v_head_dim * h

    def _mlp_parameters(self, layer: int, active: bool) -> int:
        """Layer `layer`'s MLP: all its weights, or (active) those one token multiplies with."""
        h, moe = self.hidden_size, self.moe
        if moe is None or not moe.is_sparse(layer):
            return 3 * h * self.intermediate_size
        experts = moe.top_k if active else moe.num_experts
        shared = 0
        if moe.shared_expert_intermediate_size:
            shared = 3 * h * moe.shared_expert_intermediate_size + (h if moe.shared_expert_gated else 0)
        expert = 3 * h * moe.intermediate_size + (2 * moe.intermediate_size + h if moe.bias else 0)
        router = (h + 1 if moe.bias else h) * moe.num_experts
        return router + experts * expert + shared

    def _parameters(self, active: bool) -> int:
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        layers = sum(self._attention_parameters() + self._mlp_parameters(i, active) for i in range(self.num_layers))
        return layers + embed + self.hidden_size

    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied; every expert)."""
        return self._parameters(active=False)

    def num_active_parameters(self) -> int:
        """The parameters one token's forward pass uses: num_parameters() with only top_k experts
        per sparse layer (the router and any shared expert included); equal to it for dense models."""
        return self._parameters(active=True)

    def active_intermediate_size(self) -> float:
        """The MLP width one token passes through, averaged over the layers (experts: top_k x their
        width plus the shared expert's), for cost models written for a dense MLP."""
        total = 0
        for i in range(self.num_layers):
            moe = self.moe
            if moe is None or not moe.is_sparse(i):
                total += self.intermediate_size
            else:
                total += moe.top_k * moe.intermediate_size + moe.shared_expert_intermediate_size
        return total / max(1, self.num_layers)


@dataclass(frozen=True)
class MoESpec:
    """Where a mixture-of-experts family's config.json keeps its expert fields."""
    # the field of each expert's width
    expert_size_key: str = "moe_intermediate_size"
    # the field that says whether the top-k weights are renormalised (None: always, Mixtral)
    renormalize_key: Optional[str] = "norm_topk_prob"
    # Qwen2-MoE: shared_expert_intermediate_size
    shared_expert: bool = False
    # Qwen: decoder_sparse_step and mlp_only_layers
    sparse_layers: bool = False
    # gpt-oss: biases on the router and the experts, and the clamped SwiGLU (swiglu_limit, swiglu_alpha)
    gpt_oss: bool = False


@dataclass(frozen=True)
class ArchitectureSpec:
    name: str
    # Qwen2 always has biases on q/k/v (its config has no `attention_bias` field).
    force_qkv_bias: bool = False
    # The config field that turns the q/k/v biases on, and its default (Qwen2-MoE: qkv_bias, true).
    qkv_bias_key: str = "attention_bias"
    qkv_bias_default: bool = False
    # Qwen3 normalises each head of q and k with an RMSNorm before rotary; OLMoE all of q and all
    # of k (qk_norm_per_head False).
    qk_norm: bool = False
    qk_norm_per_head: bool = True
    # The config's `clip_qkv` is honoured (OLMoE).
    clip_qkv: bool = False
    # How HF reads the config's `sliding_window` for this architecture: "none" (never used), "all"
    # (every layer, Mistral, Mixtral), "all_if_used" (every layer if `use_sliding_window`, Qwen3-MoE),
    # "layers" (only if `use_sliding_window`, on the layers that `layer_types` or
    # `max_window_layers` name, Qwen2/Qwen3), "alternate_layers" (the same with Qwen2-MoE's default
    # layer_types: every other layer below max_window_layers), "layer_types" (always, on the layers
    # `layer_types` names, by default all but every window_pattern-th: Gemma 2 and 3).
    sliding_window: str = "none"
    window_pattern: int = 0
    # Gemma: query_pre_attn_scalar, the soft-capping fields, four norms per layer, q/k norm read as is.
    gemma: bool = False
    # A mixture-of-experts family (models/moe.py builds it).
    moe: Optional[MoESpec] = None
    # The config's partial_rotary_factor is honoured (Phi-3's family; others ignore it, as HF does).
    partial_rotary: bool = False
    # LoRA adapters can be applied (Phi-3's name the fused qkv_proj / gate_up_proj, not mapped yet).
    lora: bool = True
    # Checkpoint name pieces the family writes otherwise than the Llama/Qwen layout, and ours.
    weight_renames: tuple[tuple[str, str], ...] = ()
    # gpt-oss: attention sinks and an o_proj bias (with attention_bias), layer_types' sliding layers,
    # rope_theta 150000 when the config leaves it out (HF's GptOssConfig default).
    gpt_oss: bool = False
    # DeepSeek's multi-head latent attention and routing, "v2" or "v3" (models/deepseek.py).
    deepseek: Optional[str] = None


_ARCHITECTURES = {
    spec.name: spec
    for spec in (
        ArchitectureSpec("LlamaForCausalLM"),
        ArchitectureSpec("MistralForCausalLM", sliding_window="all"),
        ArchitectureSpec("Qwen2ForCausalLM", force_qkv_bias=True, sliding_window="layers"),
        ArchitectureSpec("Qwen3ForCausalLM", qk_norm=True, sliding_window="layers"),
        ArchitectureSpec("Qwen3MoeForCausalLM", qk_norm=True, sliding_window="all_if_used",
                         moe=MoESpec(sparse_layers=True)),
        ArchitectureSpec("Qwen2MoeForCausalLM", qkv_bias_key="qkv_bias", qkv_bias_default=True,
                         sliding_window="alternate_layers", moe=MoESpec(shared_expert=True, sparse_layers=True)),
        ArchitectureSpec("MixtralForCausalLM", sliding_window="all",
                         moe=MoESpec(expert_size_key="intermediate_size", renormalize_key=None),
                         weight_renames=((".block_sparse_moe.", ".mlp."),)),
        # Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv_proj / gate_up_proj in the checkpoint (models/phi3.py).
        ArchitectureSpec("Phi3ForCausalLM", sliding_window="all", partial_rotary=True, lora=False),
        # Gemma 2 / Gemma 3 text: (1 + w) norms, GeGLU, scaled embeddings (models/gemma.py).
        # LoRA not tested on them yet: refused.
        ArchitectureSpec("Gemma2ForCausalLM", sliding_window="layer_types", window_pattern=2, gemma=True, lora=False),
        ArchitectureSpec("Gemma3ForCausalLM", qk_norm=True, sliding_window="layer_types", window_pattern=6,
                         gemma=True, lora=False),
        ArchitectureSpec("OlmoeForCausalLM", qk_norm=True, qk_norm_per_head=False, clip_qkv=True,
                         moe=MoESpec(expert_size_key="intermediate_size")),
        # gpt-oss: its checkpoint layout (interleaved gate/up, MXFP4 experts) is models/gpt_oss.py's.
        # LoRA not tested on it (attention sinks, biased experts): refused.
        ArchitectureSpec("GptOssForCausalLM", qkv_bias_default=True, sliding_window="layer_types", window_pattern=2,
                         moe=MoESpec(expert_size_key="intermediate_size", renormalize_key=None, gpt_oss=True),
                         lora=False, gpt_oss=True, weight_renames=((".mlp.router.", ".mlp.gate."),)),
        # DeepSeek-V2 / V3: multi-head latent attention, grouped routing, ungated shared experts
        # (models/deepseek.py); LoRA adapters have no MLA projections mapped: refused.
        ArchitectureSpec("DeepseekV2ForCausalLM", moe=MoESpec(), lora=False, deepseek="v2"),
        ArchitectureSpec("DeepseekV3ForCausalLM", moe=MoESpec(), lora=False, deepseek="v3"),
    )
}


def architecture_spec(name: str) -> ArchitectureSpec:
    """The table's entry of a supported architecture (as ModelArchConfig.architecture names it)."""
    return resolve_architecture([name])


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve_architecture(architectures: list[str]) -> ArchitectureSpec:
    for name in architectures:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    raise UnsupportedArchitectureError(
        f"unsupported architecture {architectures}; tokenmill supports {supported_architectures()}"
    )


def _rope_from_hf(cfg: dict[str, Any], rotary_dim: int, layer_type: str = "full_attention") -> RopeConfig:
    # transformers 5 writes "rope_parameters" (Gemma 3: one dict per layer type); older configs have
    # rope_theta + rope_scaling (Gemma 3: rope_local_base_freq for the sliding layers, unscaled).
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    default_theta = 10000.0
    if "full_attention" in params or "sliding_attention" in params:
        params = dict(params.get(layer_type) or {})
    if layer_type == "sliding_attention":
        scaling = {}
        default_theta = cfg.get("rope_local_base_freq", 10000.0)
    theta = params.get("rope_theta", default_theta if layer_type == "sliding_attention"
                       else cfg.get("rope_theta", default_theta))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind == "su":  # early Phi-3 configs' name for LongRoPE (HF renames it too)
        kind = "longrope"
    if kind not in ("default", "linear", "llama3", "longrope", "yarn"):
        raise ModelLoadError(f"rope scaling type {kind!r} is not supported "
                             "(supported: default, linear, llama3, longrope, yarn)")
    original = merged.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    rope = RopeConfig(
        theta=float(theta),
        kind=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=int(original if original is not None else 8192),
        freq_factors=cfg.get("rope_freq_factors"),
    )
    if kind == "longrope":
        _longrope_from_hf(rope, merged, cfg, rotary_dim)
    if kind == "yarn":
        _yarn_from_hf(rope, merged, cfg)
    return rope


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor`: 0.1 * mscale * ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_from_hf(rope: RopeConfig, merged: dict[str, Any], cfg: dict[str, Any]) -> None:
    """YaRN's parameters as HF's _compute_yarn_parameters reads them (DeepSeek's mscale pair included)."""
    original = merged.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if original is None:
        raise ModelLoadError("config.json: yarn scaling needs original_max_position_embeddings")
    rope.original_max_position = int(original)
    factor = merged.get("factor")
    if factor is None:
        factor = int(cfg.get("max_position_embeddings", original)) / rope.original_max_position
    rope.factor = float(factor)
    rope.beta_fast = float(merged.get("beta_fast") or 32)
    rope.beta_slow = float(merged.get("beta_slow") or 1)
    rope.truncate = bool(merged.get("truncate", True))
    attention = merged.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = merged.get("mscale"), merged.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = yarn_mscale(rope.factor, mscale) / yarn_mscale(rope.factor, mscale_all_dim)
        else:
            attention = yarn_mscale(rope.factor)
    rope.attention_factor = float(attention)


def _longrope_from_hf(rope: RopeConfig, merged: dict[str, Any], cfg: dict[str, Any], rotary_dim: int) -> None:
    """LongRoPE's factor lists and attention factor, as HF's _compute_longrope_parameters reads them."""
    original = merged.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if original is None:
        raise ModelLoadError("config.json: longrope scaling needs original_max_position_embeddings")
    rope.original_max_position = int(original)
    half = rotary_dim // 2
    for key in ("short_factor", "long_factor"):
        values = merged.get(key)
        if not isinstance(values, list) or len(values) != half:
            raise ModelLoadError(f"config.json: longrope {key} must be a list of {half} numbers, got {values!r}")
        setattr(rope, key, [float(v) for v in values])
    # Without an explicit factor HF takes the context extension max_position_embeddings / original.
    factor = merged.get("factor")
    if factor is None:
        factor = int(cfg.get("max_position_embeddings", 4096)) / rope.original_max_position
    rope.factor = float(factor)
    attention = merged.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(rope.original_max_position))
    rope.attention_factor = float(attention)


def _partial_rotary_factor(cfg: dict[str, Any]) -> float:
    # Hub configs have it top-level; transformers 5 also writes it into rope_parameters.
    value = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    return 1.0 if value is None else float(value)


def _layer_types(cfg: dict[str, Any], pattern: int, num_layers: int) -> list[str]:
    """Gemma's layer kinds: config.json's `layer_types`, else HF's default from the pattern (every
    pattern-th layer global; Gemma 3's hub configs say sliding_window_pattern)."""
    kinds = cfg.get("layer_types")
    if kinds is None:
        pattern = int(cfg.get("sliding_window_pattern") or pattern)
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if len(kinds) != num_layers or not set(kinds) <= {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"config.json: layer_types must name sliding_attention or full_attention for "
                             f"each of the {num_layers} layers, got {kinds!r}")
    return list(kinds)


def _sliding_window_from_hf(cfg: dict[str, Any], style: str, num_layers: int) -> Optional[int]:
    """The window the sliding layers attend within, read as HF reads it for the architecture (`style`,
    see ArchitectureSpec). A window on only some of the layers is refused except for the Gemma
    families ("layer_types"), whose layers say which they are (ModelArchConfig.sliding_layers)."""
    if style == "layer_types":
        window = cfg.get("sliding_window")
        if window is not None and int(window) < 1:
            raise ModelLoadError(f"config.json: sliding_window must be >= 1, got {window!r}")
        return None if window is None else int(window)
    window = cfg.get("sliding_window") if style != "none" else None
    if style in ("layers", "alternate_layers", "all_if_used") and not cfg.get("use_sliding_window", False):
        window = None
    if window is None:
        return None
    if int(window) < 1:
        raise ModelLoadError(f"config.json: sliding_window must be >= 1, got {window!r}")
    if style in ("layers", "alternate_layers"):
        first = int(cfg.get("max_window_layers", 28))
        # HF's default layer_types: Qwen2/Qwen3 slide from layer max_window_layers on, Qwen2-MoE on
        # the even-indexed layers below it.
        slides = (lambda i: i >= first) if style == "layers" else (lambda i: i % 2 == 0 and i < first)
        kinds = cfg.get("layer_types") or ["sliding_attention" if slides(i) else "full_attention"
                                           for i in range(num_layers)]
        sliding = sum(kind == "sliding_attention" for kind in kinds)
        if sliding == 0:
            return None
        if sliding != len(kinds):
            raise ModelLoadError(
                f"config.json: the sliding window ({window}) applies to {sliding} of {len(kinds)} layers "
                "(layer_types / max_window_layers); tokenmill supports a window on all layers or on none")
    return int(window)


def _moe_from_hf(cfg: dict[str, Any], spec: MoESpec) -> MoEConfig:
    """The experts' fields, read as HF reads them for the family (`spec`)."""
    # transformers 5 writes num_local_experts for every family (an alias); hub configs of Qwen-MoE
    # and OLMoE say num_experts, Mixtral's num_local_experts.
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if num_experts is None:
        raise ModelLoadError("config.json lacks the field 'num_experts' (or 'num_local_experts')")
    moe = MoEConfig(
        num_experts=int(num_experts),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg[spec.expert_size_key]),
        renormalize=True if spec.renormalize_key is None else bool(cfg.get(spec.renormalize_key, False)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if spec.shared_expert else 0,
        sparse_step=int(cfg.get("decoder_sparse_step") or 1) if spec.sparse_layers else 1,
        dense_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()) if spec.sparse_layers else (),
        bias=spec.gpt_oss,
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)) if spec.gpt_oss else None,
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
    )
    if moe.num_experts > 0 and not 1 <= moe.top_k <= moe.num_experts:
        raise ModelLoadError(f"config.json: num_experts_per_tok {moe.top_k} must be in 1..{moe.num_experts}")
    return moe


def _gemma_fields(cfg: dict[str, Any], spec: ArchitectureSpec, num_layers: int, head_dim: int) -> dict[str, Any]:
    """What Gemma 2 / 3 add: which layers slide, the local layers' rotary, the attention scale and
    the soft-caps (HF's defaults where the config leaves them out)."""
    kinds = _layer_types(cfg, spec.window_pattern, num_layers)
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":  # models/gemma.py's GeGLU is the tanh GELU's
        raise ModelLoadError(f"config.json: hidden_activation {act!r} is not supported (supported: gelu_pytorch_tanh)")
    softcaps = {"Gemma2ForCausalLM": (50.0, 30.0)}.get(spec.name, (None, None))
    attn_cap = cfg.get("attn_logit_softcapping", softcaps[0])
    final_cap = cfg.get("final_logit_softcapping", softcaps[1])
    fields = dict(sliding_layers=tuple(kind == "sliding_attention" for kind in kinds),
                  attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
                  attn_logit_softcap=None if attn_cap is None else float(attn_cap),
                  final_logit_softcap=None if final_cap is None else float(final_cap),
                  norms_per_layer=4)
    if spec.name == "Gemma3ForCausalLM":
        fields["local_rope"] = _rope_from_hf(cfg, head_dim, "sliding_attention")
    return fields


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope scaling fields however the config writes them (rope_scaling, rope_parameters)."""
    return {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}


def mla_softmax_scale(cfg: dict[str, Any], qk_head_dim: int) -> float:
    """(nope + rope) ** -0.5, times mscale(factor, mscale_all_dim) ** 2 when rope scaling names
    mscale_all_dim: DeepSeek scales the whole of q.k, not only the rotated dims (HF's yarn_apply_mscale)."""
    scale = qk_head_dim ** -0.5
    rope = _rope_params(cfg)
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale = scale * m * m
    return scale


_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _deepseek_fields(cfg: dict[str, Any], version: str, num_heads: int) -> dict[str, Any]:
    """What DeepSeek-V2 / V3 set otherwise than the Llama layout, read as HF's classes read them:
    the MLA shapes (head_dim is the rope'd width, as HF sets it), the softmax scale, and the MoE
    routing (V2: softmax, topk_method greedy or group_limited_greedy, never renormalised, as HF's
    V2 router ignores norm_topk_prob; V3: sigmoid with the correction bias in every group-limited
    choice, renormalised by norm_topk_prob)."""
    if cfg.get("attention_bias"):
        raise ModelLoadError("config.json: attention_bias on DeepSeek's MLA projections is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"config.json: hidden_act {cfg.get('hidden_act')!r} is not supported (supported: silu)")
    q_lora = cfg.get("q_lora_rank")
    mla = MLAConfig(kv_lora_rank=int(cfg.get("kv_lora_rank", 512)),
                    qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)),
                    qk_rope_head_dim=int(cfg.get("qk_rope_head_dim", 64)), v_head_dim=int(cfg.get("v_head_dim", 128)),
                    q_lora_rank=int(q_lora) if q_lora else None,
                    rope_interleave=True if version == "v2" else bool(cfg.get("rope_interleave", True)))
    experts = int(cfg.get("n_routed_experts", 64 if version == "v2" else 256))
    num_groups = int(cfg.get("n_group") or 1)
    topk_groups = int(cfg.get("topk_group") or 1)
    if version == "v2":
        method = cfg.get("topk_method") or "greedy"
        if method not in _V2_TOPK_METHODS:
            raise ModelLoadError(f"config.json: topk_method {method!r} is not supported "
                                 f"(supported: {', '.join(_V2_TOPK_METHODS)})")
        if method == "greedy":
            num_groups = topk_groups = 1
        routing = dict(scoring="softmax", group_score="max", renormalize=False)
    else:
        routing = dict(scoring="sigmoid", group_score="top2_sum", score_correction_bias=True,
                       renormalize=bool(cfg.get("norm_topk_prob", True)))
    if experts % num_groups or not 1 <= topk_groups <= num_groups:
        raise ModelLoadError(f"config.json: {experts} experts in n_group {num_groups} groups, topk_group {topk_groups}")
    k = int(cfg.get("first_k_dense_replace") or 0)
    shared = int(cfg.get("n_shared_experts") or 0) * int(cfg["moe_intermediate_size"])
    moe = MoEConfig(num_experts=experts, top_k=int(cfg["num_experts_per_tok"]),
                    intermediate_size=int(cfg["moe_intermediate_size"]), shared_expert_intermediate_size=shared,
                    shared_expert_gated=False, dense_layers=tuple(range(k)), num_groups=num_groups,
                    topk_groups=topk_groups, routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                    **routing)
    if not 1 <= moe.top_k <= experts:
        raise ModelLoadError(f"config.json: num_experts_per_tok {moe.top_k} must be in 1..{experts}")
    return dict(mla=mla, moe=moe, head_dim=mla.qk_rope_head_dim, num_kv_heads=num_heads,
                attn_scale=mla_softmax_scale(cfg, mla.qk_head_dim))


# Gemma3TextConfig's defaults, for hub configs whose text_config names only what differs from them.
_GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                             max_position_embeddings=131_072, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                             query_pre_attn_scalar=256, sliding_window=4096, tie_word_embeddings=True)


def _language_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gemma3ForConditionalGeneration config as its text model's: the vision tower is not served
    (models/gemma.py skips its weights)."""
    if "Gemma3ForConditionalGeneration" not in (cfg.get("architectures") or []):
        return cfg
    text = {**_GEMMA3_TEXT_DEFAULTS, **(cfg.get("text_config") or {})}
    for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "tie_word_embeddings"):
        if key in cfg and key not in (cfg.get("text_config") or {}):
            text[key] = cfg[key]
    return {**text, "architectures": ["Gemma3ForCausalLM"]}


def _gpt_oss_fields(cfg: dict[str, Any], spec: ArchitectureSpec, num_layers: int) -> dict[str, Any]:
    """What gpt-oss adds: which layers slide (layer_types, by default every other one from layer 0),
    the attention sinks, and o_proj's bias (attention_bias covers all four projections)."""
    kinds = _layer_types(cfg, spec.window_pattern, num_layers)
    act = cfg.get("hidden_act") or "silu"
    if act != "silu":  # the clamped SwiGLU's sigmoid gate is what the kernels implement
        raise ModelLoadError(f"config.json: hidden_act {act!r} is not supported for gpt-oss (supported: silu)")
    return dict(sliding_layers=tuple(kind == "sliding_attention" for kind in kinds), attention_sinks=True,
                o_bias=bool(cfg.get(spec.qkv_bias_key, spec.qkv_bias_default)))


def arch_config_from_hf(cfg: dict[str, Any]) -> ModelArchConfig:
    """Parse an HF config.json dict; raises ModelLoadError naming what is missing."""
    cfg = _language_model_config(cfg)
    archs = cfg.get("architectures") or []
    if not archs:
        raise ModelLoadError("config.json has no 'architectures' field")
    spec = resolve_architecture(archs)
    if spec.gpt_oss and "rope_theta" not in cfg:  # HF's GptOssConfig default
        cfg = {**cfg, "rope_theta": 150000.0}
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        partial_rotary = _partial_rotary_factor(cfg) if spec.partial_rotary else 1.0
        if not 0 < partial_rotary <= 1 or int(head_dim * partial_rotary) % 2:
            raise ModelLoadError(f"config.json: partial_rotary_factor {partial_rotary} must leave an even number "
                                 f"of rotated dims in (0, head_dim {head_dim}]")
        eos = cfg.get("eos_token_id")
        deepseek = _deepseek_fields(cfg, spec.deepseek, num_heads) if spec.deepseek else {}
        if deepseek:
            head_dim = deepseek.pop("head_dim")
        fields = dict(
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            moe=_moe_from_hf(cfg, spec.moe) if spec.moe is not None and not deepseek else None,
            **(_gemma_fields(cfg, spec, num_layers, head_dim) if spec.gemma else {}))
        fields.update(deepseek)
        return ModelArchConfig(
            architecture=spec.name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=spec.force_qkv_bias or bool(cfg.get(spec.qkv_bias_key, spec.qkv_bias_default)),
            qk_norm=spec.qk_norm,
            qk_norm_per_head=spec.qk_norm_per_head,
            clip_qkv=float(cfg["clip_qkv"]) if spec.clip_qkv and cfg.get("clip_qkv") is not None else None,
            rope=_rope_from_hf(cfg, int(head_dim * partial_rotary)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else (list(eos) if isinstance(eos, list) else [int(eos)]),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_window=_sliding_window_from_hf(cfg, spec.sliding_window, num_layers),
            partial_rotary_factor=partial_rotary,
            **fields,
            **(_gpt_oss_fields(cfg, spec, num_layers) if spec.gpt_oss else {}),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks the field {e.args[0]!r}") from None
