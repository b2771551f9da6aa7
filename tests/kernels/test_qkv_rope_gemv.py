"""The q/k/v GEMV with rotary and the KV-cache write fused in (1 to 8 tokens), against its torch
reference (the projection, then qkv_prep's reference): interpreter at small shapes on CPU, real
model shapes on CUDA."""

import pytest
import torch

from tokenmill.kernels.qkv_rope_gemv import fusable, skinny_qkv_rope_ref, skinny_qkv_rope_triton
from tokenmill.kernels.skinny_gemm import MAX_ROWS
from tokenmill.layers.rotary import RotaryEmbedding, rope_inv_freq

from tests.kernels.common import DEVICES, TOL, nan_empty, rel_err  # noqa: F401

PAGE = 16


def _cases(device):
    """(hidden, q heads, kv heads, head_dim, dtype): toy shapes on the CPU; Llama-3.1-8B, a model
    with head_dim 64 and the toy shape on CUDA."""
    toy = [(64, 4, 2, 16, torch.float32), (96, 2, 1, 32, torch.float32)]
    if device == "cpu":
        return toy
    return toy + [(4096, 32, 8, 128, torch.bfloat16), (4096, 32, 8, 128, torch.float32),
                  (2048, 32, 8, 64, torch.bfloat16)]


def _step(hidden, hq, hk, d, dtype, device, position, slot, with_residual):
    torch.manual_seed(hidden + hq + d + position)
    n = (hq + 2 * hk) * d
    inputs = dict(
        x=torch.randn(1, hidden, device=device, dtype=dtype),
        weight=torch.randn(n, hidden, device=device, dtype=dtype) / hidden ** 0.5,
        residual=torch.randn(1, hidden, device=device, dtype=dtype) if with_residual else None,
        norm_weight=1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype),
        eps=1e-5,
        positions=torch.tensor([position], device=device, dtype=torch.int64),
        cos_sin_cache=RotaryEmbedding(d, 4096, rope_inv_freq(d, 500000.0, "llama3", 8.0, 1.0, 4.0, 8192),
                                      device=device).cos_sin_cache,
        slot_mapping=torch.tensor([slot], device=device, dtype=torch.int64),
    )
    caches = [torch.randn(4, PAGE, hk, d, device=device, dtype=dtype) for _ in range(2)]
    return inputs, caches


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_matches_reference(device, with_residual, nan_empty):
    """q, the residual stream and both caches (the new slot, and every other slot unchanged)."""
    for hidden, hq, hk, d, dtype in _cases(device):
        for position, slot in ((0, 0), (1000, 2 * PAGE + 5), (4095, 4 * PAGE - 1)):
            inputs, (kc, vc) = _step(hidden, hq, hk, d, dtype, device, position, slot, with_residual)
            kc_ref, vc_ref = kc.clone(), vc.clone()
            q, summed = skinny_qkv_rope_triton(**inputs, k_cache=kc, v_cache=vc, num_q_heads=hq, num_kv_heads=hk)
            q_ref, summed_ref = skinny_qkv_rope_ref(**inputs, k_cache=kc_ref, v_cache=vc_ref,
                                                    num_q_heads=hq, num_kv_heads=hk)
            what = (hidden, hq, hk, d, dtype, position)
            assert q.shape == (1, hq, d)
            assert rel_err(q, q_ref) < TOL[dtype], what
            torch.testing.assert_close(summed, summed_ref, rtol=0, atol=0)
            page, offset = divmod(slot, PAGE)
            for got, want in ((kc, kc_ref), (vc, vc_ref)):
                assert rel_err(got[page, offset], want[page, offset]) < TOL[dtype], what
                got[page, offset] = want[page, offset]
                assert torch.equal(got, want), ("other slots changed", what)


@pytest.mark.parametrize("device", DEVICES)
def test_padding_slot_writes_nothing(device, nan_empty):
    hidden, hq, hk, d, dtype = _cases(device)[0]
    inputs, (kc, vc) = _step(hidden, hq, hk, d, dtype, device, 7, -1, True)
    kc_before, vc_before = kc.clone(), vc.clone()
    q_out = torch.empty(1, hq, d, device=device, dtype=dtype)
    q, _ = skinny_qkv_rope_triton(**inputs, k_cache=kc, v_cache=vc, num_q_heads=hq, num_kv_heads=hk, q_out=q_out)
    assert q.data_ptr() == q_out.data_ptr() and not q.isnan().any()
    assert torch.equal(kc, kc_before) and torch.equal(vc, vc_before)


def test_fusable_and_errors():
    """A tile must hold whole rotary pairs of one head; wrong shapes are refused with a message."""
    assert fusable(6144, 4096, 128, torch.bfloat16) and fusable(6144, 4096, 64, torch.bfloat16)
    assert not fusable(6144, 4096, 12, torch.bfloat16)  # 6 pairs per head, 8 per tile
    assert not fusable(6144, 4096, 128, torch.bfloat16, {"block_n": 6})
    inputs, (kc, vc) = _step(64, 4, 2, 16, torch.float32, "cpu", 0, 0, True)
    assert fusable(6144, 4096, 128, torch.bfloat16, tokens=4) and fusable(6144, 4096, 64, torch.bfloat16, tokens=8)
    assert not fusable(6144, 4096, 128, torch.bfloat16, tokens=MAX_ROWS + 1)
    many = MAX_ROWS + 1
    with pytest.raises(AssertionError, match=f"at most {MAX_ROWS} rows"):
        skinny_qkv_rope_triton(**{**inputs, "x": torch.randn(many, 64), "residual": None,
                                  "positions": torch.zeros(many, dtype=torch.int64),
                                  "slot_mapping": torch.zeros(many, dtype=torch.int64)},
                               k_cache=kc, v_cache=vc, num_q_heads=4, num_kv_heads=2)



