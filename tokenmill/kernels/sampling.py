"""Sampling ops over a batch of logits [B, V], each row reading its request's parameters.

Logits may be float32, bfloat16 or float16; every op computes in float32 (the in-place ones round
their result back to the logits' dtype once).

The noise of Gumbel-max sampling is a stateless hash of (request seed, position, token id), so a
seeded request samples the same tokens whatever else is in the batch, and no softmax over the
vocabulary is ever materialised for sampling: the sample is argmax(logits + T * gumbel), which for
T > 0 is argmax(logits / T + gumbel) scaled by T, i.e. a draw from softmax(logits / T). Multiplying
the noise instead of dividing the logits saves the kernel an IEEE division per element.

The hash works on 32-bit unsigned words. The torch reference emulates them in int64 with
multipliers below 2**31, so every product fits and both implementations agree bit for bit.
"""


from typing import Optional

import torch

from tokenmill.kernels._dispatch import use_triton

MASK32 = 0xFFFFFFFF
MUL_A = 0x7FEB352D
MUL_B = 0x2C1B3C6D
GOLDEN = 0x9E3779B1


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix (xorshift-multiply rounds), on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * MUL_A) & MASK32
    x = x ^ (x >> 15)
    x = (x * MUL_B) & MASK32
    return x ^ (x >> 16)


def row_keys_ref(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per (seed, position): int64 tensors in, int64 (uint32 values) out."""
    seeds = seeds.long()
    lo, hi = seeds & MASK32, (seeds >> 32) & MASK32
    key = _mix32(lo ^ _mix32(hi))
    return _mix32(key ^ (positions.long() & MASK32))


def gumbel_from_bits_ref(bits: torch.Tensor) -> torch.Tensor:
    """float32 Gumbel(0, 1) noise from uint32 hash values (held in int64), always finite.

    u takes the 2**23 values (k + 0.5) / 2**23, all exact in float32 and inside (0, 1). (With 24
    bits, the top value 1 - 2**-25 would round to 1.0 and give +inf noise: one token in 2**24.)"""
    u = (bits >> 9).float() * (1.0 / (1 << 23)) + (0.5 / (1 << 23))
    return -torch.log(-torch.log(u))


def gumbel_noise_ref(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 Gumbel(0, 1) noise from (seed, position, token id)."""
    keys = row_keys_ref(seeds, positions)[:, None]
    tokens = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)[None, :]
    return gumbel_from_bits_ref(_mix32(keys ^ ((tokens * GOLDEN) & MASK32)))


def apply_penalties_ref(logits, output_counts, prompt_mask, repetition, frequency, presence) -> None:
    """In place. repetition applies to tokens seen in prompt or output (HF's rule: divide positive
    logits, multiply negative ones); frequency and presence (OpenAI's) to output tokens only."""
    x = logits.float()
    seen_out = output_counts > 0
    seen = seen_out | prompt_mask if prompt_mask is not None else seen_out
    rep = repetition.float()[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - (frequency.float()[:, None] * output_counts.float() + presence.float()[:, None] * seen_out.float())
    logits.copy_(x)


def apply_top_k_top_p_min_p_ref(logits, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor],
                                min_p: Optional[torch.Tensor]) -> None:
    """In place: -inf outside each row's allowed set. top_k 0 / top_p 1 / min_p 0 mean off."""
    x = logits.float()  # the thresholds and the top-p mass in float32; kept values are untouched
    if min_p is not None:
        threshold = x.max(dim=-1, keepdim=True).values + torch.log(min_p.float().clamp(min=1e-30))[:, None]
        logits.masked_fill_((x < threshold) & (min_p[:, None] > 0), float("-inf"))
        x = logits.float()
    if top_k is None and top_p is None:
        return
    sorted_logits, order = x.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        drop |= torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        # Keep the smallest prefix whose mass reaches top_p; top_p = 1 is off (rounding in the
        # cumulative sum must not drop the tail).
        drop |= (before >= top_p[:, None]) & (top_p[:, None] < 1)
    logits.scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")).to(logits.dtype))


def gumbel_sample_ref(logits, temperature, seeds, positions, greedy_only: bool = False) -> torch.Tensor:
    """int64 [B]: argmax(logits + T * gumbel) in float32, rounding the product and then the sum.
    The noise is finite, so rows with temperature 0 (and greedy_only) take plain argmax(logits);
    ties go to the lowest index."""
    x = logits.float()
    if greedy_only:
        return x.argmax(dim=-1)
    noise = gumbel_noise_ref(seeds, positions, x.shape[-1])
    return (x + temperature.float()[:, None] * noise).argmax(dim=-1)


_ROW_CHUNK = 256


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp(x, -1) of [B, V] float32, each row summed the same way whatever B is: torch on
    the CPU splits the reduction of a lone long row over threads (another order than for B rows),
    so the exponentials are summed in chunks of _ROW_CHUNK columns (padded with zeros), then the
    chunk sums."""
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows of -inf (or inf) keep torch's result
    e = torch.exp(x - m)
    pad = -e.shape[-1] % _ROW_CHUNK
    if pad:
        e = torch.nn.functional.pad(e, (0, pad))
    total = e.view(e.shape[0], -1, _ROW_CHUNK).sum(dim=-1).sum(dim=-1)
    return torch.log(total) + m[:, 0]


def logprobs_ref(raw_logits, sampled, num_top: int):
    """From unprocessed logits: the sampled token's logprob and rank, and the top-`num_top` pairs;
    logprobs are float32 whatever the logits' dtype."""
    x = raw_logits.float()
    lse = logsumexp_rows(x)
    chosen = x.gather(1, sampled.long()[:, None])[:, 0]
    rank = (x > chosen[:, None]).sum(dim=-1) + 1
    # topk in the logits' own dtype, as the Triton path does (same values; same order among ties).
    top_vals, top_ids = raw_logits.topk(num_top, dim=-1) if num_top > 0 else (x[:, :0], sampled[:, None][:, :0])
    return chosen - lse, rank, top_ids, top_vals.float() - lse[:, None]


def gumbel_sample(logits, temperature, seeds, positions, greedy_only: bool = False) -> torch.Tensor:
    if use_triton(logits):
        from tokenmill.kernels.sampling_triton import gumbel_sample_triton

        return gumbel_sample_triton(logits, temperature, seeds, positions, greedy_only)
    return gumbel_sample_ref(logits, temperature, seeds, positions, greedy_only)


def apply_penalties(logits, output_counts, prompt_mask, repetition, frequency, presence) -> None:
    if use_triton(logits):
        from tokenmill.kernels.sampling_triton import apply_penalties_triton

        apply_penalties_triton(logits, output_counts, prompt_mask, repetition, frequency, presence)
    else:
        apply_penalties_ref(logits, output_counts, prompt_mask, repetition, frequency, presence)


def apply_top_k_top_p_min_p(logits, top_k, top_p, min_p) -> None:
    if use_triton(logits):
        from tokenmill.kernels.sampling_triton import apply_top_k_top_p_min_p_triton

        apply_top_k_top_p_min_p_triton(logits, top_k, top_p, min_p)
    else:
        apply_top_k_top_p_min_p_ref(logits, top_k, top_p, min_p)


def logprobs(raw_logits, sampled, num_top: int):
    if use_triton(raw_logits):
        from tokenmill.kernels.sampling_triton import logprobs_triton

        return logprobs_triton(raw_logits, sampled, num_top)
    return logprobs_ref(raw_logits, sampled, num_top)



