"""DeepSeek-V2 / V2-Lite / V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): the Llama decoder's
stack with multi-head latent attention (layers/mla.py) and DeepSeek's mixture of experts.

- Attention (heads split over tensor-parallel ranks): q from q_proj (V2-Lite) or the low-rank
  q_a_proj -> q_a_layernorm -> q_b_proj (V2, V3); kv_a_proj_with_mqa gives the latent (then
  kv_a_layernorm) and the shared rope'd key; the MLA layer caches the two and owns kv_b_proj (the
  checkpoint's self_attn.kv_b_proj). The softmax scale is (nope + rope) ** -0.5, times YaRN's
  mscale(mscale_all_dim) ** 2 (models/config.py).
- Rotary: DeepSeek's rope dims are interleaved pairs (V2's complex rotation; V3's rope_interleave);
  the rope rows of q and kv_a are permuted at load to (evens, odds), where the rotate-half kernels
  rotate the same pairs: V3's output layout exactly, V2's up to the same permutation of q and k, so q.k
  is unchanged.
- MoE: the first first_k_dense_replace layers dense; the others a router in fp32 (as HF keeps it),
  grouped routing inside FusedMoE (kernels/fused_moe.py GroupedTopK: V2 softmax, V3 sigmoid with
  e_score_correction_bias), and n_shared_experts' MLP added ungated.
- V3 checkpoints carry multi-token-prediction layers after the last decoder layer
  (model.layers.<num_hidden_layers>.*): skipped at load, logged.
"""

import re
from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import divide, get_tp_size
from tokenmill.kernels.fused_moe import GroupedTopK
from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from tokenmill.layers.mla import MLAAttention
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.logger import init_logger
from tokenmill.models.config import ModelArchConfig
from tokenmill.models.interface import AttentionSpec
from tokenmill.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel
from tokenmill.models.moe import MoeForCausalLM

logger = init_logger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _norm(norm: RMSNorm, hidden: torch.Tensor, residual: Optional[torch.Tensor]):
    """(norm(hidden + residual), hidden + residual); the first layer's input starts the stream."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


class DeepseekAttention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, layer_idx: int, dtype, device):
        super().__init__()
        m, h, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
        if max(m.qk_head_dim, m.v_head_dim) > m.cache_width:  # the piecewise buffers are a cache row wide
            raise ValueError(f"MLA head dims {m.qk_head_dim}/{m.v_head_dim} wider than a cache row {m.cache_width}")
        # Tensor parallelism splits the heads (q and o_proj by head, kv_b_proj in the MLA layer); the
        # low-rank q_a and the latent's kv_a are computed whole on every rank.
        kw = dict(bias=False, dtype=dtype, device=device)
        self.num_heads = divide(heads, get_tp_size())
        self.mla = m
        self.q_lora = m.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = ReplicatedLinear(h, m.q_lora_rank, **kw)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps, dtype=dtype, device=device)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, heads * m.qk_head_dim, **kw)
        else:
            self.q_proj = ColumnParallelLinear(h, heads * m.qk_head_dim, **kw)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, m.cache_width, **kw)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(heads * m.v_head_dim, h, **kw)
        self.rotary = rotary
        self.attn = MLAAttention(heads, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim,
                                 cfg.attn_scale, layer_idx, dtype=dtype, device=device)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = _norm(norm, hidden, residual)
        m, tokens = self.mla, hidden.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(tokens, self.num_heads, m.qk_head_dim)
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[:, : m.kv_lora_rank])
        q_pe, k_pe = self.rotary(positions, q[..., m.qk_nope_head_dim:], compressed[:, None, m.kv_lora_rank:])
        q = torch.cat((q[..., : m.qk_nope_head_dim], q_pe), dim=-1)
        return self.o_proj(self.attn(q, latent, k_pe[:, 0])), residual


class DeepseekRouter(nn.Module):
    """The router's logits in float32 over a float32 weight (HF keeps `gate.weight` in fp32)."""

    def __init__(self, hidden_size: int, num_experts: int, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class DeepseekMoE(nn.Module):
    """norm(hidden + residual) -> routed experts (grouped routing) + the shared experts, ungated;
    called as LlamaMLP is: (hidden, residual, norm) -> (output, new residual stream)."""

    def __init__(self, cfg: ModelArchConfig, dtype, device):
        super().__init__()
        moe = cfg.moe
        self.gate = DeepseekRouter(cfg.hidden_size, moe.num_experts, device)
        # V2-Lite's greedy softmax routing is plain top-k: the softmax routing kernel serves it
        grouping = (GroupedTopK(moe.scoring, moe.num_groups, moe.topk_groups, moe.group_score,
                                moe.routed_scaling_factor) if moe.grouped_routing else None)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.intermediate_size, moe.renormalize,
                                dtype=dtype, device=device, grouping=grouping,
                                correction_bias=moe.score_correction_bias)
        self.shared_experts = (LlamaMLP(cfg, dtype, device, intermediate_size=moe.shared_expert_intermediate_size)
                               if moe.shared_expert_intermediate_size else None)

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = _norm(norm, hidden, residual)
        out = self.experts(x, self.gate(x))
        if self.shared_experts is not None:
            out = out + self.shared_experts.forward_normed(x)
        return out, residual


