"""MXFP4 (OCP microscaling FP4) weights, as gpt-oss checkpoints store their experts, dequantized at
load: tokenmill serves them in the model dtype (docs/ARCHITECTURE.md, "MXFP4 checkpoints").

A tensor W [..., N, K] is stored as `*_blocks` uint8 [..., N, K / 32, 16] and `*_scales` uint8
[..., N, K / 32]: each byte of a block holds two e2m1 values (the low nibble is the even element,
the high nibble the odd one), and each 32-element block shares one e8m0 scale, the power of two
2^(scale - 127).
"""

import torch

BLOCK = 32  # elements per shared scale
E8M0_BIAS = 127
# e2m1 codes 0..15: sign bit 3, then the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in dtype (exact: every
    e2m1 value times a power of two is a bf16 / fp32 value unless it under- or overflows)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks [..., G, {BLOCK // 2}] and scales [..., G])")
    if blocks.dim() > 2:  # one leading slice (an expert) at a time: the temporaries stay small
        out = torch.empty((*scales.shape[:-1], scales.shape[-1] * BLOCK), dtype=dtype, device=blocks.device)
        for i in range(blocks.shape[0]):
            out[i] = dequantize_mxfp4(blocks[i], scales[i], dtype)
        return out
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]: even, odd
    values = lut[codes].flatten(-2)  # [..., G, 32]
    # ldexp in fp32: the scale's power of two is exact, and the one rounding is the cast to dtype
    values = torch.ldexp(values, (scales.to(torch.int32) - E8M0_BIAS)[..., None].to(torch.float32))
    return values.flatten(-2).to(dtype)
