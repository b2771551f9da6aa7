"""Banning bad words' last tokens (SamplingParams.bad_words): -inf at token last[b, s] of logits
row b when the tokens before the sampled one end with the word's other tokens.

A word of m tokens is stored right-aligned in the L columns of prefix[b, s] (its first m - 1
tokens; WILDCARD to the left of them) with its last token in last[b, s] (-1: no word). history[b]
holds the L tokens before the sampled one, oldest first (NO_TOKEN where the sequence has none, so
it matches no word). A word of one token has a prefix of wildcards only: it is banned always.

ban_bad_words is the vectorised torch version (device ops only, no host read: compare, reduce,
then one scatter with amin, so that duplicates and padding never undo a ban); ban_bad_words_ref
is a plain loop over rows and words, for the tests.

apply_bad_words is the sampler stage's whole step over per-request tables (runner/sample/
token_mask.py): it first records each tracked row's newest token in the row's history ring (the
token at position p - 1 sits in column (p - 1) % RING; it comes from last_sampled when p - 1 is at
or past what was known at admission), then reads the ring and bans. apply_bad_words_ref does it
in torch ops (about thirty launches); the Triton kernel (token_mask_triton.py) in one.
"""

from typing import Optional

import torch

from tokenmill.kernels._dispatch import use_triton
from tokenmill.kernels.token_mask_triton import NO_TOKEN, WILDCARD, apply_bad_words_triton



def ban_bad_words(logits: torch.Tensor, history: torch.Tensor, prefix: torch.Tensor, last: torch.Tensor) -> None:
    """logits [B, V] float (written in place); history [B, L], prefix [B, S, L], last [B, S] integers."""
    if last.shape[1] == 0:
        return
    hits = (prefix == history[:, None, :].to(prefix.dtype)) | (prefix == WILDCARD)
    banned = hits.all(dim=-1) & (last >= 0)
    inf = torch.full(banned.shape, float("inf"), dtype=logits.dtype, device=logits.device)
    logits.scatter_reduce_(1, last.clamp(min=0).long(), torch.where(banned, -inf, inf), reduce="amin")


def ban_bad_words_ref(logits: torch.Tensor, history: torch.Tensor, prefix: torch.Tensor, last: torch.Tensor) -> None:
    for b in range(logits.shape[0]):
        before = history[b].tolist()
        for s in range(last.shape[1]):
            token = int(last[b, s])
            if token < 0:
                continue
            word = [t for t in prefix[b, s].tolist() if t != WILDCARD]
            if not word or before[len(before) - len(word):] == word:
                logits[b, token] = float("-inf")


def apply_bad_words_ref(logits: torch.Tensor, idx: torch.Tensor, positions: torch.Tensor, known: torch.Tensor,
                        last_sampled: torch.Tensor, ring: Optional[torch.Tensor], prefix: torch.Tensor,
                        last: torch.Tensor, count: int, length: int) -> None:
    """logits [B, V] float (written in place); idx [B] request rows; positions [B] the sampled
    token's; known [R] tokens known at admission (a huge value for rows without a history);
    last_sampled [R]; ring [R, RING] int32, written (None when length is 0); prefix [R, S, L] and
    last [R, S] int32 (the words); count <= S and length <= L: the words and prefix columns to read."""
    if length:
        width = ring.shape[1]
        positions = positions.long()
        prev = positions - 1
        fresh = prev >= known[idx]
        col = prev.clamp(min=0) % width
        ring[idx, col] = torch.where(fresh, last_sampled[idx].to(ring.dtype), ring[idx, col])
        at = positions[:, None] + torch.arange(-length, 0, device=positions.device)
        tokens = ring[idx[:, None], at.clamp(min=0) % width]
        history = torch.where(at >= 0, tokens, torch.full_like(tokens, NO_TOKEN))
    else:
        history = torch.empty((idx.shape[0], 0), dtype=torch.int32, device=logits.device)
    heads = prefix[idx, :count, prefix.shape[2] - length:]
    ban_bad_words(logits, history, heads, last[idx, :count])


def apply_bad_words(logits: torch.Tensor, idx: torch.Tensor, positions: torch.Tensor, known: torch.Tensor,
                    last_sampled: torch.Tensor, ring: Optional[torch.Tensor], prefix: torch.Tensor,
                    last: torch.Tensor, count: int, length: int) -> None:
    if use_triton(logits):
        apply_bad_words_triton(logits, idx, positions, known, last_sampled, ring, prefix, last, count, length)
    else:
        apply_bad_words_ref(logits, idx, positions, known, last_sampled, ring, prefix, last, count, length)
