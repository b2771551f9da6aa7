"""Multi-head latent attention (DeepSeek-V2 / V3) over a paged latent cache: the second attention backend.

Per token the cache holds the compressed latent c = kv_a_layernorm(kv_a(x))[:R] and the rope'd
key k_pe (kernels/mla_attention.py has the layout), not per-head K/V. Head h's key is
[W_UK[h] c, k_pe] and its value W_UV[h] c, with kv_b_proj's weight [H * (nope + v), R] = per
head [W_UK[h]; W_UV[h]]. Two ways to attend:

- decode (every request computes one token: max_query_len == 1): W_UK is absorbed into the query,
  q_lat = W_UK[h]^T q_nope, the latent kernel attends over the cache rows as they are, and W_UV is
  applied to its output. Reads R + P numbers per cached token instead of H * (nope + 2v).
- prefill and mixed steps: each request's whole cached context (earlier chunks included) is
  expanded through kv_b_proj into per-head keys and values and attended to with a lower-right causal
  mask through torch's SDPA: plain attention over what HF computes, so the two paths check each other.

Tensor parallelism splits the heads: each rank holds its heads' rows of kv_b_proj (and of q and
o_proj, models/deepseek.py) and the whole latent cache, which every head shares.

The absorbed kernel serves only uniform single-token decode steps, so the backend declares
CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE (full graphs for decode batches, piecewise otherwise).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from tokenmill.distributed import divide, get_tp_size
from tokenmill.kernels.mla_attention import gather_latent, mla_cache_write, mla_decode
from tokenmill.layers.attention import CudaGraphSupport
from tokenmill.layers.forward_context import AttentionMetadata, get_forward_context
from tokenmill.layers.linear import ColumnParallelLinear


class MLAAttention(nn.Module):
    cuda_graph_support = CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float, layer_idx: int, dtype=None, device=None):
        """num_heads: the model's; this rank attends with num_heads / tensor-parallel size of them."""
        super().__init__()
        self.layer_idx = layer_idx  # which of the forward context's caches is this layer's
        self.num_heads = divide(num_heads, get_tp_size())
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = scale
        # The up-projection both paths use (the checkpoint's self_attn.kv_b_proj): expansion, or absorption.
        # Its rows are grouped by head, so a column-parallel split gives each rank whole heads.
        self.kv_b_proj = ColumnParallelLinear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False,
                                              dtype=dtype, device=device)

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, R], W_UV [H, v, R]) as views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    def forward(self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """q [T, H, nope + rope] (rope part rotated), latent [T, R] (normalised), k_pe [T, P] (rotated)
        -> [T, H * v]. This step's latent rows go into the cache first, then q attends."""
        ctx = get_forward_context()
        cache = ctx.kv_caches[self.layer_idx][0]
        mla_cache_write(cache, latent, k_pe, ctx.metadata.slot_mapping)
        tokens = q.shape[0]
        splitter = ctx.splitter
        if splitter is not None:  # capturing piecewise graphs: attention runs between the pieces
            splitter.q_buffer(tokens)[..., : self.qk_head_dim].copy_(q)
            out = splitter.split(self)[..., : self.v_head_dim]
        else:
            out = self.attend(q, ctx.metadata, ctx.kv_caches)
        return out.reshape(tokens, self.num_heads * self.v_head_dim)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, kv_caches, out: Optional[torch.Tensor] = None):
        """q [T, H, >= nope + rope] (only the first nope + rope dims read: the piecewise buffers are
        as wide as a cache row) -> [T, H, v], written into out[..., :v] when given."""
        cache = kv_caches[self.layer_idx][0]
        q = q[..., : self.qk_head_dim]
        if meta.max_query_len == 1:
            result = self._decode(q, meta, cache)
        else:
            result = self._prefill(q, meta, cache)
        if out is None:
            return result
        out[..., : self.v_head_dim].copy_(result)
        return out

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor) -> torch.Tensor:
        """One token per request (row b is request b; rows past the batch are padding, left zero)."""
        w_uk, w_uv = self._up_weights()
        nope = self.qk_nope_head_dim
        batch = min(q.shape[0], meta.seq_lens.shape[0])
        q_lat = torch.bmm(q[:batch, :, :nope].transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, R]
        q_pe = q[:batch, :, nope:]
        o_lat = mla_decode(q_lat, q_pe, cache, meta.block_tables, meta.seq_lens, self.scale,
                           num_splits=meta.num_splits, max_seq_len=meta.max_seq_len)
        out = q.new_zeros((q.shape[0], self.num_heads, self.v_head_dim))
        out[:batch] = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        return out

    def _prefill(self, q: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor) -> torch.Tensor:
        """Each request's queries over its whole context, expanded from the cached latent, through
        SDPA with a lower-right causal mask (the chunk's queries are the context's last positions; on
        CUDA a memory-efficient kernel, so no [q, context] score matrix is held). The host reads the
        step's query starts and lengths: prefill steps are never inside a full graph."""
        nope, R = self.qk_nope_head_dim, self.kv_lora_rank
        out = q.new_zeros((q.shape[0], self.num_heads, self.v_head_dim))
        starts = meta.query_start_loc.tolist()
        for b, seq_len in enumerate(meta.seq_lens.tolist()):
            lo, hi = starts[b], starts[b + 1]
            if hi <= lo:
                continue
            rows = gather_latent(cache, meta.block_tables[b], seq_len)
            kv = self.kv_b_proj(rows[:, :R]).view(seq_len, self.num_heads, nope + self.v_head_dim)
            k = torch.cat((kv[..., :nope], rows[:, None, R:].expand(seq_len, self.num_heads, -1)), dim=-1)
            attn = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1)[None], k.transpose(0, 1)[None], kv[..., nope:].transpose(0, 1)[None],
                attn_mask=causal_lower_right(hi - lo, seq_len), scale=self.scale)
            out[lo:hi] = attn[0].transpose(0, 1)
        return out
