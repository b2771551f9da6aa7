"""Persistent request state: one row per live request, for its whole life in the runner.

Rows come from a free list; each step's batch reaches them through idx_mapping (batch position ->
row), so nothing is ever reordered or compacted. RequestStates keeps what every request needs to
run (token ids, block table, prefill length, last sampled token); a feature that keeps rows of
its own (each sampler stage does) is a RowState, told of every admission and release.

Small per-row parameters live in RowParams: a numpy mirror copied to the device (one pinned copy)
only in steps where a value changed; the big tables (token ids, block tables) take diff-only
staged writes.
"""

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np
import torch

from tokenmill.step_io import NewRequestData
from tokenmill.runner.staged_write import StagedWriteTensor, to_device


class RowState(ABC):
    """Per-request rows kept in step with RequestStates' rows (a sampler stage, for instance)."""

    @abstractmethod
    def add_request(self, row: int, new: NewRequestData) -> None:
        """The request `new` takes `row`; stage whatever the device needs for it."""

    def remove_request(self, row: int) -> None:
        """`row` is free again. By default nothing happens: the next add_request overwrites it."""

    def apply_staged(self) -> None:
        """Push what add_request staged to the device (once per step, before the forward pass)."""


class RowParams:
    """Scalar per-row parameters of one dtype: a numpy mirror [columns, rows] that the CPU writes and
    its device copy. apply_staged() makes one pinned copy, and only when a value changed, so a row
    that takes the values it already holds (a feature's neutral defaults) costs nothing.

    Owners unpack the columns into named attributes: `self.top_p, self.min_p = params.host`."""

    def __init__(self, defaults: Sequence[float], max_num_reqs: int, dtype: type, device: torch.device):
        self.device = device
        self.host = np.repeat(np.asarray(defaults, dtype=dtype)[:, None], max_num_reqs, axis=1)
        self.gpu = torch.tensor(self.host, device=device)  # a copy, never the mirror's memory
        self._dirty = False

    def set(self, row: int, values: Sequence[float]) -> None:
        """Write one row's values, in column order."""
        new = np.asarray(values, dtype=self.host.dtype)
        if not np.array_equal(self.host[:, row], new):
            self.host[:, row] = new
            self._dirty = True

    def apply_staged(self) -> None:
        if self._dirty:
            self.gpu.copy_(to_device(self.host, self.device), non_blocking=True)
            self._dirty = False


class RequestStates:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device,
                 owners: Sequence[RowState] = (), spare_columns: int = 0):
        max_blocks_per_req = -(-max_model_len // block_size)
        self.max_num_reqs = max_num_reqs
        self.block_size = block_size
        self.device = device
        self.owners = tuple(owners)
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.row_of: dict[str, int] = {}
        # spare_columns past the context length take speculative writes of not-yet-known tokens
        self.token_table = StagedWriteTensor((max_num_reqs, max_model_len + spare_columns), torch.int32, device)
        self.block_table = StagedWriteTensor((max_num_reqs, max_blocks_per_req), torch.int32, device)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)  # blocks written per row
        self.last_sampled = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self._prefill = RowParams((0,), max_num_reqs, np.int64, device)
        # Tokens known at admission (prompt + earlier outputs): input prep reads them from the table.
        self.num_prefill, self.num_prefill_gpu = self._prefill.host[0], self._prefill.gpu[0]

    # ---- admission and release ------------------------------------------------------------
    def add(self, new: NewRequestData) -> int:
        if new.req_id in self.row_of:
            raise RuntimeError(f"request {new.req_id} is already in the runner")
        row = self.free_rows.pop()
        self.row_of[new.req_id] = row
        self.token_table.stage(row, 0, new.token_ids)
        self._prefill.set(row, (len(new.token_ids),))
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)
        for owner in self.owners:
            owner.add_request(row, new)
        return row

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.free_rows.append(row)
            for owner in self.owners:
                owner.remove_request(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            self.block_table.stage(row, int(self.num_blocks[row]), block_ids)
            self.num_blocks[row] += len(block_ids)

    def apply_staged(self) -> None:
        """Push this step's admissions and block-table growth to the device."""
        self.token_table.apply()
        self.block_table.apply()
        self._prefill.apply_staged()
        for owner in self.owners:
            owner.apply_staged()
