"""Batched multi-LoRA: the shrink (x -> s = A x) and expand (y += B s) halves of a LoRA delta for a
batch whose tokens each use one of S adapter slots (slot 0: no adapter).

    s = lora_shrink(x, a_stack, token_slots, prologue, norm_weight, eps)   # [T, R] fp32
    lora_expand(s, b_stack, token_slots, y, slice_rank, slice_starts)      # y[t] += B_slot(t) s[t]

a_stack [S, R, K] and b_stack [S, N, slice_rank] hold every slot's matrices (slot 0 all zeros and
never read; the LoRA scaling is folded into B). The shrink applies the base layer's prologue to x
(skinny_gemm's PLAIN / SILU_MUL / ADD_RMSNORM), so it reads the same activations the base
projection reads; merged layers (q/k/v, gate/up) take one shrink over the stacked A rows of all
their slices (R = slices * slice_rank) and one expand whose output row n uses the slice j = number
of slice_starts <= n, i.e. s[:, j*slice_rank:(j+1)*slice_rank].

Design (the kernels run inside CUDA graphs, so the grids depend on the shapes alone, never on the
slots' values, and nothing syncs with the host):

* Two kernel shapes per op, picked on the host from T (a shape):
  - "gemv" (T <= GEMV_MAX_T, decode steps): one program per (token, block of rank rows) for the
    shrink, per (token, block of output rows) for the expand. A token's program loads its slot and
    masks every load with slot > 0, so a slot-0 (or padding) token reads no A/B/x bytes and its
    y row is not even loaded. At T = 1 and K = 4096 the shrink is R programs each streaming one
    8 KiB row of A in one or two wide loads (one DRAM round trip, no split-K, hence no atomics,
    no zero-fill launch and a deterministic sum); the expand is N / BLOCK_N programs each loading
    a [BLOCK_N, rank] tile of B. Fixed cost is one launch per op.
  - "tile" (larger T: prefill, mixed and big decode batches): one program per (block of BM tokens,
    block of rank rows, K split) for the shrink / (BM tokens, BLOCK_N output rows) for the expand.
    The program walks the distinct nonzero slots of its token block in increasing order (a data-
    dependent while loop inside the program: cur = min of the block's slots > previous), and for
    each slot runs a tensor-core tile product (tl.dot) with the block's rows of other slots masked
    off. Tokens of one request are contiguous and share a slot, so a prefill block nearly always
    takes one iteration (a plain tiled GEMM); a decode block with d distinct adapters takes d
    iterations, each reading that slot's A/B tile (from L2 after the first block), instead of one
    gather per token. A block of slot-0 tokens does no iteration and no A/B reads. The shrink
    walks the slots inside its K loop (x and the prologue computed once per K step for all the
    block's tokens, the next slot's A tile loading while this one multiplies); the expand loads
    one B tile per slot for all slices, the next slot's while this one multiplies.
    Rank rows are few (R <= 512), so a token block alone gives too few programs: the shrink
    splits K until the grid has ~2 programs per SM, and the splits add into s with fp32 atomics.
    A small prep kernel zeroes s first (and writes ADD_RMSNORM's 1 / rms per token, which every
    split needs). So at T > GEMV_MAX_T the shrink is two launches and its sum order (hence s's
    last bits) is not deterministic; at T <= GEMV_MAX_T it is one launch and deterministic.
* Precision: products accumulate in fp32. The shrink's tl.dot takes x's dtype when x and A match
  (bf16 x bf16 products are exact in fp32) and IEEE fp32 otherwise. The expand's s is fp32: for
  16-bit B it is split into hi + lo parts in B's dtype and both are multiplied (about 16 mantissa
  bits, so s is not rounded to bf16), for fp32 B the dot is IEEE fp32. y is read once, the fp32
  delta added and rounded once.
* ADD_RMSNORM (x the summed residual stream): rms_norm(x) A^T = ((x * norm_weight) A^T) / rms(x),
  so the sum of squares accumulates beside the products and the division comes last (one pass
  over x, as kernels/skinny_gemm.py does). It skips the reference's rounding of the normalised
  row to x's dtype, so it agrees to that rounding. SILU_MUL rounds as kernels/activation.py does.
* Ranks 1..MAX_RANK per slice (R up to MAX_SLICES * MAX_RANK rank rows in all) are padded to a
  power of two (>= 16 for tl.dot) with masks; K and N take any size. Slot * stride and
  token * stride offsets are int64. In Triton's interpreter (CPU tests) bf16 tile products run in
  fp32, since the interpreter multiplies bf16 tl.dot operands wrongly; fp16 takes the 16-bit path.

Measured costs against the base linear: docs/PERFORMANCE.md, "Kernel tile choices".

* Slices: up to MAX_SLICES output slices, their starts compile into the expand (constexpr); a tile
  that straddles a boundary masks B's rows per slice, so slice sizes need not be multiples of the
  tile.
"""

