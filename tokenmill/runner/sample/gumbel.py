"""The sampling itself: Gumbel-max with noise hashed from (request seed, position, token id), or
plain argmax when every row of the batch is greedy."""

import numpy as np
import torch

from tokenmill.kernels.sampling import gumbel_sample
from tokenmill.step_io import NewRequestData
from tokenmill.runner.request_states import RowParams, RowState
from tokenmill.runner.sample.stage import SampleBatch


class GumbelSampler(RowState):
    def __init__(self, max_num_reqs: int, device: torch.device):
        self._seeds = RowParams((0,), max_num_reqs, np.int64, device)
        self.seed_gpu = self._seeds.gpu[0]

    def add_request(self, row: int, new: NewRequestData) -> None:
        self._seeds.set(row, (new.seed,))

    def apply_staged(self) -> None:
        self._seeds.apply_staged()

    def sample(self, logits: torch.Tensor, batch: SampleBatch, temperature: torch.Tensor,
               greedy_only: bool) -> torch.Tensor:
        """[B] int64 tokens: argmax(logits + temperature * gumbel noise)."""
        return gumbel_sample(logits, temperature, self.seed_gpu[batch.idx], batch.positions, greedy_only)
