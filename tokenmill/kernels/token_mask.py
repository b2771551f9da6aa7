"""Banning bad words' last tokens (SamplingParams.bad_words): -inf at token last[b, s] of logits
row b when the tokens before the sampled one end with the word's other tokens.

A word of m tokens is stored right-aligned in the L columns of prefix[b, s] (its first m - 1
tokens; WILDCARD to the left of them) with its last token in last[b, s] (-1: no word). history[b]
holds the L tokens before the sampled one, oldest first (NO_TOKEN where the sequence has none, so
it matches no word). A word of one token has a prefix of wildcards only: it is banned always.

ban_bad_words is the vectorised torch version (device ops only, no host read: compare, reduce,
then one scatter with amin, so that duplicates and padding never undo a ban); ban_bad_words_ref
is a plain loop over rows and words, for the tests.
"""

import torch

WILDCARD = -1  # a prefix column left of a shorter word's tokens: matches anything
NO_TOKEN = -2  # a history column before the sequence's first token: matches no token


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
