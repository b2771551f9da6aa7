"""The Llama-family decoder: Llama 2/3/3.1, Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k norm), SmolLM2;
the mixture-of-experts families (models/moe.py) and Phi-3 (models/phi3.py) reuse it.

Parameter names follow HF's, except that q/k/v and gate/up are fused (`qkv_proj`, `gate_up_proj`);
`load_weights` maps the checkpoint's separate tensors onto them.
"""

import dataclasses
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from tokenmill.distributed import divide, get_tp_size, get_tp_state
from tokenmill.layers.attention import Attention
from tokenmill.layers.forward_context import current_forward_context
from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.layers.linear import (ADD_RMSNORM, SILU_MUL, MergedColumnParallelLinear, QKVParallelLinear,
                                     RowParallelLinear, default_weight_loader)
from tokenmill.layers.norm import RMSNorm, ShardedRMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, rope_inv_freq
from tokenmill.logger import init_logger
from tokenmill.models.config import ModelArchConfig
from tokenmill.models.interface import AttentionSpec

logger = init_logger(__name__)


def _norm_then_project(proj, hidden: torch.Tensor, residual: Optional[torch.Tensor], norm: RMSNorm):
    """(proj(norm(hidden + residual)), hidden + residual); the first layer has no residual yet, and
    its input becomes the stream. The norm rides in the projection (LinearBase.forward_fused: one
    GEMV kernel for batch-1 decode on CUDA, norm kernel + cuBLAS otherwise)."""
    if residual is None:
        return proj.forward_fused(hidden, ADD_RMSNORM, None, norm), hidden
    return proj.forward_fused(hidden, ADD_RMSNORM, residual, norm)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, layer_idx: int, dtype, device):
        super().__init__()
        tp = get_tp_size()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.qkv_bias, dtype=dtype, device=device)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype,
                                        device=device)
        qkv = self.qkv_proj
        self.per_head_norm = cfg.qk_norm and cfg.qk_norm_per_head
        if self.per_head_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, device=device)
        elif cfg.qk_norm:  # OLMoE: one norm over all of q, one over all of k (split over the ranks like them)
            self.q_norm = ShardedRMSNorm(self.q_size, qkv.tp_rank, qkv.tp_size, qkv.tp, cfg.rms_norm_eps,
                                         dtype=dtype, device=device)
            self.k_norm = ShardedRMSNorm(self.kv_size, qkv.tp_rank // qkv.kv_replicas, qkv.tp_size // qkv.kv_replicas,
                                         qkv.tp, cfg.rms_norm_eps, dtype=dtype, device=device)
        else:
            self.q_norm = self.k_norm = None
        self.clip_qkv = cfg.clip_qkv
        # q/k/v need a step of their own between the projection and attention (OLMoE's norm, clamp)
        self.prepares_qkv = (cfg.qk_norm and not self.per_head_norm) or cfg.clip_qkv is not None
        self.rotary = rotary
        # A window as long as the rotary table (the longest context) hides no key: off, at no cost.
        window = cfg.layer_window(layer_idx)
        if window is not None and window >= rotary.cos_sin_cache.shape[0]:
            window = None
        scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, scale=scale,
                              layer_idx=layer_idx, sliding_window=window, logit_softcap=cfg.attn_logit_softcap,
                              sinks=cfg.attention_sinks, dtype=dtype, device=device)
        divide(cfg.num_heads, tp)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(hidden + residual) -> q/k/v -> attention over the cache -> o_proj; returns the
        output and the new residual stream."""
        if self.q_norm is None and not self.prepares_qkv and self.qkv_proj.fuses_rope(hidden):
            # Batch 1 on CUDA: rotary and the KV-cache write ride in the q/k/v GEMV (one kernel fewer).
            k_cache, v_cache, slots, kv_scale = self.attn.step_cache()
            q, residual = self.qkv_proj.forward_rope_into_cache(hidden, residual, norm, positions,
                                                                self.rotary.cos_sin_cache, k_cache, v_cache, slots,
                                                                kv_scale)
            return self.o_proj(self.attn.attend_prepared(q)), residual
        qkv, residual = _norm_then_project(self.qkv_proj, hidden, residual, norm)
        tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.prepares_qkv:
            q, k, v = self._prepare_qkv(q, k, v)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        # Per-head q/k norm, rotary and the KV-cache write happen inside the attention layer (one fused kernel).
        if not self.per_head_norm:
            out = self.attn(positions, q, k, v, self.rotary.cos_sin_cache)
        else:
            out = self.attn(positions, q, k, v, self.rotary.cos_sin_cache,
                            self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        return self.o_proj(out), residual

    def _prepare_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """OLMoE's norm over all heads of q and of k, then the clamp of q, k and v (HF's order)."""
        if self.q_norm is not None and not self.per_head_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, dtype, device, intermediate_size: Optional[int] = None):
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [width] * 2, dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(width, cfg.hidden_size, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """down(silu_and_mul(gate_up(norm(hidden + residual)))) and the new residual stream."""
        gate_up, residual = _norm_then_project(self.gate_up_proj, hidden, residual, norm)
        return self.down_proj.forward_fused(gate_up, SILU_MUL), residual

    def forward_normed(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu_and_mul(gate_up(x))) of an input already normalised (a shared expert's)."""
        return self.down_proj.forward_fused(self.gate_up_proj(x), SILU_MUL)


