"""Persistent step-input buffers (stable addresses, so CUDA graphs can replay over them) and the
per-step host descriptors that fill them."""

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from tokenmill.kernels.input_prep import prepare_inputs
from tokenmill.layers.forward_context import AttentionMetadata
from tokenmill.runner.staged_write import to_device


@dataclass
class StepDescriptor:
    """Host-side description of one step's batch, padded to `padded_reqs` entries."""

    num_reqs: int
    num_tokens: int
    padded_reqs: int
    padded_tokens: int
    max_query_len: int
    max_seq_len: int
    rows: np.ndarray  # [num_reqs] request rows
    sample_mask: np.ndarray  # [num_reqs] bool
    q_lens: Optional[np.ndarray] = None  # [num_reqs] the host arrays the step was uploaded from
    start_pos: Optional[np.ndarray] = None  # [num_reqs]


class InputBuffers:
    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, device):
        i32, i64 = torch.int32, torch.int64
        self.device = device
        self.input_ids = torch.zeros(max_num_tokens, dtype=i64, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=i64, device=device)
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=i64, device=device)
        self.seq_lens = torch.zeros(max_num_reqs, dtype=i32, device=device)
        self.logits_indices = torch.zeros(max_num_reqs, dtype=i64, device=device)
        self.block_tables = torch.zeros((max_num_reqs, max_blocks_per_req), dtype=i32, device=device)
        # Host-provided per-step descriptors, copied in one transfer: idx_mapping, qsl, start_pos, sample_mask.
        self.host_pack = torch.zeros(4 * max_num_reqs + 1, dtype=i32, device=device)
        r = max_num_reqs
        self.idx_mapping = self.host_pack[:r]
        self.query_start_loc = self.host_pack[r : 2 * r + 1]
        self.start_pos = self.host_pack[2 * r + 1 : 3 * r + 1]
        self.sample_mask = self.host_pack[3 * r + 1 :]
        self.max_num_reqs = r

    def upload(self, rows, q_lens, start_pos, sample_mask, padded_reqs: int) -> None:
        """One host-to-device copy of the step's descriptors (padding entries: q_len 0)."""
        r, n = self.max_num_reqs, len(rows)
        pack = np.zeros(4 * r + 1, dtype=np.int32)
        pack[:n] = rows
        qsl = pack[r : 2 * r + 1]
        np.cumsum(q_lens, out=qsl[1 : n + 1])
        qsl[n + 1 : padded_reqs + 1] = qsl[n]
        pack[2 * r + 1 : 2 * r + 1 + n] = start_pos
        pack[3 * r + 1 : 3 * r + 1 + n] = sample_mask
        self.host_pack.copy_(to_device(pack, self.device), non_blocking=True)

    def prepare(self, step: StepDescriptor, states) -> None:
        b, t = step.padded_reqs, step.padded_tokens
        prepare_inputs(
            idx_mapping=self.idx_mapping[:b], query_start_loc=self.query_start_loc[: b + 1],
            start_pos=self.start_pos[:b], num_reqs=step.num_reqs, num_tokens=step.num_tokens,
            token_table=states.token_table.gpu, num_prefill=states.num_prefill_gpu,
            last_sampled=states.last_sampled, block_table=states.block_table.gpu, block_size=states.block_size,
            input_ids=self.input_ids[:t], positions=self.positions[:t], seq_lens=self.seq_lens[:b],
            slot_mapping=self.slot_mapping[:t], logits_indices=self.logits_indices[:b],
            block_tables_out=self.block_tables[:b],
        )

    def attention_metadata(self, step: StepDescriptor, in_graph: bool = False) -> AttentionMetadata:
        b, t = step.padded_reqs, step.padded_tokens
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1], seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b], slot_mapping=self.slot_mapping[:t],
            max_query_len=step.max_query_len, max_seq_len=None if in_graph else step.max_seq_len,
            host_q_lens=None if in_graph else step.q_lens, host_start_pos=None if in_graph else step.start_pos,
        )
