"""Paged attention and the KV-cache write.

KV cache layout, per layer: k_cache and v_cache are [num_blocks, block_size, num_kv_heads, head_dim].
Token slot s lives in block s // block_size at offset s % block_size.

One op covers prefill, chunked prefill and decode: request b has q_len = query_start_loc[b+1] -
query_start_loc[b] new tokens, which are the last q_len of its seq_lens[b] tokens, so query i of
request b sits at position seq_lens[b] - q_len + i and attends causally to positions <= its own.
With a sliding window W, a query at position p attends only to the keys at positions in
(p - W, p] (HF transformers' sliding-window mask); the kernel never visits key tiles below a
tile's window. Requests with q_len == 0 (padding) are skipped.

FP8 KV cache (caches of dtype float8_e4m3fn): each layer has kv_scale [2] fp32, the scales of its
K and of its V. A key k is stored as round_e4m3(clamp(k / k_scale, +-448)) and read back as
k_scale * stored, likewise v. The attention kernel widens the stored bytes to q's dtype, folds
k_scale into the softmax scale and multiplies the output by v_scale (both factor out of the dot
products); with a 16-bit model the dot products take fp16 operands (e4m3 widens to fp16 in
one instruction per pair), accumulating in fp32. The torch paths dequantize the gathered keys
(the reference).

Attention sinks (gpt-oss): a learned logit per q head that joins each row's softmax denominator
and contributes no value: out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)). The kernel
folds it in once, after the keys (or after merging the splits), so the key loop is unchanged.
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.kernels._dispatch import H200_SM_COUNT, sm_count, use_triton


FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # e4m3's largest finite value


def is_fp8_kv(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def _check_kv_scale(cache: torch.Tensor, kv_scale: Optional[torch.Tensor]) -> None:
    if is_fp8_kv(cache):
        assert kv_scale is not None and kv_scale.numel() == 2 and kv_scale.dtype == torch.float32, \
            "an FP8 KV cache needs its layer's kv_scale [2] fp32 (k_scale, v_scale)"


def quantize_kv_ref(x: torch.Tensor, cache_dtype: torch.dtype, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """x as the cache stores it: e4m3 of x / scale (saturated at +-448) for an FP8 cache, else x in
    the cache's dtype."""
    if cache_dtype != FP8_KV_DTYPE:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping, kv_scale: Optional[torch.Tensor] = None):
    """Store k, v [T, Hk, D] into the caches at slot_mapping [T]; slots < 0 are padding. kv_scale:
    (k_scale, v_scale) for an FP8 cache."""
    _check_kv_scale(k_cache, kv_scale)
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, k, v = slots[valid], k[valid], v[valid]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_scale, v_scale = (kv_scale[0], kv_scale[1]) if is_fp8_kv(k_cache) else (None, None)
    k_cache[blocks, offsets] = quantize_kv_ref(k, k_cache.dtype, k_scale)
    v_cache[blocks, offsets] = quantize_kv_ref(v, v_cache.dtype, v_scale)


def _gather_kv(k_cache, v_cache, block_row, lo: int, hi: int, kv_scale: Optional[torch.Tensor] = None,
               dtype: Optional[torch.dtype] = None):
    """A request's keys and values at positions [lo, hi), gathered from its blocks: [hi - lo, Hk, D]
    each; an FP8 cache's are dequantized (in fp32, then `dtype`)."""
    block_size = k_cache.shape[1]
    first = lo // block_size
    blocks = block_row[first:(hi + block_size - 1) // block_size].long()
    skip, n = lo - first * block_size, hi - lo
    k = k_cache[blocks].flatten(0, 1)[skip:skip + n]
    v = v_cache[blocks].flatten(0, 1)[skip:skip + n]
    if is_fp8_kv(k_cache):
        k = (k.float() * kv_scale[0]).to(dtype or torch.float32)
        v = (v.float() * kv_scale[1]).to(dtype or torch.float32)
    return k, v


def _live_requests(query_start_loc: torch.Tensor, seq_lens: torch.Tensor):
    """(request, first token, end token, seq_len) of every request with queries (host ints)."""
    qsl = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        if qsl[b + 1] > qsl[b]:
            yield b, qsl[b], qsl[b + 1], seq_len


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: Optional[int]) -> torch.Tensor:
    """[Q, K] bool: key k_pos is visible to query q_pos (causal; within the window when there is one)."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return visible


def paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out=None,
                        sliding_window: Optional[int] = None, kv_scale: Optional[torch.Tensor] = None,
                        softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None):
    """q [T, Hq, D] -> out [T, Hq, D]; softmax(q k^T * scale) v over each request's cached tokens,
    in fp32 with an explicit mask: the test oracle. `softcap` (Gemma 2) turns each score s into
    softcap * tanh(s / softcap) before the mask. `sinks` [Hq] (gpt-oss): one more logit per head in
    the softmax, whose probability is dropped (HF's eager attention: concatenate, softmax, drop)."""
    _check_kv_scale(k_cache, kv_scale)
    if out is None:
        out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for b, start, end, seq_len in _live_requests(query_start_loc, seq_lens):
        q_len = end - start
        k, v = _gather_kv(k_cache, v_cache, block_tables[b], 0, seq_len, kv_scale)
        qb = q[start:end].float().transpose(0, 1)  # [Hq, q_len, D]
        kb = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, S, D]
        vb = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
        scores = torch.matmul(qb, kb.transpose(1, 2)) * scale  # [Hq, q_len, S]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        visible = _visible(q_pos, torch.arange(seq_len, device=q.device), sliding_window)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(probs, vb).transpose(0, 1).to(out.dtype)
    return out