def _tokens_step(hidden, hq, hk, d, dtype, device, tokens, with_residual, row_pad=0):
    """`tokens` tokens at distinct positions and slots (token 1 a padding slot when there are 3 or
    more); x and the residual as views whose rows are row_pad elements apart beyond their width."""
    torch.manual_seed(hidden + 7 * tokens + with_residual)
    n = (hq + 2 * hk) * d
    positions = torch.randperm(4096, device=device)[:tokens]
    slots = torch.randperm(4 * PAGE, device=device)[:tokens]
    if tokens >= 3:
        slots[1] = -1
    inputs = dict(
        x=torch.randn(tokens, hidden + row_pad, device=device, dtype=dtype)[:, :hidden],
        weight=torch.randn(n, hidden, device=device, dtype=dtype) / hidden ** 0.5,
        residual=(torch.randn(tokens, hidden + row_pad, device=device, dtype=dtype)[:, :hidden]
                  if with_residual else None),
        norm_weight=1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype),
        eps=1e-5,
        positions=positions,
        cos_sin_cache=RotaryEmbedding(d, 4096, rope_inv_freq(d, 500000.0, "llama3", 8.0, 1.0, 4.0, 8192),
                                      device=device).cos_sin_cache,
        slot_mapping=slots,
    )
    caches = [torch.randn(4, PAGE, hk, d, device=device, dtype=dtype) for _ in range(2)]
    return inputs, caches


def _check_tokens(inputs, kc, vc, hq, hk, dtype, what, config=None):
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q, summed = skinny_qkv_rope_triton(**inputs, k_cache=kc, v_cache=vc, num_q_heads=hq, num_kv_heads=hk, config=config)
    q_ref, summed_ref = skinny_qkv_rope_ref(**inputs, k_cache=kc_ref, v_cache=vc_ref, num_q_heads=hq, num_kv_heads=hk)
    assert q.shape == q_ref.shape
    assert rel_err(q, q_ref) < TOL[dtype], what
    torch.testing.assert_close(summed, summed_ref, rtol=0, atol=0)
    for got, want in ((kc, kc_ref), (vc, vc_ref)):
        for slot in inputs["slot_mapping"].tolist():
            if slot >= 0:
                page, offset = divmod(slot, PAGE)
                assert rel_err(got[page, offset], want[page, offset]) < TOL[dtype], (what, slot)
                got[page, offset] = want[page, offset]
        assert torch.equal(got, want), ("other slots changed (a padding slot written?)", what)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("with_residual", [True, False])
def test_tokens_match_reference(device, tokens, with_residual, nan_empty):
    """1 to 8 tokens, each with its own position and slot: q, the residual stream and both caches."""
    for i, (hidden, hq, hk, d, dtype) in enumerate(_cases(device)):
        row_pad = 3 * i if device == "cpu" else 0  # the second toy shape with rows further apart
        inputs, (kc, vc) = _tokens_step(hidden, hq, hk, d, dtype, device, tokens, with_residual, row_pad)
        what = (tokens, with_residual, hidden, hq, hk, d, dtype, row_pad)
        if fusable((hq + 2 * hk) * d, hidden, d, dtype, tokens=tokens):
            _check_tokens(inputs, kc, vc, hq, hk, dtype, what)
        else:  # the default tile is wider than a head (head_dim 16, 32-feature tiles at 8 tokens)
            assert d < 32, what
        if device == "cpu" and tokens > 1:  # K in several steps, heads split into several programs
            _check_tokens(inputs, kc.clone(), vc.clone(), hq, hk, dtype, what,
                          config=dict(block_n=8, block_k=32, num_warps=4, num_stages=2))


def test_fused_path_is_taken_up_to_max_rows(monkeypatch):
    """QKVParallelLinear.fuses_rope: 1 to FUSED_MAX_ROWS tokens (as on CUDA) take the fused kernel
    (the kernel takes up to MAX_ROWS; here the dispatch limit is raised to that), more take the
    projection and qkv_prep."""
    from tokenmill.layers import linear
    from tokenmill.layers.linear import QKVParallelLinear, UnquantizedLinearMethod

    assert linear.FUSED_MAX_ROWS == 1  # the H200 default (layers/linear.py)
    monkeypatch.setattr(linear, "FUSED_MAX_ROWS", MAX_ROWS)

    layer = QKVParallelLinear(64, 64, 2, 1, dtype=torch.float32)
    real = UnquantizedLinearMethod.takes_gemv

    class OnCuda:
        """What takes_gemv reads of a tensor (shape, strides), claiming to be on CUDA."""
        is_cuda = True

        def __init__(self, t):
            self.shape, self.dim, self.stride = t.shape, t.dim, t.stride

    monkeypatch.setattr(UnquantizedLinearMethod, "takes_gemv", lambda self, layer, x: real(self, layer, OnCuda(x)))
    for tokens in range(1, MAX_ROWS + 1):
        assert layer.fuses_rope(torch.zeros(tokens, 64)), tokens
    assert not layer.fuses_rope(torch.zeros(MAX_ROWS + 1, 64))
    # While piecewise graphs are captured attention runs between the pieces: never fused.
    from tokenmill.layers.forward_context import forward_context

    with forward_context(None, [], splitter=object()):
        assert not layer.fuses_rope(torch.zeros(4, 64))
    with forward_context(None, [], small_batch_fusion=False):
        assert not layer.fuses_rope(torch.zeros(1, 64))
