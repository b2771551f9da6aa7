"""Attention over the paged KV cache: prepare q/k (optional q/k norm, rotary), store this step's K/V, attend."""

import enum
from typing import Optional

import torch
from torch import nn

from tokenmill.distributed import get_tp_state
from tokenmill.kernels.attention import paged_attention
from tokenmill.kernels.batch_invariant import paged_attention_invariant
from tokenmill.kernels.qkv_prep import qkv_prep
from tokenmill.layers.forward_context import AttentionMetadata, get_forward_context
from tokenmill.layers.linear import new_parameter


class CudaGraphSupport(enum.IntEnum):
    """What an attention backend lets a full CUDA graph hold; weaker is lower, so the runner takes
    the min over the backends in use. Piecewise graphs keep attention outside, so every level allows them."""

    NEVER = 0  # no full graphs
    UNIFORM_SINGLE_TOKEN_DECODE = 1  # full graphs of steps where every request computes one token
    UNIFORM_BATCH = 2  # ... or where every request computes the same number of tokens (verify steps)
    ALWAYS = 3  # ... or any step


class Attention(nn.Module):
    # The paged Triton kernels pick grid and tiles from the step's query lengths on the host.
    cuda_graph_support = CudaGraphSupport.UNIFORM_BATCH

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int,
                 sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
                 sinks: bool = False, dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        self.layer_idx = layer_idx  # which of the forward context's KV caches is this layer's
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window  # a query at p sees keys in (p - window, p]; None: all
        self.logit_softcap = logit_softcap  # scores become cap * tanh(scores / cap) (Gemma 2); None: off
        # An FP8 KV cache's (k_scale, v_scale) (kernels/attention.py): from the checkpoint's
        # self_attn.k_scale / v_scale when it has them (LlamaModel.load_weights), else 1.0.
        # Unused by a cache in the model dtype.
        self.register_buffer("kv_scale", torch.ones(2, dtype=torch.float32), persistent=False)
        # gpt-oss's attention sinks: a logit per q head in the softmax's denominator, this rank's
        # heads only (tensor parallelism splits them as it splits the q heads). None: off.
        self.sinks: Optional[nn.Parameter] = None
        if sinks:
            self.sinks = new_parameter(self, (num_heads,), dtype or torch.get_default_dtype(), device,
                                       loader=Attention._load_sinks)
        self.batch_invariant = False  # one fixed reduction order for every step (layers/invariance.py sets it)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's q heads' sinks out of the checkpoint's [all q heads]."""
        tp = get_tp_state()
        if tuple(loaded.shape) != (self.num_heads * tp.tp_size,):
            raise ValueError(f"shape mismatch loading attention sinks: checkpoint {tuple(loaded.shape)}, model "
                             f"({self.num_heads * tp.tp_size},)")
        param.data.copy_(loaded.narrow(0, tp.tp_rank * self.num_heads, self.num_heads))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cos_sin_cache: torch.Tensor, q_norm_weight: Optional[torch.Tensor] = None,
                k_norm_weight: Optional[torch.Tensor] = None, norm_eps: float = 0.0) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] as split from the qkv projection (strided views) -> [T, Hq * D].

        q and k are RMS-normalised per head when norm weights are given, then rotated by `positions`
        with the rotary table; k and v go into this layer's cache slots; then q attends. On CUDA one
        fused kernel does everything before the attention.
        """
        ctx = get_forward_context()
        meta = ctx.metadata
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        splitter = ctx.splitter
        q = qkv_prep(positions, q, k, v, cos_sin_cache, k_cache, v_cache, meta.slot_mapping,
                     q_norm_weight, k_norm_weight, norm_eps,
                     out=splitter.q_buffer(q.shape[0]) if splitter is not None else None, kv_scale=self.kv_scale,
                     fixed_grid=self.batch_invariant)
        if splitter is not None:  # capturing piecewise graphs: attention runs between the pieces
            out = splitter.split(self)
        else:
            out = self.attend(q, meta, ctx.kv_caches)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def step_cache(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """This layer's (k_cache, v_cache), the step's slot mapping and the layer's kv_scale, for a
        projection that writes the cache itself (QKVParallelLinear.forward_rope_into_cache)."""
        ctx = get_forward_context()
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        return k_cache, v_cache, ctx.metadata.slot_mapping, self.kv_scale

    def attend_prepared(self, q: torch.Tensor) -> torch.Tensor:
        """forward() for a q that is already rotated, with this step's K/V already cached -> [T, Hq * D]."""
        ctx = get_forward_context()
        assert ctx.splitter is None, "piecewise graphs split at forward(), not here"
        return self.attend(q, ctx.metadata, ctx.kv_caches).view(q.shape[0], self.num_heads * self.head_dim)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, kv_caches, out: Optional[torch.Tensor] = None):
        """q [T, Hq, D] (rotated, this step's K/V already cached) attends over this layer's cache."""
        k_cache, v_cache = kv_caches[self.layer_idx]
        if self.batch_invariant:  # one fixed reduction order for every step (kernels/batch_invariant.py)
            if self.logit_softcap is not None or self.sinks is not None:
                raise NotImplementedError("batch-invariant attention has no logit soft-capping (Gemma 2) "
                                          "and no attention sinks (gpt-oss)")
            return paged_attention_invariant(
                q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale, out,
                sliding_window=self.sliding_window, kv_scale=self.kv_scale, max_query_len=meta.max_query_len)
        return paged_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale, out,
            sliding_window=self.sliding_window, max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
            num_splits=meta.num_splits, kv_scale=self.kv_scale, softcap=self.logit_softcap,
            sinks=self.sinks,
        )
