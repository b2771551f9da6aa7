"""Pipeline parallelism: the decoder layers split over stages, the hidden states and residual stream
sent from each stage to the next with point-to-point ops.

Rank layout (executor/tensor_parallel.py): world = tp x pp ranks; rank r is tensor-parallel rank
r % tp of stage pp - 1 - r // tp, so rank 0 (the engine's process) is in the LAST stage: the logits,
the sampled tokens, their logprobs and prompt logprobs the engine reads are real there. The other
stages run the same runner steps (so their request state, block tables and positions stay the
same), and after each step's sampling they take the last stage's tokens (a broadcast from rank 0)
before updating their state, since the first stage feeds them to the next step. Each tensor-parallel
rank of a stage sends its (replicated) hidden states to the same tensor-parallel rank of the next.

Steps run one at a time through the stages (eager; no CUDA graphs): a stage waits while the others
run. Several micro-batches in flight, so that stages overlap, are not implemented yet.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist


def stage_of(rank: int, tp: int, pp: int) -> int:
    return pp - 1 - rank // tp


def rank_of(stage: int, tp_rank: int, tp: int, pp: int) -> int:
    return (pp - 1 - stage) * tp + tp_rank


@dataclass
class PipelineLink:
    """One rank's side of the pipeline (layers/forward_context.py's PipelineHook)."""

    stage: int
    pp: int
    tp_rank: int
    tp: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    world_group: object = None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1

    def recv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = rank_of(self.stage - 1, self.tp_rank, self.tp, self.pp)
        both = torch.empty((2, num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        dist.recv(both, src=src)
        return both[0], both[1]

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        dst = rank_of(self.stage + 1, self.tp_rank, self.tp, self.pp)
        dist.send(torch.stack([hidden, residual]).contiguous(), dst=dst)

    def share_sampled(self, sampled: torch.Tensor) -> None:
        """Every rank's `sampled` becomes rank 0's (the last stage's), in place."""
        dist.broadcast(sampled, src=0, group=self.world_group)
