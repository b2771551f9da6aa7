"""Triton versions of the sampling ops in sampling.py (same signatures and semantics).

  gumbel_sample          one program per (row, vocabulary chunk), then a tiny merge of the chunk
                         winners; the hash noise is computed on the fly in uint32 arithmetic and
                         folded into per-lane running (max, argmax): no noise or probability
                         tensor is materialised. Same tokens as the reference.
  apply_penalties        in place, one program per (row, vocab block).
  apply_top_k_top_p_min_p  in place, one program per row; no sort: the top-k / top-p cut-offs are
                         found by a 16-way search over the float bit patterns (~8 passes each).
  logprobs               one program per row for the logsumexp and the sampled token's rank;
                         the top-`num_top` pairs come from torch.topk on the raw logits.

Every kernel loads the logits in their own dtype (float32, bfloat16 or float16) and computes in
float32; the in-place ones store their result back in that dtype.

Rounding: divisions use div_rn (Triton's `/` on fp32 is approximate on CUDA) and tl.log lowers to
libdevice's logf, the function torch's CUDA log calls, so the noise and the noisy logits are bit
for bit the reference's (the sampler and penalties are launched without FMA fusion, so products
and sums round separately, as in torch).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from tokenmill.kernels._dispatch import sm_count

VOCAB_BLOCK = 2048  # vocabulary elements per loop step of the Gumbel sampler
VOCAB_WARPS = 8
PROGRAMS_PER_SM = 4  # the Gumbel sampler's grid: programs per SM aimed at, at any batch size
LSE_BLOCK = 1024  # vocabulary elements per loop step of the logprobs kernel
PENALTY_BLOCK = 1024  # vocabulary elements per program of apply_penalties
SEARCH_BLOCK = 512  # vocabulary elements per step of the threshold search
SEARCH_WAYS = 16  # candidate thresholds per pass of the search (4 bits of the 32 per pass)
NEG_INF = tl.constexpr(float("-inf"))


def _check_logits(logits: torch.Tensor) -> None:
    assert logits.dim() == 2 and (logits.stride(1) == 1 or logits.shape[1] <= 1), \
        "logits must be [B, V] with unit column stride"


# ----------------------------------------------------------------------------------------------
# Gumbel-max sampling
# ----------------------------------------------------------------------------------------------


@triton.jit
def _mix32(x):
    """sampling._mix32 on uint32: products wrap mod 2**32 and right shifts are logical."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed, position):
    """sampling.row_keys_ref for one row: int64 seed and position in, uint32 key out."""
    lo = seed.to(tl.int64).to(tl.uint32)  # truncation keeps the low word
    hi = (seed.to(tl.int64) >> 32).to(tl.uint32)
    key = _mix32(lo ^ _mix32(hi))
    return _mix32(key ^ position.to(tl.int64).to(tl.uint32))


@triton.jit
def _gumbel(key, tokens):
    """sampling.gumbel_noise_ref at the given token ids (int32) of a row with this key."""
    bits = _mix32(key ^ (tokens.to(tl.uint32) * 0x9E3779B1))
    # The reference's u = (k + 0.5) / 2**23, k = bits >> 9, exact in both, without the slow
    # int-to-float conversion: k as the mantissa of a float in [1, 2) is 1 + k / 2**23, and
    # subtracting 1 - 2**-24 is exact.
    u = ((bits >> 9) | 0x3F800000).to(tl.float32, bitcast=True) - (1.0 - 1.0 / 16777216.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _argmax_chunk(row_ptr, lo, hi, key, temp, NOISY: tl.constexpr, BLOCK: tl.constexpr):
    """(max, argmax) over columns [lo, hi) of the row in float32 (NOISY: of logits + temp * gumbel),
    the lowest index winning ties as in torch.argmax; with every value -inf the answer is lo.

    Each lane keeps its own running best through the loop and the lanes are reduced once at the
    end, so the loop has no cross-warp reduction. A lane's columns increase, so a strict > keeps
    its earliest maximum; the final reduction takes the lowest index among the lanes at the max."""
    lanes = tl.arange(0, BLOCK)
    best_val = tl.full([BLOCK], NEG_INF, tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32) + lo
    for start in range(lo, hi, BLOCK):
        cols = start + lanes
        x = tl.load(row_ptr + cols, mask=cols < hi, other=NEG_INF).to(tl.float32)
        if NOISY:
            x = x + temp * _gumbel(key, cols)  # finite noise: masked-off lanes stay -inf
        better = x > best_val
        best_val = tl.where(better, x, best_val)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best_val, axis=0)
    return top, tl.min(tl.where(best_val == top, best_idx, hi), axis=0)


