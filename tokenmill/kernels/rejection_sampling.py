"""Rejection sampling for speculative decoding: which draft tokens a target model accepts, and the
token it emits after them, lossless with respect to the target distribution.

Layout. Request b owns the logits rows cu_num_logits[b] .. cu_num_logits[b+1] - 1 of `logits`
[num_logits, V]: its n_b = cu[b+1] - cu[b] - 1 draft positions, then one bonus position. Its drafts
are draft_token_ids[b, :n_b] (of [B, k], n_b <= k; valid token ids, since the kernel reads them
unchecked; padded with anything past n_b, e.g. -1). The draft probabilities,
when there are any, are `draft_probs` [num_logits - B, V], one row per draft position in the same
order: request b's draft i is row cu[b] - b + i. `temperature`, `seeds` and `positions` are per
logits row ([num_logits] each): the noise scale the Gumbel sampler would use for that row (0:
greedy), the request's seed and the position the row's token takes.

Uniform layout (num_drafts). A CUDA graph of a verify step gives every request the same number of
rows, 1 + k, whatever its number of drafts; `num_drafts` [B] int32 on the device then says how many
each has. Request b uses n_b = min(num_drafts[b], rows_b - 1) drafts (rows_b = cu[b+1] - cu[b]): rows
cu[b] .. cu[b] + n_b - 1 are its draft positions, row cu[b] + n_b its bonus position, and its
remaining rows, their draft ids (e.g. -1) and their draft-probability rows are never read. The
draft-probability rows keep their places (request b's draft i: row cu[b] - b + i). Without
num_drafts, n_b = rows_b - 1: the compact layout above. A request gets the same tokens in both
layouts when its used rows carry the same logits, temperatures, seeds and positions.

The logits are the target's after every sampling stage (penalties, temperature and top-k/top-p/
min-p masks...), in float32 or the model's dtype: the target distribution of a row is
p = softmax(logits / T) with T its temperature, exactly what plain Gumbel sampling draws from.

Per request, drafts are checked in order until one is rejected:
  greedy rows (T = 0)  accept while draft == argmax(row); the first mismatch emits the argmax.
  sampled rows         accept draft d with probability min(1, p(d) / q(d)), by a uniform u from the
                       stateless hash (accept iff u * q(d) * S < exp(z_d - max z), z = x / T,
                       S = sum exp(z - max z)); q(d) = 1 without draft_probs (n-gram drafts are
                       deterministic: q is one-hot). A rejection emits a sample of the residual
                       max(0, p - q), normalised, by Gumbel-max: argmax(log(exp(z - max z) - q S)+ g)
                       with draft_probs, argmax(x + T g) over the tokens other than d without; if
                       the residual is empty (rounding), a sample of p: argmax(x + T g).
  all accepted         the bonus row is sampled as plain sampling would: argmax(x + T g0), with the
                       Gumbel sampler's own noise g0 at that (seed, position), so a request with no
                       drafts gets exactly plain sampling's token.
Noise streams, all stateless hashes of (seed, position): g0 (kernels/sampling.py) at the bonus row;
the acceptance uniform from the row key mixed with ACCEPT_SALT; the residual's Gumbel noise g from
the row key mixed with RESIDUAL_SALT. The three are independent of each other, and of a draft model
that samples with the plain stream g0 at the draft's own position.

synthetic_acceptance = A (a benchmark mode for random weights) replaces every accept decision, greedy
or sampled, by u < A; what a rejection emits is chosen as above.

Outputs: sampled [B, k + 1] int64 (the accepted drafts, then the emitted token, then -1) and
num_emitted [B] int32 (accepted + 1). The Triton kernel (CUDA) reads no device value on the host.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from tokenmill.kernels._dispatch import use_triton
from tokenmill.kernels.sampling import GOLDEN, MASK32, _mix32, gumbel_from_bits_ref, gumbel_sample_ref, row_keys_ref
from tokenmill.kernels.sampling_triton import NEG_INF, _argmax_chunk, _gumbel, _mix32 as _mix32_tl, _row_key

ACCEPT_SALT = 0x5BD1E995  # row key ^ salt, mixed: the acceptance uniform's bits
RESIDUAL_SALT = 0x27D4EB2F  # row key ^ salt, mixed: the key of the residual's Gumbel noise
VOCAB_BLOCK = 1024  # vocabulary elements per loop step of the kernel
_ACCEPT_SALT = tl.constexpr(ACCEPT_SALT)
_RESIDUAL_SALT = tl.constexpr(RESIDUAL_SALT)


# ----------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------


def _noise_from_keys(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    tokens = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)[None, :]
    return gumbel_from_bits_ref(_mix32(keys[:, None] ^ ((tokens * GOLDEN) & MASK32)))


def uniform_from_bits_ref(bits: torch.Tensor) -> torch.Tensor:
    """float32 uniforms (k + 0.5) / 2**23, k = bits >> 9: the u of gumbel_from_bits_ref, in (0, 1)."""
    return (bits >> 9).float() * (1.0 / (1 << 23)) + (0.5 / (1 << 23))


def _row_layout(cu: torch.Tensor, num_logits: int, num_drafts: Optional[torch.Tensor]):
    """Per logits row: its request, its index j among the request's rows, and the request's number
    of drafts n (the row is a draft row if j < n, the bonus row if j == n, unused past it)."""
    cu = cu.long()
    counts = cu[1:] - cu[:-1]
    req = torch.repeat_interleave(torch.arange(len(counts), device=cu.device), counts, output_size=num_logits)
    j = torch.arange(num_logits, device=cu.device) - cu[req]
    n = counts - 1
    if num_drafts is not None:
        n = torch.minimum(num_drafts.long().clamp(min=0), n)
    return req, j, n[req]


def _softmax_parts(x: torch.Tensor, t: torch.Tensor):
    """exp(z - max z) and its row sums, z = x / T (T = 1 for greedy rows)."""
    z = x / torch.where(t > 0, t, torch.ones_like(t))[:, None]
    top = z.max(dim=-1, keepdim=True).values
    e = torch.exp(z - torch.where(top == float("-inf"), torch.zeros_like(top), top))
    return e, e.sum(dim=-1)


def _residual_ref(x, t, keys, drafts, e, total, q: Optional[torch.Tensor]) -> torch.Tensor:
    """[N] the token each row emits if its draft is rejected (sampled rows)."""
    g = _noise_from_keys(_mix32(keys ^ RESIDUAL_SALT), x.shape[-1])
    noisy = x + t[:, None] * g
    if q is None:
        resid = noisy.scatter(1, drafts[:, None], float("-inf"))
    else:
        resid = torch.log(torch.clamp(e - q * total[:, None], min=0.0)) + g
    best = resid.max(dim=-1).values
    return torch.where(best > float("-inf"), resid.argmax(dim=-1), noisy.argmax(dim=-1))


def _row_decisions(x, drafts, q, t, keys, synthetic_acceptance):
    """Per logits row: whether its draft is accepted, and the token it emits when rejected."""
    top = x.argmax(dim=-1)
    u = uniform_from_bits_ref(_mix32(keys ^ ACCEPT_SALT))
    e, total = _softmax_parts(x, t)
    e_d = e.gather(1, drafts[:, None])[:, 0]
    q_d = q.gather(1, drafts[:, None])[:, 0] if q is not None else torch.ones_like(u)
    greedy = t == 0
    accept = torch.where(greedy, drafts == top, u * q_d * total < e_d)
    if synthetic_acceptance is not None:
        accept = u < synthetic_acceptance
    recovered = torch.where(greedy, top, _residual_ref(x, t, keys, drafts, e, total, q))
    return accept, recovered


def rejection_sample_ref(logits: torch.Tensor, cu_num_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                         draft_probs: Optional[torch.Tensor], temperature: torch.Tensor, seeds: torch.Tensor,
                         positions: torch.Tensor, synthetic_acceptance: Optional[float] = None,
                         num_drafts: Optional[torch.Tensor] = None):
    """(sampled [B, k + 1] int64, num_emitted [B] int32): see the module docstring. Vectorised
    over all rows; it syncs with the host (repeat_interleave), so it is the CPU path only."""
    x = logits.float()
    N, V = x.shape
    B, K = draft_token_ids.shape
    req, j, n = _row_layout(cu_num_logits, N, num_drafts)
    bonus, not_draft = j == n, j >= n
    padded = torch.cat([draft_token_ids.long(), draft_token_ids.new_zeros(B, 1).long()], dim=1)
    drafts = torch.where(not_draft, 0, padded[req, j.clamp(max=K)]).clamp(0, V - 1)
    q = None
    if draft_probs is not None:
        q_rows = torch.where(not_draft, draft_probs.shape[0], torch.arange(N, device=x.device) - req)
        q = torch.cat([draft_probs.float(), x.new_zeros(1, V)])[q_rows]
    t = temperature.float()
    accept, recovered = _row_decisions(x, drafts, q, t, row_keys_ref(seeds, positions), synthetic_acceptance)
    emitted = torch.where(bonus, gumbel_sample_ref(x, t, seeds, positions), recovered)
    table = torch.zeros(B, K + 1, dtype=torch.bool, device=x.device)
    table[req, j] = accept & ~not_draft
    num_acc = table.long().cumprod(dim=1).sum(dim=1)
    token = emitted[cu_num_logits[:-1].long() + num_acc]
    cols = torch.arange(K + 1, device=x.device)[None, :]
    out = torch.where(cols < num_acc[:, None], padded, torch.where(cols == num_acc[:, None], token[:, None], -1))
    return out, (num_acc + 1).to(torch.int32)


# ----------------------------------------------------------------------------------------------
# Triton: one program per request
# ----------------------------------------------------------------------------------------------


@triton.jit
def _uniform(key):
    """uniform_from_bits_ref of the key's acceptance bits, by the mantissa trick of _gumbel."""
    bits = _mix32_tl(key ^ _ACCEPT_SALT)
    return ((bits >> 9) | 0x3F800000).to(tl.float32, bitcast=True) - (1.0 - 1.0 / 16777216.0)


