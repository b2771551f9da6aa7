"""Per-step attention metadata and the KV cache, set by the runner around each forward pass.

The model's Attention layers read them instead of taking them as arguments, so model code stays the
same for eager runs, CUDA graph capture and dummy runs, and a model holds no reference to any cache
(several runners, e.g. in tests, can share one loaded model). The context also carries the
engine's own layer choices (`small_batch_fusion`) and the step's LoRA adapters (`lora`), so two engines in one process never change each
other's step path; it is a context variable, so engines on different threads do not see each other's.
"""

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import numpy as np

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
    # The host arrays the step's real requests were uploaded from (None inside graphs): a layer that
    # plans per request on the host (layers/mla.py's mixed steps) reads these, not the device.
    host_q_lens: Optional[np.ndarray] = None
    host_start_pos: Optional[np.ndarray] = None


class AttentionSplitter(Protocol):
    """Set while capturing piecewise CUDA graphs (runner/piecewise_graphs.py): attention layers
    write q into its buffer and, instead of attending, end the current graph there."""

    def q_buffer(self, tokens: int) -> torch.Tensor: ...

    def split(self, attention: torch.nn.Module) -> torch.Tensor: ...


class LoRAHook(Protocol):
    """Set for steps in which a request has a LoRA adapter (lora/slots.py's LoRAStepContext): each
    linear layer adds its adapters' B @ A @ a(x) to its output."""

    def apply(self, module: torch.nn.Module, x: torch.Tensor, prologue: int, norm: Optional[torch.nn.Module],
              y: torch.Tensor) -> None: ...


class PipelineHook(Protocol):
    """Set on the ranks of a pipeline-parallel model (executor/pipeline.py): a stage after the first
    receives the hidden states and residual stream from the one before, a stage before the last
    sends them on."""

    is_first: bool
    is_last: bool

    def recv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None: ...


@dataclass
class ForwardContext:
    metadata: AttentionMetadata
    # Per layer: (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim].
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    splitter: Optional[AttentionSplitter] = None
    # One-token steps on CUDA run each linear layer as one Triton GEMV with the op before it fused
    # in (kernels/skinny_gemm.py); False: cuBLAS and separate kernels (EngineConfig.fused_small_batch_linear).
    small_batch_fusion: bool = True
    lora: Optional[LoRAHook] = None
    pipeline: Optional[PipelineHook] = None
    # Data parallelism with expert parallelism: the tokens every DP rank runs this step (the lockstep
    # agreement's padded count, engine/dp_lockstep.py), which the MoE layers pad to; None: no agreement.
    dp_tokens: Optional[int] = None


_current: ContextVar[Optional[ForwardContext]] = ContextVar("tokenmill_forward_context", default=None)


@contextmanager
def forward_context(metadata: AttentionMetadata, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    splitter: Optional[AttentionSplitter] = None, small_batch_fusion: bool = True,
                   lora: Optional[LoRAHook] = None, pipeline: Optional[PipelineHook] = None,
                   dp_tokens: Optional[int] = None):
    token = _current.set(ForwardContext(metadata, kv_caches, splitter, small_batch_fusion, lora, pipeline, dp_tokens))
    try:
        yield
    finally:
        _current.reset(token)


def current_forward_context() -> Optional[ForwardContext]:
    """The step's context, or None outside a forward pass (e.g. a layer called on its own)."""
    return _current.get()


def get_forward_context() -> ForwardContext:
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError("attention needs a KV cache and step metadata (run the model through the runner)")
    return ctx