# What builds decoder layer i's MLP: (config, layer index, dtype, device) -> a module called as
# mlp(hidden, residual, norm) -> (output, new residual stream).
MLPFactory = Callable[[ModelArchConfig, int, torch.dtype, object], nn.Module]


def dense_mlp(cfg: ModelArchConfig, layer_idx: int, dtype, device) -> nn.Module:
    """Every layer's MLP: gate/up, SiLU-and-mul, down, of the config's intermediate_size."""
    return LlamaMLP(cfg, dtype, device)


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention  # a family with another attention gives its own (models/deepseek.py)

    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, layer_idx: int, dtype, device,
                 make_mlp: MLPFactory = dense_mlp):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = self.attention_class(cfg, rotary, layer_idx, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = make_mlp(cfg, layer_idx, dtype, device)

    def forward(self, positions, hidden, residual: Optional[torch.Tensor]):
        # The residual stream is carried separately so each add fuses into the following RMSNorm,
        # and each RMSNorm into the projection after it.
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm)
        return self.mlp(hidden, residual, self.post_attention_layernorm)


def build_rotary(cfg: ModelArchConfig, max_positions: int, device) -> RotaryEmbedding:
    """The rotary table of a model serving up to max_positions tokens per sequence.

    LongRoPE: HF switches from the short to the long factors once a sequence is longer than
    original_max_position (and its generate() recomputes the cache then); tokenmill picks one set per
    engine, by its context length, so that no cached key ever mixes the two (docs/ARCHITECTURE.md).
    """
    r = cfg.rope
    factors, scale = r.freq_factors, 1.0
    if r.kind == "longrope":
        long = max_positions > r.original_max_position
        factors = r.long_factor if long else r.short_factor
        scale = r.attention_factor
        logger.info("LongRoPE: %s factors for every sequence (context length %d %s the original %d)",
                    "long" if long else "short", max_positions, ">" if long else "<=", r.original_max_position)
    if r.kind == "yarn":
        scale = r.attention_factor
    inv_freq = rope_inv_freq(cfg.rotary_dim, r.theta, r.kind, r.factor, r.low_freq_factor, r.high_freq_factor,
                             r.original_max_position, factors, r.beta_fast, r.beta_slow, r.truncate)
    return RotaryEmbedding(cfg.head_dim, max_positions, inv_freq, device=device, scale=scale)


class LlamaModel(nn.Module):
    decoder_layer = LlamaDecoderLayer  # a family with other layers gives its own (models/gemma.py)

    def __init__(self, cfg: ModelArchConfig, max_positions: int, dtype, device, make_mlp: MLPFactory = dense_mlp):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        # One table shared by all layers (Gemma 3: one for the global layers, one for the sliding ones).
        self.rotary = build_rotary(cfg, max_positions, device)
        self.local_rotary = None
        if cfg.local_rope is not None:
            self.local_rotary = build_rotary(dataclasses.replace(cfg, rope=cfg.local_rope), max_positions, device)
        # A pipeline stage builds only its own layers (the others are empty placeholders).
        self.start, self.end = get_tp_state().layer_range(cfg.num_layers)
        self.layers = nn.ModuleList(self.decoder_layer(cfg, self._layer_rotary(cfg, i), i, dtype, device, make_mlp)
                                    if self.start <= i < self.end else MissingLayer() for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                num_layers: Optional[int] = None) -> torch.Tensor:
        """Embedding, the decoder layers (only the first num_layers if given), the final norm. A
        pipeline stage runs its own layers between what it receives and what it sends on (the
        forward context's pipeline hook); a stage before the last returns its unnormalised output."""
        ctx = current_forward_context()
        pipe = ctx.pipeline if ctx is not None else None
        if pipe is not None and not pipe.is_first:
            hidden, residual = pipe.recv(input_ids.shape[0])
        else:
            hidden, residual = self.embed(input_ids), None
        end = self.end if num_layers is None else min(self.end, num_layers)
        for layer in self.layers[self.start:end]:
            hidden, residual = layer(positions, hidden, residual)
        if pipe is not None and not pipe.is_last:
            pipe.send(hidden, residual)
            return hidden
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def _layer_rotary(self, cfg: ModelArchConfig, layer: int) -> RotaryEmbedding:
        sliding = cfg.sliding_layers is None or cfg.sliding_layers[layer]
        return self.local_rotary if self.local_rotary is not None and sliding else self.rotary


class MissingLayer(nn.Module):
    """The place of a decoder layer another pipeline stage runs."""

    def forward(self, *args):
        raise RuntimeError("this decoder layer belongs to another pipeline stage")


