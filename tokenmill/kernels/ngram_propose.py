"""N-gram prompt lookup: draft tokens copied from earlier in a request's own history.

For batch entry b (row r = idx_mapping[b], history h = token_table[r, :L] with L = num_tokens[r]):
for n from max_n down to min_n, the n-gram h[L-n:L] is looked up among the earlier n-grams
h[s:s+n], s < L - n (an occurrence may overlap the suffix itself). The largest n with a match wins,
and among its matches the latest one (the largest s). The draft is what followed it,
h[s+n : min(s+n+k, L)]: at least one token, at most k, never past the current end. No match (or a
history shorter than min_n + 1) gives no draft. Outputs: draft_ids [num_reqs, k] (padding -1) and
num_drafts [num_reqs] int32.

One pass finds it: for each candidate end e < L - 1 let m(e) be how many tokens ending at e agree
with those ending at L - 1 (capped at max_n). The chosen n is min(max_n, max m) when that is at
least min_n, and the chosen end is the latest e with m(e) >= n. The Triton kernel (one program per
entry) scans blocks of ends from the last one back and stops at the first full-length match, so a
history of L tokens costs O(L * max_n) loads at worst; the torch version computes m for every end
at once; ngram_propose_ref is the plain-Python definition the two are tested against.
"""

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from tokenmill.kernels._dispatch import use_triton

BLOCK_E = 256  # candidate n-gram ends per step of the kernel's backward scan


def _check_args(k: int, min_n: int, max_n: int) -> None:
    if k < 1 or not 1 <= min_n <= max_n:
        raise ValueError(f"need k >= 1 and 1 <= min_n <= max_n (got k={k}, min_n={min_n}, max_n={max_n})")


