"""Logit bias: per request, up to MAX_LOGIT_BIAS (token id, bias) pairs added to the logits."""

from typing import Optional

import numpy as np
import torch

from tokenmill.step_io import NewRequestData
from tokenmill.runner.sample.stage import SampleBatch, SamplingStage
from tokenmill.runner.staged_write import StagedWriteTensor
from tokenmill.sampling_params import MAX_LOGIT_BIAS


class LogitBiasStage(SamplingStage):
    def __init__(self, max_num_reqs: int, device: torch.device):
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.has_bias = np.zeros(max_num_reqs, dtype=bool)
        # Allocated on the first biased request: ids (-1 padding) and values, [R, MAX_LOGIT_BIAS].
        self.ids: Optional[StagedWriteTensor] = None
        self.values: Optional[StagedWriteTensor] = None

    def add_request(self, row: int, new: NewRequestData) -> None:
        bias = new.params.logit_bias or {}
        if bias:
            ids, values = self._tables()
            pad = MAX_LOGIT_BIAS - len(bias)
            ids.stage(row, 0, list(bias.keys()) + [-1] * pad)
            values.stage(row, 0, list(bias.values()) + [0.0] * pad)
        elif self.has_bias[row]:
            # The row's last owner had a bias: clear it, or a biased batch would apply it here too.
            self.ids.stage(row, 0, [-1] * MAX_LOGIT_BIAS)
        self.has_bias[row] = bool(bias)

    def apply_staged(self) -> None:
        if self.ids is not None:
            self.ids.apply()
            self.values.apply()

    def needed(self, rows: np.ndarray) -> bool:
        return bool(self.has_bias[rows].any())

    def apply(self, logits: torch.Tensor, batch: SampleBatch) -> None:
        ids, values = self.ids.gpu[batch.idx], self.values.gpu[batch.idx]
        valid = ids >= 0
        logits.scatter_add_(1, ids.clamp(min=0).long(), torch.where(valid, values, torch.zeros_like(values)))

    def _tables(self) -> tuple[StagedWriteTensor, StagedWriteTensor]:
        if self.ids is None:
            shape = (self.max_num_reqs, MAX_LOGIT_BIAS)
            self.ids = StagedWriteTensor(shape, torch.int32, self.device)
            self.ids.gpu.fill_(-1)
            self.values = StagedWriteTensor(shape, torch.float32, self.device)
        return self.ids, self.values
