"""Repetition, frequency and presence penalties, from per-row counts of the tokens generated so far
and a mask of the prompt's tokens.

The counts grow on the device: post-update adds each sampled token to its row's counts (in the
kernel that writes last_sampled) in every step where this stage ran.
"""

from typing import Optional

import numpy as np
import torch

from tokenmill.kernels.sampling import apply_penalties
from tokenmill.step_io import NewRequestData
from tokenmill.runner.request_states import RowParams
from tokenmill.runner.sample.stage import SampleBatch, SamplingStage
from tokenmill.runner.staged_write import to_device

NEUTRAL = (1.0, 0.0, 0.0)  # repetition, frequency, presence: no penalty


class PenaltyStage(SamplingStage):
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device):
        self.shape = (max_num_reqs, vocab_size)
        self.device = device
        self.has_penalty = np.zeros(max_num_reqs, dtype=bool)
        self._params = RowParams(NEUTRAL, max_num_reqs, np.float32, device)
        self.repetition_gpu, self.frequency_gpu, self.presence_gpu = self._params.gpu
        # Allocated on the first request with a penalty: [R, V] each.
        self.output_counts: Optional[torch.Tensor] = None  # int32
        self.prompt_mask: Optional[torch.Tensor] = None  # bool

    def add_request(self, row: int, new: NewRequestData) -> None:
        p = new.params
        values = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        self._params.set(row, values)
        self.has_penalty[row] = values != NEUTRAL
        if self.has_penalty[row]:
            self._init_counts(row, new)

    def apply_staged(self) -> None:
        self._params.apply_staged()

    def needed(self, rows: np.ndarray) -> bool:
        return bool(self.has_penalty[rows].any())

    def apply(self, logits: torch.Tensor, batch: SampleBatch) -> None:
        idx = batch.idx
        apply_penalties(logits, self.output_counts[idx], self.prompt_mask[idx], self.repetition_gpu[idx],
                        self.frequency_gpu[idx], self.presence_gpu[idx])

    def _init_counts(self, row: int, new: NewRequestData) -> None:
        if self.output_counts is None:
            self.output_counts = torch.zeros(self.shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(self.shape, dtype=torch.bool, device=self.device)
        # Stream-ordered after any earlier user of this row, so no sync is needed.
        self.output_counts[row].zero_()
        self.prompt_mask[row].zero_()
        prompt = to_device(np.asarray(new.token_ids[: new.num_prompt_tokens], dtype=np.int64), self.device)
        self.prompt_mask[row].index_fill_(0, prompt, True)
        outputs = new.token_ids[new.num_prompt_tokens:]
        if outputs:
            ids = to_device(np.asarray(outputs, dtype=np.int64), self.device)
            self.output_counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
