"""Linear layers at a few tokens (batch-1 decode, speculative verify steps, small decode
batches), with the op before them fused in.

At a handful of tokens a linear layer only streams its weight matrix, and the small ops around it
(RMSNorm before q/k/v and gate/up, SiLU-and-mul before down, cuBLAS's split-K reduction after o and
down) cost more in launches and gaps than in bytes. These kernels compute y = a(x) W^T for
M <= MAX_ROWS rows, where the prologue a() is one of:

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

One row takes _gemv_kernel. Two to eight rows take _gemv_multi_kernel, compiled for 2, 4 or 8 rows
(padded_rows; the rows past M are masked off): it loads each weight tile once per K step and
applies it to every row, so a 4-token step reads the weights once, as a 1-token step does. The
arithmetic per row is the one-row kernel's (the same roundings, the sum of squares and the rsqrt
per row); only the order in which fp32 products are summed differs, so a row's result agrees with
the one-row kernel's to fp32 rounding, not bit for bit (the residual stream is bit-equal).
"""

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.kernels.activation import silu_and_mul_ref
from tokenmill.kernels.lora_epilogue import LoRATerm, add_lora, lora_epilogue_args
from tokenmill.kernels.norm import rms_norm_ref

PLAIN, SILU_MUL, ADD_RMSNORM = 0, 1, 2
# Speculative verify steps (1 + k tokens, k <= 7) and small decode batches. Each row adds one FMA
# per weight element, and at 8 rows the FMAs alone take over half of the issue slots an H200 SM
# has at the HBM rate; beyond that the layer stops being bound by the weight stream on CUDA cores,
# and cuBLAS (tensor cores) takes it.
MAX_ROWS = 8


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
def _widen(w):
    """A weight tile in fp32. e4m3 goes through fp16 (exact: e4m3 is a subset), where Hopper
    converts two bytes in one instruction."""
    if w.dtype == tl.float8e4nv:
        return w.to(tl.float16).to(tl.float32)
    return w.to(tl.float32)


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
        acc += _widen(w) * a.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if PROLOGUE == 2:
        y = y * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    return y


@triton.jit
def _gemv_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, out_ptr, sum_ptr, ws_ptr,
    ls_ptr, lb_ptr, lslot_ptr, stride_lbs, stride_lbn,
    N, K, eps, stride_wn,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_SCALE: tl.constexpr,
    LORA: tl.constexpr, LORA_RANK: tl.constexpr, LORA_RANK_P: tl.constexpr,
    LS1: tl.constexpr, LS2: tl.constexpr, LS3: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_N),): program p computes out[p*BLOCK_N : (p+1)*BLOCK_N] for one row x;
    program 0 writes the residual stream. With W_SCALE (FP8 weights), each output is multiplied
    by its row's scale; with LORA, each output also takes its adapter term
    (kernels/lora_epilogue.py) before the one rounding."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    y = _gemv_rows(x_ptr, r_ptr, nw_ptr, w_ptr, sum_ptr, n, n_ok, K, eps, stride_wn, pid == 0,
                   PROLOGUE, HAS_RESIDUAL, BLOCK_K)
    if W_SCALE:
        y = y * tl.load(ws_ptr + n, mask=n_ok, other=0.0)
    y = add_lora(y, n, n_ok, ls_ptr, lb_ptr, lslot_ptr, stride_lbs, stride_lbn, LORA, LORA_RANK, LORA_RANK_P,
                 LS1, LS2, LS3)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _load_prologue_rows(x_ptr, r_ptr, nw_ptr, m, m_ok, kk, k_ok, K, stride_xm, stride_rm,
                        PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """_load_prologue for rows m (masked by m_ok) at the K offsets kk ([KB, VEC]): a(x) and x + r
    as [ROWS, KB, VEC] tiles, with the one-row kernel's arithmetic and rounding, row by row."""
    mask = m_ok[:, None, None] & k_ok[None, :, :]
    x_row = x_ptr + m[:, None, None] * stride_xm + kk[None, :, :]
    x = tl.load(x_row, mask=mask, other=0.0)
    summed = x
    if PROLOGUE == 1:  # SILU_MUL: each row holds [gate | up]
        gate = x.to(tl.float32)
        up = tl.load(x_row + K, mask=mask, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
        a = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
    elif PROLOGUE == 2:  # ADD_RMSNORM
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + m[:, None, None] * stride_rm + kk[None, :, :], mask=mask, other=0.0)
            summed = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        w = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        a = summed.to(tl.float32) * w[None, :, :]
    else:
        a = x
    return a, summed


@triton.jit
def _computed_once(a, PIN: tl.constexpr):
    """a, unchanged. With PIN, through an opaque register move, so that the compiler computes a
    where it is loaded, each element by one thread, and hands it to the threads that multiply it
    through shared memory. Without it, Triton recomputes the prologue in the layout of the product,
    where every element is held by all the threads that share its K (4 to 8 copies at 4 warps: at
    8 rows that doubled the instructions per weight of the loop). PTX, so not in the interpreter."""
    if PIN:
        a = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [a], dtype=tl.float32, is_pure=False, pack=1)
    return a


