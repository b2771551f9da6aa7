"""FP8 (e4m3) weights for the linear layers: quantization at load and the matmuls that read them.

Weights: each output row n of W [N, K] gets a scale s[n] = max|W[n]| / 448 (e4m3's largest finite
value), and W_q = round_e4m3(W / s) is stored in one byte an element; W ~ s[:, None] * W_q. Four
paths read them:

* one-token steps on CUDA (batch-1 decode), except the widest layers (gate/up:
  fp8_one_row_takes_w8a8): the Triton GEMV of kernels/skinny_gemm.py (and the
  rotary-fused q/k/v GEMV) load the e4m3 bytes, widen them in registers and multiply the sum by
  s[n] at the end (a per-row scale factors out of the dot product), with the op before the layer
  fused in as for bf16. The activations stay in the model dtype (weight-only quantization).
* larger steps on CUDA: the activations are quantized per token (dynamic: a[m] = max|x[m]| / 448,
  one Triton launch, kernels/fp8_quant.py) and e4m3 multiplies e4m3 on the tensor cores with both
  scales, out in the model dtype (W8A8): at decode batches (up to kernels/fp8_gemm.MAX_ROWS tokens,
  the shapes fp8_gemm_config names) in the Triton kernel there, whose tiles fill the GPU at those
  sizes, otherwise in torch._scaled_mm with fast accumulation (scaled_mm_e4m3). Where an RMSNorm or the SiLU-and-mul
  comes before the layer, that kernel writes the e4m3 rows and scales itself
  (fp8_linear_after_norm, fp8_linear_after_silu_mul: one launch and no 16-bit rows instead of two).
* the CPU (and the reference): W is dequantized (s[:, None] * W_q, in the model dtype) and
  multiplied as usual.

fp8_linear_ref is the torch reference of the GPU paths, per path: weight-only (dequantized W) for
the GEMV, and with the activations quantized and dequantized the same way for _scaled_mm.

Block-wise checkpoints (one scale per 128x128 block, HF's `weight_scale_inv`) are converted to
this per-row form once, at load (requantize_blockwise_fp8): each row's scale becomes the largest of
its block scales, s[n] = max_b S[n, b], and W_q'[n, k] = round_e4m3(W_q[n, k] * S[n, b(k)] / s[n]).
The ratios are at most 1, so nothing saturates; the block holding the row's largest scale (and
every block with the same scale: a row whose block scales are all equal entirely) keeps its bytes
exactly, and elsewhere an element takes one more e4m3 rounding (within 1/16 of itself, or 2^-10 of
s[n] where the ratio pushes it below e4m3's normal range).
"""

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from tokenmill.kernels.activation import QUANT_MAX_FEATURES, silu_and_mul_quant_fp8_triton
from tokenmill.kernels.fp8_gemm import fp8_gemm_config, fp8_gemm_triton
from tokenmill.kernels.fp8_quant import quantize_per_token_fp8_triton
from tokenmill.kernels.norm import rms_norm_quant_fp8_triton

FP8_DTYPE = torch.float8_e4m3fn
# Every e4m3 byte's value: off CUDA a table lookup widens e4m3 about 3x faster than .float().
_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()