@triton.jit
def _gumbel_chunk_kernel(logits_ptr, stride_row, V, chunk, temperature_ptr, seeds_ptr, positions_ptr,
                         val_ptr, idx_ptr, out_ptr,
                         GREEDY_ONLY: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (B, chunks): each program scans one chunk of its row. SPLIT: writes the chunk's
    (max, argmax) for _merge_chunks_kernel; else (one chunk per row) the token itself."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    lo = part * chunk
    hi = tl.minimum(lo + chunk, V)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    if GREEDY_ONLY:
        val, idx = _argmax_chunk(row_ptr, lo, hi, 0, 0.0, False, BLOCK)
    else:
        temp = tl.load(temperature_ptr + row).to(tl.float32)
        if temp == 0:  # the noise is finite, so this is the noisy scan's answer without the hashing
            val, idx = _argmax_chunk(row_ptr, lo, hi, 0, 0.0, False, BLOCK)
        else:
            key = _row_key(tl.load(seeds_ptr + row), tl.load(positions_ptr + row))
            val, idx = _argmax_chunk(row_ptr, lo, hi, key, temp, True, BLOCK)
    if SPLIT:
        slot = row.to(tl.int64) * tl.num_programs(1) + part
        tl.store(val_ptr + slot, val)
        tl.store(idx_ptr + slot, idx)
    else:
        tl.store(out_ptr + row, idx.to(tl.int64))


@triton.jit(do_not_specialize=["chunks"])
def _merge_chunks_kernel(val_ptr, idx_ptr, out_ptr, chunks, BLOCK_C: tl.constexpr):
    """Grid (B,): the row's token from its chunk winners: the max, and among equal maxima the
    lowest index (chunks cover increasing columns, so this is the whole row's torch.argmax)."""
    row = tl.program_id(0)
    parts = tl.arange(0, BLOCK_C)
    valid = parts < chunks
    base = row.to(tl.int64) * chunks
    vals = tl.load(val_ptr + base + parts, mask=valid, other=NEG_INF)
    idx = tl.load(idx_ptr + base + parts, mask=valid, other=2**31 - 1)
    top = tl.max(vals, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(vals == top, idx, 2**31 - 1), axis=0).to(tl.int64))


