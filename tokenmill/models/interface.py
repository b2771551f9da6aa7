"""What the runner may ask of a model: the shapes of its attention (to size the KV cache, compile
attention variants and allocate graph buffers), a forward pass and the LM head. The runner reads
nothing else of a model, so a new architecture only has to offer this (and, for the layer-truncated
speculative draft, `forward_first_layers(input_ids, positions, num_layers)`)."""

from dataclasses import dataclass
from typing import Optional, Protocol

import torch


@dataclass(frozen=True)
class AttentionSpec:
    """The attention layers' shapes on this rank (heads after tensor-parallel splitting)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    dtype: torch.dtype
    sliding_window: Optional[int] = None  # keys older than this many positions are not attended
    sinks: bool = False  # a learned logit per q head joins the softmax (gpt-oss): its kernel variants differ
    # Every distinct window of this rank's layers, sliding_window's first (Gemma's and gpt-oss's
    # interleaved sliding and full layers compile the attention variants of each); () : sliding_window's.
    layer_windows: tuple[Optional[int], ...] = ()
    # Multi-head latent attention (layers/mla.py): the cache holds one row of head_dim numbers per
    # token (the compressed latent and the rope'd key; num_kv_heads 1), no separate V plane.
    latent: bool = False

    @property
    def cache_planes(self) -> int:
        """Tensors per layer in the KV cache: K and V, or the one latent."""
        return 1 if self.latent else 2


class CausalLM(Protocol):
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def attention_spec(self) -> AttentionSpec: ...

