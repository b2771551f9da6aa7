"""Multi-head latent attention (DeepSeek-V2 / V3) over a paged latent cache.

The cache holds one row per token: the compressed latent c (kv_lora_rank R, after kv_a_layernorm)
then the rope'd key k_pe (qk_rope_head_dim P), shared by every head: [num_blocks, block_size, 1, R + P].

Decode attends over it directly, with the up-projections absorbed (layers/mla.py): head h's key is
[W_UK[h] c, k_pe], so q_nope . W_UK[h] c = (W_UK[h]^T q_nope) . c; the layer passes
q_lat = W_UK[h]^T q_nope [B, H, R] and q_pe [B, H, P], this kernel returns o_lat[b, h] = the
softmax(scale * (q_lat . c + q_pe . k_pe))-weighted sum of the latents c [B, H, R], and the layer
applies W_UV[h] after. One token per request (uniform single-token decode): q row b is request b.

The Triton decode is written for bandwidth: a program takes one sequence, a block of heads (all of
them when H <= BLOCK_H, so each latent block is read once per sequence) and one split of the context
(split-K, so that a few long sequences still fill the GPU); each tile of BLOCK_N latent rows is
loaded once and used for both products (scores and the weighted sum). A second launch merges the
splits by their log-sum-exp (with one split the first writes the output itself). Both accumulate in fp32.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from tokenmill.kernels._dispatch import sm_count, use_triton


# ----------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------

def mla_cache_write_ref(cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> None:
    """cache [blocks, block_size, 1, R + P]; latent [T, R], k_pe [T, P] (any row strides); token t
    goes to flat slot slots[t] (< 0: padding, not written)."""
    rows = cache.view(-1, cache.shape[-1])
    keep = slots >= 0
    rows[slots[keep]] = torch.cat((latent[keep], k_pe[keep]), dim=-1).to(cache.dtype)


def gather_latent(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One request's first seq_len cached rows [seq_len, R + P], in position order."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-seq_len // block_size)].long()
    return cache[blocks].reshape(-1, cache.shape[-1])[:seq_len]


def mla_decode_ref(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q_lat [B, H, R], q_pe [B, H, P], one query per request b attending to its seq_lens[b] cached
    rows -> o_lat [B, H, R] in q_lat's dtype (fp32 softmax and sums)."""
    R = q_lat.shape[-1]
    out = torch.zeros_like(q_lat)
    for b, n in enumerate(seq_lens[: q_lat.shape[0]].tolist()):
        if n <= 0:
            continue
        rows = gather_latent(cache, block_tables[b], n).float()
        scores = (q_lat[b].float() @ rows[:, :R].T + q_pe[b].float() @ rows[:, R:].T) * scale
        out[b] = (torch.softmax(scores, dim=-1) @ rows[:, :R]).to(q_lat.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------

@triton.jit
def _cache_write_kernel(cache_ptr, latent_ptr, kpe_ptr, slots_ptr, stride_lt, stride_pt, R, P,
                        BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """Grid (T,): token t's latent and k_pe into its cache row (slot < 0: padding, skipped)."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        row = cache_ptr + slot * (R + P)
        r = tl.arange(0, BLOCK_R)
        p = tl.arange(0, BLOCK_P)
        c = tl.load(latent_ptr + t.to(tl.int64) * stride_lt + r, mask=r < R)
        k = tl.load(kpe_ptr + t.to(tl.int64) * stride_pt + p, mask=p < P)
        tl.store(row + r, c.to(cache_ptr.dtype.element_ty), mask=r < R)
        tl.store(row + R + p, k.to(cache_ptr.dtype.element_ty), mask=p < P)


def mla_cache_write_triton(cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> None:
    T, R = latent.shape
    P = k_pe.shape[-1]
    assert cache.is_contiguous() and cache.shape[-1] == R + P and latent.stride(-1) == 1 and k_pe.stride(-1) == 1
    if T == 0:
        return
    _cache_write_kernel[(T,)](cache, latent, k_pe, slots, latent.stride(0), k_pe.stride(0), R, P,
                              BLOCK_R=triton.next_power_of_2(R), BLOCK_P=triton.next_power_of_2(P), num_warps=4)


def mla_cache_write(cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> None:
    """Store this step's latent rows (mla_cache_write_ref): Triton on CUDA (no host sync: graph-safe)."""
    if use_triton(cache):
        mla_cache_write_triton(cache, latent, k_pe, slots)
    else:
        mla_cache_write_ref(cache, latent, k_pe, slots)


@triton.jit
def _mla_decode_split_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, tables_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr, out_ptr,
    H, R, P, num_splits, min_split, qk_scale,
    stride_lb, stride_lh, stride_pb, stride_ph, stride_cblock, stride_ctok, stride_table, stride_ob, stride_oh,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr, DOT_PRECISION: tl.constexpr, DIRECT: tl.constexpr,
):
    """Grid (B, num_splits, cdiv(H, BLOCK_H)): request b's heads [hb * BLOCK_H, ...) over split s of
    its context; writes the split's normalised output [BLOCK_H, R] and log-sum-exp (base 2). A split
    covers at least min_split tokens (a multiple of BLOCK_N), so a short context fills only its first
    splits, decided on the device: num_splits is an upper bound a CUDA graph can fix. DIRECT (one
    split): the output goes straight to out_ptr, and no merge runs."""
    b = tl.program_id(0)
    split = tl.program_id(1)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    r_ok = r < R
    p_ok = p < P
    seq_len = tl.load(seq_lens_ptr + b)
    # Each split covers a whole number of BLOCK_N tiles; the last ones may be empty.
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, min_split)
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    b64 = b.to(tl.int64)
    q_lat = tl.load(q_lat_ptr + b64 * stride_lb + heads[:, None] * stride_lh + r[None, :],
                    mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + b64 * stride_pb + heads[:, None] * stride_ph + p[None, :],
                   mask=h_ok[:, None] & p_ok[None, :], other=0.0)
    m = tl.full([BLOCK_H], -float("inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        page = tl.load(tables_ptr + b64 * stride_table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        row = cache_ptr + page * stride_cblock + (n % PAGE).to(tl.int64) * stride_ctok
        kv = tl.load(row[:, None] + r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)  # [N, R]
        kpe = tl.load(row[:, None] + R + p[None, :], mask=n_ok[:, None] & p_ok[None, :], other=0.0)  # [N, P]
        s = tl.dot(q_lat, tl.trans(kv), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(kpe), input_precision=DOT_PRECISION)
        s = tl.where(n_ok[None, :], s * qk_scale, -float("inf"))  # qk_scale includes log2(e)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        prob = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(prob, axis=1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(kv.dtype), kv, input_precision=DOT_PRECISION)
        m = m_new

    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]  # zeros for an empty context
    if DIRECT:
        tl.store(out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & r_ok[None, :])
    else:
        lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), -float("inf"))
        part = (b64 * num_splits + split) * H + heads
        # an empty split writes only its lse (-inf): the merge reads nothing else of it
        tl.store(part_out_ptr + part[:, None] * R + r[None, :], out, mask=(h_ok & has)[:, None] & r_ok[None, :])
        tl.store(part_lse_ptr + part, lse, mask=h_ok)