class LlamaForCausalLM(nn.Module):
    # checkpoint name piece -> (our fused parameter's name piece, shard id)
    FUSED = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Builds each decoder layer's MLP (a family with other MLPs gives its own: models/moe.py).
    make_mlp: MLPFactory = staticmethod(dense_mlp)
    # The decoder stack (a family with other layers gives its own: models/gemma.py).
    model_class = LlamaModel

    def __init__(self, cfg: ModelArchConfig, max_positions: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        super().__init__()
        self.config = cfg
        self.model = self.model_class(cfg, max_positions or cfg.max_position_embeddings, dtype, device, self.make_mlp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def forward_first_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, num_layers: int) -> torch.Tensor:
        """The forward pass through the first num_layers decoder layers only, then the final norm:
        hidden states for compute_logits (a layer-truncated self-draft, runner/spec_decode/).
        Layer i still uses KV cache i of the forward context, so it shares the full model's cache."""
        if not 1 <= num_layers <= len(self.model.layers):
            raise ValueError(f"num_layers must be in 1..{len(self.model.layers)}, got {num_layers}")
        return self.model(input_ids, positions, num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> logits [N, vocab] in the model dtype (the sampler computes in float32)."""
        return self.lm_head.compute_logits(hidden)

    def attention_spec(self) -> AttentionSpec:
        """What the runner needs to know of the attention layers (models/interface.py)."""
        attn = self.model.layers[self.model.start].self_attn.attn
        windows = dict.fromkeys(layer.self_attn.attn.sliding_window
                                for layer in self.model.layers[self.model.start:self.model.end])
        return AttentionSpec(len(self.model.layers), attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
                             self.lm_head.weight.dtype, attn.sliding_window, attn.sinks is not None, tuple(windows))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the parameters; returns the names loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or not self._on_this_stage(name):
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue  # some tied checkpoints still store it; the embedding is the source
            if self._load_kv_scale(name, tensor):
                continue
            target, shard = self._checkpoint_target(name)
            param = params.get(target)
            if param is None:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            loader = getattr(param, "weight_loader", default_weight_loader)
            with torch.no_grad():
                if shard is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard)
            loaded.update(self._loaded_names(target, shard))
        return loaded

    def _checkpoint_target(self, name: str) -> tuple[str, object]:
        """(our parameter's name, the shard of it the tensor fills or None) for a checkpoint tensor."""
        for piece, (fused, shard_id) in self.FUSED.items():
            if f".{piece}." in name:
                return name.replace(f".{piece}.", f".{fused}."), shard_id
        return name, None

    def _loaded_names(self, target: str, shard) -> list[str]:
        """What loading `shard` of `target` counts as, in expected_weights' terms."""
        return [target if shard is None else f"{target}:{shard}"]

    # An FP8 checkpoint's KV-cache scales, per layer: HF's self_attn.{k,v}_scale, or the
    # {k,v}_proj.output_scale of older compressed-tensors checkpoints -> Attention.kv_scale[0 | 1].
    _KV_SCALE_SUFFIXES = {"self_attn.k_scale": 0, "self_attn.v_scale": 1,
                          "self_attn.k_proj.output_scale": 0, "self_attn.v_proj.output_scale": 1}

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> bool:
        for suffix, which in self._KV_SCALE_SUFFIXES.items():
            if name.endswith("." + suffix):
                if tensor.numel() != 1:
                    raise ValueError(f"{name}: a KV-cache scale must be one number, got shape {tuple(tensor.shape)}")
                value = float(tensor.reshape(()))  # at load, not on the step path
                if not (value > 0 and value != float("inf")):
                    raise ValueError(f"{name}: a KV-cache scale must be a positive finite number, got {value}")
                attn = self.get_submodule(name[: -len(suffix)] + "self_attn.attn")
                with torch.no_grad():
                    attn.kv_scale[which] = tensor.reshape(()).float()
                return True
        return False

    def _on_this_stage(self, name: str) -> bool:
        """Whether a checkpoint tensor belongs to this pipeline stage (every stage keeps the
        embedding, the final norm and the LM head; decoder layers only its own)."""
        if ".layers." not in name:
            return True
        index = int(name.split(".layers.", 1)[1].split(".", 1)[0])
        return self.model.start <= index < self.model.end

    def expected_weights(self) -> set[str]:
        """What load_weights must see for a complete checkpoint (same naming as its return value)."""
        names: set[str] = set()
        for name, _ in self.named_parameters():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            names.update(self._expected_names(name))
        return names

    def _expected_names(self, name: str) -> list[str]:
        """The names load_weights returns for a complete checkpoint's tensors of parameter `name`."""
        if ".qkv_proj." in name:
            return [f"{name}:{s}" for s in "qkv"]
        if ".gate_up_proj." in name:
            return [f"{name}:{s}" for s in (0, 1)]
        return [name]
