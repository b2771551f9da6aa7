"""Temperature, then min-p, top-k and top-p masking, for the rows that sample (temperature > 0).

The masks apply to the temperature-scaled distribution, so this stage divides the sampling rows'
logits by their temperature first; the Gumbel sampler then adds unscaled noise to those rows
(noise_scale). Greedy rows are left as they are: their argmax survives every mask.
"""

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.kernels.sampling import apply_top_k_top_p_min_p
from tokenmill.step_io import NewRequestData
from tokenmill.runner.request_states import RowParams
from tokenmill.runner.sample.stage import SampleBatch, SamplingStage


@dataclass(frozen=True)
class Filters:
    """Which masks some sampling row of a batch asks for."""

    top_k: bool
    top_p: bool
    min_p: bool

    @property
    def any(self) -> bool:
        return self.top_k or self.top_p or self.min_p


class TemperatureStage(SamplingStage):
    def __init__(self, max_num_reqs: int, device: torch.device):
        self._floats = RowParams((1.0, 1.0, 0.0), max_num_reqs, np.float32, device)
        self._ints = RowParams((0,), max_num_reqs, np.int64, device)
        self.temperature, self.top_p, self.min_p = self._floats.host
        self.temperature_gpu, self.top_p_gpu, self.min_p_gpu = self._floats.gpu
        self.top_k, self.top_k_gpu = self._ints.host[0], self._ints.gpu[0]

    def add_request(self, row: int, new: NewRequestData) -> None:
        p = new.params
        self._floats.set(row, (p.temperature, p.top_p, p.min_p))
        self._ints.set(row, (p.top_k,))

    def apply_staged(self) -> None:
        self._floats.apply_staged()
        self._ints.apply_staged()

    def all_greedy(self, rows: np.ndarray) -> bool:
        return not bool((self.temperature[rows] > 0).any())

    def filters(self, rows: np.ndarray) -> Filters:
        sampling = rows[self.temperature[rows] > 0]
        return Filters(top_k=bool((self.top_k[sampling] > 0).any()), top_p=bool((self.top_p[sampling] < 1.0).any()),
                       min_p=bool((self.min_p[sampling] > 0.0).any()))

    def needed(self, rows: np.ndarray) -> bool:
        return self.filters(rows).any

    def apply(self, logits: torch.Tensor, batch: SampleBatch) -> None:
        t = batch.temperature
        logits.div_(torch.where(t > 0, t, torch.ones_like(t))[:, None])
        use, idx = self.filters(batch.rows), batch.idx
        apply_top_k_top_p_min_p(logits, self.top_k_gpu[idx] if use.top_k else None,
                                self.top_p_gpu[idx] if use.top_p else None, self.min_p_gpu[idx] if use.min_p else None)

    @staticmethod
    def noise_scale(batch: SampleBatch, scaled: bool) -> torch.Tensor:
        """The temperature the Gumbel noise takes: the rows' own, or 1 for sampling rows whose
        logits this stage has already divided by it (scaled)."""
        t = batch.temperature
        return torch.where(t > 0, torch.ones_like(t), t) if scaled else t