import functools
import logging
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from tokenmill.kernels._dispatch import use_triton
from tokenmill.kernels.activation import silu_and_mul_ref
from tokenmill.kernels.lora_epilogue import MAX_SLICES
from tokenmill.kernels.norm import rms_norm_ref
from tokenmill.kernels.skinny_gemm import ADD_RMSNORM, PLAIN, SILU_MUL

logger = logging.getLogger(__name__)

__all__ = ["PLAIN", "SILU_MUL", "ADD_RMSNORM", "MAX_SLICES", "GEMV_MAX_T", "lora_shrink", "lora_expand",
           "lora_shrink_ref", "lora_expand_ref", "lora_shrink_triton", "lora_expand_triton",
           "lora_shrink_config", "lora_expand_config"]

MAX_RANK = 128
# Up to this many tokens the per-token ("gemv") kernels run; above it the token-block tile kernels.
GEMV_MAX_T = 16


# ---------------------------------------------------------------------------------------------
# Torch references
# ---------------------------------------------------------------------------------------------

def _lora_input(x: torch.Tensor, prologue: int, norm_weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """The base projection's input: x, silu(gate) * up, or rms_norm(x) * norm_weight."""
    if prologue == SILU_MUL:
        return silu_and_mul_ref(x)
    if prologue == ADD_RMSNORM:
        assert norm_weight is not None, "ADD_RMSNORM needs norm_weight"
        return rms_norm_ref(x, norm_weight, eps)
    assert prologue == PLAIN, f"unknown prologue {prologue}"
    return x


def _slot_groups(token_slots: torch.Tensor):
    """(slot, token indices) for each distinct nonzero slot in token_slots (host loop over the
    distinct slots; the reference path only, where a sync costs nothing)."""
    slots = token_slots.long()
    for slot in torch.unique(slots).tolist():
        if slot != 0:
            yield slot, torch.nonzero(slots == slot).squeeze(1)


def lora_shrink_ref(x: torch.Tensor, a_stack: torch.Tensor, token_slots: torch.Tensor, prologue: int = PLAIN,
                    norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                    residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """s[t] = a_stack[token_slots[t]] @ a(x)[t] in fp32, [T, R]; rows of slot-0 tokens are 0.
    With a residual (ADD_RMSNORM only), a() takes the residual stream x + residual.

    Tokens are grouped by slot (one matmul per distinct slot), the prologue a() as the base layer
    computes it (kernels/activation.py, kernels/norm.py)."""
    if residual is not None:
        assert prologue == ADD_RMSNORM, "a residual goes with ADD_RMSNORM"
        x = x + residual
    inp = _lora_input(x, prologue, norm_weight, eps)
    T, R = x.shape[0], a_stack.shape[1]
    assert inp.shape[1] == a_stack.shape[2], "x does not match a_stack's K"
    s = torch.zeros(T, R, dtype=torch.float32, device=x.device)
    for slot, idx in _slot_groups(token_slots):
        s[idx] = inp[idx].float() @ a_stack[slot].float().t()
    return s


def _slice_bounds(n: int, slice_starts: Sequence[int]) -> list:
    bounds = [0, *[int(v) for v in slice_starts], n]
    assert all(lo <= hi for lo, hi in zip(bounds, bounds[1:])), f"slice_starts {tuple(slice_starts)} out of order"
    return bounds


def lora_expand_ref(s: torch.Tensor, b_stack: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor,
                    slice_rank: int, slice_starts: Sequence[int] = ()) -> None:
    """y[t, n] += b_stack[slot, n] . s[t, j*slice_rank:(j+1)*slice_rank] (j the slice of row n) in
    fp32, added once and rounded once to y's dtype; rows of slot-0 tokens are left as they are."""
    N = y.shape[1]
    bounds = _slice_bounds(N, slice_starts)
    assert s.shape[1] >= (len(bounds) - 1) * slice_rank, "s has fewer columns than slices * slice_rank"
    assert b_stack.shape[1] == N and b_stack.shape[2] == slice_rank
    for slot, idx in _slot_groups(token_slots):
        sv = s[idx].float()
        b = b_stack[slot].float()
        delta = torch.cat([sv[:, j * slice_rank:(j + 1) * slice_rank] @ b[lo:hi].t()
                           for j, (lo, hi) in enumerate(zip(bounds, bounds[1:]))], dim=1)
        y[idx] = (y[idx].float() + delta).to(y.dtype)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _prologue(x_ptr, nw_ptr, offs, kk, mask, K, PROLOGUE: tl.constexpr, r_ptr, r_offs, HAS_RESIDUAL: tl.constexpr):
    """a(x) at x_ptr + offs (any shape; kk the K index of each element, broadcastable) in fp32,
    and the squares of x (ADD_RMSNORM's sum of squares; zeros otherwise). Masked elements are 0
    and read nothing. With HAS_RESIDUAL (ADD_RMSNORM), x is first x + r, rounded as the base
    layer rounds the residual stream."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + r_offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    if PROLOGUE == 1:  # SILU_MUL: the row holds [gate | up]
        gate = x.to(tl.float32)
        up = tl.load(x_ptr + offs + K, mask=mask, other=0.0)
        act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
        a = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype).to(tl.float32)
        sq = a * 0.0
    elif PROLOGUE == 2:  # ADD_RMSNORM: (x * w); the division by rms(x) comes after the products
        h = x.to(tl.float32)
        w = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        a = h * w
        sq = h * h
    else:
        a = x.to(tl.float32)
        sq = a * 0.0
    return a, sq


@triton.jit
def _shrink_gemv_kernel(
    x_ptr, a_ptr, nw_ptr, slots_ptr, s_ptr, r_ptr,
    R, K, eps, stride_xt, stride_as, stride_ar, stride_st, stride_rt,
    PROLOGUE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, LOOP_STAGES: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """Grid (T, cdiv(R, BLOCK_R)): s[t, r-block] for one token t (of a(x + r) with HAS_RESIDUAL)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    k_lim = tl.where(slot > 0, K, 0)  # slot 0: every load masked off (a scalar-bool & is no block mask)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
    sq = tl.zeros([BLOCK_K], tl.float32)
    a_rows = a_ptr + slot * stride_as + r.to(tl.int64)[:, None] * stride_ar
    for k0 in tl.range(0, K, BLOCK_K, num_stages=LOOP_STAGES):
        kk = k0 + ks
        k_ok = kk < k_lim
        a, sq_k = _prologue(x_ptr, nw_ptr, t * stride_xt + kk, kk, k_ok, K, PROLOGUE, r_ptr, t * stride_rt + kk,
                            HAS_RESIDUAL)
        sq += sq_k
        w = tl.load(a_rows + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * a[None, :]
    out = tl.sum(acc, axis=1)
    if PROLOGUE == 2:
        out = out * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    tl.store(s_ptr + t * stride_st + r, out, mask=r_ok)


@triton.jit
def _next_slot(sl, prev):
    """The smallest slot in sl above prev (2**31 - 1, past every slot, when none)."""
    return tl.min(tl.where(sl > prev, sl, 2147483647), axis=0)


@triton.jit
def _shrink_tile_kernel(
    x_ptr, a_ptr, nw_ptr, slots_ptr, s_ptr, rstd_ptr,
    T, R, K, K_CHUNK, eps, stride_xt, stride_as, stride_ar, stride_st,
    PROLOGUE: tl.constexpr, BM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_IEEE: tl.constexpr, LOOP_STAGES: tl.constexpr, SLOTS_INNER: tl.constexpr,
):
    """Grid (cdiv(T, BM), cdiv(R, BLOCK_R), SPLIT_K): s for BM tokens and BLOCK_R rank rows over
    K_CHUNK columns of K, one tl.dot tile product per distinct nonzero slot of the token block
    (SLOTS_INNER: the walk over the slots inside the K loop, else the K loop inside the walk).
    With SPLIT_K > 1 the partial sums are added with atomics into s, which _shrink_prep_kernel
    zeroed (it also wrote ADD_RMSNORM's 1 / rms(x) per token, so each split can apply it)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    m_ok = m < T
    sl = tl.load(slots_ptr + m, mask=m_ok, other=0)
    m64 = m.to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    k_start = tl.program_id(2) * K_CHUNK
    k_end = tl.minimum(k_start + K_CHUNK, K)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BM, BLOCK_R], tl.float32)
    sq = tl.zeros([BM], tl.float32)
    if PROLOGUE == 2:
        if SPLIT_K > 1:  # 1 / rms(x) from _shrink_prep_kernel
            sq = tl.load(rstd_ptr + m, mask=m_ok, other=0.0)
    first = _next_slot(sl, 0)
    if SLOTS_INNER:
        # Per K step: the activations and the prologue once for all the block's tokens, then one
        # product per distinct slot (the next slot's A tile loads while this one multiplies).
        row_on = m_ok & (sl > 0)
        a_cols = r.to(tl.int64)[None, :] * stride_ar
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=LOOP_STAGES):
            kk = k0 + ks
            k_ok = kk < k_end
            offs = m64[:, None] * stride_xt + kk[None, :]
            a, sq_k = _prologue(x_ptr, nw_ptr, offs, kk[None, :], row_on[:, None] & k_ok[None, :], K, PROLOGUE,
                                x_ptr, offs, False)
            if PROLOGUE == 2:
                if SPLIT_K == 1:
                    sq += tl.sum(sq_k, axis=1)
            w_mask = k_ok[:, None] & r_ok[None, :]
            cur = first
            w = tl.load(a_ptr + cur.to(tl.int64) * stride_as + a_cols + kk[:, None],
                        mask=w_mask & (kk < tl.where(cur < 2147483647, k_end, 0))[:, None], other=0.0)
            while cur < 2147483647:
                nxt = _next_slot(sl, cur)
                w_next = tl.load(a_ptr + nxt.to(tl.int64) * stride_as + a_cols + kk[:, None],
                                 mask=w_mask & (kk < tl.where(nxt < 2147483647, k_end, 0))[:, None], other=0.0)
                a_sel = tl.where((sl == cur)[:, None], a, 0.0)
                if DOT_IEEE:
                    acc = tl.dot(a_sel, w.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a_sel.to(w.dtype), w, acc)
                w = w_next
                cur = nxt
    else:
        cur = first
        while cur < 2147483647:
            sel = m_ok & (sl == cur)
            a_rows = a_ptr + cur.to(tl.int64) * stride_as + r.to(tl.int64)[None, :] * stride_ar
            for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=LOOP_STAGES):
                kk = k0 + ks
                k_ok = kk < k_end
                offs = m64[:, None] * stride_xt + kk[None, :]
                a, sq_k = _prologue(x_ptr, nw_ptr, offs, kk[None, :], sel[:, None] & k_ok[None, :], K, PROLOGUE,
                                    x_ptr, offs, False)
                if PROLOGUE == 2:
                    if SPLIT_K == 1:
                        sq += tl.sum(sq_k, axis=1)
                w = tl.load(a_rows + kk[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]
                if DOT_IEEE:
                    acc = tl.dot(a, w.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a.to(w.dtype), w, acc)
            cur = _next_slot(sl, cur)
    if PROLOGUE == 2:
        if SPLIT_K > 1:
            acc = acc * sq[:, None]
        else:
            acc = acc * tl.rsqrt(sq / K + eps)[:, None]
    s_at = s_ptr + m64[:, None] * stride_st + r[None, :]
    if SPLIT_K == 1:
        tl.store(s_at, acc, mask=m_ok[:, None] & r_ok[None, :])
    else:
        tl.atomic_add(s_at, acc, mask=(m_ok & (sl > 0))[:, None] & r_ok[None, :], sem="relaxed")


@triton.jit
def _shrink_prep_kernel(x_ptr, s_ptr, rstd_ptr, T, R, K, eps, stride_xt, stride_st,
                        NORM: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """Grid (cdiv(T, ROWS),): zero s's rows (the split-K shrink adds into them) and, with NORM,
    write rstd[t] = 1 / rms(x[t]) in fp32."""
    m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m_ok = m < T
    m64 = m.to(tl.int64)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        tl.store(s_ptr + m64[:, None] * stride_st + r[None, :], tl.zeros([ROWS, BLOCK_R], tl.float32),
                 mask=m_ok[:, None] & (r < R)[None, :])
    if NORM:
        ks = tl.arange(0, BLOCK_K)
        sq = tl.zeros([ROWS, BLOCK_K], tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=2):
            kk = k0 + ks
            h = tl.load(x_ptr + m64[:, None] * stride_xt + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :],
                        other=0.0).to(tl.float32)
            sq += h * h
        tl.store(rstd_ptr + m, tl.rsqrt(tl.sum(sq, axis=1) / K + eps), mask=m_ok)


@triton.jit
def _slice_rows(n, n_ok, j: tl.constexpr, NUM_SLICES: tl.constexpr, N,
                S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr):
    """n_ok restricted to the output rows of slice j (bounds [0, S1, S2, S3, N][: NUM_SLICES + 1])."""
    if j == 0:
        lo_ok = n >= 0
    elif j == 1:
        lo_ok = n >= S1
    elif j == 2:
        lo_ok = n >= S2
    else:
        lo_ok = n >= S3
    if j == NUM_SLICES - 1:
        hi_ok = n < N
    elif j == 0:
        hi_ok = n < S1
    elif j == 1:
        hi_ok = n < S2
    else:
        hi_ok = n < S3
    return n_ok & lo_ok & hi_ok


@triton.jit
def _expand_gemv_kernel(
    s_ptr, b_ptr, slots_ptr, y_ptr,
    N, stride_st, stride_bs, stride_bn, stride_yt,
    RANK: tl.constexpr, RANK_P: tl.constexpr, NUM_SLICES: tl.constexpr,
    S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (T, cdiv(N, BLOCK_N)): y[t, n-block] += B_slot[n-block] s[t, slice] for one token t."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    n_lim = tl.where(slot > 0, N, 0)  # slot 0: nothing read, y untouched
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_lim
    rr = tl.arange(0, RANK_P)
    rr_ok = rr < tl.where(slot > 0, RANK, 0)
    b_rows = b_ptr + slot * stride_bs + n.to(tl.int64)[:, None] * stride_bn + rr[None, :]
    acc = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(NUM_SLICES):
        in_j = _slice_rows(n, n_ok, j, NUM_SLICES, N, S1, S2, S3)
        sv = tl.load(s_ptr + t * stride_st + j * RANK + rr, mask=rr_ok, other=0.0)
        b = tl.load(b_rows, mask=in_j[:, None] & rr_ok[None, :], other=0.0)
        acc += tl.sum(b.to(tl.float32) * sv[None, :], axis=1)
    y_at = y_ptr + t * stride_yt + n
    y = tl.load(y_at, mask=n_ok, other=0.0)
    tl.store(y_at, (y.to(tl.float32) + acc).to(y.dtype), mask=n_ok)


@triton.jit
def _expand_tile_kernel(
    s_ptr, b_ptr, slots_ptr, y_ptr,
    T, N, stride_st, stride_bs, stride_bn, stride_yt,
    RANK: tl.constexpr, RANK_P: tl.constexpr, NUM_SLICES: tl.constexpr,
    S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr,
    BM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_IEEE: tl.constexpr,
):
    """Grid (cdiv(T, BM), cdiv(N, BLOCK_N)): y[m-block, n-block] += s B^T, one tile product per
    distinct nonzero slot of the token block (and per slice the n-block overlaps)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    m_ok = m < T
    sl = tl.load(slots_ptr + m, mask=m_ok, other=0)
    m64 = m.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rr = tl.arange(0, RANK_P)
    rr_ok = rr < RANK
    acc = tl.zeros([BM, BLOCK_N], tl.float32)
    b_cols = n.to(tl.int64)[None, :] * stride_bn + rr[:, None]
    b_mask = rr_ok[:, None] & n_ok[None, :]
    cur = _next_slot(sl, 0)
    # One [RANK_P, BLOCK_N] tile of B per slot (the rows of every slice; each slice's product masks
    # the others' rows), the next slot's tile loading while this one multiplies.
    b = tl.load(b_ptr + cur.to(tl.int64) * stride_bs + b_cols,
                mask=b_mask & (n < tl.where(cur < 2147483647, N, 0))[None, :], other=0.0)
    while cur < 2147483647:
        nxt = _next_slot(sl, cur)
        b_next = tl.load(b_ptr + nxt.to(tl.int64) * stride_bs + b_cols,
                         mask=b_mask & (n < tl.where(nxt < 2147483647, N, 0))[None, :], other=0.0)
        sel = m_ok & (sl == cur)
        for j in tl.static_range(NUM_SLICES):
            sv = tl.load(s_ptr + m64[:, None] * stride_st + j * RANK + rr[None, :],
                         mask=sel[:, None] & rr_ok[None, :], other=0.0)  # [BM, RANK_P] fp32
            if NUM_SLICES > 1:
                in_j = _slice_rows(n, n_ok, j, NUM_SLICES, N, S1, S2, S3)
                bj = tl.where(in_j[None, :], b, 0.0).to(b.dtype)
            else:
                bj = b
            if DOT_IEEE:
                acc = tl.dot(sv, bj.to(tl.float32), acc, input_precision="ieee")
            else:
                # s in two parts of B's dtype (hi + lo carry ~16 bits), so s is not rounded to 16 bits.
                s_hi = sv.to(bj.dtype)
                s_lo = (sv - s_hi.to(tl.float32)).to(bj.dtype)
                acc = tl.dot(s_hi, bj, acc)
                acc = tl.dot(s_lo, bj, acc)
        b = b_next
        cur = nxt
    y_mask = (m_ok & (sl > 0))[:, None] & n_ok[None, :]
    y_at = y_ptr + m64[:, None] * stride_yt + n[None, :]
    y = tl.load(y_at, mask=y_mask, other=0.0)
    tl.store(y_at, (y.to(tl.float32) + acc).to(y.dtype), mask=y_mask)


# ---------------------------------------------------------------------------------------------
# Launch configs and host wrappers
# ---------------------------------------------------------------------------------------------

def _tile_bm(T: int) -> int:
    return 16 if T <= 256 else 32 if T <= 1024 else 64


# Programs a launch aims for: two per SM of an H200, so that the memory system has enough in flight.
_TARGET_PROGRAMS = 2 * 132


def _auto_split_k(T: int, R: int, K: int, bm: int, block_r: int, block_k: int) -> int:
    """Split K until the grid fills the GPU (each split at least one K step), in powers of two: each
    split count is a kernel specialization of its own, compiled at start-up (runner/warmup.py)."""
    programs = triton.cdiv(T, bm) * triton.cdiv(R, block_r)
    split = max(1, min(triton.cdiv(_TARGET_PROGRAMS, programs), K // block_k))
    return 1 << (split.bit_length() - 1)


def lora_shrink_config(T: int, R: int, K: int, prologue: int = PLAIN) -> dict:
    """Launch choice for the shrink at T tokens (shapes only). Tune here."""
    r_p = triton.next_power_of_2(R)
    if T <= GEMV_MAX_T:
        # One rank row per program while that leaves few programs (latency: one wide load of the
        # row of A), more rows per program for bigger batches (fewer re-reads of x from L2).
        # The whole row of K in one or two steps (all loads in flight at once: latency, not
        # bandwidth, is what a handful of programs waits on), 32 elements per thread and tensor.
        block_r = 1 if T * R <= 512 else min(r_p, 4)
        block_k = max(16, min(triton.next_power_of_2(K), 16384 // block_r))
        num_warps = max(4, min(16, block_k * block_r // 1024))
        return dict(mode="gemv", block_r=block_r, block_k=block_k, split_k=1, num_warps=num_warps, num_stages=2)
    # From the H200 sweep (benchmarks/lora_kernel_bench.py --sweep, Llama-3.1-8B layers, rank 16,
    # requests in runs and interleaved decode tokens over 8 adapters): 32-token blocks up to 256
    # tokens, 64 above; 64-wide K steps; the walk over the slots inside the K loop (the activations
    # and the prologue once per step, the next slot's A tile prefetched) won or tied everywhere
    # except one-slot blocks at a few shapes, where it costs at most ~10%.
    block_r = min(128, max(16, r_p))
    bm = 32 if T <= 256 else 64
    block_k = 64
    split_k = _auto_split_k(T, R, K, bm, block_r, block_k)
    return dict(mode="tile", bm=bm, block_r=block_r, block_k=block_k, split_k=split_k, slots_inner=True,
                num_warps=4, num_stages=2)


def lora_expand_config(T: int, N: int, slice_rank: int) -> dict:
    """Launch choice for the expand at T tokens (shapes only). Tune here."""
    rank_p = triton.next_power_of_2(slice_rank)
    if T <= GEMV_MAX_T:
        block_n = max(16, min(256, 2048 // rank_p, triton.next_power_of_2(N)))
        return dict(mode="gemv", block_n=block_n, num_warps=4, num_stages=1)
    # Sweep as for the shrink: 128 output rows per program; 16 / 32 / 64 tokens as T grows.
    return dict(mode="tile", bm=_tile_bm(T), block_n=128, num_warps=4, num_stages=2)


@functools.lru_cache(maxsize=256)
def _log_launch(op: str, T: int, shape: tuple, cfg_items: tuple) -> None:
    """Log each launch choice once (debug)."""
    logger.debug("lora %s T=%d %s: %s", op, T, shape, dict(cfg_items))


def _dot_ieee(device: torch.device, *dtypes: torch.dtype) -> bool:
    """Whether the tile product runs in IEEE fp32 (else in the operands' shared 16-bit dtype).
    Triton's interpreter (CPU) multiplies bf16 tl.dot operands wrongly, so there bf16 takes fp32."""
    if not all(d == dtypes[0] for d in dtypes):
        return True
    return not (dtypes[0] == torch.float16 or (dtypes[0] == torch.bfloat16 and device.type == "cuda"))


def _last_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def lora_shrink_triton(x: torch.Tensor, a_stack: torch.Tensor, token_slots: torch.Tensor, prologue: int = PLAIN,
                       norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                       config: Optional[dict] = None, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton path of lora_shrink_ref; x [T, K] ([T, 2K] for SILU_MUL), any row stride; the
    residual [T, K] likewise (the per-token kernel adds it in its prologue, the tile kernel takes
    the sum from torch)."""
    assert x.dim() == 2 and a_stack.dim() == 3 and token_slots.dim() == 1
    if residual is not None:
        assert prologue == ADD_RMSNORM and residual.shape == x.shape, "a residual goes with ADD_RMSNORM, x's shape"
        residual = _last_unit(residual)
    T = x.shape[0]
    S, R, K = a_stack.shape
    assert x.shape[1] == (2 * K if prologue == SILU_MUL else K), "x does not match a_stack's K"
    assert token_slots.shape[0] == T
    assert 1 <= R <= MAX_SLICES * MAX_RANK, f"rank rows {R} not in 1..{MAX_SLICES * MAX_RANK}"
    x, a_stack = _last_unit(x), _last_unit(a_stack)
    slots = token_slots if token_slots.dtype == torch.int32 else token_slots.to(torch.int32)
    s = torch.empty(T, R, dtype=torch.float32, device=x.device)
    if T == 0:
        return s
    if prologue == ADD_RMSNORM:
        assert norm_weight is not None and norm_weight.shape == (K,), "ADD_RMSNORM needs norm_weight [K]"
        nw = norm_weight.contiguous()
    else:
        nw = x
    cfg = {**lora_shrink_config(T, R, K, prologue), **(config or {})}
    if logger.isEnabledFor(logging.DEBUG):
        _log_launch("shrink", T, (R, K, prologue), tuple(sorted(cfg.items())))
    if cfg["mode"] == "gemv":
        grid = (T, triton.cdiv(R, cfg["block_r"]))
        has_residual = residual is not None
        r_arg = residual if has_residual else x
        _shrink_gemv_kernel[grid](
            x, a_stack, nw, slots, s, r_arg, R, K, eps, x.stride(0), a_stack.stride(0), a_stack.stride(1), s.stride(0),
            r_arg.stride(0), PROLOGUE=prologue, BLOCK_R=cfg["block_r"], BLOCK_K=cfg["block_k"],
            LOOP_STAGES=cfg["num_stages"], HAS_RESIDUAL=has_residual, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
    else:
        if residual is not None:
            x = x + residual
        assert cfg["bm"] >= 16 and cfg["block_r"] >= 16 and cfg["block_k"] >= 16, "tl.dot tiles are >= 16"
        ieee = _dot_ieee(x.device, x.dtype, a_stack.dtype)
        split_k = cfg.get("split_k")  # None: chosen for the config's tiles
        if split_k is None:
            split_k = _auto_split_k(T, R, K, cfg["bm"], cfg["block_r"], cfg["block_k"])
        split_k = max(1, int(split_k))
        k_chunk = triton.cdiv(triton.cdiv(K, split_k), cfg["block_k"]) * cfg["block_k"]
        split_k = triton.cdiv(K, k_chunk)
        rstd = s
        if split_k > 1:
            norm = prologue == ADD_RMSNORM
            if norm:
                rstd = torch.empty(T, dtype=torch.float32, device=x.device)
            rows = 4
            _shrink_prep_kernel[(triton.cdiv(T, rows),)](
                x, s, rstd, T, R, K, eps, x.stride(0), s.stride(0), NORM=norm, ROWS=rows,
                BLOCK_K=min(1024, triton.next_power_of_2(K)), BLOCK_R=min(128, triton.next_power_of_2(R)), num_warps=4)
        grid = (triton.cdiv(T, cfg["bm"]), triton.cdiv(R, cfg["block_r"]), split_k)
        _shrink_tile_kernel[grid](
            x, a_stack, nw, slots, s, rstd, T, R, K, k_chunk, eps, x.stride(0), a_stack.stride(0), a_stack.stride(1),
            s.stride(0), PROLOGUE=prologue, BM=cfg["bm"], BLOCK_R=cfg["block_r"], BLOCK_K=cfg["block_k"],
            SPLIT_K=split_k, DOT_IEEE=ieee, LOOP_STAGES=cfg["num_stages"], SLOTS_INNER=bool(cfg.get("slots_inner")),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return s


def lora_expand_triton(s: torch.Tensor, b_stack: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor,
                       slice_rank: int, slice_starts: Sequence[int] = (), config: Optional[dict] = None) -> None:
    """Triton path of lora_expand_ref; y [T, N] (unit last stride) is updated in place."""
    assert s.dim() == 2 and b_stack.dim() == 3 and y.dim() == 2 and token_slots.dim() == 1
    T, N = y.shape
    assert y.stride(-1) == 1, "y needs a unit last stride (it is updated in place)"
    assert b_stack.shape[1] == N and b_stack.shape[2] == slice_rank, "b_stack must be [S, N, slice_rank]"
    starts = tuple(int(v) for v in slice_starts)
    _slice_bounds(N, starts)
    num_slices = len(starts) + 1
    assert num_slices <= MAX_SLICES, f"at most {MAX_SLICES} slices"
    assert s.shape[0] == T and s.shape[1] >= num_slices * slice_rank and s.dtype == torch.float32
    assert 1 <= slice_rank <= MAX_RANK
    assert token_slots.shape[0] == T
    if T == 0 or N == 0:
        return
    s, b_stack = _last_unit(s), _last_unit(b_stack)
    slots = token_slots if token_slots.dtype == torch.int32 else token_slots.to(torch.int32)
    padded = (*starts, *([N] * (MAX_SLICES - 1 - len(starts))))
    cfg = {**lora_expand_config(T, N, slice_rank), **(config or {})}
    if logger.isEnabledFor(logging.DEBUG):
        _log_launch("expand", T, (N, slice_rank, starts), tuple(sorted(cfg.items())))
    if cfg["mode"] == "gemv":
        grid = (T, triton.cdiv(N, cfg["block_n"]))
        _expand_gemv_kernel[grid](
            s, b_stack, slots, y, N, s.stride(0), b_stack.stride(0), b_stack.stride(1), y.stride(0),
            RANK=slice_rank, RANK_P=triton.next_power_of_2(slice_rank), NUM_SLICES=num_slices,
            S1=padded[0], S2=padded[1], S3=padded[2], BLOCK_N=cfg["block_n"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    else:
        assert cfg["bm"] >= 16 and cfg["block_n"] >= 16, "tl.dot tiles are >= 16"
        ieee = _dot_ieee(y.device, b_stack.dtype)
        grid = (triton.cdiv(T, cfg["bm"]), triton.cdiv(N, cfg["block_n"]))
        _expand_tile_kernel[grid](
            s, b_stack, slots, y, T, N, s.stride(0), b_stack.stride(0), b_stack.stride(1), y.stride(0),
            RANK=slice_rank, RANK_P=max(16, triton.next_power_of_2(slice_rank)), NUM_SLICES=num_slices,
            S1=padded[0], S2=padded[1], S3=padded[2], BM=cfg["bm"], BLOCK_N=cfg["block_n"], DOT_IEEE=ieee,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, token_slots: torch.Tensor, prologue: int = PLAIN,
                norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """s [T, R] fp32 = per-token a_stack[slot] @ a(x) (a(x + residual) with a residual); Triton on
    CUDA, the reference elsewhere."""
    if use_triton(x):
        return lora_shrink_triton(x, a_stack, token_slots, prologue, norm_weight, eps, residual=residual)
    return lora_shrink_ref(x, a_stack, token_slots, prologue, norm_weight, eps, residual=residual)


def lora_expand(s: torch.Tensor, b_stack: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor,
                slice_rank: int, slice_starts: Sequence[int] = ()) -> None:
    """y += per-token b_stack[slot] @ s (per output slice), in place; Triton on CUDA, the reference elsewhere."""
    if use_triton(y):
        lora_expand_triton(s, b_stack, token_slots, y, slice_rank, slice_starts)
    else:
        lora_expand_ref(s, b_stack, token_slots, y, slice_rank, slice_starts)
