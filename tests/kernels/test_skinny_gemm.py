"""skinny_linear (linear layers at 1 to MAX_ROWS tokens with a fused prologue): the Triton kernels
against the torch reference."""

import pytest
import torch

from tokenmill.kernels.skinny_gemm import (ADD_RMSNORM, MAX_ROWS, PLAIN, SILU_MUL, padded_rows, skinny_gemm_config,
                                           skinny_linear_ref, skinny_linear_triton)

from tests.kernels.common import CPU, CUDA, DEVICES, TOL, nan_empty, rel_err  # noqa: F401

ROW_COUNTS = [1, 2, 3, 4, 5, 8]
PROLOGUES = [(PLAIN, False), (SILU_MUL, False), (ADD_RMSNORM, True), (ADD_RMSNORM, False)]
# Llama-3.1-8B's projections at batch 1: (name, N, K, prologue).
LLAMA_8B = [("qkv", 6144, 4096, ADD_RMSNORM), ("o", 4096, 4096, PLAIN), ("gate_up", 28672, 4096, ADD_RMSNORM),
            ("down", 4096, 14336, SILU_MUL)]


def _cases(device):
    """(N, K, dtype): toy shapes on the CPU, the Llama-3.1-8B and Qwen3-0.6B projections on CUDA."""
    if device == "cpu":
        return [(n, k, torch.float32) for n, k in ((48, 96), (40, 300), (5, 64))]
    return [(n, k, dtype) for n, k in ((6144, 4096), (4096, 4096), (4096, 14336), (3072, 1024))
            for dtype in (torch.float32, torch.bfloat16)]


def _inputs(n, k, dtype, device, width=None, rows=1):
    x = torch.randn(rows, width or k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
    return x, w


def _check(x, w, prologue, residual, norm_w, dtype, what, config=None):
    """The kernel against the reference: the output to TOL, the residual stream bit for bit."""
    out = skinny_linear_triton(x, w, prologue, residual, norm_w, 1e-5, config=config)
    ref = skinny_linear_ref(x, w, prologue, residual, norm_w, 1e-5)
    if prologue == ADD_RMSNORM and residual is not None:
        (out, summed), (ref, ref_sum) = out, ref
        # The same rounded sum as the reference, row by row.
        torch.testing.assert_close(summed, ref_sum, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")
    assert out.shape == ref.shape == (x.shape[0], w.shape[0])
    err = rel_err(out, ref)
    assert err < TOL[dtype], (what, err)


def _prologue_inputs(n, k, dtype, device, prologue, with_residual, rows, row_pad=0):
    """x, w, residual, norm weight for `rows` rows; with row_pad > 0, x and the residual are views
    whose rows are row_pad elements further apart than their width."""
    width = 2 * k if prologue == SILU_MUL else k
    x = torch.randn(rows, width + row_pad, device=device, dtype=dtype)[:, :width]
    w = torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
    residual = None
    if with_residual:
        residual = torch.randn(rows, k + row_pad, device=device, dtype=dtype)[:, :k]
    norm_w = 1 + 0.1 * torch.randn(k, device=device, dtype=dtype) if prologue == ADD_RMSNORM else None
    return x, w, residual, norm_w


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


# Tile configs the several-row kernel is checked with on the CPU, beside its default: K in several
# steps with a partial last one, N in several programs with a partial last one, and one step
# wider than K.
CPU_CONFIGS = [None, dict(block_n=8, block_k=64, num_warps=4, num_stages=2),
               dict(block_n=32, block_k=512, num_warps=4, num_stages=1)]


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("prologue,with_residual", PROLOGUES)
def test_rows_toy_shapes(device, rows, prologue, with_residual, nan_empty):
    """1 to 8 rows, every prologue, odd N and K (not multiples of any block), fp32 and fp16, rows of
    x and the residual further apart than their width."""
    torch.manual_seed(10 * rows + prologue)
    for n, k, dtype, row_pad in ((37, 203, torch.float32, 0), (21, 75, torch.float32, 5), (37, 203, torch.float16, 3)):
        x, w, residual, norm_w = _prologue_inputs(n, k, dtype, device, prologue, with_residual, rows, row_pad)
        for config in CPU_CONFIGS if rows > 1 else [None]:
            what = (rows, prologue, with_residual, n, k, dtype, config)
            _check(x, w, prologue, residual, norm_w, dtype, what, config)


@pytest.mark.parametrize("device", [CPU])
def test_rows_are_independent(device, nan_empty):
    """Each row's result depends on that row only: row i of an M-row launch matches a launch of
    row i alone to rounding, and padding rows (M rounded up to a power of two) are never written."""
    torch.manual_seed(5)
    n, k = 24, 130
    x, w, residual, norm_w = _prologue_inputs(n, k, torch.float32, device, ADD_RMSNORM, True, 5)
    out, summed = skinny_linear_triton(x, w, ADD_RMSNORM, residual, norm_w, 1e-5)
    for i in range(5):
        one, one_sum = skinny_linear_triton(x[i:i + 1], w, ADD_RMSNORM, residual[i:i + 1], norm_w, 1e-5)
        torch.testing.assert_close(summed[i:i + 1], one_sum, rtol=0, atol=0)
        assert rel_err(out[i:i + 1], one) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_offset_view_and_bounds(device, nan_empty):
    torch.manual_seed(3)
    big = torch.randn(1, 200, device=device)
    x = big[:, 50:146]  # a view that does not start at the storage's beginning
    w = torch.randn(40, 96, device=device)
    assert rel_err(skinny_linear_triton(x, w, PLAIN), skinny_linear_ref(x, w)) < 1e-5
    x4 = torch.randn(4, 200, device=device)[:, 50:146]  # several rows, same kind of view
    assert rel_err(skinny_linear_triton(x4, w, PLAIN), skinny_linear_ref(x4, w)) < 1e-5
    assert skinny_linear_triton(torch.empty(0, 96, device=device), w).shape == (0, 40)
    with pytest.raises(AssertionError, match=f"at most {MAX_ROWS} rows"):
        skinny_linear_triton(torch.randn(MAX_ROWS + 1, 96, device=device), w)


def test_config_is_keyed_by_padded_rows():
    """One compiled variant per power of two: 3 rows run the 4-row kernel with its config."""
    assert [padded_rows(m) for m in range(0, MAX_ROWS + 1)] == [1, 1, 2, 4, 4, 8, 8, 8, 8]
    for _, n, k, prologue in LLAMA_8B:
        assert skinny_gemm_config(n, k, torch.bfloat16, prologue, 3) == skinny_gemm_config(n, k, torch.bfloat16,
                                                                                          prologue, 4)
        assert skinny_gemm_config(n, k, torch.bfloat16, prologue, 1) == skinny_gemm_config(n, k, torch.bfloat16,
                                                                                          prologue)
        for rows in (2, 4, 8):
            cfg = skinny_gemm_config(n, k, torch.bfloat16, prologue, rows)
            assert cfg["block_k"] >= 8 and cfg["block_k"] & (cfg["block_k"] - 1) == 0, cfg


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_llama_8b_shapes(device, rows, dtype, nan_empty):
    """The Llama-3.1-8B projections at 1, 4 and 8 rows with their default tile configs."""
    torch.manual_seed(rows)
    for name, n, k, prologue in LLAMA_8B:
        for with_residual in (True, False) if prologue == ADD_RMSNORM else (False,):
            x, w, residual, norm_w = _prologue_inputs(n, k, dtype, device, prologue, with_residual, rows)
            _check(x, w, prologue, residual, norm_w, dtype, (name, rows, dtype, with_residual))
