"""The expand half of a LoRA delta inside the one-row GEMV kernels (batch-1 decode with an adapter).

At one token a LoRA projection is three small launches in a row: the base GEMV, the shrink
s = A a(x) and the expand y += B s (kernels/lora.py). The expand needs nothing the GEMV program
lacks: once s is known, program p's output rows n take y[n] += B_slot[n] . s[slice(n)] from a
[BLOCK_N, rank] tile of B, a few hundred bytes beside the BLOCK_N rows of W it streams. So with
adapters a batch-1 projection is the shrink (run first; it applies the layer's prologue itself,
residual included) and the base GEMV with this epilogue: two launches instead of three, and the
q/k/v projection keeps its rotary and KV-cache write fused (kernels/qkv_rope_gemv.py), since the
LoRA term is added before the rotation as the unfused path adds it.

Rounding: the product and the LoRA term are summed in fp32 and rounded once to the model dtype
(the unfused path rounds the product first, then the sum), so the two agree to one rounding.
Reference: kernels/skinny_gemm.skinny_linear_ref followed by kernels/lora.lora_expand_ref.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

MAX_SLICES = 4


@dataclass(frozen=True)
class LoRATerm:
    """What the epilogue adds for one token: the shrink's s and the slot's B rows."""

    s: torch.Tensor  # [1, slices * rank] fp32, the shrink's output (kernels/lora.lora_shrink)
    b_stack: torch.Tensor  # [S, N, rank]
    token_slots: torch.Tensor  # [>= 1] int32; the token's slot is token_slots[0] (0: nothing added)
    rank: int  # columns of s per slice
    slice_starts: tuple[int, ...] = ()  # output rows where slices 1, 2, ... begin


def lora_epilogue_args(term: Optional[LoRATerm], y_like: torch.Tensor, n: int) -> tuple[tuple, dict]:
    """The kernel arguments (pointer and stride args, constexprs) of a GEMV launch with `term`, or
    dummies with LORA=False without one (y_like stands in for the pointers)."""
    if term is None:
        return (y_like, y_like, y_like, 0, 0), dict(LORA=False, LORA_RANK=1, LORA_RANK_P=1, LS1=n, LS2=n, LS3=n)
    b = term.b_stack
    starts = tuple(int(v) for v in term.slice_starts)
    assert len(starts) < MAX_SLICES, f"at most {MAX_SLICES} slices"
    assert b.dim() == 3 and b.shape[1] == n and b.shape[2] == term.rank and b.stride(-1) == 1
    assert term.s.dtype == torch.float32 and term.s.shape[-1] >= (len(starts) + 1) * term.rank and term.s.is_contiguous()
    assert term.token_slots.dtype == torch.int32 and term.token_slots.shape[0] >= 1
    padded = (*starts, *([n] * (MAX_SLICES - 1 - len(starts))))
    return ((term.s, b, term.token_slots, b.stride(0), b.stride(1)),
            dict(LORA=True, LORA_RANK=term.rank, LORA_RANK_P=triton.next_power_of_2(term.rank),
                 LS1=padded[0], LS2=padded[1], LS3=padded[2]))


@triton.jit
def add_lora(y, n, n_ok, s_ptr, b_ptr, slot_ptr, stride_bs, stride_bn,
             LORA: tl.constexpr, RANK: tl.constexpr, RANK_P: tl.constexpr,
             S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr):
    """y (fp32, the rows n) + B_slot[n] . s[slice(n)] for the token's slot (y itself without LORA
    or at slot 0). The slice of row n is the number of slice starts <= n (starts past the last
    slice are N, past every row)."""
    if LORA:
        slot = tl.load(slot_ptr).to(tl.int64)
        r = tl.arange(0, RANK_P)
        r_ok = r < tl.where(slot > 0, RANK, 0)
        j = (n >= S1).to(tl.int32) + (n >= S2).to(tl.int32) + (n >= S3).to(tl.int32)
        mask = n_ok[:, None] & r_ok[None, :]
        sv = tl.load(s_ptr + j[:, None] * RANK + r[None, :], mask=mask, other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + n.to(tl.int64)[:, None] * stride_bn + r[None, :], mask=mask, other=0.0)
        y = y + tl.sum(b.to(tl.float32) * sv, axis=1)
    return y
