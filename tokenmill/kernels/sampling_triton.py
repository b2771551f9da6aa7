"""Triton versions of the sampling ops in sampling.py (same signatures and semantics).

  gumbel_sample          one program per row (per row chunk for small batches); the hash noise is
                         computed on the fly in uint32 arithmetic and folded into a running
                         (max, argmax): no noise or probability tensor is materialised. Same
                         tokens as the reference.
  apply_penalties        in place, one program per (row, vocab block).
  apply_top_k_top_p_min_p  in place, one program per row; no sort: the top-k / top-p cut-offs are
                         found by a 16-way search over the float bit patterns (~8 passes each).
  logprobs               one program per row for the logsumexp and the sampled token's rank;
                         the top-`num_top` pairs come from torch.topk on the raw logits.

Rounding: divisions use div_rn (Triton's `/` on fp32 is approximate on CUDA) and tl.log lowers to
libdevice's logf, the function torch's CUDA log calls, so the noise and the scaled logits are bit
for bit the reference's. Float outputs of penalties are exact too (launched without FMA fusion).
"""

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

VOCAB_BLOCK = 1024  # vocabulary elements per loop step (one program per row)
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
    # (bits >> 8) < 2**24 converts exactly and the product by 2**-24 is exact, so an FMA here
    # rounds like the reference's separate multiply and add.
    u = (bits >> 8).to(tl.float32) * (1.0 / 16777216.0) + (0.5 / 16777216.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _argmax_range(row_ptr, lo, hi, key, temp, NOISY: tl.constexpr, BLOCK: tl.constexpr):
    """(max, argmax) over columns [lo, hi) of the row (NOISY: logits / temp + gumbel); the lowest
    index wins ties, as in torch.argmax: blocks are visited in order and only a strictly larger max
    replaces. With every value -inf the answer is lo."""
    lanes = tl.arange(0, BLOCK)
    best_val = tl.full([], NEG_INF, tl.float32)
    best_idx = tl.zeros([], tl.int32) + lo
    for start in range(lo, hi, BLOCK):
        cols = start + lanes
        valid = cols < hi
        x = tl.load(row_ptr + cols, mask=valid, other=NEG_INF).to(tl.float32)
        if NOISY:
            x = tl.math.div_rn(x, temp) + _gumbel(key, cols)
            x = tl.where(valid, x, NEG_INF)
        blk_val, blk_idx = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = blk_val > best_val
        best_idx = tl.where(better, start + blk_idx, best_idx)
        best_val = tl.where(better, blk_val, best_val)
    return best_val, best_idx


@triton.jit
def _sample_range(logits_ptr, stride_row, row, lo, hi, temperature_ptr, seeds_ptr, positions_ptr,
                  GREEDY_ONLY: tl.constexpr, BLOCK: tl.constexpr):
    """The row's (max, argmax) over [lo, hi): plain for greedy rows, with Gumbel noise otherwise."""
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    if GREEDY_ONLY:
        val, idx = _argmax_range(row_ptr, lo, hi, 0, 1.0, False, BLOCK)
    else:
        temp = tl.load(temperature_ptr + row).to(tl.float32)
        if temp == 0:
            val, idx = _argmax_range(row_ptr, lo, hi, 0, 1.0, False, BLOCK)
        else:
            key = _row_key(tl.load(seeds_ptr + row), tl.load(positions_ptr + row))
            val, idx = _argmax_range(row_ptr, lo, hi, key, tl.maximum(temp, 1e-6), True, BLOCK)
    return val, idx


@triton.jit
def _gumbel_sample_kernel(logits_ptr, stride_row, V, temperature_ptr, seeds_ptr, positions_ptr, out_ptr,
                          GREEDY_ONLY: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (B,): one program scans its whole row."""
    row = tl.program_id(0)
    _, token = _sample_range(logits_ptr, stride_row, row, 0, V, temperature_ptr, seeds_ptr, positions_ptr,
                             GREEDY_ONLY, BLOCK)
    tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _gumbel_chunk_kernel(logits_ptr, stride_row, V, chunk, temperature_ptr, seeds_ptr, positions_ptr,
                         val_ptr, idx_ptr, GREEDY_ONLY: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (B, chunks): each program scans one chunk of its row and writes its (max, argmax)."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    lo = part * chunk
    hi = tl.minimum(lo + chunk, V)
    val, idx = _sample_range(logits_ptr, stride_row, row, lo, hi, temperature_ptr, seeds_ptr, positions_ptr,
                             GREEDY_ONLY, BLOCK)
    slot = row.to(tl.int64) * tl.num_programs(1) + part
    tl.store(val_ptr + slot, val)
    tl.store(idx_ptr + slot, idx)


def _vocab_chunks(batch: int, vocab: int, device: torch.device) -> int:
    """Split each row's vocabulary over several programs when the batch alone leaves SMs idle
    (a batch of 1 would otherwise scan 150k logits on one SM): about 2 programs per SM."""
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 132
    return max(1, min(triton.cdiv(2 * sms, batch), triton.cdiv(vocab, VOCAB_BLOCK)))


def gumbel_sample_triton(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                         positions: torch.Tensor, greedy_only: bool = False,
                         num_chunks: Optional[int] = None) -> torch.Tensor:
    """int64 [B]: argmax(logits) for greedy rows (temperature 0, or all with greedy_only), else
    argmax(logits / max(T, 1e-6) + gumbel(seed, position, token)).

    Small batches split each row into chunks scanned by separate programs; the chunk winners are
    merged with torch.argmax, which keeps the lowest index on ties like a single scan does.
    """
    _check_logits(logits)
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    if greedy_only:  # the other tensors are not read
        temperature = seeds = positions = out
    chunks = num_chunks if num_chunks is not None else _vocab_chunks(B, V, logits.device)
    chunk = triton.cdiv(triton.cdiv(V, max(chunks, 1)), VOCAB_BLOCK) * VOCAB_BLOCK
    chunks = triton.cdiv(V, chunk)
    if chunks == 1:
        _gumbel_sample_kernel[(B,)](
            logits, logits.stride(0), V, temperature, seeds, positions, out,
            GREEDY_ONLY=greedy_only, BLOCK=VOCAB_BLOCK, num_warps=8,
        )
        return out
    vals = torch.empty((B, chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((B, chunks), dtype=torch.int32, device=logits.device)
    _gumbel_chunk_kernel[(B, chunks)](
        logits, logits.stride(0), V, chunk, temperature, seeds, positions, vals, idx,
        GREEDY_ONLY=greedy_only, BLOCK=VOCAB_BLOCK, num_warps=8,
    )
    return idx.gather(1, vals.argmax(dim=1, keepdim=True))[:, 0].to(torch.int64)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


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
    the unprocessed logits. Allocates the four outputs (plus an lse buffer); topk is torch's."""
    _check_logits(raw_logits)
    B, V = raw_logits.shape
    device = raw_logits.device
    lse = torch.empty(B, dtype=torch.float32, device=device)
    logprob = torch.empty(B, dtype=torch.float32, device=device)
    rank = torch.empty(B, dtype=torch.int64, device=device)
    if B > 0:
        _lse_rank_kernel[(B,)](raw_logits, raw_logits.stride(0), V, sampled, lse, logprob, rank,
                               BLOCK=VOCAB_BLOCK, num_warps=8)
    if num_top > 0:
        top_vals, top_ids = raw_logits.topk(num_top, dim=-1)
        top_logprobs = top_vals - lse.to(raw_logits.dtype)[:, None]
    else:
        top_ids, top_logprobs = sampled[:, None][:, :0], raw_logits[:, :0]
    return logprob.to(raw_logits.dtype), rank, top_ids, top_logprobs
