"""Linear layers at one token (batch-1 decode), with the op before them fused in.

At a handful of tokens a linear layer only streams its weight matrix, and the small ops around it
(RMSNorm before q/k/v and gate/up, SiLU-and-mul before down, cuBLAS's split-K reduction after o and
down) cost more in launches and gaps than in bytes. This kernel computes y = a(x) W^T for one row
(batch-1 decode), where the prologue a() is one of:

    PLAIN        a(x) = x
    SILU_MUL     a(x) = silu(x[:, :K]) * x[:, K:]            (x is the gate|up projection output)
    ADD_RMSNORM  a(x) = rms_norm(x + residual) * norm_weight  (x + residual also written out)

Each program owns BLOCK_N output features and runs over all of K (no split-K, so no reduction
pass); the prologue is recomputed per program from L2, which costs far less than the launches it
removes. PLAIN and SILU_MUL round as the separate kernels do (kernels/activation.py). ADD_RMSNORM
takes one pass: since rms_norm(h) W^T = ((h * norm_weight) W^T) / rms(h), the sum of squares
accumulates beside the products and the division comes last, so the weight loads start at once
instead of after a pass over the row (in a one-wave grid such as q/k/v's, every program would wait
for that pass with the memory idle). It skips the separate kernel's rounding of the normalised row
to the input dtype, so it agrees with the unfused path to that rounding, not bit for bit.
"""

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.kernels.activation import silu_and_mul_ref
from tokenmill.kernels.norm import rms_norm_ref

PLAIN, SILU_MUL, ADD_RMSNORM = 0, 1, 2
MAX_ROWS = 1  # batch-1 decode; more tokens go to cuBLAS


def skinny_linear_ref(x: torch.Tensor, weight: torch.Tensor, prologue: int = PLAIN,
                      residual: Optional[torch.Tensor] = None, norm_weight: Optional[torch.Tensor] = None,
                      eps: float = 1e-6):
    """Torch reference: y, or (y, x + residual) for ADD_RMSNORM with a residual."""
    if prologue == SILU_MUL:
        return F.linear(silu_and_mul_ref(x), weight)
    if prologue == ADD_RMSNORM:
        normed = rms_norm_ref(x, norm_weight, eps, residual)
        if residual is None:
            return F.linear(normed, weight)
        normed, summed = normed
        return F.linear(normed, weight), summed
    return F.linear(x, weight)


@triton.jit
def _load_prologue(x_ptr, r_ptr, nw_ptr, kk, k_ok, K, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """a(x)[kk] (fp32 for ADD_RMSNORM, where it is (x + r) * norm_weight, not yet divided by the
    RMS; the input dtype otherwise) and the rounded sum x + r (x without a residual)."""
    x = tl.load(x_ptr + kk, mask=k_ok, other=0.0)
    summed = x
    if PROLOGUE == 1:  # SILU_MUL: x holds [gate | up]
        gate = x.to(tl.float32)
        up = tl.load(x_ptr + K + kk, mask=k_ok, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
        a = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
    elif PROLOGUE == 2:  # ADD_RMSNORM
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + kk, mask=k_ok, other=0.0)
            summed = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        w = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        a = summed.to(tl.float32) * w
    else:
        a = x
    return a, summed


@triton.jit
def _gemv_rows(x_ptr, r_ptr, nw_ptr, w_ptr, sum_ptr, n, n_ok, K, eps, stride_wn, write_sum,
               PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[i] = a(x) . W[n[i]] in fp32 for the rows n (any BLOCK_N of them); with write_sum, this
    program also writes the new residual stream x + r (ADD_RMSNORM with a residual).

    Products accumulate in a [BLOCK_N, BLOCK_K] fp32 tile, reduced once at the end, so the loop
    body is loads and FMAs only."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([n.shape[0], BLOCK_K], tl.float32)
    sq = tl.zeros([BLOCK_K], tl.float32)  # ADD_RMSNORM: squares of the (rounded) x + r
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < K
        a, summed = _load_prologue(x_ptr, r_ptr, nw_ptr, kk, k_ok, K, PROLOGUE, HAS_RESIDUAL)
        if PROLOGUE == 2:
            h = summed.to(tl.float32)
            sq += h * h
            if HAS_RESIDUAL:
                if write_sum:
                    tl.store(sum_ptr + kk, summed, mask=k_ok)
        w = tl.load(w_ptr + n[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if PROLOGUE == 2:
        y = y * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    return y


@triton.jit
def _gemv_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, out_ptr, sum_ptr,
    N, K, eps, stride_wn,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N),): program p computes out[p*BLOCK_N : (p+1)*BLOCK_N] for one row x;
    program 0 writes the residual stream."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    y = _gemv_rows(x_ptr, r_ptr, nw_ptr, w_ptr, sum_ptr, n, n_ok, K, eps, stride_wn, pid == 0,
                   PROLOGUE, HAS_RESIDUAL, BLOCK_K)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def skinny_gemm_config(n: int, k: int, dtype: torch.dtype, prologue: int = PLAIN) -> dict:
    """BLOCK_N output features per program, BLOCK_K per step, warps, stages. Tune here.

    From the H200 sweep in CUDA graphs (kernel_bench, Llama-3.1-8B shapes): with ADD_RMSNORM every
    program re-reads the row (and residual) from L2, so programs own 16 output features, and the
    narrower q/k/v projection takes 8 warps; o and down take 8 features, 4 warps."""
    if prologue == ADD_RMSNORM:
        return dict(block_n=16, block_k=256, num_warps=4, num_stages=3) if n >= 16384 else \
            dict(block_n=16, block_k=512, num_warps=8, num_stages=3)
    return dict(block_n=8, block_k=512, num_warps=4, num_stages=3)


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, prologue: int = PLAIN,
                         residual: Optional[torch.Tensor] = None, norm_weight: Optional[torch.Tensor] = None,
                         eps: float = 1e-6, config: Optional[dict] = None):
    """Triton path of skinny_linear_ref for one row x [1, K] (or [1, 2K] for SILU_MUL), contiguous."""
    M = x.shape[0]
    N, K = weight.shape
    assert M <= MAX_ROWS, f"skinny_linear takes at most {MAX_ROWS} row, got {M}"
    assert x.stride(-1) == 1 and weight.stride(-1) == 1
    assert x.shape[1] == (2 * K if prologue == SILU_MUL else K), "x does not match the weight's K"
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    has_residual = prologue == ADD_RMSNORM and residual is not None
    summed = torch.empty((M, K), dtype=x.dtype, device=x.device) if has_residual else out
    if has_residual:
        assert residual.shape == (M, K) and residual.stride(-1) == 1
    cfg = {**skinny_gemm_config(N, K, x.dtype, prologue), **(config or {})}
    if M > 0:
        _gemv_kernel[(triton.cdiv(N, cfg["block_n"]),)](
            x, residual if has_residual else x, norm_weight if prologue == ADD_RMSNORM else x, weight, out, summed,
            N, K, eps, weight.stride(0),
            PROLOGUE=prologue, HAS_RESIDUAL=has_residual, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return (out, summed) if has_residual else out
