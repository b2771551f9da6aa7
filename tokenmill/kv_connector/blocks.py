"""KV blocks as bytes: what every connector's worker side does to the runner's cache.

runner/kv_cache.py allocates the cache as one [layers, planes, blocks, block_size, kv_heads,
head_dim] tensor (planes: K and V, or MLA's one latent) and hands the runner per-layer views of it.
A connector sees it as uint8 (any KV dtype, fp8 included, moves the same way), gathers a set of
blocks into one staging tensor [n, layers, planes, ...] whose rows are each one whole block,
contiguous, and scatters such a tensor back.
"""

import hashlib

import torch


def kv_cache_bytes(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The runner's cache as one uint8 tensor [layers, planes, blocks, ...bytes of a block-row]."""
    base = kv_caches[0][0]._base  # runner/kv_cache.py: one [layers, planes, blocks, ...] tensor, viewed per layer
    if base is None or any(k._base is not base or v._base is not base for k, v in kv_caches):
        raise ValueError("a KV connector needs the KV cache as one tensor (runner/kv_cache.py's layout)")
    return base.view(torch.uint8)


def block_shape(cache: torch.Tensor) -> tuple[int, ...]:
    """The shape of one block's bytes, [layers, planes, ...], as gather_blocks stages it."""
    return (cache.shape[0], cache.shape[1]) + tuple(cache.shape[3:])


def layout_tag(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bytes:
    """16 bytes naming the block layout (shape and dtype): engines exchange blocks only when theirs agree."""
    base = kv_caches[0][0]._base
    shape = (base.shape[0], base.shape[1]) + tuple(base.shape[3:])
    return hashlib.sha256(f"{shape}:{base.dtype}".encode()).digest()[:16]


def device_block_ids(block_ids: list[int], device: torch.device) -> torch.Tensor:
    ids = torch.tensor(block_ids, dtype=torch.int64)
    if device.type != "cuda":
        return ids
    # From pinned memory, asynchronously: a pageable copy would make the host wait for the stream.
    return ids.pin_memory().to(device, non_blocking=True)


def gather_blocks(cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """The blocks' bytes, on the cache's device: [n, layers, planes, ...], each row contiguous."""
    ids = device_block_ids(block_ids, cache.device)
    return cache.index_select(2, ids).movedim(2, 0).contiguous()


def scatter_blocks(cache: torch.Tensor, block_ids: list[int], staged: torch.Tensor) -> None:
    """Write staged [n, layers, planes, ...] (on any device) into the cache's blocks."""
    if staged.device != cache.device:
        staged = staged.to(cache.device, non_blocking=True)
    cache.index_copy_(2, device_block_ids(block_ids, cache.device), staged.movedim(0, 2))
