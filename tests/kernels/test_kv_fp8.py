"""The FP8 (e4m3) KV cache: every kernel that writes or reads it against the torch references
(kernels/attention.py's quantize_kv_ref, write_kv_cache_ref, paged_attention_ref).

Writes must store the same bytes as the reference (the same IEEE division and round-to-nearest-even
cast); attention over an FP8 cache must equal the reference's attention over the dequantized keys
and values within the usual kernel tolerance (the scales fold into the softmax scale and the
output, so only the fp32 rounding order differs).
"""

import pytest
import torch

from tokenmill.kernels.attention import (
    FP8_KV_DTYPE,
    paged_attention_ref,
    paged_attention_sdpa,
    paged_attention_triton,
    quantize_kv_ref,
    write_kv_cache_ref,
    write_kv_cache_triton,
)
from tokenmill.kernels.qkv_prep import qkv_prep_ref, qkv_prep_triton
from tokenmill.kernels.qkv_rope_gemv import skinny_qkv_rope_ref, skinny_qkv_rope_triton
from tokenmill.layers.rotary import RotaryEmbedding, rope_inv_freq
from tests.kernels.common import DEVICES, rel_err
from tests.kernels.test_attention import DECODE, MIXED, make_batch

KV_SCALE = (0.05, 0.02)  # K and V values of a few units: stored as tens to hundreds


def _scales(device):
    return torch.tensor(KV_SCALE, dtype=torch.float32, device=device)


def _fp8_batch(reqs, dtype, device, **kw):
    """make_batch's batch with its caches quantized to e4m3 (values of a few units)."""
    batch = make_batch(reqs, dtype=torch.float32, device=device, **kw)
    scale = _scales(device)
    batch.k_cache = quantize_kv_ref(3 * batch.k_cache, FP8_KV_DTYPE, scale[0])
    batch.v_cache = quantize_kv_ref(3 * batch.v_cache, FP8_KV_DTYPE, scale[1])
    batch.q = batch.q.to(dtype)
    return batch, scale


