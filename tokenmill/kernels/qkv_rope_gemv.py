"""The q/k/v projection of 1 to 8 tokens with what follows it fused in: one kernel computes
rms_norm(x + residual) W_qkv^T, rotates q and k, writes q out and k/v into the paged KV cache.

At a few tokens (batch-1 decode, speculative verify steps, small decode batches) the separate
qkv_prep kernel (kernels/qkv_prep.py) costs a launch and a dependent step between the GEMV and
attention for a few kilobytes of work. Here each GEMV program owns pairs of
rotary partners instead of consecutive rows: rows d and d + D/2 of one head (D = head_dim), for
BLOCK_N / 2 consecutive d, so rotary needs nothing from another program. Rotary rounds as
qkv_prep does: the projection is rounded to the model dtype, rotated in fp32, rounded again. Only
for models without q/k norm (that norm needs the whole head). One token runs the one-row GEMV
(skinny_gemm._gemv_rows), 2 to 8 tokens the several-row one (_gemv_multi_rows), each token with
its own position and slot.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from tokenmill.kernels.lora import lora_expand_ref
from tokenmill.kernels.lora_epilogue import LoRATerm, add_lora, lora_epilogue_args
from tokenmill.kernels.attention import kv_scale_arg, to_kv_cache
from tokenmill.kernels.qkv_prep import qkv_prep_ref
from tokenmill.kernels.skinny_gemm import (ADD_RMSNORM, MAX_ROWS, _gemv_multi_rows, _gemv_rows, padded_rows,
                                           skinny_gemm_config, skinny_linear_ref)

MAX_TOKENS = MAX_ROWS


def skinny_qkv_rope_ref(x, weight, residual, norm_weight, eps, positions, cos_sin_cache, slot_mapping,
                        k_cache, v_cache, num_q_heads: int, num_kv_heads: int, lora: Optional[LoRATerm] = None,
                        kv_scale: Optional[torch.Tensor] = None):
    """Torch reference: (rotated q [T, Hq, D], the new residual stream x + residual, or x without
    one); k (rotated) and v go into the caches at slot_mapping (a negative slot stores nothing).
    With `lora`, the adapter's term is added to the projection (lora_expand_ref) before the rotation."""
    y = skinny_linear_ref(x, weight, ADD_RMSNORM, residual, norm_weight, eps)
    qkv, summed = y if residual is not None else (y, x)
    if lora is not None:
        lora_expand_ref(lora.s, lora.b_stack, lora.token_slots[: qkv.shape[0]], qkv, lora.rank, lora.slice_starts)
    head_dim = weight.shape[0] // (num_q_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q_rot = qkv_prep_ref(positions, q.view(-1, num_q_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
                         v.view(-1, num_kv_heads, head_dim), cos_sin_cache, k_cache, v_cache, slot_mapping,
                         kv_scale=kv_scale)
    return q_rot, summed


