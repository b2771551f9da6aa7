"""Attention over the paged KV cache: store this step's K/V, then attend."""

from typing import Optional

import torch
from torch import nn

from tokenmill.kernels.attention import paged_attention, write_kv_cache
from tokenmill.layers.forward_context import get_attention_metadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # Bound by the runner once the KV cache is allocated: [num_blocks, block_size, Hk, D] each.
        self.k_cache: Optional[torch.Tensor] = None
        self.v_cache: Optional[torch.Tensor] = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] -> [T, Hq * D]."""
        meta = get_attention_metadata()
        if meta is None or self.k_cache is None:
            raise RuntimeError("attention needs a KV cache and step metadata (run the model through the runner)")
        write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = paged_attention(
            q, self.k_cache, self.v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, num_splits=meta.num_splits,
        )
        return out.view(q.shape[0], self.num_heads * self.head_dim)
