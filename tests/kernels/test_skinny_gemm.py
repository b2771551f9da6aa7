"""skinny_linear (batch-1 linear with a fused prologue): the Triton kernel against the torch reference."""

import pytest
import torch

from tokenmill.kernels.skinny_gemm import (ADD_RMSNORM, PLAIN, SILU_MUL, skinny_linear_ref,
                                           skinny_linear_triton)

from tests.kernels.common import DEVICES, TOL, nan_empty, rel_err  # noqa: F401


def _cases(device):
    """(N, K, dtype): toy shapes on the CPU, the Llama-3.1-8B and Qwen3-0.6B projections on CUDA."""
    if device == "cpu":
        return [(n, k, torch.float32) for n, k in ((48, 96), (40, 300), (5, 64))]
    return [(n, k, dtype) for n, k in ((6144, 4096), (4096, 4096), (4096, 14336), (3072, 1024))
            for dtype in (torch.float32, torch.bfloat16)]


def _inputs(n, k, dtype, device, width=None):
    x = torch.randn(1, width or k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
    return x, w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prologue", [PLAIN, SILU_MUL])
def test_plain_and_silu_mul(device, prologue, nan_empty):
    torch.manual_seed(prologue)
    for n, k, dtype in _cases(device):
        x, w = _inputs(n, k, dtype, device, width=2 * k if prologue == SILU_MUL else k)
        out = skinny_linear_triton(x, w, prologue)
        assert rel_err(out, skinny_linear_ref(x, w, prologue)) < TOL[dtype], (prologue, n, k, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_add_rmsnorm_prologue(device, nan_empty):
    torch.manual_seed(2)
    for n, k, dtype in _cases(device):
        x, w = _inputs(n, k, dtype, device)
        residual = torch.randn(1, k, device=device, dtype=dtype)
        norm_w = 1 + 0.1 * torch.randn(k, device=device, dtype=dtype)
        out, summed = skinny_linear_triton(x, w, ADD_RMSNORM, residual, norm_w, 1e-5)
        ref_out, ref_sum = skinny_linear_ref(x, w, ADD_RMSNORM, residual, norm_w, 1e-5)
        # The residual stream is bit-exact: the same rounded sum as the reference.
        torch.testing.assert_close(summed, ref_sum, rtol=0, atol=0)
        assert rel_err(out, ref_out) < TOL[dtype], (n, k, dtype)
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
