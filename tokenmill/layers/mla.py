"""Multi-head latent attention (DeepSeek-V2 / V3) over a paged latent cache: the second attention backend.

Per token the cache holds the compressed latent c = kv_a_layernorm(kv_a(x))[:R] and the rope'd
key k_pe (kernels/mla_attention.py has the layout), not per-head K/V. Head h's key is
[W_UK[h] c, k_pe] and its value W_UV[h] c, with kv_b_proj's weight [H * (nope + v), R] = per
head [W_UK[h]; W_UV[h]]. Two ways to attend:

- absorbed, for every request that computes one token (all of a decode step, max_query_len == 1,
  and the decodes of a mixed step): W_UK is absorbed into the query, q_lat = W_UK[h]^T q_nope, the
  latent kernel attends over the cache rows as they are, and W_UV is applied to its output. Reads
  R + P numbers per cached token instead of H * (nope + 2v).
- expanded, for each longer chunk (prefill, chunked prefill, verify): the request's whole cached
  context (earlier chunks included) is expanded through kv_b_proj into per-head keys and values and
  attended to with a lower-right causal mask through torch's SDPA: plain attention over what HF
  computes, so the two paths check each other.

Tensor parallelism splits the heads: each rank holds its heads' rows of kv_b_proj (and of q and
o_proj, models/deepseek.py) and the whole latent cache, which every head shares.

Only a step where every request computes one token picks its path without reading query lengths on
the host, so the backend declares CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE (full graphs for
decode batches; other steps eager or piecewise).
"""

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import divide, get_tp_size
from tokenmill.kernels.mla_attention import gather_latent, mla_cache_write, mla_decode
from tokenmill.layers.attention import CudaGraphSupport
from tokenmill.layers.forward_context import AttentionMetadata, get_forward_context
from tokenmill.layers.linear import ColumnParallelLinear


# Query slices of the expanded path hold at most this many scores (heads x queries x keys): 256 MiB in fp32.
SCORES_BUDGET = 1 << 26


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
        if meta.max_query_len == 1:  # row b is request b; rows past the batch are padding, left zero
            batch = min(q.shape[0], meta.seq_lens.shape[0])
            result = q.new_zeros((q.shape[0], self.num_heads, self.v_head_dim))
            result[:batch] = self._absorbed(q[:batch], cache, meta.block_tables, meta.seq_lens, meta.num_splits,
                                            meta.max_seq_len)
        else:
            result = self._mixed(q, meta, cache)
        if out is None:
            return result
        out[..., : self.v_head_dim].copy_(result)
        return out

    def _absorbed(self, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  num_splits: Optional[int], max_seq_len: Optional[int]) -> torch.Tensor:
        """q [B, H, nope + rope], one query per request at the end of its context -> [B, H, v]:
        W_UK into the query, the latent kernel over the cached rows, W_UV after."""
        w_uk, w_uv = self._up_weights()
        nope = self.qk_nope_head_dim
        q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, R]
        o_lat = mla_decode(q_lat, q[..., nope:], cache, block_tables, seq_lens, self.scale,
                           num_splits=num_splits, max_seq_len=max_seq_len)
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _mixed(self, q: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor) -> torch.Tensor:
        """A step with prefill chunks (and maybe decodes): the one-token requests together through the
        absorbed path, each longer chunk over its expanded context (planned on the host from the
        runner's copies of the step's query starts and context lengths: such steps are never inside a full graph)."""
        out = q.new_zeros((q.shape[0], self.num_heads, self.v_head_dim))
        if meta.host_q_lens is not None:  # the runner's host arrays: no device read on the step path
            starts = [0] + np.cumsum(meta.host_q_lens).tolist()
            seq_lens = (meta.host_start_pos + meta.host_q_lens).tolist()  # as prepare_inputs computes them
        else:  # (a warm-up or dummy run's metadata)
            starts, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        decodes = [b for b in range(len(seq_lens)) if starts[b + 1] - starts[b] == 1]
        if decodes:
            reqs = torch.tensor(decodes).to(q.device, non_blocking=True)  # (a blocking copy would wait for the device)
            rows = meta.query_start_loc[reqs].long()
            out[rows] = self._absorbed(q[rows], cache, meta.block_tables[reqs], meta.seq_lens[reqs], None,
                                       max(seq_lens[b] for b in decodes))
        for b, seq_len in enumerate(seq_lens):
            lo, hi = starts[b], starts[b + 1]
            if hi - lo > 1:
                out[lo:hi] = self._expanded(q[lo:hi], cache, meta.block_tables[b], seq_len)
        return out

    def _expanded(self, q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
        """One request's chunk q [n, H, nope + rope], the last n positions of its seq_len-token context
        -> [n, H, v]: the cached latent expanded through kv_b_proj into per-head keys and values, then
        SDPA with a lower-right causal mask, over slices of the queries small enough that a score
        matrix (the math backend's, where no fused kernel takes these head dims) stays bounded."""
        nope, R = self.qk_nope_head_dim, self.kv_lora_rank
        rows = gather_latent(cache, block_table, seq_len)
        kv = self.kv_b_proj(rows[:, :R]).view(seq_len, self.num_heads, nope + self.v_head_dim)
        k = torch.cat((kv[..., :nope], rows[:, None, R:].expand(seq_len, self.num_heads, -1)), dim=-1)
        k, v = k.transpose(0, 1)[None], kv[..., nope:].transpose(0, 1)[None]  # [1, H, seq_len, d]
        # Imported here: torch.nn.attention.bias pulls in torch._dynamo (0.9 s at every process start).
        from torch.nn.attention.bias import causal_lower_right

        n = q.shape[0]
        out = q.new_empty((n, self.num_heads, self.v_head_dim))
        step = max(1, SCORES_BUDGET // (self.num_heads * seq_len))
        for i in range(0, n, step):
            j = min(n, i + step)
            visible = seq_len - (n - j)  # keys up to the slice's last query
            out[i:j] = F.scaled_dot_product_attention(
                q[i:j].transpose(0, 1)[None], k[:, :, :visible], v[:, :, :visible],
                attn_mask=causal_lower_right(j - i, visible), scale=self.scale)[0].transpose(0, 1)
        return out
