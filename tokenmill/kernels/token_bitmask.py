"""Applying a packed token bitmask to logits (structured output): bit j of int32 word w of a row
allows token 32 w + j; every token whose bit is clear gets -inf. Rows whose mask row is all ones
(-1 words) are left as they are. Columns past 32 * words (none, when the mask covers the logits'
width) are masked too."""

import torch

from tokenmill.kernels._dispatch import use_triton


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [B, V] float (written in place); bitmask [B, W] int32."""
    b, v = logits.shape
    cols = torch.arange(v, device=logits.device)
    words = cols // 32
    inside = words < bitmask.shape[1]
    w = bitmask.long()[:, words.clamp(max=bitmask.shape[1] - 1)]
    allowed = ((w >> (cols % 32)) & 1).bool() & inside
    logits.masked_fill_(~allowed, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if use_triton(logits):
        from tokenmill.kernels.token_bitmask_triton import apply_token_bitmask_triton

        apply_token_bitmask_triton(logits, bitmask)
    else:
        apply_token_bitmask_ref(logits, bitmask)
