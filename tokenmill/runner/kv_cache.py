"""KV cache allocation: one tensor for all layers, viewed per layer, sized from memory or given."""

from dataclasses import dataclass

import torch

from tokenmill.logger import init_logger

logger = init_logger(__name__)


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    # K and V (2), or one latent per token (MLA: AttentionSpec.latent), whose bytes alone count
    planes: int = 2

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return self.planes * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """EngineConfig.kv_cache_dtype as a torch dtype: "auto" is the model's, "fp8" e4m3 (scaled per
    layer: kernels/attention.py)."""
    return model_dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One [layers, planes, blocks, block_size, kv_heads, head_dim] tensor, as (k, v) views per
    layer; with one plane (a latent cache) both name the same tensor."""
    cache = torch.zeros((spec.num_layers, spec.planes, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim),
                        dtype=spec.dtype, device=device)
    return [(cache[i, 0], cache[i, spec.planes - 1]) for i in range(spec.num_layers)]


def cuda_kv_budget_bytes(utilization: float, peak_activation_bytes: int, device) -> int:
    """What the KV cache may take: the utilization share of the device, minus what is in use now
    (weights, other processes) and minus the activation peak the profiling run measured."""
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    return int(total * utilization - in_use - peak_activation_bytes)
