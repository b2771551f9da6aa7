"""Tensor-parallel state and collectives.

A model's layers learn their rank and the tensor-parallel size when they are built: `get_tp_state()` /
`get_tp_size()` read the state that `tensor_parallel(...)` sets around the
model's construction (the loader's, in each rank's process: executor/). Each layer keeps the
ParallelState it was built with and runs its collectives in that group, so the state is only read
at construction: two models of different parallel sizes in one process (a tensor-parallel engine
beside a single-process one, in tests) never see each other's groups. World size 1 by default: the
collectives are then no-ops.
"""

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    group: object = None  # the torch.distributed group of the tensor-parallel ranks (None: the default)
    pp_rank: int = 0  # pipeline stage (0 runs the embedding and the first layers)
    pp_size: int = 1
    # Data parallelism with expert parallelism (engine/dp_lockstep.py): this engine's DP rank, and
    # the group of the DP ranks that the MoE layers gather their tokens over (None with dp_size 1).
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: object = None
    # enable_expert_parallel: MoE layers place whole experts on the tp_size x dp_size ranks
    # instead of splitting every expert's intermediate dimension over the tensor-parallel ranks.
    expert_parallel: bool = False
    microbatching: bool = False  # MoE layers run two micro-batches, one's exchange under the other's experts

    @property
    def ep_size(self) -> int:
        return self.tp_size * self.dp_size if self.expert_parallel else 1

    @property
    def ep_rank(self) -> int:
        return self.dp_rank * self.tp_size + self.tp_rank if self.expert_parallel else 0

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """The decoder layers [start, end) of this pipeline stage (an even split)."""
        return self.pp_rank * num_layers // self.pp_size, (self.pp_rank + 1) * num_layers // self.pp_size


_BUILDING: contextvars.ContextVar[ParallelState] = contextvars.ContextVar("tokenmill_tp_state",
                                                                           default=ParallelState())


@contextlib.contextmanager
def tensor_parallel(state: ParallelState):
    """Layers built inside take this rank and group (the process group must exist when tp_size > 1)."""
    if (state.tp_size > 1 or state.dp_size > 1) and not dist.is_initialized():
        raise RuntimeError("tensor parallelism needs torch.distributed to be initialised first")
    token = _BUILDING.set(state)
    try:
        yield state
    finally:
        _BUILDING.reset(token)


def get_tp_state() -> ParallelState:
    return _BUILDING.get()


def get_tp_size() -> int:
    return _BUILDING.get().tp_size


def tp_all_reduce(x: torch.Tensor, state: Optional[ParallelState] = None, fixed_order: bool = False) -> torch.Tensor:
    """Sum x over the ranks of `state` (a layer's own; default: the state being built), in place.
    fixed_order: every element summed rank 0 first, then 1, ... (an all-gather, then the adds),
    where an all-reduce's order may follow the message size (batch-invariant numerics)."""
    state = state or _BUILDING.get()
    if state.tp_size == 1:
        return x
    if not fixed_order:
        dist.all_reduce(x, group=state.group)
        return x
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=state.group)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return x.copy_(total)


def tp_all_reduce_max(x: torch.Tensor, state: Optional[ParallelState] = None) -> torch.Tensor:
    """The elementwise max of x over the ranks of `state`, in place (e.g. the rows' largest
    weights before quantizing a row-parallel layer)."""
    state = state or _BUILDING.get()
    if state.tp_size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=state.group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1, state: Optional[ParallelState] = None) -> torch.Tensor:
    state = state or _BUILDING.get()
    if state.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=state.group)
    return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
