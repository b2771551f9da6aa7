"""FP8 (e4m3) weights for the linear layers: quantization at load and the matmuls that read them.

Weights: each output row n of W [N, K] gets a scale s[n] = max|W[n]| / 448 (e4m3's largest finite
value), and W_q = round_e4m3(W / s) is stored in one byte an element; W ~ s[:, None] * W_q. Four
paths read them:

* one-token steps on CUDA (batch-1 decode): the Triton GEMV of kernels/skinny_gemm.py (and the
  rotary-fused q/k/v GEMV) load the e4m3 bytes, widen them in registers and multiply the sum by
  s[n] at the end (a per-row scale factors out of the dot product), with the op before the layer
  fused in as for bf16. The activations stay in the model dtype (weight-only quantization).
* larger steps on CUDA: the activations are quantized per token (dynamic: a[m] = max|x[m]| / 448,
  one Triton launch, kernels/fp8_quant.py) and torch._scaled_mm multiplies e4m3 by e4m3 on the
  tensor cores with both scales, out in the model dtype (W8A8).
* the CPU (and the reference): W is dequantized (s[:, None] * W_q, in the model dtype) and
  multiplied as usual.

fp8_linear_ref is the torch reference of the GPU paths, per path: weight-only (dequantized W) for
the GEMV, and with the activations quantized and dequantized the same way for _scaled_mm.
"""

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from tokenmill.kernels.fp8_quant import quantize_per_token_fp8_triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_MIN_SCALE = 1e-12  # an all-zero row still gets a finite scale


def quantize_weight_fp8(weight: torch.Tensor, row_amax: Optional[torch.Tensor] = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_q [N, K] e4m3, scales [N] fp32) with W ~ scales[:, None] * W_q (per output row).
    row_amax [N]: each row's largest |w| when W is a slice of the rows (a row-parallel shard: the
    max over every rank's slice gives every rank the scales of the whole rows)."""
    w = weight.float()
    amax = w.abs().amax(dim=1) if row_amax is None else row_amax.float()
    scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
    w_q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w_q, scale


def dequantize_weight_fp8(w_q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (w_q.float() * scale[:, None]).to(dtype)


def quantize_activation_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic quantization: (x_q [M, K] e4m3, scales [M, 1] fp32)."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    x_q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_q, scale


def fp8_linear_ref(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   quantize_input: bool = False) -> torch.Tensor:
    """x W^T (+ bias) with W = scale[:, None] * w_q; with quantize_input, x is first quantized per
    token and dequantized (what the _scaled_mm path computes, up to its fp32 accumulation order)."""
    if quantize_input:
        x_q, x_scale = quantize_activation_fp8(x)
        y = (x_q.float() * x_scale) @ (w_q.float() * scale[:, None]).t()
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


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ (scale * w_q)^T in x's dtype: _scaled_mm with per-token activation scales on
    CUDA, the dequantized weight elsewhere."""
    if not _scaled_mm_ok(x, w_q):
        return fp8_linear_ref(x, w_q, scale, bias)
    x_q, x_scale = quantize_per_token_fp8_triton(x if x.stride(-1) == 1 else x.contiguous())
    y = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=scale[None, :], out_dtype=x.dtype)
    return y if bias is None else y + bias
