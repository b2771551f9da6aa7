"""Persistent request state: one row per live request, for its whole life in the runner.

Rows come from a free list; each step's batch reaches them through idx_mapping (batch position ->
row), so nothing is ever reordered or compacted. Small per-row parameters have a numpy mirror that
is copied to the device (one pinned copy per pack) only in steps that admitted requests; the big
tables (token ids, block tables, logit bias, stop ids) take diff-only staged writes.
"""

import numpy as np
import torch

from tokenmill.messages import NewRequestData
from tokenmill.runner.staged_write import StagedWriteTensor, to_device
from tokenmill.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

# Fields of the two per-row parameter packs.
INT_FIELDS = ("num_prefill", "num_prompt", "top_k", "min_tokens", "seed")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition", "frequency", "presence")


class RequestStates:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, vocab_size: int,
                 device: torch.device):
        max_blocks_per_req = -(-max_model_len // block_size)
        self.max_num_reqs = max_num_reqs
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.row_of: dict[str, int] = {}
        self.token_table = StagedWriteTensor((max_num_reqs, max_model_len), torch.int32, device)
        self.block_table = StagedWriteTensor((max_num_reqs, max_blocks_per_req), torch.int32, device)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)  # blocks written per row
        self.last_sampled = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.ints = np.zeros((len(INT_FIELDS), max_num_reqs), dtype=np.int64)
        self.floats = np.zeros((len(FLOAT_FIELDS), max_num_reqs), dtype=np.float32)
        self.ints_gpu = torch.zeros(self.ints.shape, dtype=torch.int64, device=device)
        self.floats_gpu = torch.zeros(self.floats.shape, dtype=torch.float32, device=device)
        self._packs_dirty = False
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: not asked
        self.has_penalty = np.zeros(max_num_reqs, dtype=bool)
        self.has_bias = np.zeros(max_num_reqs, dtype=bool)
        # Tables only some features need, allocated on first use so an unused feature costs nothing.
        self._logit_bias = None  # (ids [R, MAX_LOGIT_BIAS] int32 with -1 padding, values float32)
        self._stop_ids = None  # [R, MAX_STOP_TOKEN_IDS + 8] int32, -1 padding
        self.output_counts = None  # [R, V] int32
        self.prompt_mask = None  # [R, V] bool

    # ---- per-row fields -------------------------------------------------------------------
    def field(self, name: str) -> np.ndarray:
        if name in INT_FIELDS:
            return self.ints[INT_FIELDS.index(name)]
        return self.floats[FLOAT_FIELDS.index(name)]

    def field_gpu(self, name: str) -> torch.Tensor:
        if name in INT_FIELDS:
            return self.ints_gpu[INT_FIELDS.index(name)]
        return self.floats_gpu[FLOAT_FIELDS.index(name)]

    # ---- admission and release ------------------------------------------------------------
    def add(self, new: NewRequestData) -> int:
        if new.req_id in self.row_of:
            raise RuntimeError(f"request {new.req_id} is already in the runner")
        row = self.free_rows.pop()
        self.row_of[new.req_id] = row
        p = new.params
        self.token_table.stage(row, 0, new.token_ids)
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)
        values = {"num_prefill": len(new.token_ids), "num_prompt": new.num_prompt_tokens, "top_k": p.top_k,
                  "min_tokens": p.min_tokens, "seed": new.seed, "temperature": p.temperature, "top_p": p.top_p,
                  "min_p": p.min_p, "repetition": p.repetition_penalty, "frequency": p.frequency_penalty,
                  "presence": p.presence_penalty}
        for name, value in values.items():
            self.field(name)[row] = value
        self._packs_dirty = True
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.has_penalty[row] = (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                                 or p.presence_penalty != 0.0)
        self.has_bias[row] = bool(p.logit_bias)
        if p.logit_bias:
            ids, vals = self._bias_tables()
            pad = MAX_LOGIT_BIAS - len(p.logit_bias)
            ids.stage(row, 0, list(p.logit_bias.keys()) + [-1] * pad)
            vals.stage(row, 0, list(p.logit_bias.values()) + [0.0] * pad)
        if p.min_tokens > 0:
            stop = new.min_tokens_stop_ids[: self.stop_ids().gpu.shape[1]]
            self.stop_ids().stage(row, 0, stop + [-1] * (self.stop_ids().gpu.shape[1] - len(stop)))
        if self.has_penalty[row]:
            self._init_penalty_state(row, new)
        return row

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            self.block_table.stage(row, int(self.num_blocks[row]), block_ids)
            self.num_blocks[row] += len(block_ids)

    def apply_staged(self) -> None:
        """Push this step's admissions and block-table growth to the device."""
        self.token_table.apply()
        self.block_table.apply()
        if self._logit_bias is not None:
            self._logit_bias[0].apply()
            self._logit_bias[1].apply()
        if self._stop_ids is not None:
            self._stop_ids.apply()
        if self._packs_dirty:
            self.ints_gpu.copy_(to_device(self.ints, self.device), non_blocking=True)
            self.floats_gpu.copy_(to_device(self.floats, self.device), non_blocking=True)
            self._packs_dirty = False

    # ---- feature tables, allocated on first use ------------------------------------------------
    def _bias_tables(self):
        if self._logit_bias is None:
            self._logit_bias = (StagedWriteTensor((self.max_num_reqs, MAX_LOGIT_BIAS), torch.int32, self.device),
                                StagedWriteTensor((self.max_num_reqs, MAX_LOGIT_BIAS), torch.float32, self.device))
        return self._logit_bias

    @property
    def logit_bias(self):
        return None if self._logit_bias is None else (self._logit_bias[0].gpu, self._logit_bias[1].gpu)

    def stop_ids(self) -> StagedWriteTensor:
        if self._stop_ids is None:
            self._stop_ids = StagedWriteTensor((self.max_num_reqs, MAX_STOP_TOKEN_IDS + 8), torch.int32, self.device)
        return self._stop_ids

    def _init_penalty_state(self, row: int, new: NewRequestData) -> None:
        if self.output_counts is None:
            shape = (self.max_num_reqs, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        # Stream-ordered after any earlier user of this row, so no sync is needed.
        self.output_counts[row].zero_()
        self.prompt_mask[row].zero_()
        prompt = to_device(np.asarray(new.token_ids[: new.num_prompt_tokens], dtype=np.int64), self.device)
        self.prompt_mask[row].index_fill_(0, prompt, True)
        outputs = new.token_ids[new.num_prompt_tokens:]
        if outputs:
            ids = to_device(np.asarray(outputs, dtype=np.int64), self.device)
            self.output_counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
