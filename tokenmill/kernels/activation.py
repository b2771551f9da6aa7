"""SiLU-and-mul: the gated activation of Llama-family MLPs."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.kernels._dispatch import use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x is [tokens, 2 * d] = [gate | up]; returns silu(gate) * up, [tokens, d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, BLOCK: tl.constexpr):
    """Grid (rows, cdiv(d, BLOCK)): one BLOCK-wide slice of one row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    # Round silu(gate) to the input dtype before the product, as the two torch ops do.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(out_ptr + row * d + cols, act.to(tl.float32) * up.to(tl.float32), mask=mask)


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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