def _vocab_chunk(batch: int, vocab: int, device: torch.device, num_chunks: Optional[int] = None) -> int:
    """Columns per program: each row is split so that every batch size gives at least
    PROGRAMS_PER_SM programs per SM (one program per row leaves most of the GPU idle at a batch of a
    few hundred, and a batch of 1 would scan 150k logits on one SM), in whole blocks, at least
    one. Rounding down to whole blocks can only add chunks; num_chunks overrides the target."""
    if num_chunks is None:
        sms = sm_count(device)
        num_chunks = triton.cdiv(PROGRAMS_PER_SM * sms, batch)
    return max(1, triton.cdiv(vocab, VOCAB_BLOCK) // max(num_chunks, 1)) * VOCAB_BLOCK


def gumbel_sample_triton(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                         positions: torch.Tensor, greedy_only: bool = False,
                         num_chunks: Optional[int] = None) -> torch.Tensor:
    """int64 [B]: argmax(logits) for greedy rows (temperature 0, or all with greedy_only), else
    argmax(logits + T * gumbel(seed, position, token)), in float32 whatever the logits' dtype.

    Each row is split into chunks scanned by separate programs (num_chunks overrides the choice);
    the chunk winners are merged by a second, tiny kernel."""
    _check_logits(logits)
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    if greedy_only:  # the other tensors are not read
        temperature = seeds = positions = out
    chunk = _vocab_chunk(B, V, logits.device, num_chunks)
    chunks = triton.cdiv(V, chunk)
    split = chunks > 1
    vals = torch.empty((B, chunks), dtype=torch.float32, device=logits.device) if split else out
    idx = torch.empty((B, chunks), dtype=torch.int32, device=logits.device) if split else out
    _gumbel_chunk_kernel[(B, chunks)](
        logits, logits.stride(0), V, chunk, temperature, seeds, positions, vals, idx, out,
        GREEDY_ONLY=greedy_only, SPLIT=split, BLOCK=VOCAB_BLOCK, num_warps=VOCAB_WARPS,
        enable_fp_fusion=False,  # round temp * gumbel before the sum, like the reference
    )
    if split:
        # BLOCK_C from the vocabulary alone: one compile for every batch size
        _merge_chunks_kernel[(B,)](vals, idx, out, chunks, BLOCK_C=triton.next_power_of_2(triton.cdiv(V, VOCAB_BLOCK)),
                                   num_warps=1)
    return out


# ----------------------------------------------------------------------------------------------
# Penalties
# ----------------------------------------------------------------------------------------------


@triton.jit
def _penalties_kernel(logits_ptr, counts_ptr, prompt_mask_ptr, repetition_ptr, frequency_ptr, presence_ptr,
                      V, stride_logits, stride_counts, stride_prompt,
                      HAS_PROMPT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    rep = tl.load(repetition_ptr + row).to(tl.float32)
    freq = tl.load(frequency_ptr + row).to(tl.float32)
    pres = tl.load(presence_ptr + row).to(tl.float32)
    # Neutral parameters leave the row bit for bit unchanged, so skip its memory traffic.
    if (rep != 1.0) | (freq != 0.0) | (pres != 0.0):
        row64 = row.to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = cols < V
        x = tl.load(logits_ptr + row64 * stride_logits + cols, mask=valid, other=0.0).to(tl.float32)
        counts = tl.load(counts_ptr + row64 * stride_counts + cols, mask=valid, other=0)
        seen_out = counts > 0
        seen = seen_out
        if HAS_PROMPT:
            seen = seen | (tl.load(prompt_mask_ptr + row64 * stride_prompt + cols, mask=valid, other=0) != 0)
        penalised = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)
        x = tl.where(seen, penalised, x)
        x = x - (freq * counts.to(tl.float32) + pres * seen_out.to(tl.float32))
        tl.store(logits_ptr + row64 * stride_logits + cols, x.to(logits_ptr.dtype.element_ty), mask=valid)


def apply_penalties_triton(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: Optional[torch.Tensor],
                           repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> None:
    """In place on logits [B, V]; output_counts [B, V] int, prompt_mask bool [B, V] or None,
    repetition / frequency / presence float [B]."""
    _check_logits(logits)
    B, V = logits.shape
    if B == 0 or V == 0:
        return
    assert output_counts.stride(1) == 1, "output_counts needs unit column stride"
    if prompt_mask is not None:
        assert prompt_mask.stride(1) == 1, "prompt_mask needs unit column stride"
        if prompt_mask.dtype == torch.bool:
            prompt_mask = prompt_mask.view(torch.uint8)
    grid = (B, triton.cdiv(V, PENALTY_BLOCK))
    _penalties_kernel[grid](
        logits, output_counts, prompt_mask if prompt_mask is not None else output_counts,
        repetition, frequency, presence,
        V, logits.stride(0), output_counts.stride(0), prompt_mask.stride(0) if prompt_mask is not None else 0,
        HAS_PROMPT=prompt_mask is not None, BLOCK=PENALTY_BLOCK, num_warps=4,
        enable_fp_fusion=False,  # round the products and the sum separately, like torch
    )


# ----------------------------------------------------------------------------------------------
# top-k / top-p / min-p
# ----------------------------------------------------------------------------------------------


@triton.jit
def _ordered_key(x):
    """An int32 that orders like the float x (-0.0 sorts just below +0.0): flip the magnitude
    bits of negatives so that larger negative floats map to smaller integers."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _load_after_min_p(row_ptr, cols, V, min_p_cut):
    """A block of the row as the min-p stage leaves it: below the cut (and out of range) is -inf."""
    x = tl.load(row_ptr + cols, mask=cols < V, other=NEG_INF).to(tl.float32)
    return tl.where(x < min_p_cut, NEG_INF, x)


@triton.jit
def _search_threshold(row_ptr, V, min_p_cut, row_max, lo, hi, target,
                      BY_MASS: tl.constexpr, BLOCK: tl.constexpr, WAYS: tl.constexpr):
    """The largest int64 key t in [lo, hi] with f(t) >= target, where f(t) counts the elements whose
    key is >= t (or, BY_MASS, sums their exp(x - row_max)); f is non-increasing and f(lo) >= target
    is assumed. Each pass over the row tests WAYS candidates and keeps one of WAYS sub-intervals."""
    ways = tl.arange(0, WAYS).to(tl.int64) + 1
    lanes = tl.arange(0, BLOCK)
    while lo < hi:
        cand = lo + ((hi - lo) * ways + (WAYS - 1)) // WAYS  # increasing, in (lo, hi], last = hi
        cand32 = cand.to(tl.int32)  # keys are int32; only the spacing arithmetic needs 64 bits
        if BY_MASS:
            acc = tl.zeros([WAYS], tl.float32)
        else:
            acc = tl.zeros([WAYS], tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + lanes
            x = _load_after_min_p(row_ptr, cols, V, min_p_cut)
            above = (_ordered_key(x)[:, None] >= cand32[None, :]) & (cols < V)[:, None]
            if BY_MASS:
                w = tl.exp(x - row_max)
                acc += tl.sum(tl.where(above, w[:, None], 0.0), axis=0)
            else:
                acc += tl.sum(above.to(tl.int32), axis=0)
        ok = acc >= target  # a prefix of the candidates
        new_lo = tl.max(tl.where(ok, cand, lo), axis=0)
        hi = tl.min(tl.where(ok, hi, cand - 1), axis=0)
        lo = new_lo
    return lo


@triton.jit
def _mass_at_or_above(row_ptr, V, min_p_cut, row_max, key_cut, BLOCK: tl.constexpr):
    """sum of exp(x - row_max) over the elements whose key is >= key_cut."""
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + lanes
        x = _load_after_min_p(row_ptr, cols, V, min_p_cut)
        keep = (_ordered_key(x).to(tl.int64) >= key_cut) & (cols < V)
        acc += tl.where(keep, tl.exp(x - row_max), 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _top_k_top_p_min_p_kernel(logits_ptr, stride_row, V, top_k_ptr, top_p_ptr, min_p_ptr,
                              HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
                              BLOCK: tl.constexpr, WAYS: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)

    # Pass 1: the row's max and min.
    run_max = tl.full([BLOCK], NEG_INF, tl.float32)
    run_min = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + lanes
        x = tl.load(row_ptr + cols, mask=cols < V, other=NEG_INF).to(tl.float32)
        run_max = tl.maximum(run_max, x)
        run_min = tl.minimum(run_min, tl.where(cols < V, x, float("inf")))
    row_max = tl.max(run_max, axis=0)
    row_min = tl.min(run_min, axis=0)

    # min-p, relative to the max probability: drop x < max + log(min_p).
    min_p_cut = tl.full([], NEG_INF, tl.float32)
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + row).to(tl.float32)
        if min_p > 0:
            min_p_cut = row_max + tl.log(tl.maximum(min_p, 1e-30))
    row_min = tl.where(row_min < min_p_cut, NEG_INF, row_min)
    active = min_p_cut > NEG_INF  # whether the final pass has anything to drop

    # top-k: the key of the k-th largest value (every element at or above it is kept).
    cut = _ordered_key(row_min).to(tl.int64)
    max_key = _ordered_key(row_max).to(tl.int64)
    if HAS_K:
        k = tl.load(top_k_ptr + row).to(tl.int64)
        if (k > 0) & (k < V):
            cut = _search_threshold(row_ptr, V, min_p_cut, row_max, cut, max_key, k, False, BLOCK, WAYS)
            active = active | (k > 0)

    # top-p over the distribution left by top-k: the largest cut whose kept mass reaches top_p.
    if HAS_P:
        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        if top_p < 1.0:
            target = top_p * _mass_at_or_above(row_ptr, V, min_p_cut, row_max, cut, BLOCK)
            cut = _search_threshold(row_ptr, V, min_p_cut, row_max, cut, max_key, target, True, BLOCK, WAYS)
            active = active | (top_p < 1.0)

    if active:
        for start in range(0, V, BLOCK):
            cols = start + lanes
            x = _load_after_min_p(row_ptr, cols, V, min_p_cut)
            drop = (x == NEG_INF) | (_ordered_key(x).to(tl.int64) < cut)
            tl.store(row_ptr + cols, tl.full([BLOCK], NEG_INF, logits_ptr.dtype.element_ty),
                     mask=drop & (cols < V))


def apply_top_k_top_p_min_p_triton(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                                   top_p: Optional[torch.Tensor], min_p: Optional[torch.Tensor]) -> None:
    """In place: -inf outside each row's allowed set; each of top_k / top_p / min_p is a [B] tensor
    or None (stage off), with per-row off values 0 / 1.0 / 0.0.

    Ties differ from the sort-based reference: every element equal to the k-th largest value is
    kept (so more than k may survive), and likewise at the top-p cut; -0.0 counts as just below
    +0.0 there. Off ties, on continuous logits, the kept set is the reference's (top-p up to the
    rounding of the mass sums at the cut). A top_p row at exactly 1.0 is a no-op."""
    _check_logits(logits)
    B, V = logits.shape
    if B == 0 or V == 0 or (top_k is None and top_p is None and min_p is None):
        return
    dummy = logits
    _top_k_top_p_min_p_kernel[(B,)](
        logits, logits.stride(0), V,
        top_k if top_k is not None else dummy, top_p if top_p is not None else dummy,
        min_p if min_p is not None else dummy,
        HAS_K=top_k is not None, HAS_P=top_p is not None, HAS_MIN_P=min_p is not None,
        BLOCK=SEARCH_BLOCK, WAYS=SEARCH_WAYS, num_warps=8,
    )


# ----------------------------------------------------------------------------------------------
# Logprobs
# ----------------------------------------------------------------------------------------------


@triton.jit
def _lse_rank_kernel(logits_ptr, stride_row, V, sampled_ptr, lse_ptr, logprob_ptr, rank_ptr,
                     BLOCK: tl.constexpr):
    """Online logsumexp of the row, the sampled token's logprob, and its rank (1 + #strictly greater)."""
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    chosen = tl.load(row_ptr + tl.load(sampled_ptr + row).to(tl.int64)).to(tl.float32)
    lanes = tl.arange(0, BLOCK)
    run_max = tl.full([], NEG_INF, tl.float32)
    run_sum = tl.zeros([], tl.float32)
    greater = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + lanes
        x = tl.load(row_ptr + cols, mask=cols < V, other=NEG_INF).to(tl.float32)
        new_max = tl.maximum(run_max, tl.max(x, axis=0))
        # A shift of 0 while everything so far is -inf keeps exp() away from inf - inf.
        shift = tl.where(new_max == NEG_INF, 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        run_max = new_max
        greater += (x > chosen).to(tl.int32)
    lse = tl.where(run_max == NEG_INF, 0.0, run_max) + tl.log(run_sum)
    tl.store(lse_ptr + row, lse)
    tl.store(logprob_ptr + row, chosen - lse)
    tl.store(rank_ptr + row, tl.sum(greater, axis=0).to(tl.int64) + 1)


def logprobs_triton(raw_logits: torch.Tensor, sampled: torch.Tensor, num_top: int):
    """(sampled logprob [B], rank int64 [B], top ids [B, num_top], top logprobs [B, num_top]) from
    the unprocessed logits, any float dtype; the logprobs are float32. Allocates the four outputs
    (plus an lse buffer); topk is torch's, on the logits in their own dtype."""
    _check_logits(raw_logits)
    B, V = raw_logits.shape
    device = raw_logits.device
    lse = torch.empty(B, dtype=torch.float32, device=device)
    logprob = torch.empty(B, dtype=torch.float32, device=device)
    rank = torch.empty(B, dtype=torch.int64, device=device)
    if B > 0:
        _lse_rank_kernel[(B,)](raw_logits, raw_logits.stride(0), V, sampled, lse, logprob, rank,
                               BLOCK=LSE_BLOCK, num_warps=8)
    if num_top > 0:
        top_vals, top_ids = raw_logits.topk(num_top, dim=-1)
        top_logprobs = top_vals.float() - lse[:, None]
    else:
        top_ids, top_logprobs = sampled[:, None][:, :0], lse[:, None][:, :0]
    return logprob, rank, top_ids, top_logprobs