def paged_attention_sdpa(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out=None,
                         sliding_window: Optional[int] = None, kv_scale: Optional[torch.Tensor] = None):
    """paged_attention_ref's semantics through torch's fused scaled_dot_product_attention (the CPU
    path): per request, over the keys gathered from its blocks, only those inside the window of its
    first query. A whole prompt takes the causal kernel, a decode no mask, a chunk an explicit mask."""
    _check_kv_scale(k_cache, kv_scale)
    if out is None:
        out = torch.empty_like(q)
    for b, start, end, seq_len in _live_requests(query_start_loc, seq_lens):
        q_len = end - start
        ctx = seq_len - q_len
        lo = 0 if sliding_window is None else max(0, ctx - sliding_window + 1)
        k, v = _gather_kv(k_cache, v_cache, block_tables[b], lo, seq_len, kv_scale, q.dtype)
        mask, causal = None, False
        if q_len > 1 and ctx == 0 and (sliding_window is None or sliding_window >= q_len):
            causal = True
        elif q_len > 1:
            q_pos = torch.arange(ctx, seq_len, device=q.device)
            mask = _visible(q_pos, torch.arange(lo, seq_len, device=q.device), sliding_window)
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0).to(q.dtype),
            v.transpose(0, 1).unsqueeze(0).to(q.dtype), attn_mask=mask, is_causal=causal, scale=scale,
            enable_gqa=True,
        )
        out[start:end] = o[0].transpose(0, 1).to(out.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Triton: KV-cache write
# ----------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, kv_scale_ptr,
    num_heads, head_dim,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Grid (T,): copy one token's k and v heads into its cache slot; slot < 0 is padding."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    page, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    k_dst = k_cache_ptr + page * stride_kcb + offset * stride_kcs + heads * stride_kch + dims
    v_dst = v_cache_ptr + page * stride_vcb + offset * stride_vcs + heads * stride_vch + dims
    tl.store(k_dst, to_kv_cache(k, kv_scale_ptr, 0, k_cache_ptr, KV_FP8), mask=mask)
    tl.store(v_dst, to_kv_cache(v, kv_scale_ptr, 1, v_cache_ptr, KV_FP8), mask=mask)


@triton.jit
def round_to_e4m3(x):
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even, in exact fp32
    arithmetic: the cast that follows is then exact. (The GPU's own cast rounds the same way;
    Triton's CPU interpreter does not at binade edges and ties, so the kernels round first.)"""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # subnormals: -6
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits: 2^(e - 3)
    inv_step = ((127 - exponent + 3) << 23).to(tl.float32, bitcast=True)
    y = x * inv_step  # exact (a power of two)
    whole = tl.floor(y)
    frac = y - whole
    odd = (whole - 2.0 * tl.floor(whole * 0.5)) != 0.0
    r = tl.abs((whole + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)) * step)
    # x's sign bit set on r as bits, so that a negative x that rounds to zero stays -0 as in torch's
    # cast (Triton's -r is 0 - r, +0 for r = +0: the H200 stored those as +0, 2026-12-02)
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def to_kv_cache(x, kv_scale_ptr, which, cache_ptr, KV_FP8: tl.constexpr):
    """x as the cache at cache_ptr stores it (quantize_kv_ref): with KV_FP8, e4m3 of x / scale,
    the scale being kv_scale_ptr[which] (0: K, 1: V), with IEEE division as torch's."""
    if KV_FP8:
        scale = tl.load(kv_scale_ptr + which)
        x = round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale), -448.0), 448.0))
    return x.to(cache_ptr.dtype.element_ty)