@triton.jit
def _softmax_stats(row_ptr, V, t, BLOCK: tl.constexpr):
    """(max z, sum exp(z - max z)) of z = x / t, each lane keeping an online (max, sum)."""
    lanes = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], NEG_INF, tl.float32)
    run_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + lanes
        z = tl.math.div_rn(tl.load(row_ptr + cols, mask=cols < V, other=NEG_INF).to(tl.float32), t)
        new_max = tl.maximum(run_max, z)
        shift = tl.where(new_max == NEG_INF, 0.0, new_max)  # keeps exp() away from inf - inf
        run_sum = run_sum * tl.exp(run_max - shift) + tl.exp(z - shift)
        run_max = new_max
    top = tl.max(run_max, axis=0)
    top = tl.where(top == NEG_INF, 0.0, top)
    return top, tl.sum(run_sum * tl.exp(run_max - top), axis=0)


@triton.jit
def _residual_token(row_ptr, q_row_ptr, V, d, key, t, z_max, total, HAS_Q: tl.constexpr, BLOCK: tl.constexpr):
    """_residual_ref for one row: Gumbel-max of the residual, else (empty residual) of p."""
    rkey = _mix32_tl(key ^ _RESIDUAL_SALT)
    lanes = tl.arange(0, BLOCK)
    best_r = tl.full([BLOCK], NEG_INF, tl.float32)
    best_p = tl.full([BLOCK], NEG_INF, tl.float32)
    idx_r = tl.zeros([BLOCK], tl.int32)
    idx_p = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + lanes
        valid = cols < V
        x = tl.load(row_ptr + cols, mask=valid, other=NEG_INF).to(tl.float32)
        g = _gumbel(rkey, cols)
        noisy = x + t * g
        if HAS_Q:
            q = tl.load(q_row_ptr + cols, mask=valid, other=0.0).to(tl.float32)
            e = tl.exp(tl.math.div_rn(x, t) - z_max)
            r = e - q * total
            r = tl.where(valid & (r > 0), tl.log(tl.where(r > 0, r, 1.0)) + g, NEG_INF)  # log(0) is -inf
        else:
            r = tl.where(cols == d, NEG_INF, noisy)
        better_r = r > best_r
        best_r = tl.where(better_r, r, best_r)
        idx_r = tl.where(better_r, cols, idx_r)
        better_p = noisy > best_p
        best_p = tl.where(better_p, noisy, best_p)
        idx_p = tl.where(better_p, cols, idx_p)
    top_r = tl.max(best_r, axis=0)
    top_p = tl.max(best_p, axis=0)
    token_r = tl.min(tl.where(best_r == top_r, idx_r, V), axis=0)
    token_p = tl.min(tl.where(best_p == top_p, idx_p, V), axis=0)
    return tl.where(top_r > NEG_INF, token_r, token_p)