def test_quantize_kv_ref_saturates_and_round_trips():
    x = torch.tensor([0.0, 1.0, -2.5, 1e6, -1e6, 0.013])
    scale = torch.tensor(0.5)
    q = quantize_kv_ref(x, FP8_KV_DTYPE, scale)
    assert q.dtype == FP8_KV_DTYPE
    back = q.float() * scale
    assert back[3] == 448 * 0.5 and back[4] == -448 * 0.5  # saturated, never inf/nan
    torch.testing.assert_close(back[:3], x[:3])  # exactly representable
    assert abs(back[5] - 0.013) <= 0.013 * 2 ** -3  # e4m3: 3 mantissa bits
    # Not an FP8 cache: a plain cast, the scale ignored.
    assert torch.equal(quantize_kv_ref(x, torch.bfloat16, None), x.to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
def test_write_stores_the_reference_bytes(device):
    torch.manual_seed(0)
    tokens, heads, dim, page = 9, 2, 64, 16
    k = 4 * torch.randn(tokens, heads, 3 * dim, device=device)[:, :, :dim]  # strided, as from qkv
    v = 4 * torch.randn(tokens, heads, dim, device=device)
    slots = torch.tensor([0, 5, 17, -1, 31, 32, 40, -1, 63], device=device)
    caches = [torch.zeros(4, page, heads, dim, dtype=FP8_KV_DTYPE, device=device) for _ in range(4)]
    write_kv_cache_triton(k, v, caches[0], caches[1], slots, _scales(device))
    write_kv_cache_ref(k, v, caches[2], caches[3], slots, _scales(device))
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    assert caches[0].view(torch.uint8).any()  # something was written


@pytest.mark.parametrize("device", DEVICES)
def test_write_rounds_like_torch_at_every_edge(device):
    """The write kernel's rounding (round_to_e4m3, then the cast) against torch's cast on the values
    where rounding is hard: every e4m3 value, the midpoints between neighbours (ties to even), one
    ulp either side of them, the subnormals and the saturation beyond 448."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid >= 0)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mids, torch.nextafter(mids, torch.zeros_like(mids)),
                        torch.nextafter(mids, torch.full_like(mids, 1e9)), torch.tensor([449.0, 464.0, 500.0, 1e6])])
    values = torch.cat([values, -values])
    heads, dim = 1, 16
    tokens = -(-values.numel() // dim)
    k = torch.zeros(tokens * dim)
    k[: values.numel()] = values
    k = k.view(tokens, heads, dim).to(device)
    slots = torch.arange(tokens, device=device)
    caches = [torch.zeros(-(-tokens // 16), 16, heads, dim, dtype=FP8_KV_DTYPE, device=device) for _ in range(4)]
    ones = torch.ones(2, device=device)
    write_kv_cache_triton(k, k, caches[0], caches[1], slots, ones)
    write_kv_cache_ref(k, k, caches[2], caches[3], slots, ones)
    got, want = caches[0].view(torch.uint8).flatten(), caches[2].view(torch.uint8).flatten()
    assert torch.equal(got, want), (got != want).nonzero()[:5]


def test_fp8_cache_needs_its_scales():
    cache = torch.zeros(2, 16, 1, 16, dtype=FP8_KV_DTYPE)
    k = torch.randn(1, 1, 16)
    with pytest.raises(AssertionError, match="kv_scale"):
        write_kv_cache_ref(k, k, cache, cache.clone(), torch.tensor([0]))


@pytest.mark.parametrize("device", DEVICES)
def test_qkv_prep_writes_the_reference_bytes(device):
    torch.manual_seed(1)
    tokens, hq, hk, dim, page = 5, 4, 2, 32, 16
    qkv = 3 * torch.randn(tokens, (hq + 2 * hk) * dim, device=device)
    q, k, v = qkv.split([hq * dim, hk * dim, hk * dim], dim=-1)
    q, k, v = q.view(tokens, hq, dim), k.view(tokens, hk, dim), v.view(tokens, hk, dim)
    cos_sin = RotaryEmbedding(dim, 256, rope_inv_freq(dim, 10000.0), device=device).cos_sin_cache
    positions = torch.tensor([0, 3, 7, 100, 255], device=device)
    slots = torch.tensor([1, 2, -1, 20, 47], device=device)
    caches = [torch.zeros(3, page, hk, dim, dtype=FP8_KV_DTYPE, device=device) for _ in range(4)]
    q_tri = qkv_prep_triton(positions, q, k, v, cos_sin, caches[0], caches[1], slots, kv_scale=_scales(device))
    q_ref = qkv_prep_ref(positions, q, k, v, cos_sin, caches[2], caches[3], slots, kv_scale=_scales(device))
    assert rel_err(q_tri, q_ref) < 1e-5
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_qkv_rope_gemv_writes_the_reference_bytes(device):
    torch.manual_seed(2)
    hidden, hq, hk, dim, page = 64, 4, 2, 16, 16
    n = (hq + 2 * hk) * dim
    dtype = torch.float32
    inputs = dict(
        x=torch.randn(1, hidden, device=device, dtype=dtype),
        weight=3 * torch.randn(n, hidden, device=device, dtype=dtype) / hidden ** 0.5,
        residual=torch.randn(1, hidden, device=device, dtype=dtype),
        norm_weight=1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype),
        eps=1e-5,
        positions=torch.tensor([37], device=device),
        cos_sin_cache=RotaryEmbedding(dim, 256, rope_inv_freq(dim, 10000.0), device=device).cos_sin_cache,
        slot_mapping=torch.tensor([21], device=device),
    )
    caches = [torch.zeros(3, page, hk, dim, dtype=FP8_KV_DTYPE, device=device) for _ in range(4)]
    q, _ = skinny_qkv_rope_triton(**inputs, k_cache=caches[0], v_cache=caches[1], num_q_heads=hq, num_kv_heads=hk,
                                  kv_scale=_scales(device))
    q_ref, _ = skinny_qkv_rope_ref(**inputs, k_cache=caches[2], v_cache=caches[3], num_q_heads=hq,
                                   num_kv_heads=hk, kv_scale=_scales(device))
    assert rel_err(q, q_ref) < 1e-5
    # One e4m3 step at most where the GEMV's fp32 sum rounds differently from torch's.
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert want.view(torch.uint8).any()
        diff = (got.view(torch.uint8).int() - want.view(torch.uint8).int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 0.05


def _attention_cases(device):
    dtypes = [torch.float32] if device == "cpu" else [torch.bfloat16, torch.float16, torch.float32]
    shapes = [dict(num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=16)]
    if device == "cuda":
        shapes.append(dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16))
    return dtypes, shapes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reqs,num_splits", [(MIXED, 1), (MIXED, 3), (DECODE, 4), (DECODE, 1)])
def test_attention_over_an_fp8_cache(device, reqs, num_splits):
    dtypes, shapes = _attention_cases(device)
    for dtype in dtypes:
        for shape in shapes:
            batch, scale = _fp8_batch(reqs, dtype, device, extra_tokens=1, **shape)
            ref = paged_attention_ref(*batch.args(), kv_scale=scale)
            out = torch.full_like(batch.q, float("nan"))
            hints = dict(max_query_len=batch.max_query_len, num_splits=num_splits)
            if device == "cpu":
                hints.update(block_m=16, block_n=16)
            paged_attention_triton(*batch.args(), out=out, kv_scale=scale, **hints)
            n = batch.num_tokens
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert rel_err(out[:n], ref[:n]) < tol, (dtype, shape, num_splits)
            # The scales matter: the same bytes read with the scale 1.0 give something else.
            ones = torch.ones(2, device=device)
            wrong = paged_attention_ref(*batch.args(), kv_scale=ones)
            assert rel_err(wrong[:n], ref[:n]) > 0.5


def test_sdpa_path_over_an_fp8_cache():
    """The CPU engine path (torch's fused attention on the dequantized keys) against the oracle."""
    batch, scale = _fp8_batch(MIXED, torch.float32, "cpu", num_q_heads=6, num_kv_heads=2, head_dim=64,
                              page_size=16)
    ref = paged_attention_ref(*batch.args(), kv_scale=scale)
    out = paged_attention_sdpa(*batch.args(), kv_scale=scale)
    n = batch.num_tokens
    assert rel_err(out[:n], ref[:n]) < 1e-5
