"""Dequantization of GGUF tensors to float32 torch tensors.

The common llama.cpp block formats are done here in vectorised torch (several times faster than the
`gguf` package's numpy code); the rest falls back to `gguf.quants.dequantize`.
"""

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of each block, as float32 [n_blocks, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1).float()


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """The 5th bit of each of 32 values, packed in 4 bytes, as 0 or 16."""
    bits = qh.contiguous().view(torch.int32)  # [n, 1], little-endian
    shifts = torch.arange(32, dtype=torch.int32)
    return (((bits >> shifts) & 1) << 4).float()


def _dequant_q4_0(b):
    return (_nibbles(b[:, 2:18]) - 8) * _halves(b, 0)


def _dequant_q4_1(b):
    return _nibbles(b[:, 4:20]) * _halves(b, 0) + _halves(b, 2)


def _dequant_q5_0(b):
    return (_nibbles(b[:, 6:22]) + _high_bits(b[:, 2:6]) - 16) * _halves(b, 0)


def _dequant_q5_1(b):
    return (_nibbles(b[:, 8:24]) + _high_bits(b[:, 4:8])) * _halves(b, 0) + _halves(b, 2)


def _dequant_q8_0(b):
    return b[:, 2:34].contiguous().view(torch.int8).float() * _halves(b, 0)


_BLOCK_DEQUANT = {Q.Q4_0: _dequant_q4_0, Q.Q4_1: _dequant_q4_1, Q.Q5_0: _dequant_q5_0,
                  Q.Q5_1: _dequant_q5_1, Q.Q8_0: _dequant_q8_0}
_PLAIN = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """raw uint8 bytes of one tensor -> float32 tensor of `shape` (plain float types keep their dtype)."""
    qtype = Q(ggml_type)
    if qtype in _PLAIN:
        return torch.frombuffer(bytearray(raw), dtype=_PLAIN[qtype]).reshape(shape)
    if qtype in _BLOCK_DEQUANT:
        _, type_size = GGML_QUANT_SIZES[qtype]
        blocks = torch.from_numpy(np.array(raw)).view(-1, type_size)
        return _BLOCK_DEQUANT[qtype](blocks).reshape(shape)
    from gguf.quants import dequantize as gguf_dequantize

    return torch.from_numpy(gguf_dequantize(np.array(raw), qtype)).reshape(shape)
