"""Batch-invariant linear layers and attention: each output row computed by the same operations in
the same order whatever else is in the step (batch size, step kind, padding, graph size).

The default paths are fast because they adapt to the step's shape, and that adaptation changes
rounding: torch on the CPU multiplies one row with a GEMV and more rows with a GEMM whose blocking
depends on the row count; on CUDA the one-token GEMVs, cuBLAS's per-shape kernels and split-KV
attention each reduce in a different order. Here:

- linear: on the CPU, the rows go through torch's matmul in fixed chunks of CPU_ROWS (the last
  one padded with zeros), so every product has the same shape; on CUDA, one Triton matmul with a
  fixed tile (MATMUL_TILES, no per-shape choice). K is cut into fixed chunks from 0, each reduced
  in BLOCK_K steps and the chunks summed in order. A step whose tiles would leave SMs idle (batch-1
  decode: N / BLOCK_N programs) gives each chunk its own program and sums the fp32 partials in
  the same order in a second kernel: the same bits with chunks x more programs.
- attention: on the CPU, keys in fixed blocks of KEY_BLOCK aligned to position 0 and queries in
  fixed chunks of QUERY_ROWS; the row maximum over every visible key (exact in any order), then per
  block one fixed-shape product of the probabilities with [V | 1] (values and the softmax sum
  together), the blocks summed in position order. Blocks a query cannot see add exact zeros, so a
  decode token and the same token inside a prompt chunk compute the same numbers. On CUDA, the
  paged attention kernel with one fixed tile config and no split-KV (bi_attention_tiles): its
  online softmax visits key tiles from position 0 in BLOCK_N steps for every query, its exponent
  one explicit fma whether a tile is masked or not (a decode token visits unmasked a key tile that
  a prompt tile visits masked), and tiles past a query's position leave its state unchanged. A batch-1
  decode attends with one program per KV head (no split-KV); a fixed split size of the keys,
  aligned to position 0 and used by prefill tiles too, would keep the order with more programs.

- mixture-of-experts MLPs: routing is row-wise already (a fixed tile over the experts); the
  experts' products as linear's on the CPU, and on CUDA the one-token GEMV tiles at every size.

Elementwise ops, RMSNorm and the sampler are row-wise already (one reduction per row of a fixed
length, independent of the row count; tests/kernels/test_batch_invariant.py checks the CPU ones).
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.kernels._dispatch import sm_count, use_triton
from tokenmill.kernels.attention import _check_kv_scale, _gather_kv, _live_requests, paged_attention_triton
from tokenmill.kernels.fused_moe import ClampedSwiGLU, fused_moe_ref, fused_moe_triton, moe_config

CPU_ROWS = 16  # rows per torch matmul on the CPU
KEY_BLOCK = 64  # keys per block in the CPU attention
QUERY_ROWS = 16  # query rows per chunk in the CPU attention
_SCORE_BYTES = 64 << 20  # the CPU attention's scores are built a few query chunks at a time


@dataclass(frozen=True)
class MatmulTiles:
    """The CUDA matmul's launch config, one for every step: a block_m x block_n output tile per
    program, K reduced in block_k steps within chunks of k_chunk (a multiple of block_k)."""
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    k_chunk: int = 1024
    num_warps: int = 4
    num_stages: int = 3


MATMUL_TILES = MatmulTiles()  # H200, 2026-12-02 (d38edfe): the fastest of bi_matmul_bench.py's at 1 to 256 rows


def bi_attention_tiles(num_q_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """The paged attention kernel's one launch config in batch-invariant mode (every step, decode or
    prefill, any batch): 64 (token, head) rows (at least a GQA group), 64 keys (32 past 128 dims),
    4 warps, 2 stages, one split, the softmax exponent one explicit fma in every key tile."""
    group = num_q_heads // num_kv_heads
    wide = triton.next_power_of_2(head_dim) > 128
    return dict(block_m=max(64, triton.next_power_of_2(group)), block_n=32 if wide else 64, num_warps=4,
                num_stages=2, num_splits=1, fma_scores=True)


# ----------------------------------------------------------------------------------------------
# Linear
# ----------------------------------------------------------------------------------------------


def linear_invariant_cpu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias) over [M, K] rows in chunks of CPU_ROWS rows, the last padded."""
    m = x.shape[0]
    if m == 0:
        return F.linear(x, weight, bias)
    pad = -m % CPU_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = torch.cat([F.linear(x[i:i + CPU_ROWS], weight, bias) for i in range(0, x.shape[0], CPU_ROWS)])
    return out[:m]


