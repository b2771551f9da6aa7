"""RMSNorm layers: over the fused residual-add + RMSNorm kernel, and over features split across
tensor-parallel ranks."""

from typing import Optional

import torch
from torch import nn

from tokenmill.distributed import ParallelState, tp_all_reduce
from tokenmill.kernels.norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor = None):
        """With a residual: returns (norm(x + residual), x + residual) for the next layer's residual."""
        return rms_norm(x, self.weight, self.eps, residual)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a feature vector whose features are split across tensor-parallel ranks (a
    column-parallel projection's output, e.g. OLMoE's q/k norm over all heads): each rank holds
    `size` features and the matching part of the weight; the mean of squares is summed over ranks.

    `part` of `parts`: which of the checkpoint weight's equal parts this rank holds (its rank of
    tp_size, or for KV heads replicated over ranks, rank // replicas of tp_size // replicas).
    Replicated parts count once per replica in the sum and in the width alike: the mean is the same."""

    def __init__(self, size: int, part: int, parts: int, tp: ParallelState, eps: float = 1e-6, dtype=None,
                 device=None):
        super().__init__()
        self.eps = eps
        self.size, self.tp = size, tp
        self.fixed_order_reduce = False  # batch_invariant: the ranks' sums of squares added in rank order
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = _ShardLoader(part, parts, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, size] -> weight * x / rms(x over every rank's features)."""
        if self.tp.tp_size == 1:
            return rms_norm(x, self.weight, self.eps)
        h = x.float()
        sum_sq = tp_all_reduce(h.pow(2).sum(-1, keepdim=True), self.tp, self.fixed_order_reduce)
        h = h * torch.rsqrt(sum_sq / (self.size * self.tp.tp_size) + self.eps)
        return self.weight * h.to(x.dtype)


class _ShardLoader:
    """A ShardedRMSNorm weight's loader: the rank's part of the full checkpoint vector (holds no
    reference to the layer)."""

    __slots__ = ("part", "parts", "size")

    def __init__(self, part: int, parts: int, size: int):
        self.part, self.parts, self.size = part, parts, size

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[object] = None) -> None:
        if tuple(loaded.shape) != (self.parts * self.size,):
            raise ValueError(f"shape mismatch loading a norm weight: checkpoint {tuple(loaded.shape)}, "
                             f"model ({self.parts * self.size},)")
        param.data.copy_(loaded.narrow(0, self.part * self.size, self.size))
