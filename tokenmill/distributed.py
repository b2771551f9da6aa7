"""Tensor-parallel state and collectives.

World size 1 by default: the collectives are then no-ops. The layers ask this module for their rank
and world size, so that turning on tensor parallelism (torch.distributed with NCCL on GPUs, gloo on
CPUs) only has to initialise the group here.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    group: object = None


_STATE = ParallelState()


def init_tensor_parallel(tp_size: int, tp_rank: int, group=None) -> None:
    """Declare this process's place in the tensor-parallel group (the process group must exist)."""
    global _STATE
    if tp_size > 1 and not dist.is_initialized():
        raise RuntimeError("tensor parallelism needs torch.distributed to be initialised first")
    _STATE = ParallelState(tp_rank=tp_rank, tp_size=tp_size, group=group)


def get_tp_rank() -> int:
    return _STATE.tp_rank


def get_tp_size() -> int:
    return _STATE.tp_size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    dist.all_reduce(x, group=_STATE.group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_STATE.group)
    return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
