"""Choosing between the Triton kernel and the torch reference, and the device facts launches need."""

import functools

import torch

H200_SM_COUNT = 132  # what launch choices assume off the GPU (CPU tests, interpreter)


def use_triton(t: torch.Tensor) -> bool:
    """Triton kernels run on CUDA tensors; everything else takes the torch reference."""
    return t.is_cuda


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (H200_SM_COUNT for any other device)."""
    if device.type != "cuda":
        return H200_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
