"""Structured output in the sampler: the packed token masks the engine computed for the step
(messages.GrammarBitmask) applied to the logits, -inf wherever a token's bit is clear
(kernels/token_bitmask.py).

The runner knows nothing of grammars: it learns from the sampling parameters which rows have one,
and the engine sends each step's masks for those rows. The masks live in a per-row device table
[R, ceil(V / 32)] (allocated with the first grammar request), so a step's logits rows gather them
through idx (a request may own several rows of a speculative step). Rows without a grammar hold
all ones. It runs first, so that top-k / top-p / min-p choose among the allowed tokens only.
"""

from typing import Optional

import numpy as np
import torch

from tokenmill.kernels.token_bitmask import apply_token_bitmask
from tokenmill.messages import NewRequestData
from tokenmill.runner.sample.stage import SampleBatch, SamplingStage
from tokenmill.runner.staged_write import to_device


class GrammarStage(SamplingStage):
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device):
        self.max_num_reqs = max_num_reqs
        self.num_words = -(-vocab_size // 32)
        self.device = device
        self.has_grammar = np.zeros(max_num_reqs, dtype=bool)
        self.table: Optional[torch.Tensor] = None  # [R, W] int32
        self._reset: list[int] = []  # rows whose last owner had a grammar and whose new one has none

    def add_request(self, row: int, new: NewRequestData) -> None:
        grammar = new.params.structured_outputs is not None
        if self.has_grammar[row] and not grammar:
            self._reset.append(row)
        self.has_grammar[row] = grammar

    def apply_staged(self) -> None:
        if self._reset:
            rows = to_device(np.asarray(self._reset, dtype=np.int64), self.device)
            self.table.index_fill_(0, rows, -1)
            self._reset = []

    def set_masks(self, rows: np.ndarray, mask: np.ndarray) -> None:
        """The step's masks: mask [G, W] int32 for request rows `rows` [G] (one pinned copy)."""
        if mask.shape[1] != self.num_words:
            raise ValueError(f"a grammar mask has {mask.shape[1]} words a row; the logits need {self.num_words}")
        if self.table is None:
            self.table = torch.full((self.max_num_reqs, self.num_words), -1, dtype=torch.int32, device=self.device)
        packed = np.concatenate([rows.astype(np.int32)[:, None], mask.astype(np.int32, copy=False)], axis=1)
        dev = to_device(packed, self.device)
        self.table.index_copy_(0, dev[:, 0].long(), dev[:, 1:])

    def needed(self, rows: np.ndarray) -> bool:
        return bool(self.has_grammar[rows].any())

    def apply(self, logits: torch.Tensor, batch: SampleBatch) -> None:
        if self.table is None:  # no mask was ever sent (a grammar row that does not sample yet)
            return
        apply_token_bitmask(logits, self.table[batch.idx])
