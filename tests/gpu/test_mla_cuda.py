"""The MLA latent decode kernel on CUDA at DeepSeek's shapes (kv_lora_rank 512, rope 64; 16 heads as
V2-Lite, 128 as V3), contexts of 4k-32k in bf16 (and fp32), against its torch reference; inside a
CUDA graph (fixed splits, the context lengths changed between replays); the cache write; and
DeepSeek-V3's grouped routing kernel at its real shape."""

import pytest
import torch

from tests.kernels.common import rel_err
from tokenmill.kernels.mla_attention import (mla_cache_write_ref, mla_cache_write_triton, mla_decode_ref,
                                             mla_decode_triton)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

R, P, PAGE = 512, 64, 16


def _batch(seq_lens: list[int], heads: int, dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = [-(-n // PAGE) for n in seq_lens]
    num_blocks = sum(pages) + 1
    order = torch.randperm(num_blocks - 1, generator=gen, device="cuda").to(torch.int32) + 1
    tables = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(pages):
        tables[b, :n] = order[used:used + n]
        used += n
    cache = torch.randn(num_blocks, PAGE, 1, R + P, generator=gen, device="cuda").to(dtype)
    q_lat = torch.randn(len(seq_lens), heads, R, generator=gen, device="cuda").to(dtype)
    q_pe = torch.randn(len(seq_lens), heads, P, generator=gen, device="cuda").to(dtype)
    return q_lat, q_pe, cache, tables, torch.tensor(seq_lens, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("seq_lens", [[4096], [32768], [4096, 8191, 16384, 32768, 1, 777]], ids=["4k", "32k", "mixed"])
def test_decode_bf16_matches_reference(heads, seq_lens):
    q_lat, q_pe, cache, tables, lens = _batch(seq_lens, heads, torch.bfloat16)
    scale = 192 ** -0.5
    ref = mla_decode_ref(q_lat.float(), q_pe.float(), cache.float(), tables, lens, scale)
    out = mla_decode_triton(q_lat, q_pe, cache, tables, lens, scale, max_seq_len=max(seq_lens))
    assert out.dtype == torch.bfloat16 and rel_err(out.float(), ref) < 1e-2


def test_decode_fp32_matches_reference():
    q_lat, q_pe, cache, tables, lens = _batch([5000, 17, 12000], 16, torch.float32, seed=1)
    ref = mla_decode_ref(q_lat, q_pe, cache, tables, lens, 0.07)
    for splits in (1, 7, 64):
        assert rel_err(mla_decode_triton(q_lat, q_pe, cache, tables, lens, 0.07, num_splits=splits), ref) < 1e-5


def test_decode_in_a_cuda_graph():
    """Captured once with fixed splits (as the decode graphs capture it), replayed with longer contexts."""
    q_lat, q_pe, cache, tables, lens = _batch([8192, 8192, 8192, 8192], 16, torch.bfloat16, seed=2)
    lens.copy_(torch.tensor([100, 2000, 50, 7], dtype=torch.int32))
    out = torch.empty_like(q_lat)
    mla_decode_triton(q_lat, q_pe, cache, tables, lens, 0.1, num_splits=8, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode_triton(q_lat, q_pe, cache, tables, lens, 0.1, num_splits=8, out=out)
    for new in ([8192, 1, 4000, 300], [17, 8192, 8192, 5000]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        ref = mla_decode_ref(q_lat.float(), q_pe.float(), cache.float(), tables, lens, 0.1)
        assert rel_err(out.float(), ref) < 1e-2


def test_cache_write_bf16():
    gen = torch.Generator(device="cuda").manual_seed(3)
    compressed = torch.randn(300, R + P, generator=gen, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(64 * PAGE, generator=gen, device="cuda")[:300]
    slots[::7] = -1
    ref = torch.zeros(64, PAGE, 1, R + P, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros_like(ref)
    mla_cache_write_ref(ref, compressed[:, :R], compressed[:, R:], slots)
    mla_cache_write_triton(out, compressed[:, :R], compressed[:, R:], slots)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_grouped_routing_at_v3_shape(tokens):
    """DeepSeek-V3's routing on CUDA (256 experts in 8 groups, the best 4 groups, top 8, sigmoid with
    the correction bias, renormalised, x 2.5): the Triton kernel against its reference."""
    from tokenmill.kernels.fused_moe import GroupedTopK, moe_route_grouped_ref, moe_route_grouped_triton

    gen = torch.Generator(device="cuda").manual_seed(4)
    logits = torch.randn(tokens, 256, generator=gen, device="cuda")
    bias = torch.randn(256, generator=gen, device="cuda") * 0.1
    grouping = GroupedTopK("sigmoid", 8, 4, "top2_sum", 2.5)
    ref_w, ref_ids = moe_route_grouped_ref(logits, 8, True, grouping, bias)
    weights, ids = moe_route_grouped_triton(logits, 8, True, grouping, bias)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)