@triton.jit
def _draft_row(row_ptr, q_row_ptr, V, d, t, key, synthetic,
               HAS_Q: tl.constexpr, SYNTHETIC: tl.constexpr, BLOCK: tl.constexpr):
    """(accepted, the token emitted if not) for one draft row: _row_decisions for one row."""
    u = _uniform(key)
    if t == 0:
        _, top = _argmax_chunk(row_ptr, 0, V, key, 0.0, False, BLOCK)
        accepted = d == top
        if SYNTHETIC:
            accepted = u < synthetic
        alt = top
    else:
        z_max = tl.zeros([], tl.float32)
        total = z_max + 1.0
        if HAS_Q or not SYNTHETIC:
            z_max, total = _softmax_stats(row_ptr, V, t, BLOCK)
        if SYNTHETIC:
            accepted = u < synthetic
        else:
            q_d = 1.0
            if HAS_Q:
                q_d = tl.load(q_row_ptr + d).to(tl.float32)
            e_d = tl.exp(tl.math.div_rn(tl.load(row_ptr + d).to(tl.float32), t) - z_max)
            accepted = u * q_d * total < e_d
        alt = d
        if accepted == 0:
            alt = _residual_token(row_ptr, q_row_ptr, V, d, key, t, z_max, total, HAS_Q, BLOCK)
    return accepted, alt