@triton.jit
def _add_lanes(acc, p, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr):
    """acc [ROWS, BLOCK_N, KB] + p [ROWS, BLOCK_N, KB, 8] summed over its last axis, one lane
    after another (split, not tl.sum: the lanes sit in one thread, and a chain of adds onto acc
    compiles to a chain of FMAs where tl.sum's tree would add a multiply and an add per pair)."""
    p_even, p_odd = tl.split(tl.reshape(p, (ROWS, BLOCK_N, KB, 4, 2)))
    p0, p1 = tl.split(tl.reshape(p_even, (ROWS, BLOCK_N, KB, 2, 2)))
    p2, p3 = tl.split(tl.reshape(p_odd, (ROWS, BLOCK_N, KB, 2, 2)))
    q0, q1 = tl.split(p0)
    q2, q3 = tl.split(p1)
    q4, q5 = tl.split(p2)
    q6, q7 = tl.split(p3)
    return acc + q0 + q1 + q2 + q3 + q4 + q5 + q6 + q7


@triton.jit
def _gemv_multi_rows(x_ptr, r_ptr, nw_ptr, w_ptr, sum_ptr, m, m_ok, sum_rows, n, n_ok, K, eps,
                     stride_xm, stride_rm, stride_wn,
                     PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr, PIN_PROLOGUE: tl.constexpr):
    """y[i, j] = a(x[m[i]]) . W[n[j]] in fp32, [ROWS, BLOCK_N], for the rows m (masked by m_ok) and
    any BLOCK_N weight rows n; the rows sum_rows of the residual stream x + r are written too
    (ADD_RMSNORM with a residual: program 0 passes m_ok, the others none).

    Each K step loads the weight tile once, as [BLOCK_N, KB, 8] (8 consecutive K per thread: 16-byte
    loads in bf16), and applies it to every row: the products [ROWS, BLOCK_N, KB, 8] are added lane
    by lane into a [ROWS, BLOCK_N, KB] fp32 accumulator, reduced over KB once at the end. So the
    loop body is loads and FMA chains, and the accumulator holds an eighth of the products of a
    step (the one-row kernel keeps one per product: at 4 or 8 rows that would not fit in the
    registers). LOOP_STAGES > 1 pipelines the loop's loads through shared memory (tl.range's
    num_stages), keeping several tiles in flight without holding them in registers."""
    VEC: tl.constexpr = 8
    KB: tl.constexpr = BLOCK_K // VEC
    koff = tl.arange(0, KB)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [KB, VEC]
    acc = tl.zeros([ROWS, BLOCK_N, KB], tl.float32)
    sq = tl.zeros([ROWS, KB, VEC], tl.float32)  # ADD_RMSNORM: per-row squares of the (rounded) x + r
    for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
        kk = k0 + koff
        k_ok = kk < K
        a, summed = _load_prologue_rows(x_ptr, r_ptr, nw_ptr, m, m_ok, kk, k_ok, K, stride_xm, stride_rm,
                                        PROLOGUE, HAS_RESIDUAL)
        if PROLOGUE == 2:
            h = summed.to(tl.float32)
            sq += h * h
            if HAS_RESIDUAL:
                tl.store(sum_ptr + m[:, None, None] * K + kk[None, :, :], summed,
                         mask=sum_rows[:, None, None] & k_ok[None, :, :])
        w = tl.load(w_ptr + n[:, None, None] * stride_wn + kk[None, :, :], mask=n_ok[:, None, None] & k_ok[None, :, :],
                    other=0.0)
        a = _computed_once(a.to(tl.float32), PIN_PROLOGUE)
        acc = _add_lanes(acc, _widen(w)[None, :, :, :] * a[:, None, :, :], ROWS, BLOCK_N, KB)
    y = tl.sum(acc, axis=2)  # [ROWS, BLOCK_N]
    if PROLOGUE == 2:
        y = y * tl.rsqrt(tl.sum(tl.sum(sq, axis=2), axis=1) / K + eps)[:, None]
    return y


