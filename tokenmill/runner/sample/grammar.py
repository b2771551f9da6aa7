"""Structured output in the sampler: the packed token masks the engine computed for the step
(messages.GrammarBitmask) applied to the logits, -inf wherever a token's bit is clear
(kernels/token_bitmask.py).

The runner knows nothing of grammars: it learns from the sampling parameters which rows have one,
and the engine sends each step's masks for those rows. The masks live in a device table of
`rows_per_request` slots per request row ([R * S, ceil(V / 32)], allocated with the first grammar
request; S = 1 + k with speculative decoding, else 1): slot j holds the mask of the request's j-th
logits row of the step, which in a verify step is the grammar's state after the first j drafts. A
step's logits rows gather them through idx and SampleBatch.offsets. Slots without a grammar hold all
ones. It runs first, so that top-k / top-p / min-p choose among the allowed tokens only (and a
draft the grammar refuses has probability 0 in the rejection sampler, so it is never accepted).
"""

from typing import Optional

import numpy as np
import torch

from tokenmill.kernels.token_bitmask import apply_token_bitmask
from tokenmill.step_io import NewRequestData
from tokenmill.runner.sample.stage import SampleBatch, SamplingStage
from tokenmill.runner.staged_write import to_device


class GrammarStage(SamplingStage):
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device):
        self.max_num_reqs = max_num_reqs
        self.rows_per_request = 1  # slots per request row: 1 + k with speculative decoding (set before use)
        self.num_words = -(-vocab_size // 32)
        self.device = device
        self.has_grammar = np.zeros(max_num_reqs, dtype=bool)
        self.table: Optional[torch.Tensor] = None  # [R * S, W] int32
        self._reset: list[int] = []  # rows whose last owner had a grammar and whose new one has none

    def add_request(self, row: int, new: NewRequestData) -> None:
        grammar = new.params.structured_outputs is not None
        if self.has_grammar[row] and not grammar:
            self._reset.append(row)
        self.has_grammar[row] = grammar

    def apply_staged(self) -> None:
        if self._reset and self.table is None:  # no mask was ever written (e.g. a pipeline stage
            self._reset = []                    # before the last, which never samples)
        if self._reset:
            s = self.rows_per_request
            slots = (np.asarray(self._reset, dtype=np.int64)[:, None] * s + np.arange(s)).ravel()
            self.table.index_fill_(0, to_device(slots, self.device), -1)
            self._reset = []

    def set_masks(self, rows: np.ndarray, mask: np.ndarray, offsets: Optional[np.ndarray] = None) -> None:
        """The step's masks: mask [G, W] int32 for request rows `rows` [G], each for the logits row
        `offsets` [G] of its request (default 0) (one pinned copy)."""
        if mask.shape[1] != self.num_words:
            raise ValueError(f"a grammar mask has {mask.shape[1]} words a row; the logits need {self.num_words}")
        s = self.rows_per_request
        if self.table is None:
            self.table = torch.full((self.max_num_reqs * s, self.num_words), -1, dtype=torch.int32,
                                    device=self.device)
        slots = rows.astype(np.int64) * s
        if offsets is not None:
            if offsets.size and int(offsets.max()) >= s:
                raise ValueError(f"a grammar mask for logits row {int(offsets.max())} of a request; the table holds {s}")
            slots = slots + offsets
        packed = np.concatenate([slots.astype(np.int32)[:, None], mask.astype(np.int32, copy=False)], axis=1)
        dev = to_device(packed, self.device)
        self.table.index_copy_(0, dev[:, 0].long(), dev[:, 1:])

    def needed(self, rows: np.ndarray) -> bool:
        return bool(self.has_grammar[rows].any())

    def apply(self, logits: torch.Tensor, batch: SampleBatch) -> None:
        if self.table is None:  # no mask was ever sent (a grammar row that does not sample yet)
            return
        slots = batch.idx * self.rows_per_request
        if batch.offsets is not None:
            slots = slots + batch.offsets
        apply_token_bitmask(logits, self.table[slots])