@triton.jit
def _rejection_kernel(logits_ptr, stride_logits, V, cu_ptr, drafts_ptr, stride_drafts, q_ptr, stride_q,
                      temperature_ptr, seeds_ptr, positions_ptr, num_drafts_ptr, out_ptr, stride_out, emitted_ptr,
                      K, synthetic, HAS_Q: tl.constexpr, SYNTHETIC: tl.constexpr, HAS_NUM_DRAFTS: tl.constexpr,
                      BLOCK: tl.constexpr, OUT_BLOCK: tl.constexpr):
    b = tl.program_id(0)
    first = tl.load(cu_ptr + b).to(tl.int32)
    n = tl.load(cu_ptr + b + 1).to(tl.int32) - first - 1
    if HAS_NUM_DRAFTS:  # a uniform layout: the rows past the bonus row are not read
        n = tl.minimum(tl.maximum(tl.load(num_drafts_ptr + b).to(tl.int32), 0), n)
    drafts_row = drafts_ptr + b.to(tl.int64) * stride_drafts
    num_acc = tl.zeros([], tl.int32)
    rejected = tl.zeros([], tl.int32)
    token = tl.zeros([], tl.int32)
    while (num_acc < n) & (rejected == 0):
        row = first + num_acc
        key = _row_key(tl.load(seeds_ptr + row), tl.load(positions_ptr + row))
        t = tl.load(temperature_ptr + row).to(tl.float32)
        d = tl.load(drafts_row + num_acc).to(tl.int32)
        accepted, alt = _draft_row(logits_ptr + row.to(tl.int64) * stride_logits,
                                   q_ptr + (row - b).to(tl.int64) * stride_q, V, d, t, key, synthetic,
                                   HAS_Q, SYNTHETIC, BLOCK)
        num_acc += accepted.to(tl.int32)
        rejected = 1 - accepted.to(tl.int32)
        token = alt
    if rejected == 0:  # every draft accepted: the bonus row, as plain Gumbel sampling
        row = first + n
        row_ptr = logits_ptr + row.to(tl.int64) * stride_logits
        key = _row_key(tl.load(seeds_ptr + row), tl.load(positions_ptr + row))
        t = tl.load(temperature_ptr + row).to(tl.float32)
        if t == 0:
            _, token = _argmax_chunk(row_ptr, 0, V, key, 0.0, False, BLOCK)
        else:
            _, token = _argmax_chunk(row_ptr, 0, V, key, t, True, BLOCK)
    cols = tl.arange(0, OUT_BLOCK)
    drafts = tl.load(drafts_row + cols, mask=cols < num_acc, other=0).to(tl.int64)
    out = tl.where(cols < num_acc, drafts, tl.where(cols == num_acc, token.to(tl.int64), -1))
    tl.store(out_ptr + b.to(tl.int64) * stride_out + cols, out, mask=cols < K + 1)
    tl.store(emitted_ptr + b, num_acc + 1)