@triton.jit
def _program_rows(HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's head (q heads, then k, then v), the first of its rotary dims d0, and its
    BLOCK_N projection rows: dims d0 + [0, PAIRS) of the head and their partners d0 + HALF + [0, PAIRS)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    PAIRS: tl.constexpr = BLOCK_N // 2
    pid = tl.program_id(0)
    head = pid // (HALF // PAIRS)
    d0 = (pid % (HALF // PAIRS)) * PAIRS
    j = tl.arange(0, BLOCK_N)
    rows = head * HEAD_DIM + d0 + j % PAIRS + (j // PAIRS) * HALF
    return pid, head, d0, rows


@triton.jit
def _kv_destination(head, page, offset, k_cache_ptr, v_cache_ptr, stride_kcb, stride_kcs, stride_kch, stride_vcb,
                    stride_vcs, stride_vch, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr):
    """Where the cache row of a k head (head < NUM_Q_HEADS + NUM_KV_HEADS) or a v head at `page`,
    `offset` (scalars, or one per token) starts."""
    if head < NUM_Q_HEADS + NUM_KV_HEADS:
        dst = k_cache_ptr + page * stride_kcb + offset * stride_kcs + (head - NUM_Q_HEADS) * stride_kch
    else:
        dst = v_cache_ptr + page * stride_vcb + offset * stride_vcs + (head - NUM_Q_HEADS - NUM_KV_HEADS) * stride_vch
    return dst


@triton.jit
def _qkv_rope_gemv_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, sum_ptr, pos_ptr, slot_ptr, cos_sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    kv_scale_ptr, ws_ptr, ls_ptr, lb_ptr, lslot_ptr, stride_lbs, stride_lbn,
    K, eps, stride_wn, stride_cs, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_SCALE: tl.constexpr,
    LORA: tl.constexpr, LORA_RANK: tl.constexpr, LORA_RANK_P: tl.constexpr,
    LS1: tl.constexpr, LS2: tl.constexpr, LS3: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Grid (heads * HEAD_DIM / BLOCK_N,): program p takes head p // (HALF / PAIRS) (q heads, then k,
    then v) and, in it, dims d0 + [0, PAIRS) and their partners d0 + HALF + [0, PAIRS). With LORA,
    the adapter's term (kernels/lora_epilogue.py) joins the projection before its rounding and the
    rotation."""
    HALF: tl.constexpr = HEAD_DIM // 2
    PAIRS: tl.constexpr = BLOCK_N // 2
    pid, head, d0, rows = _program_rows(HEAD_DIM, BLOCK_N)
    y = _gemv_rows(x_ptr, r_ptr, nw_ptr, w_ptr, sum_ptr, rows, rows >= 0, K, eps, stride_wn, pid == 0,
                   2, HAS_RESIDUAL, BLOCK_K)
    if W_SCALE:  # FP8 weights: each row's scale
        y = y * tl.load(ws_ptr + rows)
    y = add_lora(y, rows, rows >= 0, ls_ptr, lb_ptr, lslot_ptr, stride_lbs, stride_lbn, LORA, LORA_RANK,
                 LORA_RANK_P, LS1, LS2, LS3)
    # The projection as the unfused path stores it (model dtype), split into the two halves.
    y = tl.reshape(y.to(q_out_ptr.dtype.element_ty).to(tl.float32), (2, PAIRS))
    half_of = tl.arange(0, 2)[:, None]
    lo = tl.sum(tl.where(half_of == 0, y, 0.0), axis=0)  # dims d0 + [0, PAIRS)
    hi = tl.sum(tl.where(half_of == 1, y, 0.0), axis=0)  # their partners, + HALF
    d = d0 + tl.arange(0, PAIRS)
    if head < NUM_Q_HEADS + NUM_KV_HEADS:  # q and k are rotated: x' = x cos + partner * (-sin | +sin)
        pos = tl.load(pos_ptr).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * stride_cs + d).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d).to(tl.float32)
        rot_lo = lo * cos + hi * -sin
        hi = hi * cos + lo * sin
        lo = rot_lo
    if head < NUM_Q_HEADS:
        q_row = q_out_ptr + head * HEAD_DIM
        tl.store(q_row + d, lo.to(q_out_ptr.dtype.element_ty))
        tl.store(q_row + HALF + d, hi.to(q_out_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_ptr).to(tl.int64)
        if slot >= 0:  # a padding slot stores nothing
            dst = _kv_destination(head, slot // PAGE_SIZE, slot % PAGE_SIZE, k_cache_ptr, v_cache_ptr, stride_kcb,
                                  stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, NUM_Q_HEADS, NUM_KV_HEADS)
            which = (head >= NUM_Q_HEADS + NUM_KV_HEADS).to(tl.int32)  # the K or the V scale
            tl.store(dst + d, to_kv_cache(lo, kv_scale_ptr, which, k_cache_ptr, KV_FP8))
            tl.store(dst + HALF + d, to_kv_cache(hi, kv_scale_ptr, which, k_cache_ptr, KV_FP8))


@triton.jit
def _qkv_rope_gemv_multi_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, sum_ptr, pos_ptr, slot_ptr, cos_sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    kv_scale_ptr, ws_ptr, M, K, eps, stride_xm, stride_rm, stride_wn, stride_cs,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LOOP_STAGES: tl.constexpr, PIN_PROLOGUE: tl.constexpr, W_SCALE: tl.constexpr, KV_FP8: tl.constexpr,
):
    """_qkv_rope_gemv_kernel for M <= ROWS tokens (ROWS a power of two; tokens M.. masked off), each
    with its own position and slot: the same programs and rotary pairs, the several-row GEMV
    (skinny_gemm._gemv_multi_rows) for the projection; program 0 writes the M rows of the
    residual stream."""
    HALF: tl.constexpr = HEAD_DIM // 2
    PAIRS: tl.constexpr = BLOCK_N // 2
    Q_STRIDE: tl.constexpr = NUM_Q_HEADS * HEAD_DIM
    pid, head, d0, rows = _program_rows(HEAD_DIM, BLOCK_N)
    m = tl.arange(0, ROWS)
    m_ok = m < M
    sum_rows = m < tl.where(pid == 0, M, 0)
    y = _gemv_multi_rows(x_ptr, r_ptr, nw_ptr, w_ptr, sum_ptr, m, m_ok, sum_rows, rows, rows >= 0, K, eps,
                         stride_xm, stride_rm, stride_wn, 2, HAS_RESIDUAL, ROWS, BLOCK_N, BLOCK_K, LOOP_STAGES,
                         PIN_PROLOGUE)
    if W_SCALE:
        y = y * tl.load(ws_ptr + rows)[None, :]
    # The projection as the unfused path stores it (model dtype), split into the two halves.
    y = tl.reshape(y.to(q_out_ptr.dtype.element_ty).to(tl.float32), (ROWS, 2, PAIRS))
    half_of = tl.arange(0, 2)[None, :, None]
    lo = tl.sum(tl.where(half_of == 0, y, 0.0), axis=1)  # [ROWS, PAIRS]: dims d0 + [0, PAIRS)
    hi = tl.sum(tl.where(half_of == 1, y, 0.0), axis=1)  # their partners, + HALF
    d = d0 + tl.arange(0, PAIRS)
    if head < NUM_Q_HEADS + NUM_KV_HEADS:  # q and k are rotated: x' = x cos + partner * (-sin | +sin)
        pos = tl.load(pos_ptr + m, mask=m_ok, other=0).to(tl.int64)
        cs = cos_sin_ptr + pos[:, None] * stride_cs + d[None, :]
        cos = tl.load(cs, mask=m_ok[:, None], other=0.0).to(tl.float32)
        sin = tl.load(cs + HALF, mask=m_ok[:, None], other=0.0).to(tl.float32)
        rot_lo = lo * cos + hi * -sin
        hi = hi * cos + lo * sin
        lo = rot_lo
    if head < NUM_Q_HEADS:
        q_row = q_out_ptr + m[:, None] * Q_STRIDE + head * HEAD_DIM + d[None, :]
        tl.store(q_row, lo.to(q_out_ptr.dtype.element_ty), mask=m_ok[:, None])
        tl.store(q_row + HALF, hi.to(q_out_ptr.dtype.element_ty), mask=m_ok[:, None])
    else:
        slot = tl.load(slot_ptr + m, mask=m_ok, other=-1).to(tl.int64)
        store = (slot >= 0)[:, None]  # a padding slot (and a padding token) stores nothing
        dst = _kv_destination(head, slot // PAGE_SIZE, slot % PAGE_SIZE, k_cache_ptr, v_cache_ptr, stride_kcb,
                              stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, NUM_Q_HEADS, NUM_KV_HEADS)
        dst = dst[:, None] + d[None, :]
        which = (head >= NUM_Q_HEADS + NUM_KV_HEADS).to(tl.int32)  # the K or the V scale
        tl.store(dst, to_kv_cache(lo, kv_scale_ptr, which, k_cache_ptr, KV_FP8), mask=store)
        tl.store(dst + HALF, to_kv_cache(hi, kv_scale_ptr, which, k_cache_ptr, KV_FP8), mask=store)


def fusable(n: int, k: int, head_dim: int, dtype: torch.dtype, config: Optional[dict] = None, tokens: int = 1) -> bool:
    """Whether the tile config of an [n, k] q/k/v weight at `tokens` tokens splits a head into
    whole pairs of rotary partners."""
    if not 1 <= tokens <= MAX_TOKENS:
        return False
    block_n = {**skinny_gemm_config(n, k, dtype, ADD_RMSNORM, tokens), **(config or {})}["block_n"]
    return head_dim % 2 == 0 and block_n % 2 == 0 and (head_dim // 2) % (block_n // 2) == 0


def skinny_qkv_rope_triton(x, weight, residual, norm_weight, eps, positions, cos_sin_cache, slot_mapping,
                           k_cache, v_cache, num_q_heads: int, num_kv_heads: int,
                           q_out: Optional[torch.Tensor] = None, config: Optional[dict] = None,
                           lora: Optional[LoRATerm] = None, weight_scale: Optional[torch.Tensor] = None,
                           kv_scale: Optional[torch.Tensor] = None):
    """Triton version of skinny_qkv_rope_ref, one launch; q goes into q_out ([T, Hq, D],
    contiguous) when given. `lora` (one token only) adds an adapter's term to the projection
    before the rotation (kernels/lora_epilogue.py). weight_scale [N] fp32: FP8 weights with these
    per-row scales (reference: skinny_qkv_rope_ref on the dequantized weight). kv_scale: an FP8
    cache's (k_scale, v_scale) (kernels/attention.py). x [T, K] with T <= MAX_TOKENS, rows contiguous (any row stride), the
    residual likewise; positions and slot_mapping [T]; weight [(Hq + 2 Hk) D, K] with q, k, v rows
    in that order; caches [blocks, page, Hk, D]."""
    tokens, K = x.shape
    N = weight.shape[0]
    head_dim = N // (num_q_heads + 2 * num_kv_heads)
    assert tokens <= MAX_TOKENS, f"skinny_qkv_rope takes at most {MAX_TOKENS} rows, got {tokens}"
    assert head_dim * (num_q_heads + 2 * num_kv_heads) == N and weight.shape[1] == K
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and cos_sin_cache.shape[1] == head_dim
    assert positions.shape[0] >= tokens and slot_mapping.shape[0] >= tokens
    cfg = {**skinny_gemm_config(N, K, x.dtype, ADD_RMSNORM, tokens, weight.dtype), **(config or {})}
    assert fusable(N, K, head_dim, x.dtype, cfg, max(tokens, 1)), \
        f"BLOCK_N {cfg['block_n']} does not split head_dim {head_dim} into rotary pairs"
    if q_out is None:
        q_out = torch.empty((tokens, num_q_heads, head_dim), dtype=x.dtype, device=x.device)
    assert q_out.shape == (tokens, num_q_heads, head_dim) and q_out.is_contiguous() and q_out.dtype == x.dtype
    has_residual = residual is not None
    summed = torch.empty((tokens, K), dtype=x.dtype, device=x.device) if has_residual else x
    if has_residual:
        assert residual.shape == x.shape and residual.stride(-1) == 1
    grid = (N // cfg["block_n"],)
    if weight_scale is not None:
        assert weight_scale.shape == (N,) and weight_scale.dtype == torch.float32 and weight_scale.is_contiguous()
    ws_arg = weight_scale if weight_scale is not None else x
    scale_arg, kv_fp8 = kv_scale_arg(k_cache, kv_scale)
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    heads = dict(NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1])
    assert lora is None or tokens == 1, "the LoRA epilogue is the one-token kernel's"
    if tokens == 1:
        lora_args, lora_meta = lora_epilogue_args(lora, q_out, N)
        _qkv_rope_gemv_kernel[grid](
            x, residual if has_residual else x, norm_weight, weight, summed, positions, slot_mapping, cos_sin_cache,
            q_out, k_cache, v_cache, scale_arg, ws_arg, *lora_args,
            K, eps, weight.stride(0), cos_sin_cache.stride(0), *cache_strides,
            **heads, HAS_RESIDUAL=has_residual, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
            W_SCALE=weight_scale is not None, KV_FP8=kv_fp8, **lora_meta, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    elif tokens > 1:
        assert cfg["block_k"] >= 8, "the several-row kernel takes K in groups of 8"
        _qkv_rope_gemv_multi_kernel[grid](
            x, residual if has_residual else x, norm_weight, weight, summed, positions, slot_mapping, cos_sin_cache,
            q_out, k_cache, v_cache, scale_arg, ws_arg,
            tokens, K, eps, x.stride(0), residual.stride(0) if has_residual else 0, weight.stride(0),
            cos_sin_cache.stride(0), *cache_strides,
            **heads, HAS_RESIDUAL=has_residual, ROWS=padded_rows(tokens), BLOCK_N=cfg["block_n"],
            BLOCK_K=cfg["block_k"], LOOP_STAGES=cfg["num_stages"], PIN_PROLOGUE=x.is_cuda,
            W_SCALE=weight_scale is not None, KV_FP8=kv_fp8,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return q_out, summed
