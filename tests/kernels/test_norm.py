"""rms_norm: the Triton kernel against the torch reference (interpreter on CPU, real shapes on CUDA)."""


import pytest
import torch

from tokenmill.kernels.norm import rms_norm, rms_norm_ref, rms_norm_triton

from tests.kernels.common import DEVICES, TOL, nan_empty, rel_err  # noqa: F401


def _cases(device):
    if device == "cpu":
        return [((5, 64), torch.float32), ((3, 100), torch.float32), ((4, 64), torch.float16)]
    return [((t, h), dt) for t in (1, 37, 512) for h in (1024, 4096)
            for dt in (torch.float32, torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_plain_and_residual(device, nan_empty):
    torch.manual_seed(0)
    for shape, dtype in _cases(device):
        x = torch.randn(shape, device=device, dtype=dtype)
        w = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(dtype)
        ref = rms_norm_ref(x, w, 1e-6)
        out = rms_norm_triton(x, w, 1e-6)
        assert rel_err(out, ref) < TOL[dtype], (shape, dtype)

        res = torch.randn(shape, device=device, dtype=dtype)
        ref_out, ref_res = rms_norm_ref(x, w, 1e-6, res.clone())
        res_buf = res.clone()
        out, new_res = rms_norm_triton(x, w, 1e-6, res_buf)
        assert new_res.data_ptr() == res_buf.data_ptr(), "residual is updated in place"
        assert rel_err(new_res, ref_res) < TOL[dtype] / 10
        assert rel_err(out, ref_out) < TOL[dtype], (shape, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_strided_views(device, nan_empty):
    """Row-strided 2-D slices and [T, heads, head_dim] views of a fused qkv buffer (Qwen3 q/k norm)."""
    torch.manual_seed(1)
    tokens, hq, hk, d = (6, 3, 2, 32) if device == "cpu" else (300, 16, 8, 128)
    dtypes = [torch.float32] if device == "cpu" else [torch.float32, torch.bfloat16]
    for dtype in dtypes:
        qkv = torch.randn(tokens, (hq + 2 * hk) * d, device=device, dtype=dtype)
        w = torch.randn(d, device=device, dtype=dtype)
        q = qkv[:, : hq * d].view(tokens, hq, d)
        k = qkv[:, hq * d: (hq + hk) * d].view(tokens, hk, d)
        for view in (q, k, qkv[:, :d]):
            assert not view.is_contiguous()
            assert rel_err(rms_norm_triton(view, w, 1e-6), rms_norm_ref(view, w, 1e-6)) < TOL[dtype]

        # Strided x with a strided residual slice: the sum lands in the residual's own buffer.
        big = torch.randn(tokens, 2 * d, device=device, dtype=dtype)
        x, res = qkv[:, :d], big[:, d:]
        ref_out, ref_res = rms_norm_ref(x, w, 1e-5, res.clone())
        out, new_res = rms_norm_triton(x, w, 1e-5, res)
        assert rel_err(out, ref_out) < TOL[dtype]
        assert rel_err(big[:, d:], ref_res) < TOL[dtype] / 10


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_mixed_dtypes(device, nan_empty):
    """bf16 activations with an fp32 weight follow the reference's type promotion."""
    torch.manual_seed(2)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(4, 48, device=device, dtype=dtype)
    w = torch.randn(48, device=device, dtype=torch.float32)
    res = torch.randn(4, 48, device=device, dtype=torch.float32)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-6, res.clone())
    out, new_res = rms_norm_triton(x, w, 1e-6, res.clone())
    assert rel_err(out, ref_out) < 1e-5 and rel_err(new_res, ref_res) < 1e-6


def test_dispatch_cpu_uses_reference():
    x, w = torch.randn(3, 16), torch.randn(16)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), rtol=0, atol=0)
