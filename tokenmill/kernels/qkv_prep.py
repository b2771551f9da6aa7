"""Attention input preparation in one pass: optional per-head q/k RMSNorm (Qwen3), rotary on q and k,
and the KV-cache write of k and v.

Unfused this is up to six small launches per layer (two strided copies, two RMSNorms, rotary, the
KV write); the Triton kernel reads q, k, v straight from the qkv projection's output through their
strides and rounds exactly where the separate kernels do (norm in fp32, rounded to the model dtype
before the weight multiply and again before rotary; rotary in fp32).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from tokenmill.kernels._dispatch import use_triton
from tokenmill.kernels.attention import kv_scale_arg, to_kv_cache, write_kv_cache_ref
from tokenmill.kernels.norm import rms_norm_ref
from tokenmill.kernels.rotary import rotary_ref

# From this many tokens on, one program takes all heads of a token; below it, one program per
# (token, kv head) so that a small decode batch still spreads over the SMs.
TOKEN_GRID_MIN_TOKENS = 256


def qkv_prep_ref(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                 q_norm_weight: Optional[torch.Tensor] = None, k_norm_weight: Optional[torch.Tensor] = None,
                 eps: float = 0.0, kv_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hk, D] (strided views are fine) -> rotated q, a new tensor.

    With norm weights, q and k are first RMS-normalised per head. k (rotated) and v are stored into
    the caches at slot_mapping [T]; slots < 0 are padding (an FP8 cache quantized with kv_scale,
    kernels/attention.py).
    """
    if q_norm_weight is not None:
        q = rms_norm_ref(q, q_norm_weight, eps)
        k = rms_norm_ref(k, k_norm_weight, eps)
    q, k = rotary_ref(positions, q, k, cos_sin_cache)
    write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping, kv_scale)
    return q


