"""Rotary position embedding (neox / rotate-half layout, as HF Llama applies it)."""

import torch
import triton
import triton.language as tl

from tokenmill.kernels._dispatch import use_triton


def rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor):
    """Rotate q [T, Hq, D] and k [T, Hk, D] by the angles of `positions` [T].

    cos_sin_cache is [max_positions, D] float32: cos of the D/2 frequencies, then their sin.
    Returns new (q, k) in the input dtype.
    """
    half = cos_sin_cache.shape[1] // 2
    cs = cos_sin_cache[positions.long()]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rotate(x):
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


@triton.jit
def _rotate_heads(x_ptr, token, num_heads, stride_t, stride_h, cos, sin, half, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    """Rotate all heads of one token in place: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin."""
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (cols < half)[None, :]
    ptr1 = x_ptr + token * stride_t + heads[:, None] * stride_h + cols[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + half, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(ptr1, x1f * cos[None, :] - x2f * sin[None, :], mask=mask)
    tl.store(ptr1 + half, x2f * cos[None, :] + x1f * sin[None, :], mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr,
    num_q_heads, num_k_heads, half,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Grid (T,): one token's q and k heads, sharing one cos/sin load."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + cols, mask=cols < half, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + half + cols, mask=cols < half, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, token, num_q_heads, stride_qt, stride_qh, cos, sin, half, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr, token, num_k_heads, stride_kt, stride_kh, cos, sin, half, BLOCK_HK, BLOCK_HALF)


def rotary_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor):
    """Triton rotary; rotates q and k IN PLACE (any strides with a unit last one) and returns (q, k).

    q/k may be views into a fused qkv buffer: that buffer is updated.
    """
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "head_dim must be contiguous"
    assert cos_sin_cache.stride(-1) == 1
    tokens, head_dim = q.shape[0], q.shape[-1]
    half = cos_sin_cache.shape[1] // 2
    assert 2 * half == head_dim, "rotary over the full head_dim only"
    if tokens == 0:
        return q, k
    block_half = triton.next_power_of_2(half)
    block_hq, block_hk = triton.next_power_of_2(q.shape[1]), triton.next_power_of_2(k.shape[1])
    num_warps = 4 if block_hq * block_half >= 2048 else 2
    _rotary_kernel[(tokens,)](
        positions.contiguous(), q, k, cos_sin_cache,
        q.shape[1], k.shape[1], half,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, num_warps=num_warps,
    )
    return q, k


def rotary_embedding(positions, q, k, cos_sin_cache):
    """Dispatch: Triton on CUDA rotates q/k in place and returns them; torch returns new tensors."""
    if use_triton(q):
        return rotary_triton(positions, q, k, cos_sin_cache)
    return rotary_ref(positions, q, k, cos_sin_cache)
