"""RMSNorm layer over the fused residual-add + RMSNorm kernel."""

import torch
from torch import nn

from tokenmill.kernels.norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor = None):
        """With a residual: returns (norm(x + residual), x + residual) for the next layer's residual."""
        return rms_norm(x, self.weight, self.eps, residual)