def ngram_lookup(history: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The draft for one history (a list of token ids): see the module docstring."""
    _check_args(k, min_n, max_n)
    h = list(history)
    L = len(h)
    for n in range(max_n, min_n - 1, -1):
        suffix = h[L - n:] if L > n else None
        for s in range(L - n - 1, -1, -1):
            if h[s:s + n] == suffix:
                return h[s + n:min(s + n + k, L)]
    return []


def ngram_propose_ref(idx_mapping: torch.Tensor, num_reqs: int, token_table: torch.Tensor,
                      num_tokens: torch.Tensor, k: int, min_n: int, max_n: int):
    """Plain-Python reference over the batch: (draft_ids [num_reqs, k] int32, num_drafts [num_reqs] int32)."""
    rows = idx_mapping[:num_reqs].tolist()
    lengths = num_tokens.tolist()
    draft_ids = torch.full((num_reqs, k), -1, dtype=torch.int32)
    num_drafts = torch.zeros(num_reqs, dtype=torch.int32)
    for b, r in enumerate(rows):
        draft = ngram_lookup(token_table[r, :lengths[r]].tolist(), k, min_n, max_n)
        draft_ids[b, :len(draft)] = torch.tensor(draft, dtype=torch.int32)
        num_drafts[b] = len(draft)
    return draft_ids.to(token_table.device), num_drafts.to(token_table.device)


def _match_lengths(hist: torch.Tensor, lengths: torch.Tensor, max_n: int) -> torch.Tensor:
    """m[b, e]: tokens ending at e that agree with those ending at lengths[b] - 1 (capped at max_n;
    0 for ends that are not earlier than lengths[b] - 1)."""
    width = hist.shape[1]
    ends = torch.arange(width, device=hist.device)
    alive = ends[None, :] < (lengths[:, None] - 1)
    m = torch.zeros(hist.shape, dtype=torch.int32, device=hist.device)
    for i in range(max_n):
        pos = ends - i
        suffix_tok = hist.gather(1, (lengths[:, None] - 1 - i).clamp(min=0))
        alive = alive & (pos >= 0)[None, :] & (hist[:, pos.clamp(min=0)] == suffix_tok)
        m += alive.int()
    return m


def ngram_propose_torch(idx_mapping: torch.Tensor, num_reqs: int, token_table: torch.Tensor,
                        num_tokens: torch.Tensor, k: int, min_n: int, max_n: int):
    """Vectorised torch version (all entries and all ends at once; no host reads)."""
    _check_args(k, min_n, max_n)
    rows = idx_mapping[:num_reqs].long()
    hist = token_table[rows].long()
    lengths = num_tokens.long()[rows].clamp(max=token_table.shape[1])
    m = _match_lengths(hist, lengths, max_n)
    n = m.max(dim=1).values
    ends = torch.arange(hist.shape[1], device=hist.device)
    start = torch.where(m >= n[:, None], ends[None, :], -1).max(dim=1).values + 1
    count = torch.where(n >= min_n, torch.clamp(lengths - start, max=k), 0)
    cols = start[:, None] + torch.arange(k, device=hist.device)[None, :]
    drafts = hist.gather(1, cols.clamp(max=hist.shape[1] - 1))
    keep = torch.arange(k, device=hist.device)[None, :] < count[:, None]
    draft_ids = torch.where(keep, drafts, -1).to(torch.int32)
    return draft_ids, count.to(torch.int32)


@triton.jit
def _match_lengths_block(row_ptr, e, L, MAX_N: tl.constexpr):
    """m(e) for a block of candidate ends e (0 where e is not an earlier end)."""
    alive = (e >= 0) & (e < L - 1)
    m = tl.zeros(e.shape, dtype=tl.int32)
    for i in tl.static_range(MAX_N):
        pos = e - i
        ok = alive & (pos >= 0)
        ref = tl.load(row_ptr + tl.maximum(L - 1 - i, 0))
        tok = tl.load(row_ptr + pos, mask=ok, other=0)
        alive = ok & (tok == ref)
        m += alive.to(tl.int32)
    return m


@triton.jit(do_not_specialize=["k"])
def _ngram_propose_kernel(idx_mapping_ptr, token_table_ptr, num_tokens_ptr, draft_ids_ptr, num_drafts_ptr,
                          table_width, stride_tt, stride_d, k, MIN_N: tl.constexpr, MAX_N: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(0)
    r = tl.load(idx_mapping_ptr + b).to(tl.int64)
    L = tl.minimum(tl.load(num_tokens_ptr + r).to(tl.int64), table_width)
    row_ptr = token_table_ptr + r * stride_tt
    lanes = tl.arange(0, BLOCK_E)
    best_n = tl.full([], MIN_N - 1, tl.int32)  # only matches of at least MIN_N tokens count
    best_end = L * 0 - 1
    hi = L - 2  # the latest candidate end
    while (hi >= 0) & (best_n < MAX_N):
        e = hi - lanes  # lane 0 holds the latest end of the block
        m = _match_lengths_block(row_ptr, e, L, MAX_N)
        block_n = tl.max(m, axis=0)
        latest = tl.max(tl.where(m >= block_n, e, -1), axis=0)
        better = block_n > best_n  # an equal length found earlier (scanning back) is later: keep it
        best_end = tl.where(better, latest, best_end)
        best_n = tl.where(better, block_n, best_n)
        hi -= BLOCK_E
    start = best_end + 1
    count = tl.where(best_n >= MIN_N, tl.minimum(L - start, k), 0)
    j = tl.arange(0, BLOCK_K)
    keep = j < count
    drafts = tl.load(row_ptr + start + j, mask=keep, other=-1)
    tl.store(draft_ids_ptr + b * stride_d + j, drafts.to(draft_ids_ptr.dtype.element_ty), mask=j < k)
    tl.store(num_drafts_ptr + b, count.to(num_drafts_ptr.dtype.element_ty))


def ngram_propose_triton(idx_mapping: torch.Tensor, num_reqs: int, token_table: torch.Tensor,
                         num_tokens: torch.Tensor, k: int, min_n: int, max_n: int,
                         draft_ids: Optional[torch.Tensor] = None, num_drafts: Optional[torch.Tensor] = None,
                         block_e: int = BLOCK_E):
    """One program per entry; writes (and returns) draft_ids [num_reqs, k] and num_drafts [num_reqs]
    (allocated when not given; int32 or int64). Recompiles only for a new (min_n, max_n, k's power of 2)."""
    _check_args(k, min_n, max_n)
    assert token_table.dim() == 2 and token_table.stride(1) == 1, "token_table must have unit column stride"
    assert idx_mapping.dim() == 1 and num_tokens.dim() == 1
    device = token_table.device
    if draft_ids is None:
        draft_ids = torch.empty((num_reqs, k), dtype=torch.int32, device=device)
    if num_drafts is None:
        num_drafts = torch.empty(num_reqs, dtype=torch.int32, device=device)
    assert draft_ids.shape[0] >= num_reqs and draft_ids.shape[1] >= k and draft_ids.stride(1) == 1
    if num_reqs > 0:
        _ngram_propose_kernel[(num_reqs,)](
            idx_mapping, token_table, num_tokens, draft_ids, num_drafts,
            token_table.shape[1], token_table.stride(0), draft_ids.stride(0), k,
            MIN_N=min_n, MAX_N=max_n, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(k), num_warps=4,
        )
    return draft_ids[:num_reqs, :k], num_drafts[:num_reqs]


def ngram_propose(idx_mapping: torch.Tensor, num_reqs: int, token_table: torch.Tensor,
                  num_tokens: torch.Tensor, k: int, min_n: int, max_n: int,
                  draft_ids: Optional[torch.Tensor] = None, num_drafts: Optional[torch.Tensor] = None):
    """Triton on CUDA, the torch version elsewhere. With out tensors given, the results land in them."""
    if use_triton(token_table):
        return ngram_propose_triton(idx_mapping, num_reqs, token_table, num_tokens, k, min_n, max_n,
                                    draft_ids, num_drafts)
    ids, counts = ngram_propose_torch(idx_mapping, num_reqs, token_table, num_tokens, k, min_n, max_n)
    if draft_ids is None:
        return ids, counts
    draft_ids[:num_reqs, :k].copy_(ids)
    num_drafts[:num_reqs].copy_(counts)
    return draft_ids[:num_reqs, :k], num_drafts[:num_reqs]
