"""skinny_linear (few-token linear with a fused prologue): the Triton kernel against the torch reference."""

import pytest
import torch

from tokenmill.kernels.skinny_gemm import (ADD_RMSNORM, PLAIN, SILU_MUL, skinny_linear_ref,
                                           skinny_linear_triton)

from tests.kernels.common import DEVICES, TOL, nan_empty, rel_err  # noqa: F401


def _shapes(device):
    if device == "cpu":  # (M, N, K)
        return [(1, 48, 96), (1, 40, 300), (1, 5, 64)]
    return [(m, n, k) for m in (1,) for n, k in ((6144, 4096), (4096, 4096), (4096, 14336), (3072, 1024))]


def _dtypes(device):
    return [torch.float32] if device == "cpu" else [torch.float32, torch.bfloat16]


def _inputs(m, n, k, dtype, device, width=None):
    x = torch.randn(m, width or k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
    return x, w


@pytest.mark.parametrize("device", DEVICES)
def test_plain(device, nan_empty):
    torch.manual_seed(0)
    for m, n, k in _shapes(device):
        for dtype in _dtypes(device):
            x, w = _inputs(m, n, k, dtype, device)
            assert rel_err(skinny_linear_triton(x, w), skinny_linear_ref(x, w)) < TOL[dtype], (m, n, k, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_prologue(device, nan_empty):
    torch.manual_seed(1)
    for m, n, k in _shapes(device):
        for dtype in _dtypes(device):
            x, w = _inputs(m, n, k, dtype, device, width=2 * k)
            out = skinny_linear_triton(x, w, SILU_MUL)
            assert rel_err(out, skinny_linear_ref(x, w, SILU_MUL)) < TOL[dtype], (m, n, k, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_add_rmsnorm_prologue(device, nan_empty):
    torch.manual_seed(2)
    for m, n, k in _shapes(device):
        for dtype in _dtypes(device):
            x, w = _inputs(m, n, k, dtype, device)
            residual = torch.randn(m, k, device=device, dtype=dtype)
            norm_w = 1 + 0.1 * torch.randn(k, device=device, dtype=dtype)
            out, summed = skinny_linear_triton(x, w, ADD_RMSNORM, residual, norm_w, 1e-5)
            ref_out, ref_sum = skinny_linear_ref(x, w, ADD_RMSNORM, residual, norm_w, 1e-5)
            # The residual stream is bit-exact: the same rounded sum as the reference.
            torch.testing.assert_close(summed, ref_sum, rtol=0, atol=0)
            assert rel_err(out, ref_out) < TOL[dtype], (m, n, k, dtype)
            # Without a residual (the first layer) there is no sum to write.
            out = skinny_linear_triton(x, w, ADD_RMSNORM, None, norm_w, 1e-5)
            assert rel_err(out, skinny_linear_ref(x, w, ADD_RMSNORM, None, norm_w, 1e-5)) < TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_offset_view_and_bounds(device, nan_empty):
    torch.manual_seed(3)
    big = torch.randn(1, 200, device=device)
    x = big[:, 50:146]  # a view that does not start at the storage's beginning
    w = torch.randn(40, 96, device=device)
    assert rel_err(skinny_linear_triton(x, w, PLAIN), skinny_linear_ref(x, w)) < 1e-5
    with pytest.raises(AssertionError, match="at most 1 row"):
        skinny_linear_triton(torch.randn(2, 96, device=device), w)
