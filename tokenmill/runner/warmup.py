"""Compiling kernels before the first request.

A Triton kernel compiles the first time a launch selects a new specialization; under load, that
compile (about 1.3 s for the attention kernel on the H200) stalls every running request. The
decode graphs compile what they capture; the rest is compiled here: the model forward at a few
step shapes, every attention variant (tile config x decode grid x split-KV) a step can select, and
the token-bitmask kernel of structured output (the first grammar request would compile it).
"""

import numpy as np
import torch

from tokenmill.kernels.attention import attention_variants, is_fp8_kv, paged_attention
from tokenmill.logger import init_logger
from tokenmill.runner.dummy_batch import fill_dummy_batch

logger = init_logger(__name__)

# Step shapes whose forward passes run once: queries per request of 1, 8, 16, 24 and >= 64, the
# split-KV prefill of one long request, and the largest step.
_FORWARD_SHAPES = ((None, 4), (1024, 1), (64, 8), (32, 2), (96, 4), (257, 3), (3, 3))


def warm_up_forward(runner) -> None:
    for num_tokens, num_reqs in _FORWARD_SHAPES:
        runner.dummy_run(min(num_tokens or runner.max_num_tokens, runner.max_num_tokens), num_reqs)


def warm_up_cpu_batch_invariant(runner) -> None:
    """Batch-invariant mode on the CPU: a prefill and a decode pass before the first request. In
    one fresh process of 30 (2026-12-02, 2 threads), the very first batched products of the
    fixed-block attention rounded the rows of one thread differently from every later call
    (tests/kernels/test_batch_invariant.py); after one warm-up call, 30 of 30 agreed."""
    for num_tokens, num_reqs in ((min(64, runner.max_num_tokens), 2), (2, 2)):
        runner.dummy_run(num_tokens, num_reqs)


def warm_up_token_bitmask(runner) -> None:
    """The grammar stage's kernel at the logits' width (the sampler's float32 work copy)."""
    from tokenmill.kernels.token_bitmask import apply_token_bitmask

    vocab = runner.vocab_size
    logits = torch.zeros((2, vocab), dtype=torch.float32, device=runner.device)
    apply_token_bitmask(logits, torch.full((2, -(-vocab // 32)), -1, dtype=torch.int32, device=runner.device))


def warm_up_attention(runner) -> int:
    """Launch every attention variant once on a tiny input (layer 0's cache, the runner's own
    metadata buffers, so strides and alignment match real steps); returns how many ran. In
    batch-invariant mode none: every step takes the one tile config, whose decode and prefill grids
    warm_up_forward's passes compiled."""
    spec = runner.attn_spec
    if runner.config.batch_invariant or spec.latent:  # MLA's kernels compile in warm_up_forward's passes
        return 0
    k_cache, v_cache = runner.kv_caches[0]
    # An FP8 cache's kernels take the scales' pointer (any value compiles the same variant).
    kv_scale = torch.ones(2, dtype=torch.float32, device=runner.device) if is_fp8_kv(k_cache) else None
    # Models with attention sinks compile the SINKS variants (any values do).
    sinks = torch.zeros(spec.num_heads, dtype=runner.dtype, device=runner.device) if spec.sinks else None
    variants = attention_variants(spec.num_heads, spec.num_kv_heads, spec.head_dim, runner.dtype,
                                  runner.max_num_tokens, runner.config.max_num_seqs, kv_fp8=kv_scale is not None)
    windows = spec.layer_windows or (spec.sliding_window,)  # sliding and full layers: each its own variants
    for window in windows:
        for plan, tokens, num_reqs in variants:
            q_lens = np.full(num_reqs, 1, dtype=np.int64)
            q_lens[0] += tokens - num_reqs  # one request takes the longest query
            meta = fill_dummy_batch(runner.buffers, q_lens)
            q = torch.zeros((tokens, spec.num_heads, spec.head_dim), dtype=runner.dtype, device=runner.device)
            paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, spec.scale,
                            sliding_window=window, max_query_len=meta.max_query_len,
                            num_splits=plan.num_splits, block_m=plan.block_m, block_n=plan.block_n,
                            num_warps=plan.num_warps, num_stages=plan.num_stages, kv_scale=kv_scale,
                            sinks=sinks)
    return len(variants) * len(windows)


def warm_up_lora(runner) -> int:
    """With LoRA: every specialization of the shrink and expand kernels a step can select (their
    launch configs change with the token count, and Triton specializes the count itself on
    divisibility by 16), launched once per projection shape on zero inputs; returns how many ran.
    Steps above one token take the unfused path, whose LoRA input needs no prologue; one-token
    steps run the shrink with the layer's prologue (and residual) before the fused GEMV, whose
    LoRA epilogue the decode graphs' eager warm-up compiles with the rest of the batch-1 path."""
    from tokenmill.kernels.lora import lora_expand, lora_expand_config, lora_shrink, lora_shrink_config
    from tokenmill.kernels.skinny_gemm import ADD_RMSNORM, PLAIN, SILU_MUL

    lora = runner.lora
    if lora is None:
        return 0
    launched = 0
    seen: set = set()
    for layer in lora.slots.layers.values():
        r_total, k = layer.a.shape[1], layer.a.shape[2]
        n = layer.b.shape[1]
        wanted: dict = {}
        for t in range(1, runner.max_num_tokens + 1):
            key = (r_total, k, n, layer.rank, layer.slice_starts, t == 1, t % 16 == 0,
                   tuple(sorted(lora_shrink_config(t, r_total, k, PLAIN).items())),
                   tuple(sorted(lora_expand_config(t, n, layer.rank).items())))
            if key not in seen:
                seen.add(key)
                wanted[key] = t
        for t in wanted.values():
            x = torch.zeros((t, k), dtype=runner.dtype, device=runner.device)
            y = torch.zeros((t, n), dtype=runner.dtype, device=runner.device)
            slots = torch.ones(t, dtype=torch.int32, device=runner.device)
            s = lora_shrink(x, layer.a, slots, PLAIN)
            lora_expand(s, layer.b, slots, y, layer.rank, layer.slice_starts)
            launched += 1
        one = torch.ones(1, dtype=torch.int32, device=runner.device)
        x = torch.zeros((1, 2 * k), dtype=runner.dtype, device=runner.device)
        norm_weight = torch.ones(k, dtype=runner.dtype, device=runner.device)
        for prologue, residual in ((SILU_MUL, None), (ADD_RMSNORM, None), (ADD_RMSNORM, x[:, :k])):
            key = (r_total, k, prologue, residual is None)
            if key not in seen:
                seen.add(key)
                lora_shrink(x if prologue == SILU_MUL else x[:, :k], layer.a, one, prologue, norm_weight,
                            residual=residual)
                launched += 1
    return launched