def kv_scale_arg(k_cache: torch.Tensor, kv_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """(the kv_scale pointer argument, KV_FP8) of a kernel that writes or reads k_cache."""
    _check_kv_scale(k_cache, kv_scale)
    fp8 = is_fp8_kv(k_cache)
    return (kv_scale if fp8 else k_cache), fp8


def write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping, kv_scale: Optional[torch.Tensor] = None):
    """Triton KV write; k/v may be strided views (unit last stride). No host sync."""
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    tokens, num_heads, head_dim = k.shape
    if tokens == 0:
        return
    scale_arg, fp8 = kv_scale_arg(k_cache, kv_scale)
    block_h, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)
    _write_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping.contiguous(), scale_arg,
        num_heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        PAGE_SIZE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d, KV_FP8=fp8,
        num_warps=4 if block_h * block_d >= 1024 else 2,
    )


# ----------------------------------------------------------------------------------------------
# Triton: paged attention
#
# One kernel serves prefill, chunked prefill, mixed batches and decode. A program owns one
# kv head and one "query tile" of one request; the tile's BLOCK_M rows are (token, q head) pairs,
# token-major, over the GROUP q heads that share the kv head, so every K/V tile is loaded once per
# group (GQA packing). Decode (q_len 1) is the special case of one token per tile.
# With num_splits > 1 (flash-decoding) program (.., .., split) covers a contiguous share of the
# tile's keys, computed in the kernel from seq_lens, writes (max, sum, acc) partials in fp32, and
# _reduce_splits_kernel merges them; the grid never depends on tensor values (CUDA-graph safe).
# ----------------------------------------------------------------------------------------------

LOG2E = 1.4426950408889634
MAX_SPLITS = 32  # with max_seq_len known
MAX_SPLITS_UNKNOWN_LEN = 16  # without it (e.g. inside CUDA graphs)
MIN_KEYS_PER_SPLIT = 256
MAX_WORKSPACE_BYTES = 256 << 20
DEFAULT_SM_COUNT = H200_SM_COUNT


