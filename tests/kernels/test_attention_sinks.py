"""gpt-oss's attention sinks (a learned logit per q head in the softmax's denominator, with no value)
in the Triton paged attention kernel against the torch reference, in Triton's interpreter: prefill,
chunked prefill and decode in one batch, with and without a sliding window, the keys split or not.
The reference itself is checked against HF's formulation (concatenate the sink, softmax, drop it)."""

import pytest
import torch

from tests.kernels.common import INTERPRETER, rel_err
from tests.kernels.test_attention import MIXED, make_batch
from tokenmill.kernels.attention import paged_attention, paged_attention_ref, paged_attention_triton

HEADS, KV_HEADS = 6, 2


def _sinks() -> torch.Tensor:
    # large enough against the scores (a few units) to take a visible share of each row
    return torch.linspace(-1.0, 3.0, HEADS)


def _batch():
    batch = make_batch(MIXED + [(20, 75)], num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=64, page_size=16,
                       dtype=torch.float32, device="cpu", extra_tokens=2, fused_qkv=True)
    batch.q.mul_(4.0)
    return batch


def test_reference_is_hf_eager_softmax():
    """One request, a whole prompt: the reference equals HF's eager gpt-oss attention on the same q/k/v."""
    torch.manual_seed(0)
    batch = make_batch([(9, 9)], num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=16, page_size=4,
                       dtype=torch.float32, device="cpu")
    sinks = _sinks()
    out = paged_attention_ref(*batch.args(), sinks=sinks)
    q, k_cache, v_cache, _, _, block_tables, scale = batch.args()[:7]
    n = 9
    blocks = block_tables[0].long()
    k = k_cache[blocks].flatten(0, 1)[:n].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
    v = v_cache[blocks].flatten(0, 1)[:n].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
    logits = q[:n].transpose(0, 1) @ k.transpose(1, 2) * scale
    logits = logits + torch.triu(torch.full((n, n), float("-inf")), 1)
    combined = torch.cat([logits, sinks[:, None, None].expand(-1, n, 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    expected = (probs @ v).transpose(0, 1)
    assert rel_err(out[:n], expected) < 1e-6
    assert rel_err(paged_attention(*batch.args(), sinks=sinks)[:n], expected) < 1e-6  # the CPU dispatch


@pytest.mark.skipif(not INTERPRETER, reason="Triton on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("window,num_splits", [(None, 1), (None, 3), (21, 1), (5, 3)])
def test_sinks_match_reference_cpu(window, num_splits):
    batch = _batch()
    n = batch.num_tokens
    sinks = _sinks()
    ref = paged_attention_ref(*batch.args(), sliding_window=window, sinks=sinks)
    plain = paged_attention_ref(*batch.args(), sliding_window=window)
    assert rel_err(plain[:n], ref[:n]) > 1e-2  # the sinks change the output
    out = torch.full_like(batch.q, float("nan"))
    paged_attention_triton(*batch.args(), out=out, sliding_window=window, sinks=sinks,
                           max_query_len=batch.max_query_len, num_splits=num_splits, block_m=16, block_n=16)
    assert not out[:n].isnan().any()
    assert rel_err(out[:n], ref[:n]) < 1e-5