@triton.jit
def _gemv_multi_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, out_ptr, sum_ptr, ws_ptr,
    M, N, K, eps, stride_xm, stride_rm, stride_wn,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr,
    PIN_PROLOGUE: tl.constexpr, W_SCALE: tl.constexpr,
):
    """_gemv_kernel for M <= ROWS rows (ROWS a power of two; rows M.. are masked off): grid
    (cdiv(N, BLOCK_N),), program p computes out[:M, p*BLOCK_N : (p+1)*BLOCK_N]; program 0 writes
    the M rows of the residual stream."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, ROWS)
    m_ok = m < M
    sum_rows = m < tl.where(pid == 0, M, 0)
    y = _gemv_multi_rows(x_ptr, r_ptr, nw_ptr, w_ptr, sum_ptr, m, m_ok, sum_rows, n, n_ok, K, eps,
                         stride_xm, stride_rm, stride_wn, PROLOGUE, HAS_RESIDUAL, ROWS, BLOCK_N, BLOCK_K, LOOP_STAGES,
                         PIN_PROLOGUE)
    if W_SCALE:
        y = y * tl.load(ws_ptr + n, mask=n_ok, other=0.0)[None, :]
    tl.store(out_ptr + m[:, None] * N + n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])

def padded_rows(m: int) -> int:
    """The row count a launch for m rows is compiled for: 1 (the one-row kernel), else the power
    of two >= m (2, 4 or 8; the rows past m are masked off)."""
    return 1 if m <= 1 else triton.next_power_of_2(m)


def skinny_gemm_config(n: int, k: int, dtype: torch.dtype, prologue: int = PLAIN, rows: int = 1,
                       weight_dtype: Optional[torch.dtype] = None) -> dict:
    """BLOCK_N output features per program, BLOCK_K per step, warps, stages, for `rows` rows (keyed
    by padded_rows(rows)). Tune here (benchmarks/kernel_bench.py --skinny-rows, --skinny-fp8).

    One row: with ADD_RMSNORM every program re-reads the row from L2, so programs own 16 features.
    Several rows: the widest tiles that compile without spills, since at 8 rows the loop is close
    to issue-bound; num_stages is the loop's load-pipeline depth. FP8 weights: 8-feature tiles, as
    the byte widening costs issue slots. The sweeps behind each: docs/PERFORMANCE.md, "Kernel tile
    choices"."""
    rows = padded_rows(rows)
    if rows == 1 and weight_dtype is not None and weight_dtype.itemsize == 1:
        if prologue == ADD_RMSNORM:
            return dict(block_n=8, block_k=512, num_warps=4, num_stages=3)
        return dict(block_n=8, block_k=1024, num_warps=4, num_stages=3)
    if rows == 1:
        if prologue == ADD_RMSNORM:
            return dict(block_n=16, block_k=256, num_warps=4, num_stages=3) if n >= 16384 else \
                dict(block_n=16, block_k=512, num_warps=8, num_stages=3)
        return dict(block_n=8, block_k=512, num_warps=4, num_stages=3)
    wide = n >= 16384  # gate/up: enough programs for 32-feature tiles
    if rows == 2:
        # 96-128 registers, 4.8-6.6 instructions per weight element.
        if prologue == ADD_RMSNORM and wide:
            return dict(block_n=32, block_k=256, num_warps=4, num_stages=3)
        return dict(block_n=16, block_k=512, num_warps=4, num_stages=3)
    if rows == 4:
        # 96-166 registers, 7.8-9.8 instructions per weight element.
        if prologue == SILU_MUL:  # the SiLU per element is dear: 32 features share it
            return dict(block_n=32, block_k=256, num_warps=8, num_stages=4)
        if prologue == ADD_RMSNORM and wide:
            return dict(block_n=32, block_k=256, num_warps=4, num_stages=3)
        return dict(block_n=16, block_k=256, num_warps=4, num_stages=4)
    # 8 rows: 124-143 registers, 12-16 instructions per weight element.
    return dict(block_n=32, block_k=128, num_warps=4, num_stages=4)

