"""silu_and_mul: the Triton kernel against the torch reference."""


import pytest
import torch

from tokenmill.kernels.activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton

from tests.kernels.common import DEVICES, TOL, nan_empty, rel_err  # noqa: F401


def _cases(device):
    if device == "cpu":
        return [(3, 64, torch.float32), (2, 1500, torch.float32), (4, 96, torch.float16)]
    return [(t, d, dt) for t in (1, 100, 2048) for d in (3072, 14336)
            for dt in (torch.float32, torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("device", DEVICES)
def test_silu_and_mul(device, nan_empty):
    torch.manual_seed(0)
    for tokens, d, dtype in _cases(device):
        x = 3 * torch.randn(tokens, 2 * d, device=device, dtype=dtype)
        out = silu_and_mul_triton(x)
        assert rel_err(out, silu_and_mul_ref(x)) < TOL[dtype], (tokens, d, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_silu_and_mul_strided_and_3d(device, nan_empty):
    torch.manual_seed(1)
    d = 40 if device == "cpu" else 1024
    big = torch.randn(5, 3 * d, device=device)
    x = big[:, : 2 * d]  # row stride 3d
    assert rel_err(silu_and_mul_triton(x), silu_and_mul_ref(x)) < 1e-5
    x3 = torch.randn(2, 3, 2 * d, device=device)
    assert rel_err(silu_and_mul_triton(x3), silu_and_mul_ref(x3)) < 1e-5


def test_dispatch_cpu_uses_reference():
    x = torch.randn(3, 32)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), rtol=0, atol=0)
