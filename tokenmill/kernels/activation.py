"""SiLU-and-mul: the gated activation of Llama-family MLPs."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.kernels._dispatch import use_triton
from tokenmill.kernels.fp8_quant import quantize_rows_fp8


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x is [tokens, 2 * d] = [gate | up]; returns silu(gate) * up, [tokens, d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


@triton.jit
def _silu_mul(x_ptrs, d, mask):
    """silu(gate) * up in fp32 at x_ptrs (gate) and x_ptrs + d (up), zero where masked off."""
    gate = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptrs + d, mask=mask, other=0.0)
    # Round silu(gate) to the input dtype before the product, as the two torch ops do.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    return act.to(tl.float32) * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, BLOCK: tl.constexpr):
    """Grid (rows, cdiv(d, BLOCK)): one BLOCK-wide slice of one row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    tl.store(out_ptr + row * d + cols, _silu_mul(x_ptr + row * stride_x + cols, d, mask), mask=mask)


@triton.jit
def _silu_and_mul_quant_kernel(x_ptr, q_ptr, s_ptr, d, stride_x, BLOCK: tl.constexpr):
    """Grid (rows,): one row's silu(gate) * up (d <= BLOCK features, held in registers), rounded to
    the input dtype as _silu_and_mul_kernel stores it, then quantized to e4m3 with one scale for
    the row (kernels/fp8_quant.py)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    v = _silu_mul(x_ptr + row * stride_x + cols, d, mask).to(x_ptr.dtype.element_ty).to(tl.float32)
    quantize_rows_fp8(v[None, :], (q_ptr + row * d + cols)[None, :], s_ptr + row + tl.zeros([1], tl.int64),
                      mask[None, :], tl.full([1], True, tl.int1))


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton silu_and_mul; x may have any row stride (unit last stride); returns a new tensor."""
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if rows == 0 or d == 0:
        return out
    block = min(1024, triton.next_power_of_2(d))
    grid = (rows, triton.cdiv(d, block))
    _silu_and_mul_kernel[grid](x2, out, d, x2.stride(0), BLOCK=block, num_warps=4)
    return out


# The longest row silu_and_mul_quant_fp8_triton takes (one program a row, 16 warps, 32 features a
# thread); longer rows take the unfused pair (quantization/fp8.py). Measured: PERFORMANCE.md.
QUANT_MAX_FEATURES = 16384


def silu_and_mul_quant_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul_triton's rows quantized to e4m3 per row in the same launch: (x_q [M, d] e4m3,
    scales [M, 1] fp32), bit for bit silu_and_mul_triton and then
    kernels/fp8_quant.quantize_per_token_fp8_triton. x [M, 2d], unit last stride,
    d <= QUANT_MAX_FEATURES."""
    assert x.dim() == 2 and x.stride(-1) == 1
    rows, d = x.shape[0], x.shape[1] // 2
    assert d <= QUANT_MAX_FEATURES, f"rows of {d} features: at most {QUANT_MAX_FEATURES}"
    q = torch.empty((rows, d), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows and d:
        block = triton.next_power_of_2(d)
        _silu_and_mul_quant_kernel[(rows,)](x, q, s, d, x.stride(0), BLOCK=block,
                                            num_warps=max(4, min(16, block // 1024)))
    return q, s


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
