"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): the Llama decoder with a
sparse MoE block in place of the MLP on the layers the config names (ModelArchConfig.moe).

The block: the router `gate` (replicated on every tensor-parallel rank), the routed experts
(layers/fused_moe.py's FusedMoE), and, for Qwen2-MoE, a shared expert (a dense MLP) scaled by
sigmoid(shared_expert_gate(x)). Checkpoints store each expert's projections apart
(`experts.<e>.gate_proj/up_proj/down_proj`, Mixtral's `block_sparse_moe.experts.<e>.w1/w3/w2`), or,
as transformers 5 holds them in memory, fused (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]); each is copied into its slice of the stacked weights as it streams in.
"""

import re
from typing import Optional

import torch
from torch import nn

from tokenmill.layers.fused_moe import ClampedSwiGLU, FusedMoE
from tokenmill.layers.linear import ReplicatedLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.models.config import ModelArchConfig, architecture_spec
from tokenmill.models.llama import LlamaForCausalLM, LlamaMLP

# One expert's projection, as Qwen-MoE / OLMoE (gate_proj, up_proj, down_proj) and Mixtral (w1, w3, w2) name it.
# An FP8 checkpoint also stores each projection's block scales (`weight_scale_inv`).
_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.(weight|weight_scale_inv)")
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
# Every expert's projections in one tensor (transformers 5's in-memory layout).
_FUSED_EXPERTS = re.compile(r"(.+\.experts)\.(gate_up_proj|down_proj)")
_EXPERT_PARAMS = ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")
# FP8 experts quantized at load (layers/fp8_moe.py): scales their weights' loader sets, in no checkpoint
_DERIVED_PARAMS = ("w13_weight_scale", "w2_weight_scale")


class SparseMoeBlock(nn.Module):
    """norm(hidden + residual) -> router -> top-k experts (+ the gated shared expert); called as
    LlamaMLP is: (hidden, residual, norm) -> (output, new residual stream)."""

    def __init__(self, cfg: ModelArchConfig, dtype, device):
        super().__init__()
        moe = cfg.moe
        self.gate = ReplicatedLinear(cfg.hidden_size, moe.num_experts, bias=moe.bias, dtype=dtype, device=device)
        activation = None if moe.swiglu_limit is None else ClampedSwiGLU(moe.swiglu_alpha, moe.swiglu_limit)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.intermediate_size, moe.renormalize,
                                dtype=dtype, device=device, bias=moe.bias, activation=activation)
        if moe.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(cfg, dtype, device, intermediate_size=moe.shared_expert_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, bias=False, dtype=dtype, device=device)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = norm(hidden), hidden
        else:
            x, residual = norm(hidden, residual)
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            shared = self.shared_expert.forward_normed(x)
            # The gate widened to the row first: a [T, 1] sigmoid on the CPU takes its scalar tail path for
            # the last rows, whose bits then depend on T (batch_invariant); rows of H stay in vector lanes.
            out = out + torch.sigmoid(self.shared_expert_gate(x).expand_as(shared)) * shared
        return out, residual


def moe_or_dense_mlp(cfg: ModelArchConfig, layer_idx: int, dtype, device) -> nn.Module:
    """The sparse block on the layers MoEConfig.is_sparse names, a dense MLP of intermediate_size elsewhere."""
    if cfg.moe.is_sparse(layer_idx):
        return SparseMoeBlock(cfg, dtype, device)
    return LlamaMLP(cfg, dtype, device)


class MoeForCausalLM(LlamaForCausalLM):
    make_mlp = staticmethod(moe_or_dense_mlp)

    def __init__(self, cfg: ModelArchConfig, max_positions: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture}: a mixture-of-experts model needs ModelArchConfig.moe")
        super().__init__(cfg, max_positions, dtype, device)
        self._renames = architecture_spec(cfg.architecture).weight_renames

    def _checkpoint_target(self, name: str) -> tuple[str, object]:
        for old, new in self._renames:
            name = name.replace(old, new)
        match = _EXPERT.fullmatch(name)
        if match is not None:
            proj = _PROJ[match.group(3)]
            param = ("w2_weight" if proj == "down" else "w13_weight") + match.group(4)[len("weight"):]
            return f"{match.group(1)}.{param}", f"{match.group(2)}.{proj}"
        match = _FUSED_EXPERTS.fullmatch(name)
        if match is not None:
            if match.group(2) == "gate_up_proj":
                return f"{match.group(1)}.w13_weight", "gate_up"
            return f"{match.group(1)}.w2_weight", "down"
        return super()._checkpoint_target(name)

    def _experts_of(self, param_name: str) -> Optional[tuple[FusedMoE, str]]:
        module, _, leaf = param_name.rpartition(".")
        if leaf not in _EXPERT_PARAMS:
            return None
        return self.get_submodule(module), leaf

    def _loaded_names(self, target: str, shard) -> list[str]:
        experts = self._experts_of(target)
        if experts is None:
            return super()._loaded_names(target, shard)
        layer, leaf = experts
        return [f"{target}:{s}" for s in layer.shards_covered(leaf, shard)]

    def _expected_names(self, name: str) -> list[str]:
        if name.rpartition(".")[2] in _DERIVED_PARAMS:
            return []
        experts = self._experts_of(name)
        if experts is None:
            return super()._expected_names(name)
        layer, leaf = experts
        return [f"{name}:{s}" for s in layer.expected_shards(leaf)]