@triton.jit
def _dot_chunk(x_ptr, w_ptr, rm, rn, m_ok, n_ok, k_start, K, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr,
               WIDEN: tl.constexpr):
    """x[rm, k] @ w[rn, k]^T over k in [k_start, k_start + K_CHUNK) and below K, in BLOCK_K steps
    from zero, in fp32."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + K_CHUNK, K), BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        a = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w_ptr + rn.to(tl.int64)[None, :] * stride_wn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None],
                    other=0.0)
        if WIDEN:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    return acc


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   K_CHUNK: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """y[M, N] = x[M, K] @ w[N, K]^T (+ bias), one BLOCK_M x BLOCK_N tile per program. K is cut into
    chunks of K_CHUNK from 0; each chunk is reduced from zero in BLOCK_K steps (fp32) and the chunks
    are summed in order, total = ((0 + c0) + c1) + ... SPLIT: this program computes only chunk
    program_id(2) and stores it (fp32) in y[chunk, M, N] for _sum_chunks_kernel, which sums them in
    the same order, so both ways give the same bits. WIDEN: the tiles multiply in fp32 (Triton's
    interpreter multiplies bf16 tl.dot operands wrongly)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        chunk = tl.program_id(2)
        acc = _dot_chunk(x_ptr, w_ptr, rm, rn, m_ok, n_ok, chunk * K_CHUNK, K, stride_xm, stride_wn, BLOCK_M, BLOCK_N,
                         BLOCK_K, K_CHUNK, DOT_PRECISION, WIDEN)
        tl.store(y_ptr + (chunk * M + rm.to(tl.int64))[:, None] * N + rn[None, :], acc, mask=mask)
    else:
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k_start in range(0, K, K_CHUNK):
            total += _dot_chunk(x_ptr, w_ptr, rm, rn, m_ok, n_ok, k_start, K, stride_xm, stride_wn, BLOCK_M,
                                BLOCK_N, BLOCK_K, K_CHUNK, DOT_PRECISION, WIDEN)
        if HAS_BIAS:
            total += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], total.to(y_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit(do_not_specialize=["M"])
def _sum_chunks_kernel(part_ptr, bias_ptr, y_ptr, M, N, CHUNKS, stride_ym, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """y[m, n] = ((0 + part[0, m, n]) + part[1, m, n]) + ... (+ bias[n]): one row block per program."""
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_ok = rn < N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, CHUNKS):
        total += tl.load(part_ptr + (c * M + m).to(tl.int64) * N + rn, mask=n_ok, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + rn, total.to(y_ptr.dtype.element_ty), mask=n_ok)


def linear_invariant_triton(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                            tiles: Optional[MatmulTiles] = None, split: Optional[bool] = None) -> torch.Tensor:
    """The Triton matmul for x [M, K] and weight [N, K] of one dtype (fp32 products in IEEE fp32).
    split: each K chunk in its own program, then the chunks summed by a second kernel (same bits);
    None: when the tiles alone would leave SMs idle (small M) and K has more than one chunk."""
    t = tiles or MATMUL_TILES
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert weight.stride(-1) == 1 and x.dtype == weight.dtype, "x and weight: one dtype, rows contiguous"
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    chunks = triton.cdiv(k, t.k_chunk)
    tile_grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n))
    if split is None:
        split = chunks > 1 and tile_grid[0] * tile_grid[1] < sm_count(x.device)
    widen = x.dtype == torch.bfloat16 and not x.is_cuda
    meta = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, K_CHUNK=t.k_chunk,
                DOT_PRECISION="ieee" if x.dtype == torch.float32 or widen else "tf32", WIDEN=widen,
                num_warps=t.num_warps, num_stages=t.num_stages)
    has_bias = bias is not None
    bias_arg = bias if has_bias else weight
    if not split:
        _matmul_kernel[tile_grid](x, weight, bias_arg, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
                                  HAS_BIAS=has_bias, SPLIT=False, **meta)
        return y
    part = torch.empty((chunks, m, n), dtype=torch.float32, device=x.device)
    _matmul_kernel[tile_grid + (chunks,)](x, weight, bias_arg, part, m, n, k, x.stride(0), weight.stride(0), n,
                                          HAS_BIAS=False, SPLIT=True, **meta)
    block = min(1024, triton.next_power_of_2(n))
    _sum_chunks_kernel[(m, triton.cdiv(n, block))](part, bias_arg, y, m, n, chunks, y.stride(0), HAS_BIAS=has_bias,
                                                   BLOCK=block, num_warps=4)
    return y


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias), each row's result independent of the other rows."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    y = linear_invariant_triton(x2, weight, bias) if use_triton(x2) else linear_invariant_cpu(x2, weight, bias)
    return y.view(*lead, weight.shape[0])


# ----------------------------------------------------------------------------------------------
# Mixture-of-experts MLPs
# ----------------------------------------------------------------------------------------------

