"""The RMSNorm and the SiLU-and-mul that write the W8A8 matmul's e4m3 input themselves
(kernels/norm.rms_norm_quant_fp8_triton, kernels/activation.silu_and_mul_quant_fp8_triton): the
same bytes and scales as the 16-bit kernel followed by the per-token quantization kernel, the
residual stream as the norm writes it, and, on CUDA, a linear layer with FP8 weights taking that
path with the unfused path's output bit for bit.

On the CPU the kernels run in Triton's interpreter, whose float32 -> e4m3 cast rounds some values
wrongly (tests/quantization/test_fp8.py); both sides of each comparison go through that same cast,
so the comparison still checks the fusion, and CUDA checks the bytes against torch too."""

import pytest
import torch

from tokenmill.kernels.activation import QUANT_MAX_FEATURES, silu_and_mul_quant_fp8_triton, silu_and_mul_triton
from tokenmill.kernels.fp8_quant import quantize_per_token_fp8_triton
from tokenmill.kernels.norm import rms_norm_quant_fp8_triton, rms_norm_ref, rms_norm_triton
from tokenmill.quantization.fp8 import quantize_activation_fp8

from tests.kernels.common import CUDA, DEVICES, fp8_llama_mlp, nan_empty  # noqa: F401


def _rows(m: int, k: int, dtype, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]
    x[0] = 0  # an all-zero row
    return x.to(device=device, dtype=dtype)


def _assert_same_quantization(got, want, what):
    (q, s), (q_want, s_want) = got, want
    assert torch.equal(s, s_want), what
    assert torch.equal(q.view(torch.uint8), q_want.view(torch.uint8)), what


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_writes_the_quantized_rows(device, dtype, nan_empty):
    # hidden 576: two rows a program; 4096: one (the norm's launch config, which the fused
    # kernel shares, so the sums of squares are added in the same order)
    for m, hidden in ((5, 576), (3, 4096)) if device == "cpu" else ((5, 576), (300, 4096), (1, 8192)):
        x = _rows(m, hidden, dtype, device)
        x[0] = 1.0  # the zero row would not survive the norm; the residual's first row is zero
        residual = _rows(m, hidden, dtype, device, seed=1)
        weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(2)) + 0.5).to(device=device, dtype=dtype)
        for res in (None, residual):
            want_res = None if res is None else res.clone()
            normed = rms_norm_triton(x, weight, 1e-5, want_res)
            if res is not None:
                normed, want_sum = normed
            want = quantize_per_token_fp8_triton(normed)
            got_res = None if res is None else res.clone()
            q, s, summed = rms_norm_quant_fp8_triton(x, weight, 1e-5, got_res)
            _assert_same_quantization((q, s), want, (m, hidden, res is None))
            if res is not None:
                assert summed.data_ptr() == got_res.data_ptr()  # in place, as rms_norm_triton
                assert torch.equal(summed, want_sum)
            else:
                assert summed is x
            if device != "cpu":  # and against torch: the norm's reference, quantized by torch
                ref = rms_norm_ref(x, weight, 1e-5, None if res is None else res.clone())
                ref = ref if res is None else ref[0]
                q_ref, s_ref = quantize_activation_fp8(ref)
                torch.testing.assert_close(s, s_ref, rtol=1e-2, atol=0)
                deq, deq_ref = q.float() * s, q_ref.float() * s_ref
                assert (deq - deq_ref).abs().max() <= 0.07 * s_ref.max() * 448


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_writes_the_quantized_rows(device, dtype, nan_empty):
    shapes = ((4, 1536), (2, 1000)) if device == "cpu" else ((4, 1536), (77, 14336), (512, 14336), (3, 1000))
    for m, d in shapes:
        x = _rows(m, 2 * d, dtype, device) / 4
        x[1, :d] = 0  # silu(0) * up = 0: an all-zero row of the product
        x_strided = torch.cat([x, x[:, :8]], dim=1)[:, : 2 * d]  # a row stride other than 2d
        for inp in (x, x_strided):
            got = silu_and_mul_quant_fp8_triton(inp)
            want = quantize_per_token_fp8_triton(silu_and_mul_triton(inp))
            _assert_same_quantization(got, want, (m, d, inp.stride(0)))
            if device != "cpu":
                _assert_same_quantization(got, quantize_activation_fp8(silu_and_mul_triton(inp)), (m, d))


def test_rows_too_long_for_the_fused_silu_take_the_unfused_pair():
    from tokenmill.quantization.fp8 import fp8_linear_after_silu_mul, quantize_weight_fp8

    w_q, w_s = quantize_weight_fp8(torch.randn(16, QUANT_MAX_FEATURES + 16))
    assert fp8_linear_after_silu_mul(torch.randn(2, 2 * (QUANT_MAX_FEATURES + 16)), w_q, w_s) is None
    with pytest.raises(AssertionError, match="at most"):
        silu_and_mul_quant_fp8_triton(torch.randn(1, 2 * (QUANT_MAX_FEATURES + 16)))


@pytest.mark.parametrize("device", [CUDA])
def test_fp8_linear_layers_take_the_fused_prologues(device):
    """gate/up after the norm, down after the SiLU-and-mul (Llama-3.1-8B widths, bf16): the
    fused launches give the unfused path's outputs and residual stream bit for bit, with and
    without a residual, and the norm's fused launch replaces two (no 16-bit rows)."""
    from tokenmill.kernels.skinny_gemm import ADD_RMSNORM, SILU_MUL

    dt = torch.bfloat16
    gate_up, down, norm = fp8_llama_mlp(device, dt)
    for m in (9, 64, 1000):
        hidden = torch.randn(m, 4096, device=device, dtype=dt)
        residual = torch.randn(m, 4096, device=device, dtype=dt)
        for res in (None, residual):
            got = gate_up.forward_fused(hidden, ADD_RMSNORM, None if res is None else res.clone(), norm)
            normed = norm(hidden, None if res is None else res.clone())
            x = normed if res is None else normed[0]
            want = gate_up.linear_method.apply(gate_up, x)
            if res is None:
                assert torch.equal(got, want)
            else:
                assert torch.equal(got[0], want) and torch.equal(got[1], normed[1])
        act = torch.randn(m, 2 * 14336, device=device, dtype=dt)
        assert torch.equal(down.forward_fused(act, SILU_MUL), down.linear_method.apply(down, silu_and_mul_triton(act)))
