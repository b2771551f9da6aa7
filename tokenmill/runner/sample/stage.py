"""The interface every sampler stage implements, and the per-step batch the stages read."""

from abc import abstractmethod
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from tokenmill.runner.request_states import RowState


@dataclass(frozen=True)
class SampleBatch:
    """One step's sampling batch, as the stages see it."""

    rows: np.ndarray  # [B] request rows, on the host: what needed() reads
    idx: torch.Tensor  # [B] int64 on the device: the same rows, for gathering a stage's columns
    positions: torch.Tensor  # [B]: the position the sampled token will take in its sequence
    temperature: torch.Tensor  # [B] float32 on the device (0: greedy)
    # [B] int64 on the device: each row's index within its request's rows of the step (a verify
    # step's draft positions 0..k); None when every request has one row. Only grammar masks read it.
    offsets: Optional[torch.Tensor] = None


class SamplingStage(RowState):
    """A step of the sampler that rewrites the logits in place (logit bias, penalties, masks...).

    It owns its per-request rows (add_request / remove_request / apply_staged, from RowState) and
    runs only in steps where needed() says some row of the batch uses it. needed() decides on the
    CPU from the stage's numpy mirrors and never reads a device value."""

    @abstractmethod
    def needed(self, rows: np.ndarray) -> bool:
        """Whether some request among `rows` uses this stage."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, batch: SampleBatch) -> None:
        """Rewrite `logits` [B, V] (the sampler's float32 work copy) in place."""
