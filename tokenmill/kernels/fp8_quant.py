"""Per-token FP8 (e4m3) quantization of activations, the input of the W8A8 matmul (quantization/fp8.py).

For each row x[m]: s[m] = max(max|x[m]| / 448, tiny) and x_q[m] = round_e4m3(x[m] * (1 / s[m])), the
reciprocal correctly rounded once a row (a product an element instead of a division: the IEEE
division took about a third of the SiLU-and-mul's instructions, and x * (1 / s) differs from x / s
by at most an ulp of fp32, which changes an e4m3 byte only at a rounding tie's edge). The
torch version is about six passes over the activations in fp32 (a copy, abs, amax, a division, a
clamp, the cast); here one program per row reads its row twice (the second time from L2: the max,
then the quantized row) and writes one byte per element and the scale.
Reference: quantization/fp8.quantize_activation_fp8.

quantize_rows_fp8 is the same quantization as an epilogue for kernels that already hold whole rows
(the RMSNorm of kernels/norm.py, the SiLU-and-mul of kernels/activation.py): they write the W8A8
matmul's input and scales directly, instead of a 16-bit row that this kernel then reads.
"""

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
MIN_SCALE = 1e-12


@triton.jit
def fp8_row_scale(amax):
    """(s, 1 / s) for rows whose largest |x| is amax (fp32, any shape): s = max(amax / 448, 1e-12),
    both with IEEE division, as torch's."""
    scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1e-12)
    return scale, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)


@triton.jit
def to_e4m3(x, inv_scale):
    """x (fp32) * inv_scale saturated at +-448, ready for the cast to e4m3."""
    return tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0)


@triton.jit
def quantize_rows_fp8(v, q_ptrs, s_ptrs, mask, row_ok):
    """Quantize the rows of v [R, B] fp32 (each whole row, zero where masked off), as
    _quant_rows_kernel does: the e4m3 bytes to q_ptrs [R, B] (under mask), each row's scale to
    s_ptrs [R] (under row_ok)."""
    scale, inv_scale = fp8_row_scale(tl.max(tl.abs(v), axis=1))
    tl.store(q_ptrs, to_e4m3(v, inv_scale[:, None]).to(q_ptrs.dtype.element_ty), mask=mask)
    tl.store(s_ptrs, scale, mask=row_ok)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x = tl.load(x_ptr + m * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale, inv_scale = fp8_row_scale(tl.max(amax, axis=0))
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x = tl.load(x_ptr + m * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + m * stride_qm + kk, to_e4m3(x, inv_scale).to(q_ptr.dtype.element_ty), mask=kk < K)
    tl.store(s_ptr + m, scale)


def quantize_per_token_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q [M, K] e4m3, scales [M, 1] fp32) for x [M, K] (unit last stride)."""
    assert x.dim() == 2 and x.stride(-1) == 1
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        block_k = min(2048, triton.next_power_of_2(K))
        _quant_rows_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0), BLOCK_K=block_k,
                                 num_warps=4 if block_k <= 1024 else 8)
    return q, s
