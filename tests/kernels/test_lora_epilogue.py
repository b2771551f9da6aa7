"""One token with an adapter on the fused GEMV path: the shrink with the layer's prologue (the
residual included), then the base GEMV (plain, or with rotary and the KV-cache write) adding the
LoRA term in its epilogue, against the references (skinny_linear_ref / skinny_qkv_rope_ref, then
lora_expand_ref). Interpreter at small shapes on the CPU; Llama-3.1-8B shapes on CUDA."""

import pytest
import torch

from tokenmill.kernels.lora import ADD_RMSNORM, PLAIN, SILU_MUL, lora_expand_ref, lora_shrink_ref, lora_shrink_triton
from tokenmill.kernels.lora_epilogue import LoRATerm
from tokenmill.kernels.qkv_rope_gemv import skinny_qkv_rope_ref, skinny_qkv_rope_triton
from tokenmill.kernels.skinny_gemm import skinny_linear_ref, skinny_linear_triton
from tokenmill.layers.rotary import RotaryEmbedding, rope_inv_freq

from tests.kernels.common import DEVICES, TOL, nan_empty, rel_err  # noqa: F401

PAGE = 16


def _linear_cases(device):
    """(K, slice sizes of N, rank, dtype): toy shapes on the CPU, the Llama-3.1-8B projections on CUDA
    (q/k/v, o, gate/up, down)."""
    toy = [(64, (32, 16, 16), 4, torch.float32), (48, (40,), 8, torch.float32), (32, (24, 24), 3, torch.float32)]
    if device == "cpu":
        return toy
    big = [(4096, (4096, 1024, 1024), 16, torch.bfloat16), (4096, (4096,), 16, torch.bfloat16),
           (4096, (14336, 14336), 16, torch.bfloat16), (14336, (4096,), 16, torch.bfloat16),
           (4096, (4096, 1024, 1024), 64, torch.bfloat16), (4096, (4096, 1024, 1024), 8, torch.float32)]
    return toy + big


def _term(k, sizes, rank, prologue, dtype, device, slot, residual=None, x=None, norm_weight=None, eps=1e-5):
    """A slot stack of 3 adapters, the shrink of x through slot `slot`, and the term."""
    slices = len(sizes)
    a = torch.randn(3, slices * rank, k, device=device, dtype=torch.float32) / k ** 0.5
    b = torch.randn(3, sum(sizes), rank, device=device, dtype=torch.float32) / rank ** 0.5
    a[0], b[0] = 0, 0
    a, b = a.to(dtype), b.to(dtype)
    slots = torch.tensor([slot], dtype=torch.int32, device=device)
    s = lora_shrink_triton(x, a, slots, prologue, norm_weight, eps, residual=residual)
    s_ref = lora_shrink_ref(x, a, slots, prologue, norm_weight, eps, residual=residual)
    starts = tuple(int(v) for v in torch.tensor(sizes[:-1]).cumsum(0)) if slices > 1 else ()
    return LoRATerm(s, b, slots, rank, starts), s_ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prologue,with_residual", [(PLAIN, False), (SILU_MUL, False), (ADD_RMSNORM, True),
                                                    (ADD_RMSNORM, False)], ids=["plain", "silu", "norm+res", "norm"])
def test_gemv_with_lora_matches_reference(device, prologue, with_residual, nan_empty):
    for k, sizes, rank, dtype in _linear_cases(device):
        torch.manual_seed(k + rank + prologue)
        n = sum(sizes)
        x = torch.randn(1, 2 * k if prologue == SILU_MUL else k, device=device, dtype=dtype)
        w = (torch.randn(n, k, device=device, dtype=torch.float32) / k ** 0.5).to(dtype)
        res = torch.randn(1, k, device=device, dtype=dtype) if with_residual else None
        nw = (1 + 0.1 * torch.randn(k, device=device)).to(dtype) if prologue == ADD_RMSNORM else None
        for slot in (2, 0):
            term, s_ref = _term(k, sizes, rank, prologue, dtype, device, slot, res, x, nw)
            what = (k, sizes, rank, dtype, slot)
            assert rel_err(term.s, s_ref) < TOL[dtype] if slot else torch.equal(term.s, s_ref), what
            out = skinny_linear_triton(x, w, prologue, res, nw, 1e-5, lora=term)
            ref = skinny_linear_ref(x, w, prologue, res, nw, 1e-5)
            if with_residual:
                (out, summed), (ref, summed_ref) = out, ref
                assert torch.equal(summed, summed_ref), what
            plain = ref.clone()
            lora_expand_ref(s_ref, term.b_stack, term.token_slots, ref, rank, term.slice_starts)
            assert rel_err(out, ref) < TOL[dtype], what
            if slot:
                delta = (ref.double() - plain.double()).norm() / plain.double().norm()
                assert delta > 10 * TOL[dtype], ("the adapter's term is too small to test", what)