def fused_moe_invariant(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, w13_bias: Optional[torch.Tensor] = None,
                        w2_bias: Optional[torch.Tensor] = None,
                        activation: Optional[ClampedSwiGLU] = None) -> torch.Tensor:
    """fused_moe's result with each token's row independent of the other tokens: on CUDA the GEMV
    path at every size with the one-token tiles (each (token, expert) pair one program, the k
    slots summed in order); on the CPU the reference over linear_invariant_cpu's fixed chunks."""
    if use_triton(x):
        num_experts, two_i, hidden = w13.shape
        config = moe_config(num_experts, two_i // 2, hidden, 1, topk_ids.shape[1], x.dtype, path="gemv")
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, config=config, w13_bias=w13_bias,
                                w2_bias=w2_bias, activation=activation)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation,
                         linear=linear_invariant_cpu)


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


def paged_attention_invariant_cpu(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out=None,
                                  sliding_window: Optional[int] = None, kv_scale: Optional[torch.Tensor] = None):
    """paged_attention_ref's semantics, computed in fp32 by fixed-shape blocks (module docstring)."""
    _check_kv_scale(k_cache, kv_scale)
    if out is None:
        out = torch.empty_like(q)
    heads, dim = q.shape[1], q.shape[2]
    group = heads // k_cache.shape[2]
    for b, start, end, seq_len in _live_requests(query_start_loc, seq_lens):
        q_len = end - start
        ctx = seq_len - q_len
        blocks = -(-seq_len // KEY_BLOCK)
        keys = blocks * KEY_BLOCK
        k, v = _gather_kv(k_cache, v_cache, block_tables[b], 0, seq_len, kv_scale)
        k = F.pad(k.float(), (0, 0, 0, 0, 0, keys - seq_len))
        v = F.pad(v.float(), (0, 0, 0, 0, 0, keys - seq_len))
        # [1, Hq, blocks, KEY_BLOCK, D]; V with a column of ones, so one product also sums p.
        kb = k.view(blocks, KEY_BLOCK, -1, dim).permute(2, 0, 1, 3).repeat_interleave(group, 0).unsqueeze(0)
        vb = v.view(blocks, KEY_BLOCK, -1, dim).permute(2, 0, 1, 3).repeat_interleave(group, 0)
        v_ext = torch.cat([vb, vb.new_ones(vb.shape[:-1] + (1,))], dim=-1).unsqueeze(0)
        kt = kb.transpose(-1, -2).contiguous()
        chunks = -(-q_len // QUERY_ROWS)
        rows = chunks * QUERY_ROWS
        qf = F.pad(q[start:end].float(), (0, 0, 0, 0, 0, rows - q_len))
        qc = qf.view(chunks, QUERY_ROWS, heads, dim).permute(0, 2, 1, 3).unsqueeze(2)  # [C, Hq, 1, R, D]
        # Padding rows take the last query's position (finite, then dropped).
        q_pos = (ctx + torch.arange(rows, device=q.device)).clamp(max=seq_len - 1).view(chunks, 1, 1, QUERY_ROWS, 1)
        k_pos = torch.arange(keys, device=q.device).view(1, 1, blocks, 1, KEY_BLOCK)
        per = max(1, _SCORE_BYTES // (QUERY_ROWS * heads * keys * 4))
        res = []
        for c in range(0, chunks, per):
            qp = q_pos[c:c + per]
            s = torch.matmul(qc[c:c + per], kt) * scale  # [c, Hq, blocks, R, KEY_BLOCK]
            visible = k_pos <= qp
            if sliding_window is not None:
                visible = visible & (k_pos > qp - sliding_window)
            s = s.masked_fill(~visible, float("-inf"))
            m = s.amax(dim=(2, 4), keepdim=True)
            o = torch.matmul(torch.exp(s - m), v_ext)  # [c, Hq, blocks, R, D + 1]
            acc = o[:, :, 0]
            for j in range(1, blocks):  # in position order
                acc = acc + o[:, :, j]
            res.append(acc[..., :dim] / acc[..., dim:])
        o = torch.cat(res).permute(0, 2, 1, 3).reshape(rows, heads, dim)
        out[start:end] = o[:q_len].to(out.dtype)
    return out


def paged_attention_invariant(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out=None,
                              sliding_window: Optional[int] = None, kv_scale: Optional[torch.Tensor] = None,
                              max_query_len: Optional[int] = None):
    """Dispatch: the Triton kernel with the fixed tiles on CUDA, the fixed-block torch path elsewhere.
    max_query_len (a host int, optional) only picks the kernel's grid (decode or not)."""
    if use_triton(q):
        tiles = bi_attention_tiles(q.shape[1], k_cache.shape[2], q.shape[2])
        return paged_attention_triton(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out,
                                      max_query_len=max_query_len, sliding_window=sliding_window,
                                      kv_scale=kv_scale, **tiles)
    return paged_attention_invariant_cpu(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out,
                                         sliding_window, kv_scale)
