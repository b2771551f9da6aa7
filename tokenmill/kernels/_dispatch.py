"""Choosing between the Triton kernel and the torch reference."""

import torch


def use_triton(t: torch.Tensor) -> bool:
    """Triton kernels run on CUDA tensors; everything else takes the torch reference."""
    return t.is_cuda