def _qkv_inputs(hidden, hq, hk, d, dtype, device, with_residual):
    torch.manual_seed(hidden + hq + d)
    n = (hq + 2 * hk) * d
    return dict(
        x=torch.randn(1, hidden, device=device, dtype=dtype),
        weight=(torch.randn(n, hidden, device=device) / hidden ** 0.5).to(dtype),
        residual=torch.randn(1, hidden, device=device, dtype=dtype) if with_residual else None,
        norm_weight=(1 + 0.1 * torch.randn(hidden, device=device)).to(dtype),
        eps=1e-5,
        positions=torch.tensor([777], device=device, dtype=torch.int64),
        cos_sin_cache=RotaryEmbedding(d, 4096, rope_inv_freq(d, 500000.0, "llama3", 8.0, 1.0, 4.0, 8192),
                                      device=device).cos_sin_cache,
        slot_mapping=torch.tensor([PAGE + 3], device=device, dtype=torch.int64),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_qkv_rope_with_lora_matches_reference(device, with_residual, nan_empty):
    """q, and k / v in the cache, with the q/k/v adapter term added before the rotation."""
    cases = [(64, 4, 2, 16, 4, torch.float32)]
    if device == "cuda":
        cases += [(4096, 32, 8, 128, 16, torch.bfloat16), (4096, 32, 8, 128, 16, torch.float32)]
    for hidden, hq, hk, d, rank, dtype in cases:
        inputs = _qkv_inputs(hidden, hq, hk, d, dtype, device, with_residual)
        sizes = (hq * d, hk * d, hk * d)
        term, s_ref = _term(hidden, sizes, rank, ADD_RMSNORM, dtype, device, 1, inputs["residual"], inputs["x"],
                            inputs["norm_weight"])
        caches = [torch.randn(4, PAGE, hk, d, device=device, dtype=dtype) for _ in range(2)]
        ref_caches = [c.clone() for c in caches]
        plain_caches = [c.clone() for c in caches]
        q, summed = skinny_qkv_rope_triton(**inputs, k_cache=caches[0], v_cache=caches[1], num_q_heads=hq,
                                           num_kv_heads=hk, lora=term)
        ref_term = LoRATerm(s_ref, term.b_stack, term.token_slots, rank, term.slice_starts)
        q_ref, summed_ref = skinny_qkv_rope_ref(**inputs, k_cache=ref_caches[0], v_cache=ref_caches[1],
                                                num_q_heads=hq, num_kv_heads=hk, lora=ref_term)
        q_plain, _ = skinny_qkv_rope_ref(**inputs, k_cache=plain_caches[0], v_cache=plain_caches[1],
                                         num_q_heads=hq, num_kv_heads=hk)
        what = (hidden, dtype, with_residual)
        assert rel_err(q, q_ref) < TOL[dtype], what
        assert rel_err(q_plain, q_ref) > 10 * TOL[dtype], ("the adapter's term is too small to test", what)
        assert torch.equal(summed, summed_ref), what
        page, offset = divmod(PAGE + 3, PAGE)
        for got, want in zip(caches, ref_caches):
            assert rel_err(got[page, offset], want[page, offset]) < TOL[dtype], what
            got[page, offset] = want[page, offset]
            assert torch.equal(got, want), ("other cache slots changed", what)


def test_term_checks_its_shapes():
    b = torch.zeros(2, 8, 4)
    bad = LoRATerm(torch.zeros(1, 4), b, torch.ones(1, dtype=torch.int32), 4, (4,))  # two slices need 8 columns
    with pytest.raises(AssertionError):
        skinny_linear_triton(torch.zeros(1, 8), torch.zeros(8, 8), lora=bad)
    with pytest.raises(AssertionError, match="one-row"):
        skinny_linear_triton(torch.zeros(2, 8), torch.zeros(8, 8),
                             lora=LoRATerm(torch.zeros(1, 4), b, torch.ones(1, dtype=torch.int32), 4))
