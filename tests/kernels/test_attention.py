"""Paged attention and the KV-cache write: the Triton kernels against the torch references.

The CPU cases run the kernels in Triton's interpreter at small shapes (fp32, tight tolerance);
the CUDA cases use real model shapes in fp32 / bf16 / fp16.
"""

import math
import random
from dataclasses import dataclass

import pytest
import torch

from tokenmill.kernels.attention import (
    attention_variants,
    choose_num_splits,
    launch_plan,
    paged_attention,
    paged_attention_ref,
    paged_attention_sdpa,
    paged_attention_triton,
    write_kv_cache,
    write_kv_cache_ref,
    write_kv_cache_triton,
)
from tests.kernels.common import DEVICES, INTERPRETER, rel_err  # noqa: F401

GPU_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    scale: float
    num_tokens: int  # rows that belong to real requests
    max_query_len: int
    max_seq_len: int

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.query_start_loc, self.seq_lens,
                self.block_tables, self.scale)


def make_batch(reqs, num_q_heads, num_kv_heads, head_dim, page_size, dtype, device,
               extra_tokens=0, fused_qkv=False, seed=0) -> Batch:
    """reqs: (q_len, seq_len) per request; (0, 0) is a padding entry. Pages are scattered randomly
    over a cache filled with random values, and unused block-table entries hold -1."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_req = [math.ceil(s / page_size) for _, s in reqs]
    num_pages = sum(pages_per_req) + 3
    max_pages = max(max(pages_per_req), 1) + 1
    perm = torch.randperm(num_pages, generator=gen)
    block_tables = torch.full((len(reqs), max_pages), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_req):
        block_tables[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    cache_shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    q_lens = [q for q, _ in reqs]
    tokens = sum(q_lens) + extra_tokens
    if fused_qkv:  # q as a strided view of a [T, (Hq + 2 Hk) D] projection output
        qkv = torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
        q = qkv.to(device)[:, : num_q_heads * head_dim].view(tokens, num_q_heads, head_dim)
    else:
        q = torch.randn(tokens, num_q_heads, head_dim, generator=gen).to(dtype).to(device)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return Batch(
        q=q, k_cache=k_cache.to(device), v_cache=v_cache.to(device),
        query_start_loc=qsl.to(device), seq_lens=torch.tensor([s for _, s in reqs], dtype=torch.int32).to(device),
        block_tables=block_tables.to(device), scale=head_dim ** -0.5, num_tokens=sum(q_lens),
        max_query_len=max(q_lens), max_seq_len=max(s for _, s in reqs),
    )


def run_and_check(batch: Batch, tol: float, sliding_window=None, **hints) -> None:
    ref = paged_attention_ref(*batch.args(), sliding_window=sliding_window)
    out = torch.full_like(batch.q, float("nan"))  # poison: every real row must be written
    result = paged_attention_triton(*batch.args(), out=out, sliding_window=sliding_window, **hints)
    assert result is out
    n = batch.num_tokens
    assert not out[:n].isnan().any(), "unwritten output rows"
    assert out[n:].isnan().all(), "rows of no request must be left alone"
    err = rel_err(out[:n], ref[:n])
    assert err < tol, (err, hints)


# Requests: a fresh prefill, decodes, padding, chunked prefills with context (seq_len > q_len),
# a context that ends exactly on a page boundary, and a trailing padding entry.
MIXED = [(5, 5), (1, 37), (0, 0), (7, 40), (1, 1), (12, 48), (0, 0)]
DECODE = [(1, 37), (1, 1), (0, 0), (1, 64), (1, 100), (0, 0)]


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mixed_batch_cpu(page_size, num_splits):
    if not INTERPRETER:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    batch = make_batch(MIXED, num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=page_size,
                       dtype=torch.float32, device="cpu", extra_tokens=2, fused_qkv=True)
    # Small tiles so requests span several query tiles and the diagonal spans several key tiles.
    run_and_check(batch, 1e-5, max_query_len=batch.max_query_len, num_splits=num_splits,
                  block_m=16, block_n=16)


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_decode_batch_cpu(num_splits):
    if not INTERPRETER:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    batch = make_batch(DECODE, num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=16,
                       dtype=torch.float32, device="cpu", extra_tokens=1)
    # num_splits=None with max_seq_len unknown exercises the CUDA-graph rule (splits from B, Hk only).
    run_and_check(batch, 1e-5, max_query_len=1, num_splits=num_splits)


def test_default_config_and_hints_cpu():
    """Default tiles, no hints at all (max_query_len falls back to T), GQA group 1, head_dim 32."""
    if not INTERPRETER:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    batch = make_batch([(9, 20), (1, 17), (0, 0), (3, 3)], num_q_heads=2, num_kv_heads=2, head_dim=32,
                       page_size=16, dtype=torch.float32, device="cpu")
    run_and_check(batch, 1e-5)
    run_and_check(batch, 1e-5, max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len)


def test_long_prompt_tiles_cpu():
    """Long prompts with 128-dim heads take 256-row query tiles (64 tokens x a group of 4), in
    16-bit; checked here in fp32 through the hints, with prompts that end inside a tile."""
    from tokenmill.kernels.attention import attention_config

    long_prompts = attention_config(4096, 4, 128, torch.bfloat16, 4096.0)
    assert (long_prompts["block_m"], long_prompts["block_n"], long_prompts["num_warps"]) == (256, 64, 16)
    assert attention_config(4096, 4, 128, torch.bfloat16, 8.0)["block_m"] == 64  # chunk among decodes
    assert attention_config(4096, 4, 64, torch.bfloat16, 4096.0)["block_m"] == 128
    if not INTERPRETER:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    batch = make_batch([(70, 70), (1, 30), (130, 150)], num_q_heads=8, num_kv_heads=2, head_dim=128,
                       page_size=16, dtype=torch.float32, device="cpu")
    run_and_check(batch, 1e-5, max_query_len=batch.max_query_len, block_m=256, block_n=64)


def test_fp16_cpu():
    if not INTERPRETER:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    batch = make_batch([(4, 20), (1, 33)], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                       dtype=torch.float16, device="cpu")
    run_and_check(batch, 1e-2, max_query_len=4, num_splits=2)


# Windows: a single key (only the query itself), shorter than a key tile, a page, and several tiles.
WINDOWS = [1, 5, 16, 21]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_sliding_window_mixed_cpu(window, num_splits):
    """Prefill, chunked prefill (context beyond the window) and decode in one batch, with a window."""
    if not INTERPRETER:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    batch = make_batch(MIXED + [(30, 30), (20, 75)], num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=16,
                       dtype=torch.float32, device="cpu", extra_tokens=2, fused_qkv=True)
    run_and_check(batch, 1e-5, sliding_window=window, max_query_len=batch.max_query_len, num_splits=num_splits,
                  block_m=16, block_n=16)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_sliding_window_decode_cpu(window, num_splits):
    if not INTERPRETER:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
    batch = make_batch(DECODE, num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=16,
                       dtype=torch.float32, device="cpu", extra_tokens=1)
    run_and_check(batch, 1e-5, sliding_window=window, max_query_len=1, max_seq_len=batch.max_seq_len,
                  num_splits=num_splits, block_n=16)


def test_sliding_window_ref_semantics():
    """HF's window: a query at p sees keys in (p - W, p]. W = 1 sees only itself; W = 2 also p - 1;
    a window of at least the sequence changes nothing."""
    batch = make_batch([(6, 6), (2, 40)], 2, 1, 8, 16, torch.float32, "cpu")
    own = paged_attention_ref(*batch.args(), sliding_window=1)
    v = batch.v_cache[batch.block_tables[0, 0].long(), :6]  # request 0's values, [6, Hk, D]
    torch.testing.assert_close(own[:6], v.expand(6, 2, 8), rtol=1e-6, atol=1e-6)
    two = paged_attention_ref(*batch.args(), sliding_window=2)
    assert not torch.allclose(two[1:6], own[1:6])
    torch.testing.assert_close(two[0], own[0])  # position 0 has no earlier key
    whole = paged_attention_ref(*batch.args(), sliding_window=40)
    torch.testing.assert_close(whole, paged_attention_ref(*batch.args()))


SDPA_CASES = [MIXED, DECODE, [(40, 40), (17, 17), (64, 100)]]


@pytest.mark.parametrize("reqs", SDPA_CASES, ids=["mixed", "decode", "prefill"])
@pytest.mark.parametrize("window", [None, 1, 5, 21, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sdpa_matches_reference(reqs, window, dtype):
    """The CPU path (torch's fused attention over gathered blocks) against the oracle."""
    batch = make_batch(reqs, num_q_heads=6, num_kv_heads=2, head_dim=32, page_size=16, dtype=dtype,
                       device="cpu", extra_tokens=2, fused_qkv=True)
    ref = paged_attention_ref(*batch.args(), sliding_window=window)
    out = paged_attention_sdpa(*batch.args(), sliding_window=window)
    n = batch.num_tokens
    assert rel_err(out[:n], ref[:n]) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_choose_num_splits():
    assert choose_num_splits(512, None) == 1  # the grid fills the GPU already
    assert choose_num_splits(8, 100) == 1  # too few keys to split
    assert choose_num_splits(8, 32768) == 32
    assert 1 < choose_num_splits(8, None) <= 16  # CUDA graphs: B and Hk only
    assert choose_num_splits(64, 8192) == 5


GPU_MODELS = {  # name: (q heads, kv heads, head_dim)
    "qwen3-0.6b": (16, 8, 128),
    "llama3-8b": (32, 8, 128),
    "smollm2-360m": (15, 5, 64),
}


GPU_CASES = [("qwen3-0.6b", torch.bfloat16), ("qwen3-0.6b", torch.float32), ("llama3-8b", torch.bfloat16),
             ("smollm2-360m", torch.bfloat16), ("smollm2-360m", torch.float16)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model,dtype", GPU_CASES, ids=[f"{m}-{str(d)[6:]}" for m, d in GPU_CASES])
@pytest.mark.parametrize("kind", ["prefill", "mixed", "decode", "decode-long"])
@pytest.mark.parametrize("window", [None, 1, 100], ids=["full", "window-1", "window-100"])
def test_real_shapes_gpu(model, dtype, kind, window):
    hq, hk, d = GPU_MODELS[model]
    gen = torch.Generator().manual_seed(0)
    if kind == "prefill":
        reqs = [(int(n), int(n)) for n in torch.randint(1, 700, (4,), generator=gen)]
    elif kind == "mixed":
        reqs = [(1, int(s)) for s in torch.randint(1, 3000, (20,), generator=gen)]
        reqs += [(300, 1500), (0, 0), (64, 64), (17, 2000), (0, 0)]
    elif kind == "decode":
        reqs = [(1, int(s)) for s in torch.randint(1, 4000, (64,), generator=gen)] + [(0, 0)] * 3
    else:
        reqs = [(1, 20000), (1, 777)]
    for page_size in (16, 32):
        batch = make_batch(reqs, hq, hk, d, page_size, dtype, "cuda", extra_tokens=3)
        mql = batch.max_query_len
        run_and_check(batch, GPU_TOL[dtype], window, max_query_len=mql, max_seq_len=batch.max_seq_len)
        run_and_check(batch, GPU_TOL[dtype], window, max_query_len=mql)  # as inside a CUDA graph
        run_and_check(batch, GPU_TOL[dtype], window, max_query_len=mql, num_splits=7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_cuda_graph_gpu():
    """A captured decode (no max_seq_len, so the split count comes from B and Hk only) replays
    correctly after seq_lens and block tables change in place."""
    batch = make_batch([(1, 3000), (1, 3000), (1, 3000), (0, 0)], 32, 8, 128, 16, torch.bfloat16, "cuda")
    out = torch.full_like(batch.q, float("nan"))
    paged_attention_triton(*batch.args(), out=out, max_query_len=1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_triton(*batch.args(), out=out, max_query_len=1)
    batch.seq_lens.copy_(torch.tensor([2000, 10, 3001, 0], dtype=torch.int32))
    batch.block_tables[:3].copy_(batch.block_tables[:3].flip(0).clone())
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_attention_ref(*batch.args())
    assert rel_err(out[:3], ref[:3]) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_write_kv_cache(device, slot_dtype):
    torch.manual_seed(0)
    if device == "cpu":
        tokens, hk, d, page, pages, dtypes = 7, 2, 64, 16, 4, [torch.float32]
    else:
        tokens, hk, d, page, pages, dtypes = 700, 8, 128, 16, 128, [torch.float32, torch.bfloat16]
    for dtype in dtypes:
        kv = torch.randn(tokens, 3 * hk * d, device=device, dtype=dtype)  # strided views, as from qkv
        k = kv[:, : hk * d].view(tokens, hk, d)
        v = kv[:, hk * d: 2 * hk * d].view(tokens, hk, d)
        slots = torch.randperm(pages * page, device=device)[:tokens].to(slot_dtype)
        slots[1] = -1  # padding tokens are skipped
        slots[-1] = -1
        caches = [torch.full((pages, page, hk, d), float("nan"), device=device, dtype=dtype) for _ in range(4)]
        write_kv_cache_ref(k, v, caches[0], caches[1], slots)
        write_kv_cache_triton(k, v, caches[2], caches[3], slots)
        # NaN marks untouched slots: equal_nan checks both the written values and the skipped ones.
        assert torch.equal(caches[0].isnan(), caches[2].isnan())
        assert torch.equal(caches[1].isnan(), caches[3].isnan())
        torch.testing.assert_close(caches[2], caches[0], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(caches[3], caches[1], rtol=0, atol=0, equal_nan=True)


def test_dispatch_cpu_uses_sdpa():
    batch = make_batch([(3, 5), (1, 9)], 4, 2, 16, 16, torch.float32, "cpu")
    torch.testing.assert_close(paged_attention(*batch.args(), max_query_len=3, sliding_window=4),
                               paged_attention_sdpa(*batch.args(), sliding_window=4), rtol=0, atol=0)
    k = torch.randn(2, 2, 16)
    c1, c2 = torch.zeros(2, 16, 2, 16), torch.zeros(2, 16, 2, 16)
    write_kv_cache(k, k, c1, c2, torch.tensor([3, 20]))
    assert torch.equal(c1[0, 3], k[0]) and torch.equal(c2[1, 4], k[1])


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype,kv_fp8", [(32, 8, 128, torch.bfloat16, False),
                                                                  (32, 8, 128, torch.bfloat16, True),
                                                                  (16, 8, 128, torch.bfloat16, False),
                                                                  (4, 2, 64, torch.float32, False)])
def test_attention_variants_cover_every_launch(heads, kv_heads, head_dim, dtype, kv_fp8):
    """Warm-up compiles attention_variants(); any step shape must select one of them (else it
    compiles under load), and each variant's small shape must select exactly that variant; with
    an e4m3 cache too, whose decode tiles differ."""
    max_tokens, max_reqs = 8192, 256
    variants = attention_variants(heads, kv_heads, head_dim, dtype, max_tokens, max_reqs, kv_fp8=kv_fp8)
    keys = {plan.compile_key for plan, _, _ in variants}
    assert len(keys) == len(variants)
    for plan, tokens, reqs in variants:
        mql = 1 if plan.decode_only else tokens - reqs + 1
        again = launch_plan(tokens, reqs, heads, kv_heads, head_dim, dtype, mql, None, plan.num_splits,
                            block_m=plan.block_m, block_n=plan.block_n, num_warps=plan.num_warps,
                            num_stages=plan.num_stages, kv_fp8=kv_fp8)
        assert again.compile_key == plan.compile_key
    rng = random.Random(0)
    for _ in range(3000):
        reqs = rng.randint(1, max_reqs)
        tokens = reqs if rng.random() < 0.5 else rng.randint(reqs, max_tokens)
        mql = 1 if tokens == reqs else rng.randint(2, tokens - reqs + 1)
        max_seq_len = rng.choice([None, rng.randint(mql, 1 << 17)])
        plan = launch_plan(tokens, reqs, heads, kv_heads, head_dim, dtype, mql, max_seq_len, kv_fp8=kv_fp8)
        assert plan.compile_key in keys, (tokens, reqs, mql, max_seq_len)
    if kv_fp8:  # decode over an e4m3 cache: 128 keys a tile, 3 stages
        plan = launch_plan(110, 110, heads, kv_heads, head_dim, dtype, 1, 700, kv_fp8=True)
        assert (plan.block_n, plan.num_stages) == (128, 3)