def e4m3_to_float(t: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor widened to float32 (the same values as t.float())."""
    if t.is_cuda:
        return t.float()
    return torch.take(_E4M3_VALUES, t.view(torch.uint8).long())
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_MIN_SCALE = 1e-12  # an all-zero row still gets a finite scale


def _div(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """t / divisor correctly rounded on every device. (On CUDA, torch divides by a Python number as
    a product with its rounded reciprocal, so the scales, and through them a few weight bytes,
    would differ from the CPU's: measured on a 135M model, 88,514 row scales and 55 weight bytes,
    enough to change greedy tokens.)"""
    return t / torch.full_like(t, divisor)


def quantize_weight_fp8(weight: torch.Tensor, row_amax: Optional[torch.Tensor] = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_q [N, K] e4m3, scales [N] fp32) with W ~ scales[:, None] * W_q (per output row).
    row_amax [N]: each row's largest |w| when W is a slice of the rows (a row-parallel shard: the
    max over every rank's slice gives every rank the scales of the whole rows)."""
    w = weight.float()
    amax = w.abs().amax(dim=1) if row_amax is None else row_amax.float()
    scale = _div(amax, FP8_MAX).clamp(min=_MIN_SCALE)
    w_q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w_q, scale


def requantize_blockwise_fp8(w_q: torch.Tensor, block_scales: torch.Tensor, block_of_col: torch.Tensor,
                             row_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_q' [N, K] e4m3, scales [N] fp32) with scales[:, None] * W_q' ~ W, from e4m3 bytes w_q [N, K]
    whose real weight is W[n, k] = w_q[n, k] * block_scales[n, block_of_col[k]] (block_scales
    [N, B]: each row's scales of the column blocks, already repeated over the rows of a block;
    block_of_col [K]: each column's block). row_scale [N]: the new scales (default: each row's
    largest block scale; a row-parallel shard passes the max over the ranks, so that every rank
    quantizes as one process would). Done in chunks of rows, so the fp32 temporaries stay small."""
    blocks = block_scales.float()
    scale = (blocks.amax(dim=1) if row_scale is None else row_scale.float()).clamp(min=_MIN_SCALE)
    ratio = blocks / scale[:, None]  # <= 1; exactly 1 in the blocks with the row's scale
    out = torch.empty_like(w_q, dtype=FP8_DTYPE)
    n, k = w_q.shape
    chunk = max(1, (1 << 22) // max(k, 1))
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        w = e4m3_to_float(w_q[start:end]) * ratio[start:end][:, block_of_col]
        out[start:end] = w.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return out, scale


def dequantize_blockwise_fp8(w_q: torch.Tensor, block_scales: torch.Tensor, block_size: tuple[int, int],
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [N, K] from e4m3 bytes and the checkpoint's block scales [ceil(N / bn), ceil(K / bk)]
    (W[n, k] = w_q[n, k] * block_scales[n // bn, k // bk]; the reference of the conversion)."""
    bn, bk = block_size
    n, k = w_q.shape
    s = block_scales.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (e4m3_to_float(w_q) * s).to(dtype)


def dequantize_weight_fp8(w_q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (e4m3_to_float(w_q) * scale[:, None]).to(dtype)


def quantize_activation_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic quantization: (x_q [M, K] e4m3, scales [M, 1] fp32), x_q = e4m3(x * (1 / s))
    with the reciprocal correctly rounded (kernels/fp8_quant.py)."""
    scale = _div(x.float().abs().amax(dim=1, keepdim=True), FP8_MAX).clamp(min=_MIN_SCALE)
    x_q = (x.float() * (torch.ones_like(scale) / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_q, scale


def fp8_linear_ref(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   quantize_input: bool = False) -> torch.Tensor:
    """x W^T (+ bias) with W = scale[:, None] * w_q; with quantize_input, x is first quantized per
    token and dequantized (what the _scaled_mm path computes, up to its fp32 accumulation order)."""
    if quantize_input:
        x_q, x_scale = quantize_activation_fp8(x)
        y = (e4m3_to_float(x_q) * x_scale) @ (e4m3_to_float(w_q) * scale[:, None]).t()
        y = y.to(x.dtype)
        return y if bias is None else y + bias
    return F.linear(x, dequantize_weight_fp8(w_q, scale, x.dtype), bias)


@functools.lru_cache(maxsize=None)
def _has_fp8_tensor_cores(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def _scaled_mm_ok(x: torch.Tensor, w_q: torch.Tensor) -> bool:
    # e4m3 tensor cores (sm_89 and later; asked once per device), K and N multiples of 16, row-wise
    # scales with a 16-bit output (an fp32 model takes the dequantized path)
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and _has_fp8_tensor_cores(x.device.index if x.device.index is not None else torch.cuda.current_device())
            and x.shape[1] % 16 == 0 and w_q.shape[0] % 16 == 0)


def scaled_mm_e4m3(a_q: torch.Tensor, a_scale: torch.Tensor, b_q_t: torch.Tensor, b_scale: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS's e4m3 x e4m3 product a_q @ b_q_t with row-wise scales ([M, 1] and [1, N]), out in
    out_dtype, with fast accumulation: the tensor cores' partial sums stay in their own accumulator
    along K instead of being added into fp32 registers every few K steps. H200
    (benchmarks/fp8_kernel_bench.py --prefill-gemm 8192, 2026-12-03), Llama-3.1-8B's projections at
    8,192 rows: 11-14 % faster (gate/up 1,443 against 1,622 us; down 739 against 856), and the
    error against a float64 product of the same e4m3 operands 2.1e-3 against 1.7e-3 (K = 4,096)
    and 3.3e-3 against 1.7e-3 (down, K = 14,336), relative Frobenius, the bf16 output's rounding
    included: a tenth or less of what quantizing the activations to e4m3 changes (about 3 %)."""
    return torch._scaled_mm(a_q, b_q_t, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype, use_fast_accum=True)


def _scaled_mm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
               bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """The e4m3 x e4m3 product with both scales: decode-sized steps through the Triton kernel
    (kernels/fp8_gemm.py, tiles and a split of K that fill the GPU) where it is the faster,
    the rest through cuBLAS."""
    cfg = fp8_gemm_config(x_q.shape[0], w_q.shape[0], w_q.shape[1])
    if cfg is not None:
        y = fp8_gemm_triton(x_q, x_scale, w_q, scale, out_dtype, cfg)
    else:
        y = scaled_mm_e4m3(x_q, x_scale, w_q.t(), scale[None, :], out_dtype)
    return y if bias is None else y + bias


# One-token steps take the weight-only GEMV (kernels/skinny_gemm.py, the norm or the SiLU-and-mul
# fused in), except the layers at least this wide, which take the W8A8 path of larger steps (the
# norm's quantizing launch, then the Triton matmul). H200, fp8_kernel_bench.py --rows 1 (2026-12-02),
# Llama-3.1-8B: gate/up 30.5 us (91 % of copy) against 39.2 for the GEMV with its RMSNorm; q/k/v
# 8.0 against 7.8, o 6.6 against 4.7, down 18.8 (and a SiLU launch) against 20.3: those stay.
W8A8_ONE_ROW_MIN_FEATURES = 16384


def fp8_one_row_takes_w8a8(x: torch.Tensor, w_q: torch.Tensor) -> bool:
    """Whether a one-token step of this FP8 layer takes the W8A8 path instead of the GEMV."""
    n, k = w_q.shape
    return n >= W8A8_ONE_ROW_MIN_FEATURES and _scaled_mm_ok(x, w_q) and fp8_gemm_config(1, n, k) is not None


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ (scale * w_q)^T in x's dtype: _scaled_mm with per-token activation scales on
    CUDA, the dequantized weight elsewhere."""
    if not _scaled_mm_ok(x, w_q):
        return fp8_linear_ref(x, w_q, scale, bias)
    x_q, x_scale = quantize_per_token_fp8_triton(x if x.stride(-1) == 1 else x.contiguous())
    return _scaled_mm(x_q, x_scale, w_q, scale, bias, x.dtype)


def fp8_linear_after_norm(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float, residual: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None
                          ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(fp8_linear(rms_norm(x + residual)), x + residual) with the RMSNorm and the activation
    quantization in one launch (kernels/norm.rms_norm_quant_fp8_triton; the same bits as the two
    launches). None where that does not apply (off CUDA, other dtypes or layouts): the caller then
    runs the norm and fp8_linear."""
    if not (_scaled_mm_ok(x, w_q) and x.dim() == 2 and x.is_contiguous() and norm_weight.dtype == x.dtype
            and (residual is None or (residual.dtype == x.dtype and residual.is_contiguous()))):
        return None
    x_q, x_scale, summed = rms_norm_quant_fp8_triton(x, norm_weight, eps, residual)
    return _scaled_mm(x_q, x_scale, w_q, scale, bias, x.dtype), summed


def fp8_linear_after_silu_mul(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
                              bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """fp8_linear(silu_and_mul(x)) with the activation and its quantization in one launch
    (kernels/activation.silu_and_mul_quant_fp8_triton; the same bits); None where that does not
    apply (off CUDA, other layouts, rows over QUANT_MAX_FEATURES features)."""
    if not (x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] // 2 <= QUANT_MAX_FEATURES
            and _scaled_mm_ok(x[:, : x.shape[1] // 2], w_q)):
        return None
    x_q, x_scale = silu_and_mul_quant_fp8_triton(x)
    return _scaled_mm(x_q, x_scale, w_q, scale, bias, x.dtype)
