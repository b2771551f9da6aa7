"""RMSNorm, optionally fused with the residual add that precedes it."""

from typing import Optional

import torch
import triton
import triton.language as tl

from tokenmill.kernels._dispatch import use_triton
from tokenmill.kernels.fp8_quant import quantize_rows_fp8


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None
):
    """out = weight * normalize(x [+ residual]); returns out, or (out, x + residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, scale_ptr,
    num_rows, rows_inner, hidden, eps,
    stride_x0, stride_x1, stride_r0, stride_r1, stride_ro0, stride_ro1,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QUANT_FP8: tl.constexpr,
):
    """One program normalises ROWS rows; a row is (r // rows_inner, r % rows_inner) of a [R0, R1, H] view.
    QUANT_FP8: out_ptr is e4m3 and takes the normalised rows (as rounded to x's dtype) quantized per
    row, with their scales at scale_ptr (kernels/fp8_quant.py)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols < hidden)[None, :]
    rows = rows.to(tl.int64)
    outer, inner = rows // rows_inner, rows % rows_inner

    x_offs = (outer * stride_x0 + inner * stride_x1)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_offs = (outer * stride_r0 + inner * stride_r1)[:, None] + cols[None, :]
        r = tl.load(res_ptr + r_offs, mask=mask, other=0.0)
        # The sum is rounded to the residual stream's dtype before normalising, as in the reference.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        ro_offs = (outer * stride_ro0 + inner * stride_ro1)[:, None] + cols[None, :]
        tl.store(res_out_ptr + ro_offs, x, mask=mask)

    h = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=1) / hidden + eps)
    # Round the normalised value to the input dtype before the weight multiply (HF Llama order).
    h = (h * inv_rms[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + rows[:, None] * hidden + cols[None, :]
    if QUANT_FP8:
        quantize_rows_fp8((h * w[None, :]).to(x.dtype).to(tl.float32), out_ptrs, scale_ptr + rows, mask, row_ok)
    else:
        tl.store(out_ptrs, h * w[None, :], mask=mask)


def _row_view(t: torch.Tensor) -> Optional[tuple[int, int, int]]:
    """Address t as [R0, R1, H] rows: (R1, stride0, stride1), or None if that needs a copy."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return None
    if t.dim() == 1:
        return 1, 0, 0
    if t.dim() == 2:
        return 1, t.stride(0), 0
    if t.dim() == 3:
        return t.shape[1], t.stride(0), t.stride(1)
    return None


def _norm_launch_config(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_H, ROWS per program, num_warps): a few KiB per program so small rows are batched."""
    block_h = triton.next_power_of_2(hidden)
    rows = max(1, min(64, 2048 // block_h))
    num_warps = max(1, min(8, rows * block_h // 512))
    return block_h, rows, num_warps


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None
):
    """Triton RMSNorm with the reference's semantics and rounding order.

    x is 1-D to 3-D (e.g. a [T, heads, head_dim] view of a fused qkv for Qwen3 q/k norm); any
    strides work without a copy as long as the last one is 1. `out` is a new contiguous tensor.
    In place: with `residual` (same shape as x), x + residual is written INTO `residual` when it
    already has the sum's dtype and a unit last stride (otherwise into a new tensor); that buffer
    is returned as the second value.
    """
    hidden = x.shape[-1]
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    res_out = None
    if residual is not None:
        assert residual.shape == x.shape, "residual must have x's shape"
        sum_dtype = torch.promote_types(x.dtype, residual.dtype)
        out_dtype = torch.promote_types(sum_dtype, weight.dtype)
        in_place = residual.dtype == sum_dtype and _row_view(residual) is not None
        res_out = residual if in_place else torch.empty(x.shape, dtype=sum_dtype, device=x.device)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    num_rows = x.numel() // hidden if hidden else 0
    if num_rows == 0:
        return out if residual is None else (out, res_out)

    views = [_row_view(t) for t in (x, residual, res_out) if t is not None]
    if any(v is None for v in views) or len({v[0] for v in views}) > 1:
        # Rare layouts: normalise flat contiguous rows, then copy the sum back if needed.
        flat = rms_norm_triton(
            x.reshape(-1, hidden).contiguous(), weight, eps,
            None if residual is None else residual.reshape(-1, hidden).contiguous(),
        )
        if residual is None:
            return flat.view(x.shape)
        res_out.copy_(flat[1].view(x.shape))
        return flat[0].view(x.shape), res_out

    inner, sx0, sx1 = views[0]
    if residual is not None:
        (_, sr0, sr1), (_, so0, so1) = views[1], views[2]
        r_arg, ro_arg = residual, res_out
    else:
        sr0 = sr1 = so0 = so1 = 0
        r_arg = ro_arg = x  # unused
    block_h, rows, num_warps = _norm_launch_config(hidden)
    grid = (triton.cdiv(num_rows, rows),)
    _rms_norm_kernel[grid](
        x, r_arg, ro_arg, weight, out, out,
        num_rows, inner, hidden, eps,
        sx0, sx1, sr0, sr1, so0, so1,
        HAS_RESIDUAL=residual is not None, ROWS=rows, BLOCK_H=block_h, QUANT_FP8=False, num_warps=num_warps,
    )
    return out if residual is None else (out, res_out)


def rms_norm_quant_fp8_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                              residual: Optional[torch.Tensor] = None):
    """rms_norm_triton's rows quantized to e4m3 per row in the same launch: (x_q [M, H] e4m3,
    scales [M, 1] fp32, the residual stream x + residual or x). Bit for bit rms_norm_triton and then
    kernels/fp8_quant.quantize_per_token_fp8_triton, without the 16-bit rows between them. x (and
    residual, whose buffer takes the sum as in rms_norm_triton) are contiguous [M, H] of weight's
    dtype."""
    assert x.dim() == 2 and x.is_contiguous() and x.dtype == weight.dtype
    assert residual is None or (residual.shape == x.shape and residual.is_contiguous() and residual.dtype == x.dtype)
    num_rows, hidden = x.shape
    q = torch.empty((num_rows, hidden), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows:
        block_h, rows, num_warps = _norm_launch_config(hidden)
        r_arg = x if residual is None else residual
        _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
            x, r_arg, r_arg, weight, q, scale,
            num_rows, 1, hidden, eps,
            hidden, 0, hidden, 0, hidden, 0,
            HAS_RESIDUAL=residual is not None, ROWS=rows, BLOCK_H=block_h, QUANT_FP8=True, num_warps=num_warps,
        )
    return q, scale, (x if residual is None else residual)


def rms_norm(x, weight, eps, residual=None):
    """Dispatch: Triton on CUDA (see rms_norm_triton for the in-place residual), torch elsewhere."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
