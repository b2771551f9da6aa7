"""Per-step attention metadata, set by the runner around each forward pass.

The model's Attention layers read it instead of taking it as an argument, so model code stays the
same for eager runs, CUDA graph capture and dummy runs.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int32: request b's tokens are [qsl[b], qsl[b+1])
    seq_lens: torch.Tensor  # [B] int32: tokens in context after this step, new ones included
    block_tables: torch.Tensor  # [B, max_blocks] int32: each request's KV blocks, in order
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes; < 0 means padding
    max_query_len: int  # host-side hints for kernel launch shapes (never read from the device)
    max_seq_len: Optional[int] = None  # None inside CUDA graphs, where it varies between replays
    num_splits: Optional[int] = None  # split-KV factor for decode, fixed per captured graph


_current: Optional[AttentionMetadata] = None


@contextmanager
def forward_context(metadata: Optional[AttentionMetadata]):
    global _current
    previous, _current = _current, metadata
    try:
        yield
    finally:
        _current = previous


def get_attention_metadata() -> Optional[AttentionMetadata]:
    return _current