@triton.jit
def _find_tile(qsl_ptr, num_reqs, pid, TOKENS_PER_TILE: tl.constexpr, BLOCK_B: tl.constexpr):
    """Map a flat program id to (request, query tile) from query_start_loc, without a host sync.

    Requests own consecutive runs of cdiv(q_len, TOKENS_PER_TILE) ids; req == num_reqs past the end.
    The requests are scanned BLOCK_B at a time (a fixed block, so one compile serves every batch
    size): req counts the requests whose last id is <= pid, and the largest such "last" is where
    pid's request starts.
    """
    offs = tl.arange(0, BLOCK_B)
    carry = num_reqs * 0  # running tile count before the chunk
    req = num_reqs * 0
    first = num_reqs * 0
    for c in range(0, num_reqs, BLOCK_B):
        ok = c + offs < num_reqs
        starts = tl.load(qsl_ptr + c + offs, mask=ok, other=0)
        ends = tl.load(qsl_ptr + c + offs + 1, mask=ok, other=0)
        n_tiles = tl.where(ok, (ends - starts + TOKENS_PER_TILE - 1) // TOKENS_PER_TILE, 0)
        last = carry + tl.cumsum(n_tiles, 0)
        below = ok & (last <= pid)
        req += tl.sum(below.to(tl.int32), 0)
        first = tl.maximum(first, tl.max(tl.where(below, last, 0), 0))
        carry += tl.sum(n_tiles, 0)
    return req, pid - first


@triton.jit
def _attn_kv_tile(
    acc, l_i, m_i, q, q_pos, start, hi, bt_row, k_base, v_base, qk_scale, window, softcap,
    stride_kb, stride_ks, stride_vb, stride_vs,
    MASKED: tl.constexpr, SLIDING: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, FMA_SCORES: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One online-softmax step over keys [start, start + BLOCK_N) (exp2 domain). FMA_SCORES: the
    exponent is one explicit fma(q.k, scale, -max), masked tile or not (batch-invariant mode);
    otherwise the compiler may fuse the unmasked tile's scale-and-subtract and not the masked one's,
    so a key tile rounds differently in a step that visits it masked."""
    n = start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    if MASKED:
        n_live = n < hi
        page = tl.load(bt_row + n // PAGE_SIZE, mask=n_live, other=0).to(tl.int64)
    else:
        n_live = n >= 0  # all true; only combined with the head_dim mask
        page = tl.load(bt_row + n // PAGE_SIZE).to(tl.int64)
    k_offs = page * stride_kb + (n % PAGE_SIZE) * stride_ks
    v_offs = page * stride_vb + (n % PAGE_SIZE) * stride_vs
    kt_ptrs = k_base + k_offs[None, :] + dims[:, None]  # K^T tile [D, N]
    if MASKED or BLOCK_D != HEAD_DIM:
        d_live = dims < HEAD_DIM
        kt = tl.load(kt_ptrs, mask=n_live[None, :] & d_live[:, None], other=0.0)
    else:
        kt = tl.load(kt_ptrs)
    # An FP8 cache's bytes widen to q's dtype (no-op otherwise); its scale is in qk_scale.
    qk = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PRECISION)
    s = qk * qk_scale
    if SOFTCAP:
        # cap * tanh(score / cap) in the exp2 domain: s and softcap (cap * log2(e)) both carry
        # log2(e). tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|): no overflow at any x.
        x = s / softcap
        e = tl.exp(-2.0 * tl.abs(x))
        th = (1.0 - e) / (1.0 + e)
        s = softcap * tl.where(x < 0, -th, th)
    if MASKED:
        visible = n_live[None, :] & (n[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = m_new
    if MASKED:
        # A row may see no key yet (split ranges, padding rows): keep exp2 away from inf - inf.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    if FMA_SCORES and not SOFTCAP:
        e = tl.fma(qk, tl.full(qk.shape, 1.0, tl.float32) * qk_scale, tl.zeros_like(qk) - m_use[:, None])
        if MASKED:
            e = tl.where(visible, e, float("-inf"))
        p = tl.math.exp2(e)
    else:
        p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = v_base + v_offs[:, None] + dims[None, :]  # [N, D]
    if MASKED or BLOCK_D != HEAD_DIM:
        v = tl.load(v_ptrs, mask=n_live[:, None] & d_live[None, :], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _key_range(ctx, tok0, q_len, split, num_splits, window, TOKENS_PER_TILE: tl.constexpr,
               SPLIT_KV: tl.constexpr, SLIDING: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keys [lo, hi) one program visits, and the run [edge, mid) of key tiles that every row of
    its query tile sees whole (no mask). Keys past the tile's last row are never visited; with a
    sliding window, neither are the keys below its first row's window (from a BLOCK_N boundary)."""
    kv_hi = ctx + tl.minimum(tok0 + TOKENS_PER_TILE, q_len)  # causal end for the tile's last row
    kv_lo = 0
    if SLIDING:
        kv_lo = tl.maximum(ctx + tok0 - window + 1, 0) // BLOCK_N * BLOCK_N
    if SPLIT_KV:
        per_split = tl.cdiv(tl.cdiv(kv_hi - kv_lo, num_splits), BLOCK_N) * BLOCK_N
        lo = kv_lo + split * per_split
        hi = tl.minimum(lo + per_split, kv_hi)
    else:
        lo = kv_lo
        hi = kv_hi
    edge = lo
    if SLIDING:  # below kv_hi - window the window's lower edge cuts the rows differently: masked
        edge = tl.minimum(lo + tl.cdiv(tl.maximum(kv_hi - window - lo, 0), BLOCK_N) * BLOCK_N, hi)
    # Keys below the tile's first query position are visible to all its rows.
    full_end = tl.minimum(hi, ctx + tok0 + 1)
    mid = edge + tl.maximum(full_end - edge, 0) // BLOCK_N * BLOCK_N
    return lo, edge, mid, hi


@triton.jit
def _attend_keys(
    q, q_pos, lo, edge, mid, hi, bt_row, k_base, v_base, qk_scale, window, softcap,
    stride_kb, stride_ks, stride_vb, stride_vs,
    SLIDING: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, MASK_ALL: tl.constexpr,
    FMA_SCORES: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Online softmax of a query tile over keys [lo, hi): (acc, l, m), unnormalised. MASK_ALL: every
    tile takes the masked code, so a key tile rounds the same in every step (FMA_SCORES in
    _attn_kv_tile is the other way to that, and keeps the unmasked tiles)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if MASK_ALL:  # the first (masked) loop takes every tile
        edge = hi
        mid = hi
    for start in range(lo, edge, BLOCK_N):  # the window's lower edge (empty without a window)
        acc, l_i, m_i = _attn_kv_tile(
            acc, l_i, m_i, q, q_pos, start, hi, bt_row, k_base, v_base, qk_scale, window, softcap,
            stride_kb, stride_ks, stride_vb, stride_vs,
            True, SLIDING, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, DOT_PRECISION, FMA_SCORES, SOFTCAP,
        )
    for start in range(edge, mid, BLOCK_N):
        acc, l_i, m_i = _attn_kv_tile(
            acc, l_i, m_i, q, q_pos, start, hi, bt_row, k_base, v_base, qk_scale, window, softcap,
            stride_kb, stride_ks, stride_vb, stride_vs,
            False, SLIDING, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, DOT_PRECISION, FMA_SCORES, SOFTCAP,
        )
    # The diagonal and the ragged end: masked. Fully-masked tiles past hi are never visited.
    for start in range(mid, hi, BLOCK_N):
        acc, l_i, m_i = _attn_kv_tile(
            acc, l_i, m_i, q, q_pos, start, hi, bt_row, k_base, v_base, qk_scale, window, softcap,
            stride_kb, stride_ks, stride_vb, stride_vs,
            True, SLIDING, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, DOT_PRECISION, FMA_SCORES, SOFTCAP,
        )
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_reqs", "num_splits", "window"])
def _paged_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, ws_acc_ptr, ws_m_ptr, ws_l_ptr,
    qsl_ptr, seq_lens_ptr, block_tables_ptr, kv_scale_ptr, sinks_ptr,
    num_reqs, num_q_heads, num_splits, qk_scale, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, TOKENS_PER_TILE: tl.constexpr, DECODE_ONLY: tl.constexpr,
    SPLIT_KV: tl.constexpr, SLIDING: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, MASK_ALL: tl.constexpr, FMA_SCORES: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    """Grid (query tiles, kv heads, num_splits); num_splits is a runtime int so that CUDA graphs of
    different batch sizes share one compiled kernel (SPLIT_KV only says whether it is > 1).
    SLIDING: keys older than `window` positions are masked and their tiles skipped.
    KV_FP8: the caches hold e4m3 with the scales at kv_scale_ptr (k_scale, v_scale).
    SINKS: each q head's sink logit at sinks_ptr joins the denominator (split: in the reduction)."""
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE_ONLY:
        req = tl.program_id(0)
        tile = 0
    else:
        # Reversed ids: a request's last (heaviest, causal) tiles are scheduled first.
        pid = tl.num_programs(0) - 1 - tl.program_id(0)
        req, tile = _find_tile(qsl_ptr, num_reqs, pid, TOKENS_PER_TILE, BLOCK_B)
        if req >= num_reqs:
            return
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if q_len <= 0:  # padding request
        return
    ctx = tl.load(seq_lens_ptr + req) - q_len  # keys before this step's first query
    if KV_FP8:  # k_scale factors out of q . k, v_scale out of p . v
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
    tok0 = tile * TOKENS_PER_TILE
    lo, edge, mid, hi = _key_range(ctx, tok0, q_len, split, num_splits, window,
                                   TOKENS_PER_TILE, SPLIT_KV, SLIDING, BLOCK_N)

    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < TOKENS_PER_TILE * GROUP) & (tok < q_len)
    dims = tl.arange(0, BLOCK_D)
    row_mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    token_idx = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + token_idx[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_mask, other=0.0)
    if KV_FP8 and q.dtype != tl.float32:
        # e4m3 widens to fp16 in one instruction per pair; a bf16 q is exact in fp16 (3 more
        # mantissa bits) unless beyond 65504. The products and p then run in fp16.
        q = q.to(tl.float16)
    acc, l_i, m_i = _attend_keys(
        q, ctx + tok, lo, edge, mid, hi, block_tables_ptr + req.to(tl.int64) * stride_bt,
        k_cache_ptr + kv_head.to(tl.int64) * stride_kh, v_cache_ptr + kv_head.to(tl.int64) * stride_vh,
        qk_scale, window, softcap, stride_kb, stride_ks, stride_vb, stride_vs,
        SLIDING, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_N, PAGE_SIZE, DOT_PRECISION, MASK_ALL, FMA_SCORES, SOFTCAP,
    )
    if KV_FP8:
        acc = acc * tl.load(kv_scale_ptr + 1)

    if not SPLIT_KV:
        if SINKS:
            acc, l_i = _add_sink(acc, l_i, m_i, sinks_ptr, head, row_ok)
        out = acc / l_i[:, None]
        out_offs = token_idx[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        part = (token_idx * num_q_heads + head) * num_splits + split
        tl.store(ws_m_ptr + part, m_i, mask=row_ok)
        tl.store(ws_l_ptr + part, l_i, mask=row_ok)
        tl.store(ws_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _add_sink(acc, l_i, m_i, sinks_ptr, head, row_ok):
    """(acc, l) rescaled to the larger of the row max and the sink (exp2 domain, as m_i is), with
    the sink's exp2 added to l: acc / l is then the attention with the sink in the softmax."""
    sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    m_f = tl.maximum(m_i, sink)
    alpha = tl.math.exp2(m_i - m_f)  # m_i = -inf (a padding row): 0
    return acc * alpha[:, None], l_i * alpha + tl.math.exp2(sink - m_f)


@triton.jit(do_not_specialize=["num_reqs", "num_splits"])
def _reduce_splits_kernel(
    ws_acc_ptr, ws_m_ptr, ws_l_ptr, out_ptr, qsl_ptr, sinks_ptr,
    num_reqs, num_q_heads, num_splits, stride_ot, stride_oh,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SINKS: tl.constexpr,
):
    """Grid (T, Hq): merge one row's split partials; rows past query_start_loc[-1] are untouched.
    SINKS: the head's sink logit joins the merged denominator."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(qsl_ptr + num_reqs):
        return
    splits = tl.arange(0, BLOCK_S)
    s_ok = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    part = (token * num_q_heads + head) * num_splits + splits
    m = tl.load(ws_m_ptr + part, mask=s_ok, other=float("-inf"))
    l = tl.load(ws_l_ptr + part, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    w = tl.math.exp2(m - m_max)  # empty splits have m = -inf -> weight 0
    acc = tl.load(ws_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], mask=s_ok[:, None], other=0.0)
    denom = tl.sum(l * w, 0)
    if SINKS:
        denom += tl.math.exp2(sink - m_max)
    out = tl.sum(acc * w[:, None], 0) / denom
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def attention_config(max_query_len: int, group: int, head_dim: int, dtype: torch.dtype,
                     mean_query_len: Optional[float] = None, kv_fp8: bool = False) -> dict:
    """Tile config (BLOCK_M rows = tokens x GROUP heads, BLOCK_N keys, warps, stages). Tune here.

    Decode / short queries: the smallest tl.dot-sized M that holds the rows. Prefill: 128 x 64 with
    8 warps for 16-bit (64 x 64 for fp32, whose tiles are twice the bytes); 256 x 64 with 16 warps
    for 128-dim heads when requests average 256 rows or more; mixed batches (a long chunk among many
    decodes) take 64-row tiles, since every decode request pads a whole tile. An e4m3 cache decodes
    with 128-key tiles and 3 stages. A row's arithmetic is the same in every tile. The H200 sweeps
    behind each choice: docs/PERFORMANCE.md, "Kernel tile choices".
    """
    rows = max(1, max_query_len) * group
    fp32 = dtype == torch.float32
    wide = triton.next_power_of_2(head_dim) > 128
    max_m = 64 if fp32 or wide else 128
    if mean_query_len is not None and mean_query_len * group < 64:
        max_m = 64
    elif max_m == 128 and triton.next_power_of_2(head_dim) == 128 and rows >= 256 \
            and (mean_query_len is None or mean_query_len * group >= 256):
        max_m = 256  # long prompts, 128-dim heads
    block_m = min(max_m, max(16, triton.next_power_of_2(rows)))
    block_m = max(block_m, triton.next_power_of_2(group))
    block_n = 32 if wide else 64
    num_warps = 16 if block_m >= 256 else 8 if block_m >= 128 else 4
    num_stages = 2 if fp32 or wide else 3
    if kv_fp8 and max_query_len == 1 and not (fp32 or wide):
        block_n = 128
    return dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)


def choose_num_splits(num_programs: int, max_seq_len: Optional[int], sm_count: int = DEFAULT_SM_COUNT) -> int:
    """Split the keys only when (q tiles x kv heads) programs leave SMs idle.

    Aims at ~2 programs per SM; with max_seq_len known, a split gets >= MIN_KEYS_PER_SPLIT keys,
    otherwise (CUDA graphs) the count depends on the batch shape only and is capped lower.
    """
    if num_programs >= sm_count:
        return 1
    splits = triton.cdiv(2 * sm_count, num_programs)
    if max_seq_len is None:
        return max(1, min(splits, MAX_SPLITS_UNKNOWN_LEN))
    return max(1, min(splits, MAX_SPLITS, triton.cdiv(max_seq_len, MIN_KEYS_PER_SPLIT)))


@dataclass(frozen=True)
class AttnLaunch:
    """How one paged_attention_triton call launches: its tile config, grid and split-KV count."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    decode_only: bool
    grid0: int  # programs along the query axis

    @property
    def compile_key(self) -> tuple:
        """What selects a compiled kernel (the split count itself is a runtime argument; only the
        reduction's block size, its next power of two, is compiled in)."""
        split = triton.next_power_of_2(self.num_splits) if self.num_splits > 1 else 0
        return (self.block_m, self.block_n, self.num_warps, self.num_stages, self.decode_only, split)


@functools.lru_cache(maxsize=4096)  # every layer of a step asks the same question
def launch_plan(tokens: int, num_reqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                max_query_len: Optional[int] = None, max_seq_len: Optional[int] = None,
                num_splits: Optional[int] = None, sm_count: int = DEFAULT_SM_COUNT, *,
                block_m: Optional[int] = None, block_n: Optional[int] = None,
                num_warps: Optional[int] = None, num_stages: Optional[int] = None, kv_fp8: bool = False) -> AttnLaunch:
    """The launch of a step shape (host-side ints only); explicit arguments override the choice.
    kv_fp8: the cache holds e4m3 (attention_config)."""
    group = num_q_heads // num_kv_heads
    mql = tokens if max_query_len is None else max(1, min(max_query_len, tokens))
    cfg = attention_config(mql, group, head_dim, dtype, tokens / num_reqs, kv_fp8)
    block_m = block_m or cfg["block_m"]
    block_n = block_n or cfg["block_n"]
    num_warps = num_warps or cfg["num_warps"]
    stages_given = num_stages is not None
    num_stages = num_stages or cfg["num_stages"]
    assert block_m >= group, "BLOCK_M must hold a whole GQA group"
    tokens_per_tile = block_m // group
    decode_only = mql == 1
    if decode_only:
        grid0 = num_reqs
    else:
        grid0 = min(num_reqs * triton.cdiv(mql, tokens_per_tile), triton.cdiv(tokens, tokens_per_tile) + num_reqs)
    block_d = triton.next_power_of_2(head_dim)
    if num_splits is None:
        num_splits = choose_num_splits(grid0 * num_kv_heads, max_seq_len, sm_count)
        while num_splits > 1 and tokens * num_q_heads * num_splits * (block_d + 2) * 4 > MAX_WORKSPACE_BYTES:
            num_splits //= 2
    num_splits = max(1, int(num_splits))
    if not stages_given and block_m <= 32 and dtype != torch.float32 and not kv_fp8 \
            and num_splits == 1 and grid0 * num_kv_heads >= DEFAULT_SM_COUNT:
        # Decode tiles over a full grid: two stages leave room for a third program per SM, which
        # streams the cache faster (H200: 12-27 % at 64-256 requests); few programs keep three.
        num_stages = 2
    return AttnLaunch(block_m, block_n, num_warps, num_stages, num_splits, decode_only, grid0)


def attention_variants(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, max_tokens: int,
                       max_reqs: int, sm_count: int = DEFAULT_SM_COUNT,
                       kv_fp8: bool = False) -> list[tuple[AttnLaunch, int, int]]:
    """Every distinct compiled kernel that steps of up to max_tokens tokens and max_reqs requests
    can select, each with a small (tokens, num_reqs) shape that selects it. The engine's warm-up
    runs them all: a variant first met under load would compile on the step path (about 1.3 s on
    the H200, a stall for every running request)."""
    found: dict[tuple, tuple[AttnLaunch, int, int]] = {}
    counts = sorted({min(2 ** i, max_tokens) for i in range(max_tokens.bit_length() + 1)})
    # Split counts are capped by keys / MIN_KEYS_PER_SPLIT: lengths around each power of two of it
    seq_lens = (None, 16) + tuple(MIN_KEYS_PER_SPLIT * 2 ** i + d for i in range(7) for d in (0, 1))
    for tokens in counts:
        for reqs in (r for r in counts if r <= min(tokens, max_reqs)):
            for mql in sorted({1, 2, 4, 8, 16, 64, tokens - reqs + 1}):
                if mql > tokens - reqs + 1 or (mql == 1 and tokens != reqs):
                    continue
                for max_seq_len in seq_lens:
                    plan = launch_plan(tokens, reqs, num_q_heads, num_kv_heads, head_dim, dtype, mql, max_seq_len,
                                       None, sm_count, kv_fp8=kv_fp8)
                    key = plan.compile_key
                    if key not in found or tokens < found[key][1]:
                        found[key] = (plan, tokens, reqs)
    return [found[k] for k in sorted(found, key=str)]


def paged_attention_triton(
    q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out=None,
    max_query_len: Optional[int] = None, max_seq_len: Optional[int] = None,
    num_splits: Optional[int] = None, block_m: Optional[int] = None, block_n: Optional[int] = None,
    num_warps: Optional[int] = None, num_stages: Optional[int] = None, sliding_window: Optional[int] = None,
    kv_scale: Optional[torch.Tensor] = None, mask_all: bool = False, fma_scores: bool = False,
    softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None, **_unused_hints,
):
    """Triton paged attention, same semantics as paged_attention_ref; no host/device sync.

    Hints (Python ints): max_query_len (an upper bound of every q_len; defaults to T; 1 selects the
    decode grid), max_seq_len (only sizes the split count; None is fine), num_splits (forces the
    split-KV count), block_m / block_n / num_warps / num_stages (override attention_config),
    mask_all (every key tile through the masked code) and fma_scores (one explicit fma for the
    softmax exponent, masked or not): two ways to batch invariance (kernels/batch_invariant.py).
    sliding_window (None: off), kv_scale (an FP8 cache's scales), softcap (Gemma 2's
    cap * tanh(score / cap); None: off) and sinks ([Hq] logits, gpt-oss; None: off) are
    semantics, not hints. Only
    output rows of real requests are written.
    """
    tokens, num_q_heads, head_dim = q.shape
    num_reqs = seq_lens.shape[0]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    assert group * num_kv_heads == num_q_heads, "q heads must be a multiple of kv heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.stride(-1) == 1 and query_start_loc.is_contiguous() and seq_lens.is_contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.stride(-1) == 1
    if sinks is not None:
        assert sinks.shape == (num_q_heads,) and sinks.is_contiguous(), "sinks: one logit per q head"
    if tokens == 0 or num_reqs == 0:
        return out
    if sliding_window is not None and max_seq_len is not None:  # a query sees at most the window
        max_seq_len = min(max_seq_len, sliding_window + (max_query_len or tokens))

    sms = sm_count(q.device) if q.is_cuda else DEFAULT_SM_COUNT
    scale_arg, fp8 = kv_scale_arg(k_cache, kv_scale)
    plan = launch_plan(tokens, num_reqs, num_q_heads, num_kv_heads, head_dim, q.dtype, max_query_len, max_seq_len,
                       num_splits, sms, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                       kv_fp8=fp8)
    block_d = triton.next_power_of_2(head_dim)
    ws_acc, ws_m, ws_l = _split_workspace(out, num_q_heads, plan.num_splits, block_d)
    _paged_attn_kernel[(plan.grid0, num_kv_heads, plan.num_splits)](
        q, k_cache, v_cache, out, ws_acc, ws_m, ws_l,
        query_start_loc, seq_lens, block_tables, scale_arg, q if sinks is None else sinks,
        num_reqs, num_q_heads, plan.num_splits, scale * LOG2E, sliding_window or 0,
        float(softcap or 1.0) * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, TOKENS_PER_TILE=plan.block_m // group, DECODE_ONLY=plan.decode_only,
        SPLIT_KV=plan.num_splits > 1, SLIDING=sliding_window is not None, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, PAGE_SIZE=page_size,
        BLOCK_B=1 if plan.decode_only else 128,  # fixed: one compile for every batch size
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=fp8, MASK_ALL=mask_all,
        FMA_SCORES=fma_scores, SOFTCAP=softcap is not None, SINKS=sinks is not None,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if plan.num_splits > 1:
        _reduce_splits_kernel[(tokens, num_q_heads)](
            ws_acc, ws_m, ws_l, out, query_start_loc, out if sinks is None else sinks,
            num_reqs, num_q_heads, plan.num_splits, out.stride(0), out.stride(1),
            BLOCK_S=triton.next_power_of_2(plan.num_splits),
            HEAD_DIM=head_dim, BLOCK_D=block_d, SINKS=sinks is not None, num_warps=4 if block_d >= 128 else 2,
        )
    return out


def _split_workspace(out: torch.Tensor, num_q_heads: int, num_splits: int, block_d: int):
    """Split-KV partials (acc, max, sum) in fp32, one per (token, q head, split); `out` (unused)
    stands in for them when the keys are not split."""
    if num_splits == 1:
        return out, out, out
    tokens = out.shape[0]
    ws_acc = torch.empty((tokens, num_q_heads, num_splits, block_d), dtype=torch.float32, device=out.device)
    ws_ml = torch.empty((2, tokens, num_q_heads, num_splits), dtype=torch.float32, device=out.device)
    return ws_acc, ws_ml[0], ws_ml[1]


# ----------------------------------------------------------------------------------------------
# Dispatchers
# ----------------------------------------------------------------------------------------------


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, kv_scale: Optional[torch.Tensor] = None):
    if use_triton(k):
        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping, kv_scale)
    else:
        write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping, kv_scale)


def paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out=None,
                    sliding_window: Optional[int] = None, kv_scale: Optional[torch.Tensor] = None,
                    softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None, **hints):
    """Dispatch: Triton on CUDA, torch's fused attention elsewhere (paged_attention_sdpa; with a
    softcap or sinks the explicit reference); hints (max_query_len, max_seq_len, num_splits, tile overrides)
    feed the Triton path."""
    if use_triton(q):
        return paged_attention_triton(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out,
            sliding_window=sliding_window, kv_scale=kv_scale, softcap=softcap, sinks=sinks, **hints
        )
    if softcap is not None or sinks is not None:
        return paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out,
                                   sliding_window, kv_scale, softcap, sinks)
    return paged_attention_sdpa(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out,
                                sliding_window, kv_scale)
