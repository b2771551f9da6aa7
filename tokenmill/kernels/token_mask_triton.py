"""Triton version of apply_bad_words: one program per logits row records the row's newest token in
its history ring, then compares every word's prefix with the ring (a vector over the words, one
column at a time) and writes -inf at the last token of each word that matches. Only -inf is ever
stored, so rows of one request (or words sharing a last token) never undo each other's bans."""

from typing import Optional

import torch
import triton
import triton.language as tl

WILDCARD = -1  # a prefix column left of a shorter word's tokens: matches anything
NO_TOKEN = -2  # a history column before the sequence's first token: matches no token


# The word count and prefix length change from batch to batch: not specialised, so one compile.
@triton.jit(do_not_specialize=["count", "length", "ring_width"])
def _bad_words_kernel(logits_ptr, idx_ptr, pos_ptr, known_ptr, last_sampled_ptr, ring_ptr, prefix_ptr, last_ptr,
                      count, length, ring_width, stride_logits, NUM_WORDS: tl.constexpr,
                      PREFIX: tl.constexpr, BLOCK_S: tl.constexpr, WILD: tl.constexpr, NONE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(idx_ptr + b).to(tl.int64)
    prev = tl.load(pos_ptr + b).to(tl.int64) - 1
    newest = tl.full((), NONE, tl.int32)
    if length > 0:
        slot = ring_ptr + row * ring_width + tl.maximum(prev, 0) % ring_width
        newest = tl.load(slot)
        if prev >= tl.load(known_ptr + row):  # a token sampled since admission: last_sampled holds it
            newest = tl.load(last_sampled_ptr + row).to(tl.int32)
            tl.store(slot, newest)
    s = tl.arange(0, BLOCK_S)
    in_s = s < count
    token = tl.load(last_ptr + row * NUM_WORDS + s, mask=in_s, other=-1)
    hit = in_s & (token >= 0)
    for j in range(0, length):  # the token at position prev - j against prefix column PREFIX - 1 - j
        q = prev - j
        h = tl.load(ring_ptr + row * ring_width + tl.maximum(q, 0) % ring_width)
        h = tl.where(j == 0, newest, h)  # (the slot this program just wrote: no reload)
        h = tl.where(q >= 0, h, NONE)
        head = tl.load(prefix_ptr + row * (NUM_WORDS * PREFIX) + s * PREFIX + (PREFIX - 1 - j), mask=in_s, other=WILD)
        hit = hit & ((head == WILD) | (head == h))
    tl.store(logits_ptr + b * stride_logits + token, float("-inf"), mask=hit)


def apply_bad_words_triton(logits: torch.Tensor, idx: torch.Tensor, positions: torch.Tensor, known: torch.Tensor,
                           last_sampled: torch.Tensor, ring: Optional[torch.Tensor], prefix: torch.Tensor,
                           last: torch.Tensor, count: int, length: int) -> None:
    """As apply_bad_words_ref; logits [B, V] with stride 1 along V; the tables contiguous."""
    b = logits.shape[0]
    if b == 0 or count == 0:
        return
    num_words, width = last.shape[1], prefix.shape[2]
    assert logits.stride(1) == 1 and prefix.is_contiguous() and last.is_contiguous()
    assert prefix.dtype == last.dtype == torch.int32
    if ring is None or last_sampled is None:  # no row keeps a history: neither is read
        assert length == 0
        ring, last_sampled = last, known
    assert ring.is_contiguous() and ring.dtype == torch.int32
    _bad_words_kernel[(b,)](logits, idx, positions, known, last_sampled, ring, prefix, last, count, length,
                            ring.shape[1], logits.stride(0), NUM_WORDS=num_words, PREFIX=width,
                            BLOCK_S=triton.next_power_of_2(num_words), WILD=WILDCARD, NONE=NO_TOKEN)
