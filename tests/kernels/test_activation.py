"""silu_and_mul: the Triton kernel against the torch reference."""

import os

import pytest
import torch

from tokenmill.kernels.activation import silu_and_mul, silu_and_mul_ref, silu_and_mul_triton

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@pytest.fixture
def nan_empty(monkeypatch):
    """Fresh float tensors start as NaN, so an element the kernel forgets to write shows up."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "unwritten (NaN) elements"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


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