def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, prologue: int = PLAIN,
                         residual: Optional[torch.Tensor] = None, norm_weight: Optional[torch.Tensor] = None,
                         eps: float = 1e-6, config: Optional[dict] = None, lora: Optional[LoRATerm] = None,
                         weight_scale: Optional[torch.Tensor] = None):
    """Triton path of skinny_linear_ref for M <= MAX_ROWS rows x [M, K] (or [M, 2K] for SILU_MUL),
    each row contiguous (any row stride); residual [M, K] likewise. One row takes the one-row
    kernel, more rows _gemv_multi_kernel (one launch either way). `lora` (one row only) adds an
    adapter's term to the product: skinny_linear_ref, then kernels/lora.lora_expand_ref.
    weight_scale [N] fp32: the weight is FP8 (e4m3) with these per-row scales (quantization/fp8.py;
    reference: skinny_linear_ref on the dequantized weight)."""
    M = x.shape[0]
    assert lora is None or M == 1, "the LoRA epilogue is the one-row kernel's"
    N, K = weight.shape
    assert M <= MAX_ROWS, f"skinny_linear takes at most {MAX_ROWS} rows, got {M}"
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.stride(-1) == 1
    assert x.shape[1] == (2 * K if prologue == SILU_MUL else K), "x does not match the weight's K"
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    has_residual = prologue == ADD_RMSNORM and residual is not None
    summed = torch.empty((M, K), dtype=x.dtype, device=x.device) if has_residual else out
    if has_residual:
        assert residual.shape == (M, K) and residual.stride(-1) == 1
    cfg = {**skinny_gemm_config(N, K, x.dtype, prologue, M, weight.dtype), **(config or {})}
    if weight_scale is not None:
        assert weight_scale.shape == (N,) and weight_scale.dtype == torch.float32 and weight_scale.is_contiguous()
    ws_arg = weight_scale if weight_scale is not None else out
    r_arg = residual if has_residual else x
    nw_arg = norm_weight if prologue == ADD_RMSNORM else x
    grid = (triton.cdiv(N, cfg["block_n"]),)
    if M == 1:
        lora_args, lora_meta = lora_epilogue_args(lora, out, N)
        _gemv_kernel[grid](
            x, r_arg, nw_arg, weight, out, summed, ws_arg, *lora_args,
            N, K, eps, weight.stride(0),
            PROLOGUE=prologue, HAS_RESIDUAL=has_residual, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
            W_SCALE=weight_scale is not None, **lora_meta, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    elif M > 1:
        assert cfg["block_k"] >= 8, "the several-row kernel takes K in groups of 8"
        _gemv_multi_kernel[grid](
            x, r_arg, nw_arg, weight, out, summed, ws_arg,
            M, N, K, eps, x.stride(0), residual.stride(0) if has_residual else 0, weight.stride(0),
            PROLOGUE=prologue, HAS_RESIDUAL=has_residual, ROWS=padded_rows(M), BLOCK_N=cfg["block_n"],
            BLOCK_K=cfg["block_k"], LOOP_STAGES=cfg["num_stages"], PIN_PROLOGUE=x.is_cuda,
            W_SCALE=weight_scale is not None,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return (out, summed) if has_residual else out
