"""Gemma 2's attention logit soft-capping (score -> cap * tanh(score / cap)) in the Triton paged
attention kernel against the torch reference, in Triton's interpreter: prefill, chunked prefill and
decode in one batch, with and without a sliding window, the keys split or not."""

import pytest
import torch

from tests.kernels.common import INTERPRETER, rel_err
from tests.kernels.test_attention import MIXED, make_batch
from tokenmill.kernels.attention import paged_attention_ref, paged_attention_triton

CAP = 0.5  # far below the scores' spread, so the cap changes the output


@pytest.mark.skipif(not INTERPRETER, reason="Triton on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("window,num_splits", [(None, 1), (None, 3), (5, 1), (21, 3)])
def test_softcap_matches_reference_cpu(window, num_splits):
    batch = make_batch(MIXED + [(20, 75)], num_q_heads=6, num_kv_heads=2, head_dim=64, page_size=16,
                       dtype=torch.float32, device="cpu", extra_tokens=2, fused_qkv=True)
    batch.q.mul_(8.0)  # scores of several units, well past the cap
    n = batch.num_tokens
    ref = paged_attention_ref(*batch.args(), sliding_window=window, softcap=CAP)
    uncapped = paged_attention_ref(*batch.args(), sliding_window=window)
    assert rel_err(uncapped[:n], ref[:n]) > 1e-2
    out = torch.full_like(batch.q, float("nan"))
    paged_attention_triton(*batch.args(), out=out, sliding_window=window, softcap=CAP,
                           max_query_len=batch.max_query_len, num_splits=num_splits, block_m=16, block_n=16)
    assert not out[:n].isnan().any()
    assert rel_err(out[:n], ref[:n]) < 1e-5