def rejection_sample_triton(logits: torch.Tensor, cu_num_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                            draft_probs: Optional[torch.Tensor], temperature: torch.Tensor, seeds: torch.Tensor,
                            positions: torch.Tensor, synthetic_acceptance: Optional[float] = None,
                            num_drafts: Optional[torch.Tensor] = None):
    """rejection_sample_ref's outputs; no host sync (every shape comes from the arguments' shapes)."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [num_logits, V] with unit column stride"
    N, V = logits.shape
    B, K = draft_token_ids.shape
    out = torch.empty((B, K + 1), dtype=torch.int64, device=logits.device)
    emitted = torch.empty(B, dtype=torch.int32, device=logits.device)
    if B == 0:
        return out, emitted
    if draft_probs is not None:
        assert draft_probs.stride(1) == 1, "draft_probs needs unit column stride"
    drafts = draft_token_ids if K > 0 else out  # never read without drafts
    q = draft_probs if draft_probs is not None else logits
    _rejection_kernel[(B,)](
        logits, logits.stride(0), V, cu_num_logits, drafts, drafts.stride(0), q, q.stride(0),
        temperature, seeds, positions, num_drafts if num_drafts is not None else cu_num_logits,
        out, out.stride(0), emitted, K, float(synthetic_acceptance) if synthetic_acceptance is not None else 0.0,
        HAS_Q=draft_probs is not None, SYNTHETIC=synthetic_acceptance is not None,
        HAS_NUM_DRAFTS=num_drafts is not None,
        BLOCK=min(VOCAB_BLOCK, triton.next_power_of_2(V)), OUT_BLOCK=triton.next_power_of_2(K + 1),
        num_warps=8, enable_fp_fusion=False,  # round T * g before the sum, like the reference
    )
    return out, emitted


def rejection_sample(logits, cu_num_logits, draft_token_ids, draft_probs, temperature, seeds, positions,
                     synthetic_acceptance: Optional[float] = None, num_drafts: Optional[torch.Tensor] = None):
    """Triton on CUDA, the torch reference elsewhere; see the module docstring for the layouts."""
    impl = rejection_sample_triton if use_triton(logits) else rejection_sample_ref
    return impl(logits, cu_num_logits, draft_token_ids, draft_probs, temperature, seeds, positions,
                synthetic_acceptance, num_drafts)