@triton.jit
def _norm_rotate(row_ptrs, rows_ok, cols, partner, col_ok, w_ptr, cos, sin, eps,
                 HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Heads at row_ptrs -> rotated [heads, BLOCK_D] in the input dtype.

    Each element is rotated with its partner in the other half, loaded a second time (from L1)
    rather than split out of registers, so the norm reduces over whole rows as the RMSNorm kernel
    does. Threads read their partners, so the rows cannot be overwritten in place.
    """
    mask = rows_ok[:, None] & col_ok[None, :]
    x = tl.load(row_ptrs[:, None] + cols[None, :], mask=mask, other=0.0)
    xp = tl.load(row_ptrs[:, None] + partner[None, :], mask=mask, other=0.0)
    h, hp = x.to(tl.float32), xp.to(tl.float32)
    if HAS_NORM:
        inv_rms = tl.rsqrt(tl.sum(h * h, axis=1) / HEAD_DIM + eps)[:, None]
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=col_ok, other=0.0).to(tl.float32)
        h = ((h * inv_rms).to(x.dtype).to(tl.float32) * w[None, :]).to(x.dtype).to(tl.float32)
        hp = ((hp * inv_rms).to(x.dtype).to(tl.float32) * wp[None, :]).to(x.dtype).to(tl.float32)
    return (h * cos[None, :] + hp * sin[None, :]).to(x.dtype)


@triton.jit
def _qkv_prep_kernel(
    pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, q_out_ptr, cos_sin_ptr, q_w_ptr, k_w_ptr, k_cache_ptr, v_cache_ptr,
    kv_scale_ptr, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_cs,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    GROUP: tl.constexpr, KV_PER_PROG: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_NORM: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Grid (T, Hk // KV_PER_PROG): KV_PER_PROG kv heads of one token and the GROUP q heads of each."""
    HALF: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    kv_first = tl.program_id(1) * KV_PER_PROG

    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < HEAD_DIM
    first_half = cols < HALF
    partner = tl.where(first_half, cols + HALF, cols - HALF)
    # Full-width cos/sin: x' = x cos + partner * (-sin in the first half, +sin in the second).
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cs_row = cos_sin_ptr + pos * stride_cs + cols % HALF
    cos = tl.load(cs_row, mask=col_ok, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + HALF, mask=col_ok, other=0.0).to(tl.float32)
    sin = tl.where(first_half, -sin, sin)

    q_local = tl.arange(0, BLOCK_Q)
    q_heads = kv_first * GROUP + q_local
    q_ok = q_local < KV_PER_PROG * GROUP
    q_rot = _norm_rotate(q_ptr + token * stride_qt + q_heads * stride_qh, q_ok, cols, partner, col_ok,
                         q_w_ptr, cos, sin, eps, HAS_NORM, HEAD_DIM)
    q_dst = q_out_ptr + token * stride_ot + q_heads[:, None] * stride_oh + cols[None, :]
    tl.store(q_dst, q_rot, mask=q_ok[:, None] & col_ok[None, :])

    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # padding tokens store nothing
        page, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
        kv_heads = kv_first + tl.arange(0, BLOCK_KV)
        kv_ok = tl.arange(0, BLOCK_KV) < KV_PER_PROG
        kv_mask = kv_ok[:, None] & col_ok[None, :]
        k_rot = _norm_rotate(k_ptr + token * stride_kt + kv_heads * stride_kh, kv_ok, cols, partner, col_ok,
                             k_w_ptr, cos, sin, eps, HAS_NORM, HEAD_DIM)
        k_dst = k_cache_ptr + page * stride_kcb + offset * stride_kcs + kv_heads[:, None] * stride_kch + cols[None, :]
        tl.store(k_dst, to_kv_cache(k_rot, kv_scale_ptr, 0, k_cache_ptr, KV_FP8), mask=kv_mask)
        v = tl.load(v_ptr + token * stride_vt + kv_heads[:, None] * stride_vh + cols[None, :], mask=kv_mask)
        v_dst = v_cache_ptr + page * stride_vcb + offset * stride_vcs + kv_heads[:, None] * stride_vch + cols[None, :]
        tl.store(v_dst, to_kv_cache(v, kv_scale_ptr, 1, v_cache_ptr, KV_FP8), mask=kv_mask)


def qkv_prep_triton(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                    q_norm_weight: Optional[torch.Tensor] = None, k_norm_weight: Optional[torch.Tensor] = None,
                    eps: float = 0.0, out: Optional[torch.Tensor] = None,
                    kv_scale: Optional[torch.Tensor] = None, fixed_grid: bool = False) -> torch.Tensor:
    """Triton version of qkv_prep_ref, one launch; the rotated q is a new contiguous [T, Hq, D]
    (not in place: see _norm_rotate), or goes into `out` (contiguous, that shape).

    Steps of TOKEN_GRID_MIN_TOKENS or more give a program all kv heads of a token, which changes
    the q/k norm's reduction layout; fixed_grid (batch-invariant mode) keeps one kv head per
    program in every step.

    q/k/v may be strided views of one qkv buffer (unit last stride), which is left unchanged. No
    host/device sync, and the grid depends only on shapes (CUDA-graph safe).
    """
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    assert group * num_kv_heads == num_q_heads, "q heads must be a multiple of kv heads"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    assert head_dim % 2 == 0 and cos_sin_cache.shape[1] == head_dim, "rotary over the full head_dim only"
    has_norm = q_norm_weight is not None
    if has_norm:  # the normed value is rounded to q's dtype, as the separate RMSNorm stores it
        assert q_norm_weight.dtype == k_norm_weight.dtype == q.dtype == k.dtype
    if out is None:
        q_out = torch.empty((tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    else:
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        q_out = out
    if tokens == 0:
        return q_out

    kv_per_prog = num_kv_heads if tokens >= TOKEN_GRID_MIN_TOKENS and not fixed_grid else 1
    block_q = triton.next_power_of_2(kv_per_prog * group)
    block_d = triton.next_power_of_2(head_dim)
    w_q, w_k = (q_norm_weight, k_norm_weight) if has_norm else (q, k)  # unused without the norm
    scale_arg, fp8 = kv_scale_arg(k_cache, kv_scale)
    _qkv_prep_kernel[(tokens, num_kv_heads // kv_per_prog)](
        positions.contiguous(), slot_mapping.contiguous(), q, k, v, q_out, cos_sin_cache, w_q, w_k, k_cache, v_cache,
        scale_arg, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        GROUP=group, KV_PER_PROG=kv_per_prog, BLOCK_Q=block_q, BLOCK_KV=triton.next_power_of_2(kv_per_prog),
        HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE_SIZE=k_cache.shape[1], HAS_NORM=has_norm, KV_FP8=fp8,
        num_warps=max(1, min(8, block_q * block_d // 512)),
    )
    return q_out


def qkv_prep(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
             q_norm_weight=None, k_norm_weight=None, eps=0.0, out=None, kv_scale=None, fixed_grid=False):
    """Dispatch: the fused Triton kernel on CUDA, the torch composition elsewhere; returns rotated q
    (written into `out` when given)."""
    if use_triton(q):
        return qkv_prep_triton(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                               q_norm_weight, k_norm_weight, eps, out, kv_scale, fixed_grid)
    q_rot = qkv_prep_ref(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
                         q_norm_weight, k_norm_weight, eps, kv_scale)
    return q_rot if out is None else out.copy_(q_rot)
