"""Logprobs of the emitted tokens: each sampled token's logprob and rank, and the top-k pairs,
taken from the raw logits (before any stage), for the rows that ask for them."""

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from tokenmill.kernels.sampling import logprobs
from tokenmill.step_io import LogprobsArrays, NewRequestData
from tokenmill.runner.request_states import RowState


@dataclass(frozen=True)
class DeviceLogprobs:
    """A step's logprobs as tensors (on the device, then in pinned host memory); LogprobsArrays is
    the numpy form the engine receives."""

    token_logprobs: torch.Tensor  # [B] float32: the sampled token's logprob
    token_ranks: torch.Tensor  # [B] int
    top_ids: torch.Tensor  # [B, k] int
    top_logprobs: torch.Tensor  # [B, k] float32

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "DeviceLogprobs":
        return DeviceLogprobs(fn(self.token_logprobs), fn(self.token_ranks), fn(self.top_ids), fn(self.top_logprobs))

    def to_arrays(self) -> LogprobsArrays:
        """Host tensors only."""
        return LogprobsArrays(self.token_logprobs.numpy().astype(np.float32), self.token_ranks.numpy().astype(np.int64),
                              self.top_ids.numpy().astype(np.int64), self.top_logprobs.numpy().astype(np.float32))


class LogprobsReader(RowState):
    def __init__(self, max_num_reqs: int):
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # top-k asked for; -1: none

    def add_request(self, row: int, new: NewRequestData) -> None:
        k = new.params.logprobs
        self.num_logprobs[row] = -1 if k is None else k

    def needed(self, rows: np.ndarray) -> bool:
        return bool(len(rows)) and bool(self.num_logprobs[rows].max() >= 0)

    def read(self, raw_logits: torch.Tensor, sampled: torch.Tensor, rows: np.ndarray) -> Optional[DeviceLogprobs]:
        """The batch's logprobs with the largest k any of its rows asked for; None if none asked."""
        if not self.needed(rows):
            return None
        k = int(self.num_logprobs[rows].max())
        return DeviceLogprobs(*logprobs(raw_logits, sampled, k))
