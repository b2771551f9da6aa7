"""Multi-head latent attention's kernels against their torch references (kernels/mla_attention.py):
the latent decode (split-K over the context, heads in blocks, pages crossing tiles, empty contexts
of padding rows) and the latent cache write; and the reference's absorbed attention against plain
attention over the expanded per-head keys and values (the identity the decode path rests on).
CPU cases run in Triton's interpreter at tiny shapes; tests/gpu/test_mla_cuda.py has real ones."""

import pytest
import torch

from tests.kernels.common import DEVICES, rel_err
from tokenmill.kernels.mla_attention import (gather_latent, mla_cache_write_ref, mla_cache_write_triton,
                                             mla_decode_ref, mla_decode_triton)

R, P = 32, 8  # latent and rope widths (DeepSeek: 512, 64)


def make_decode_batch(seq_lens: list[int], heads: int, page: int, dtype, device, seed: int = 0, R: int = R,
                      P: int = P):
    """Random queries and a cache whose pages are scattered (block tables shuffled)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in seq_lens]
    num_blocks = sum(pages) + 2
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(len(seq_lens), max(max(pages), 1), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        tables[b, :n] = order[used:used + n]
        used += n
    cache = torch.randn(num_blocks, page, 1, R + P, generator=gen).to(dtype)
    q_lat = torch.randn(len(seq_lens), heads, R, generator=gen).to(dtype)
    q_pe = torch.randn(len(seq_lens), heads, P, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(device) for t in (q_lat, q_pe, cache, tables, lens)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads, page, num_splits", [(4, 16, 1), (4, 4, 3), (20, 8, 2)])
def test_decode_matches_reference(device, heads, page, num_splits):
    """Contexts shorter than a tile, across pages, longer than a split; one empty (padding row)."""
    seq_lens = [1, 37, 70, 0, 5]
    q_lat, q_pe, cache, tables, lens = make_decode_batch(seq_lens, heads, page, torch.float32, device)
    ref = mla_decode_ref(q_lat, q_pe, cache, tables, lens, 0.3)
    out = mla_decode_triton(q_lat, q_pe, cache, tables, lens, 0.3, num_splits=num_splits, min_split=0)
    assert rel_err(out, ref) < 1e-5
    assert torch.equal(out[3], torch.zeros_like(out[3]))  # no context: zeros, not NaN


@pytest.mark.parametrize("device", DEVICES)
def test_decode_splits_from_context_length(device):
    """num_splits chosen by the launcher from the longest context (the eager path); and a grid of
    more splits than min_split lets a context use (as a CUDA graph fixes it): the rest stay empty."""
    q_lat, q_pe, cache, tables, lens = make_decode_batch([300, 9], 2, 16, torch.float32, device, seed=1)
    ref = mla_decode_ref(q_lat, q_pe, cache, tables, lens, 0.2)
    assert rel_err(mla_decode_triton(q_lat, q_pe, cache, tables, lens, 0.2, max_seq_len=300), ref) < 1e-5
    assert rel_err(mla_decode_triton(q_lat, q_pe, cache, tables, lens, 0.2, num_splits=8, min_split=64), ref) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_decode_wide_latent_merges_in_column_blocks(device):
    """A latent wider than the merge's 64 columns (160: three blocks, the last partial), split 4 ways."""
    q_lat, q_pe, cache, tables, lens = make_decode_batch([50, 9], 3, 8, torch.float32, device, seed=2, R=160, P=16)
    ref = mla_decode_ref(q_lat, q_pe, cache, tables, lens, 0.1)
    assert rel_err(mla_decode_triton(q_lat, q_pe, cache, tables, lens, 0.1, num_splits=4, min_split=0), ref) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_cache_write_matches_reference(device):
    gen = torch.Generator().manual_seed(2)
    compressed = torch.randn(6, R + P + 3, generator=gen).to(device)  # strided rows, as split from kv_a's output
    latent, k_pe = compressed[:, :R], compressed[:, R:R + P]
    slots = torch.tensor([5, -1, 0, 17, 9, -1], device=device)
    ref = torch.zeros(3, 8, 1, R + P, device=device)
    out = torch.zeros_like(ref)
    mla_cache_write_ref(ref, latent, k_pe, slots)
    mla_cache_write_triton(out, latent, k_pe, slots)
    assert torch.equal(out, ref)
    assert torch.equal(out.view(-1, R + P)[17], torch.cat((latent[3], k_pe[3])))


def test_absorbed_reference_equals_expanded_attention():
    """softmax(q_nope.(W_UK c) + q_pe.k_pe) (W_UV c) per head = W_UV (softmax(...) c) with q_lat = W_UK^T q_nope."""
    gen = torch.Generator().manual_seed(3)
    heads, nope, v, n, scale = 3, 12, 10, 21, 0.25
    q_lat0, q_pe, cache, tables, lens = make_decode_batch([n], heads, 8, torch.float64, "cpu", seed=4)
    w_uk = torch.randn(heads, nope, R, generator=gen, dtype=torch.float64)
    w_uv = torch.randn(heads, v, R, generator=gen, dtype=torch.float64)
    q_nope = torch.randn(1, heads, nope, generator=gen, dtype=torch.float64)
    rows = gather_latent(cache, tables[0], n)
    c, k_pe = rows[:, :R], rows[:, R:]
    k_nope = torch.einsum("hdr,kr->hkd", w_uk, c)
    values = torch.einsum("hvr,kr->hkv", w_uv, c)
    scores = (torch.einsum("hd,hkd->hk", q_nope[0], k_nope) + q_pe[0] @ k_pe.T) * scale
    expanded = torch.einsum("hk,hkv->hv", torch.softmax(scores, dim=-1), values)
    q_lat = torch.einsum("hd,hdr->hr", q_nope[0], w_uk)[None]
    o_lat = mla_decode_ref(q_lat, q_pe, cache, tables, lens, scale)
    absorbed = torch.einsum("hr,hvr->hv", o_lat[0], w_uv)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)  # the reference computes in fp32


def test_num_splits_fill_the_gpu_without_short_splits():
    """Two programs per SM in one wave (132 SMs off the GPU), no split under one 32-token tile when the
    longest context is known, at most 128 (CUDA graphs: the batch alone decides, the device the rest)."""
    from tokenmill.kernels.mla_attention import mla_num_splits

    cpu = torch.device("cpu")
    assert mla_num_splits(1, 16, 32768, cpu) == 128
    assert mla_num_splits(1, 16, 1000, cpu) == 32  # cdiv(1000, 32)
    assert mla_num_splits(8, 16, 4096, cpu) == 33  # 264 // 8
    assert mla_num_splits(64, 16, 4096, cpu) == 4  # 264 // 64: one full wave, not a partial second
    assert mla_num_splits(64, 128, 32768, cpu) == 1  # 64 x 8 head blocks already fill the GPU
    assert mla_num_splits(1, 16, None, cpu) == 128 and mla_num_splits(300, 16, None, cpu) == 1
