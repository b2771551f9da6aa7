"""The W8A8 matmul of decode-sized steps (kernels/fp8_gemm.py) against the product of the dequantized
operands, with and without its split of K, and on CUDA beside torch._scaled_mm at Llama-3.1-8B's
shapes; the linear layers route decode-sized steps to it."""

import pytest
import torch

from tokenmill.kernels.fp8_gemm import MAX_ROWS, Fp8GemmConfig, fp8_gemm_config, fp8_gemm_triton
from tokenmill.quantization.fp8 import quantize_activation_fp8, quantize_weight_fp8

from tests.kernels.common import CUDA, DEVICES, fp8_llama_mlp, nan_empty, rel_err  # noqa: F401


def _operands(m, n, k, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m)[:, None]
    w = torch.randn(n, k, generator=g) / k ** 0.5
    x_q, x_s = quantize_activation_fp8(x)
    w_q, w_s = quantize_weight_fp8(w)
    ref = (x_q.double() * x_s.double()) @ (w_q.double() * w_s.double()[:, None]).t()
    return [t.to(device) for t in (x_q, x_s, w_q, w_s)], ref.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_gemm_is_the_product_of_the_dequantized_operands(device, nan_empty):
    cases = [(5, 48, 256), (1, 96, 384), (33, 80, 1000)] if device == "cpu" else \
        [(9, 6144, 4096), (64, 4096, 4096), (64, 28672, 4096), (110, 4096, 4096), (128, 4096, 14336), (17, 100, 1000)]
    configs = [None, Fp8GemmConfig(block_m=64, block_n=64, split_k=2), Fp8GemmConfig(block_m=16, block_n=32, split_k=3)]
    for m, n, k in cases:
        ops, ref = _operands(m, n, k, device, seed=m + n)
        outs = []
        for cfg in configs:
            out = fp8_gemm_triton(*ops, torch.float32, config=cfg)
            # CUDA: the tensor cores accumulate e4m3 products in fewer bits than fp32 between the
            # fp32 sums (1.3e-4 measured on the H200); the interpreter multiplies in fp32
            assert rel_err(out, ref) < (1e-5 if device == "cpu" else 5e-4), (m, n, k, cfg)
            assert torch.equal(out, fp8_gemm_triton(*ops, torch.float32, config=cfg))  # the same bits every time
            outs.append(out)
        if device != "cpu":  # bf16 out, beside cuBLAS's row-scaled e4m3 matmul
            x_q, x_s, w_q, w_s = ops
            if n % 16 == 0 and k % 16 == 0:
                cublas = torch._scaled_mm(x_q, w_q.t(), scale_a=x_s, scale_b=w_s[None, :], out_dtype=torch.bfloat16)
                assert rel_err(fp8_gemm_triton(*ops, torch.bfloat16), cublas) < 5e-3


def test_configs_follow_the_sweep():
    # up to 64 rows: K split in four for the narrow projections, wide tiles for gate/up
    assert fp8_gemm_config(16, 4096, 4096) == Fp8GemmConfig(block_m=64, block_n=64, split_k=4)
    assert fp8_gemm_config(64, 28672, 4096) == Fp8GemmConfig(block_m=64, block_n=128)
    assert fp8_gemm_config(16, 4096, 1024).split_k == 1  # a short K is not split
    # 65 to 128 rows: down splits K in two; gate/up and everything above 128 rows stay with cuBLAS
    assert fp8_gemm_config(112, 4096, 14336).split_k == 2
    assert fp8_gemm_config(112, 28672, 4096) is None
    assert fp8_gemm_config(MAX_ROWS + 1, 4096, 4096) is None


@pytest.mark.parametrize("device", [CUDA])
def test_linear_layers_take_the_kernel_at_decode_batches(device):
    from tokenmill.quantization.fp8 import fp8_linear, fp8_linear_ref

    x = torch.randn(100, 4096, device=device, dtype=torch.bfloat16)  # a shape the config takes
    w_q, w_s = quantize_weight_fp8(torch.randn(4096, 4096, device=device) / 64)
    x_q, x_s = quantize_activation_fp8(x)
    want = fp8_gemm_triton(x_q, x_s, w_q, w_s, torch.bfloat16)
    assert torch.equal(fp8_linear(x, w_q, w_s), want)
    assert rel_err(want, fp8_linear_ref(x, w_q, w_s, quantize_input=True)) < 1e-2


@pytest.mark.parametrize("device", [CUDA])
def test_one_token_steps_take_w8a8_only_in_the_widest_layers(device):
    """At one token, FP8 gate/up (bf16, Llama-3.1-8B widths) takes the norm's quantizing launch and
    the W8A8 matmul, bit for bit fp8_linear_after_norm (residual stream included); down keeps the
    weight-only GEMV with the SiLU-and-mul fused in."""
    from tokenmill.kernels.skinny_gemm import ADD_RMSNORM, SILU_MUL, skinny_linear_triton
    from tokenmill.quantization.fp8 import fp8_linear_after_norm, fp8_one_row_takes_w8a8

    dt = torch.bfloat16
    gate_up, down, norm = fp8_llama_mlp(device, dt)
    x = torch.randn(1, 4096, device=device, dtype=dt)
    residual = torch.randn(1, 4096, device=device, dtype=dt)
    assert fp8_one_row_takes_w8a8(x, gate_up.weight) and not fp8_one_row_takes_w8a8(x, down.weight)
    got, summed = gate_up.forward_fused(x, ADD_RMSNORM, residual.clone(), norm)
    want, want_sum = fp8_linear_after_norm(x, gate_up.weight, gate_up.weight_scale, norm.weight, norm.eps,
                                           residual.clone())
    assert torch.equal(got, want) and torch.equal(summed, want_sum)
    h = torch.randn(1, 2 * 14336, device=device, dtype=dt)
    assert torch.equal(down.forward_fused(h, SILU_MUL),
                       skinny_linear_triton(h, down.weight, SILU_MUL, weight_scale=down.weight_scale))
