"""Attention over the paged KV cache: store this step's K/V, then attend."""

import torch
from torch import nn

from tokenmill.kernels.attention import paged_attention, write_kv_cache
from tokenmill.layers.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx  # which of the forward context's KV caches is this layer's
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] -> [T, Hq * D]."""
        ctx = get_forward_context()
        meta = ctx.metadata
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, num_splits=meta.num_splits,
        )
        return out.view(q.shape[0], self.num_heads * self.head_dim)
