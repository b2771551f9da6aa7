"""The W8A8 matmul of decode-sized steps: y = (x_q * x_scale) (w_q * w_scale)^T for e4m3 x_q [M, K]
(per-token scales [M, 1]) and e4m3 w_q [N, K] (per-row scales [N]), out in the model dtype.

Larger steps take torch._scaled_mm (quantization/fp8.py). At decode batches cuBLAS's 128 x 128
tiles leave most SMs idle for narrow projections, so this kernel splits K where the tiles alone
would (fp8_gemm_config); each split's fp32 partial goes to a workspace and a second kernel sums the
splits in order and applies both scales, so the result does not depend on timing. The tensor cores'
e4m3 accumulation is promoted to an fp32 sum every BLOCK_K (max_num_imprecise_acc). Measurements:
docs/PERFORMANCE.md, "Kernel tile choices".

Reference: quantization/fp8.fp8_linear_ref with quantize_input (the dequantized operands in fp32).
"""

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl


# Steps of up to this many tokens may take this kernel on CUDA (fp8_gemm_config says which shapes);
# above, _scaled_mm's tiles fill the GPU and it was faster at every projection (256 rows, H200).
MAX_ROWS = 128


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


def fp8_gemm_config(m: int, n: int, k: int) -> Optional[Fp8GemmConfig]:
    """The launch config for an [m, k] x [n, k]^T product, or None where cuBLAS is faster (from the
    H200 sweep at Llama-3.1-8B's projections: benchmarks/fp8_kernel_bench.py). Up to 64 rows: one
    64-row tile, 128 features for wide layers, else 64 with K split in four; 65 to 128 rows: two
    64-row tiles for short K, a 128-row tile with K split in two for long K; wide layers keep cuBLAS."""
    if m > MAX_ROWS:
        return None
    if m <= 64:
        if n >= 16384:
            return Fp8GemmConfig(block_m=64, block_n=128)
        return Fp8GemmConfig(block_m=64, block_n=64, split_k=4 if k >= 4096 else 1)
    if n >= 16384:
        return None
    if k >= 8192:
        return Fp8GemmConfig(block_m=128, block_n=64, block_k=256, split_k=2, num_warps=8, num_stages=3)
    return Fp8GemmConfig(block_m=64, block_n=64, block_k=256, num_stages=3)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, y_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                     STAGES: tl.constexpr, WIDEN: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), splits): the tile's products over K in
    [split * k_per_split, (split + 1) * k_per_split). SPLIT: stored in fp32 at y[split, M, N] for
    _sum_splits_kernel; else scaled and stored in y's dtype. WIDEN: the tiles multiply in fp32
    (Triton's interpreter has no e4m3 products)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    m_ok = rm < M
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        kk = k0 + rk
        k_ok = kk < k_hi
        a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_rows + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        if WIDEN:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        tl.store(y_ptr + (split * M + rm.to(tl.int64))[:, None] * N + rn[None, :], acc, mask=mask)
    else:
        xs = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)
        ws = tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
        y = acc * xs[:, None] * ws[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(part_ptr, xs_ptr, ws_ptr, y_ptr, M, N, stride_ym, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """y[m, n] = (((0 + part[0, m, n]) + part[1, m, n]) + ...) * x_scale[m] * w_scale[n]."""
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_ok = rn < N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        total += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + rn, mask=n_ok, other=0.0)
    y = total * tl.load(xs_ptr + m) * tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def fp8_gemm_triton(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype, config: Optional[Fp8GemmConfig] = None) -> torch.Tensor:
    """y [M, N] in out_dtype for x_q [M, K] e4m3 with x_scale [M, 1] fp32, w_q [N, K] e4m3 with
    w_scale [N] fp32 (rows contiguous)."""
    assert x_q.stride(-1) == 1 and w_q.stride(-1) == 1 and x_q.shape[1] == w_q.shape[1]
    assert x_scale.is_contiguous() and w_scale.is_contiguous()
    m, k = x_q.shape
    n = w_q.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0:
        return y
    cfg = config or fp8_gemm_config(m, n, k)
    assert cfg is not None, f"no config for {m} x {n} x {k}: cuBLAS's shape (fp8_gemm_config)"
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), splits)
    meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.num_stages,
                WIDEN=not x_q.is_cuda, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits == 1:
        _fp8_gemm_kernel[grid](x_q, w_q, x_scale, w_scale, y, m, n, k, k_per_split, x_q.stride(0), w_q.stride(0),
                               y.stride(0), SPLIT=False, **meta)
        return y
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x_q.device)
    _fp8_gemm_kernel[grid](x_q, w_q, x_scale, w_scale, part, m, n, k, k_per_split, x_q.stride(0), w_q.stride(0),
                           n, SPLIT=True, **meta)
    block = min(1024, triton.next_power_of_2(n))
    _sum_splits_kernel[(m, triton.cdiv(n, block))](part, x_scale, w_scale, y, m, n, y.stride(0), SPLITS=splits,
                                                   BLOCK=block, num_warps=4)
    return y