def deepseek_mlp(cfg: ModelArchConfig, layer_idx: int, dtype, device) -> nn.Module:
    """The first first_k_dense_replace layers dense (intermediate_size), the rest DeepseekMoE."""
    if cfg.moe.is_sparse(layer_idx):
        return DeepseekMoE(cfg, dtype, device)
    return LlamaMLP(cfg, dtype, device)


class DeepseekDecoderLayer(LlamaDecoderLayer):
    attention_class = DeepseekAttention


class DeepseekModel(LlamaModel):
    decoder_layer = DeepseekDecoderLayer


def _interleaved_to_halves(rope_dim: int) -> torch.Tensor:
    """The row order that takes interleaved pairs (x0, x1), (x2, x3)... to (x0, x2, ..., x1, x3, ...)."""
    return torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))


class DeepseekForCausalLM(MoeForCausalLM):
    # Only the MLPs' gate / up are fused (q_proj is DeepSeek's whole query, not a q/k/v part).
    FUSED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    make_mlp = staticmethod(deepseek_mlp)
    model_class = DeepseekModel
    # checkpoint name piece -> ours: the MLA layer owns kv_b_proj, FusedMoE the routing bias
    _DEEPSEEK_RENAMES = ((".self_attn.kv_b_proj.", ".self_attn.attn.kv_b_proj."),
                         (".mlp.gate.e_score_correction_bias", ".mlp.experts.e_score_correction_bias"))

    def __init__(self, cfg: ModelArchConfig, max_positions: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        if cfg.mla is None:
            raise ValueError(f"{cfg.architecture}: DeepSeek's attention needs ModelArchConfig.mla")
        super().__init__(cfg, max_positions, dtype, device)

    def attention_spec(self) -> AttentionSpec:
        """One latent row of kv_lora_rank + rope numbers per token and layer (num_kv_heads 1)."""
        attn = self.model.layers[self.model.start].self_attn.attn
        return AttentionSpec(len(self.model.layers), attn.num_heads, 1, attn.cache_width, attn.scale,
                             self.lm_head.weight.dtype, latent=True)

    def _checkpoint_target(self, name: str) -> tuple[str, object]:
        for old, new in self._DEEPSEEK_RENAMES:
            name = name.replace(old, new)
        return super()._checkpoint_target(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._prepared(weights))

    def _prepared(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors minus the multi-token-prediction layers, rope rows in rotate-half order."""
        m, skipped = self.config.mla, set()
        order = _interleaved_to_halves(m.qk_rope_head_dim) if m.rope_interleave else None
        for name, tensor in weights:
            layer = _LAYER.match(name)
            if layer is not None and int(layer.group(1)) >= self.config.num_layers:
                skipped.add(int(layer.group(1)))
                continue
            if order is not None and name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
                heads = tensor.view(self.config.num_heads, m.qk_head_dim, -1)
                rope = heads[:, m.qk_nope_head_dim:][:, order.to(tensor.device)]
                tensor = torch.cat((heads[:, : m.qk_nope_head_dim], rope), dim=1).reshape(tensor.shape)
            elif order is not None and name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
                rope = tensor[m.kv_lora_rank:][order.to(tensor.device)]
                tensor = torch.cat((tensor[: m.kv_lora_rank], rope))
            yield name, tensor
        if skipped:
            logger.info("skipped the checkpoint's multi-token-prediction layers %s (not used for decoding)",
                        sorted(skipped))
