"""min_tokens: until a request has generated min_tokens tokens, its stop ids (EOS unless ignored,
plus stop_token_ids) get -inf logits."""

from typing import Optional

import numpy as np
import torch

from tokenmill.step_io import NewRequestData
from tokenmill.runner.request_states import RowParams
from tokenmill.runner.sample.stage import SampleBatch, SamplingStage
from tokenmill.runner.staged_write import StagedWriteTensor
from tokenmill.sampling_params import MAX_STOP_TOKEN_IDS

STOP_IDS_WIDTH = MAX_STOP_TOKEN_IDS + 8  # room for the model's EOS ids beside the request's own


class MinTokensStage(SamplingStage):
    def __init__(self, max_num_reqs: int, device: torch.device):
        self.max_num_reqs = max_num_reqs
        self.device = device
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # The first position whose token may stop the request: prompt length + min_tokens (0 when
        # min_tokens is 0, so rows without it never change the pack).
        self._end = RowParams((0,), max_num_reqs, np.int64, device)
        self.end_gpu = self._end.gpu[0]
        self.stop_ids: Optional[StagedWriteTensor] = None  # [R, STOP_IDS_WIDTH] int32, -1 padding

    def add_request(self, row: int, new: NewRequestData) -> None:
        count = new.params.min_tokens
        self.min_tokens[row] = count
        self._end.set(row, (new.num_prompt_tokens + count if count > 0 else 0,))
        if count > 0:
            table = self._table()
            stop = new.min_tokens_stop_ids[:STOP_IDS_WIDTH]
            table.stage(row, 0, stop + [-1] * (STOP_IDS_WIDTH - len(stop)))

    def apply_staged(self) -> None:
        self._end.apply_staged()
        if self.stop_ids is not None:
            self.stop_ids.apply()

    def needed(self, rows: np.ndarray) -> bool:
        return bool((self.min_tokens[rows] > 0).any())

    def apply(self, logits: torch.Tensor, batch: SampleBatch) -> None:
        active = batch.positions.long() < self.end_gpu[batch.idx]
        ids = self.stop_ids.gpu[batch.idx].long()
        hit = ((ids >= 0) & active[:, None]).to(torch.int8)
        # amax, so that padding entries (clamped onto column 0) never undo a real hit there.
        mask = torch.zeros(logits.shape, dtype=torch.int8, device=logits.device)
        mask.scatter_reduce_(1, ids.clamp(min=0), hit, reduce="amax")
        logits.masked_fill_(mask.bool(), float("-inf"))

    def _table(self) -> StagedWriteTensor:
        if self.stop_ids is None:
            self.stop_ids = StagedWriteTensor((self.max_num_reqs, STOP_IDS_WIDTH), torch.int32, self.device)
        return self.stop_ids
