"""Triton version of apply_token_bitmask: a 2-D grid of (row, block of columns) programs, each
reading the block's mask words once and writing -inf where a token's bit is clear."""

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _token_bitmask_kernel(logits_ptr, mask_ptr, vocab, num_words, stride_logits, stride_mask,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    word_idx = cols // 32
    words = tl.load(mask_ptr + row * stride_mask + word_idx, mask=in_vocab & (word_idx < num_words), other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_logits + cols, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [B, V] (stride 1 along V), bitmask [B, W] int32 on the same device."""
    b, v = logits.shape
    if b == 0:
        return
    assert logits.stride(1) == 1 and bitmask.dtype == torch.int32
    bitmask = bitmask.contiguous()
    grid = (b, triton.cdiv(v, BLOCK))
    _token_bitmask_kernel[grid](logits, bitmask, v, bitmask.shape[1], logits.stride(0), bitmask.stride(0),
                                BLOCK=BLOCK)