@triton.jit
def _mla_merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, H, R, num_splits, stride_ob, stride_oh,
                      BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr):
    """Grid (B, H, cdiv(R, BLOCK_R)): the splits' outputs weighted by exp2(lse - max) -> columns
    [pid2 * BLOCK_R, ...) of out[b, h] (zeros for an empty context). Columns in blocks, so a batch of
    one still has programs enough to read its splits' partials, and a [splits, BLOCK_R] tile stays small."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    s_ok = s < num_splits
    part = (b * num_splits + s) * H + h
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=-float("inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == -float("inf"), 0.0, top)
    w = tl.exp2(lse - top)
    full = s_ok & (lse > -float("inf"))  # empty splits' outputs were never written
    o = tl.load(part_out_ptr + part[:, None] * R + r[None, :], mask=full[:, None] & (r < R)[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + r, res.to(out_ptr.dtype.element_ty), mask=r < R)


# Launch choices, from benchmarks/mla_decode_bench.py --sweep on the H100 (docs/PERFORMANCE.md)
BLOCK_H = 16  # heads per program: tl.dot needs 16 rows; V2-Lite's 16 heads read each latent tile once
BLOCK_N = 32  # latent rows per tile: [32, 512] bf16 = 32 KiB
NUM_WARPS = 4
NUM_STAGES = 3
# Two programs per SM in one wave was fastest at every batch of the sweep (one more, partly filled
# wave cost up to a third); a split may be as short as one tile.
PROGRAMS_PER_SM = 2
MIN_TOKENS_PER_SPLIT = BLOCK_N
MAX_SPLITS = 128
MERGE_BLOCK_R = 64  # latent columns per merge program: [128 splits, 64] fp32 is 32 KiB of registers


def mla_num_splits(batch: int, num_heads: int, max_seq_len: Optional[int], device: torch.device,
                   block_h: int = BLOCK_H) -> int:
    """Splits of the context per request: as many as fill PROGRAMS_PER_SM programs per SM in one wave,
    no split shorter than MIN_TOKENS_PER_SPLIT when the longest context is known (None inside CUDA graphs)."""
    programs = batch * triton.cdiv(num_heads, block_h)
    splits = PROGRAMS_PER_SM * sm_count(device) // programs
    if max_seq_len is not None:
        splits = min(splits, triton.cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT))
    return max(1, min(splits, MAX_SPLITS))


def mla_decode_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, num_splits: Optional[int] = None,
                      max_seq_len: Optional[int] = None, out: Optional[torch.Tensor] = None,
                      block_h: int = BLOCK_H, block_n: int = BLOCK_N, num_warps: int = NUM_WARPS,
                      num_stages: int = NUM_STAGES, min_split: int = MIN_TOKENS_PER_SPLIT) -> torch.Tensor:
    """mla_decode_ref in two launches (no host sync: CUDA-graph safe when num_splits is given or
    max_seq_len is None). num_splits is the most splits per request (each at least min_split
    tokens, rounded up to block_n); block_h / block_n / num_warps / num_stages: the split kernel's
    launch choices (benchmarks/mla_decode_bench.py sweeps them)."""
    B, H, R = q_lat.shape
    P = q_pe.shape[-1]
    assert cache.shape[-1] == R + P and cache.shape[2] == 1 and cache.stride(-1) == 1
    assert q_lat.stride(-1) == 1 and q_pe.stride(-1) == 1 and block_tables.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q_lat)
    assert out.shape == q_lat.shape and out.stride(-1) == 1
    if B == 0:
        return out
    if num_splits is None:
        num_splits = mla_num_splits(B, H, max_seq_len, q_lat.device, block_h)
    direct = num_splits == 1  # no partials to merge: the split kernel writes out
    parts = (B, 1, 1, 1) if direct else (B, num_splits, H, R)
    part_out = torch.empty(parts, dtype=torch.float32, device=q_lat.device)
    part_lse = part_out if direct else torch.empty((B, num_splits, H), dtype=torch.float32, device=q_lat.device)
    # tl.dot needs 16 along every dimension on the GPU (tiny test models have P = 8); masks pad
    block_r, block_p = max(16, triton.next_power_of_2(R)), max(16, triton.next_power_of_2(P))
    _mla_decode_split_kernel[(B, num_splits, triton.cdiv(H, block_h))](
        q_lat, q_pe, cache, block_tables, seq_lens, part_out, part_lse, out, H, R, P, num_splits,
        triton.cdiv(min_split, block_n) * block_n, scale * 1.4426950408889634,  # exp2 domain
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        PAGE=cache.shape[1], BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_P=block_p,
        DOT_PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32", DIRECT=direct, num_warps=num_warps,
        num_stages=num_stages)
    if direct:
        return out
    merge_r = min(block_r, MERGE_BLOCK_R)
    _mla_merge_kernel[(B, H, triton.cdiv(R, merge_r))](
        part_out, part_lse, out, H, R, num_splits, out.stride(0), out.stride(1),
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_R=merge_r, num_warps=4)
    return out


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, num_splits: Optional[int] = None,
               max_seq_len: Optional[int] = None) -> torch.Tensor:
    """Latent decode attention (mla_decode_ref's arguments and result): Triton on CUDA."""
    if use_triton(q_lat):
        return mla_decode_triton(q_lat, q_pe, cache, block_tables, seq_lens, scale, num_splits, max_seq_len)
    return mla_decode_ref(q_lat, q_pe, cache, block_tables, seq_lens, scale)
