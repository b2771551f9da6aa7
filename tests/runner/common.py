"""What the sampler's tests share: requests entering rows, and batches over them."""

from typing import Optional

import numpy as np
import torch

from tokenmill.step_io import NewRequestData
from tokenmill.runner.sample import SampleBatch
from tokenmill.sampling_params import SamplingParams

CPU = torch.device("cpu")
V = 64


def new_request(req_id: str, params: SamplingParams, prompt: tuple[int, ...] = (3, 4, 5),
                outputs: tuple[int, ...] = (), seed: int = 0, stop_ids: Optional[list[int]] = None) -> NewRequestData:
    return NewRequestData(req_id, list(prompt + outputs), len(prompt), params, seed, block_ids=[],
                          min_tokens_stop_ids=list(stop_ids or []))


def batch(rows: list[int], positions: list[int], temperature: Optional[torch.Tensor] = None) -> SampleBatch:
    idx = torch.tensor(rows, dtype=torch.int64)
    t = torch.ones(len(rows)) if temperature is None else temperature[idx]
    return SampleBatch(np.asarray(rows, dtype=np.int64), idx, torch.tensor(positions, dtype=torch.int64), t)


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return 3 * torch.randn(num_rows, V, generator=torch.Generator().manual_seed(seed))
