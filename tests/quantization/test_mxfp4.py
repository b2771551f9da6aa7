"""The MXFP4 dequantizer (quantization/mxfp4.py) against HF transformers' own
(integrations.mxfp4.convert_moe_packed_tensors) on random packed experts, bit for bit."""

import pytest
import torch

from tokenmill.quantization.mxfp4 import dequantize_mxfp4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    E, N, G = 3, 10, 4  # K = 4 blocks of 32
    blocks = torch.randint(0, 256, (E, N, G, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(127 - 20, 127 + 8, (E, N, G), generator=g, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, K, N]: HF transposes
    assert ours.shape == (E, N, G * 32) and ours.dtype == dtype
    assert torch.equal(ours, theirs.transpose(1, 2))


def test_known_values_and_errors():
    # byte 0x2F: low nibble 0xF (-6) first, high nibble 0x2 (1.0) second; scale 128: times 2
    blocks = torch.full((1, 16), 0x2F, dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8), torch.float32)
    assert out.shape == (32,) and out[:4].tolist() == [-12.0, 2.0, -12.0, 2.0]
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, torch.tensor([1, 2], dtype=torch.uint8), torch.float32)
