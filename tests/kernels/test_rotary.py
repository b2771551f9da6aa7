"""rotary_embedding: the in-place Triton kernel against the torch reference."""


import pytest
import torch

from tokenmill.kernels.rotary import rotary_embedding, rotary_ref, rotary_triton

from tests.kernels.common import DEVICES, TOL, rel_err  # noqa: F401


def cos_sin_cache(max_pos: int, head_dim: int, base: float = 10000.0, device="cpu") -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)


def _cases(device):
    if device == "cpu":
        return [(5, 3, 1, 64, torch.float32), (4, 2, 2, 32, torch.float16), (3, 2, 1, 48, torch.float32)]
    return [(t, hq, hk, 128, dt) for t in (1, 333, 4096) for hq, hk in ((16, 8), (32, 8))
            for dt in (torch.float32, torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "qkv-views"])
def test_rotary(device, fused):
    torch.manual_seed(0)
    for tokens, hq, hk, d, dtype in _cases(device):
        cache = cos_sin_cache(4096, d, device=device)
        positions = torch.randint(0, 4096, (tokens,), device=device)
        if fused:  # q/k as strided views of one qkv projection output
            qkv = torch.randn(tokens, (hq + 2 * hk) * d, device=device, dtype=dtype)
            q = qkv[:, : hq * d].view(tokens, hq, d)
            k = qkv[:, hq * d: (hq + hk) * d].view(tokens, hk, d)
            v_before = qkv[:, (hq + hk) * d:].clone()
        else:
            q = torch.randn(tokens, hq, d, device=device, dtype=dtype)
            k = torch.randn(tokens, hk, d, device=device, dtype=dtype)
        ref_q, ref_k = rotary_ref(positions, q, k, cache)
        out_q, out_k = rotary_triton(positions, q, k, cache)
        assert out_q is q and out_k is k, "rotates in place"
        assert rel_err(out_q, ref_q) < TOL[dtype] and rel_err(out_k, ref_k) < TOL[dtype]
        if fused:
            assert torch.equal(qkv[:, (hq + hk) * d:], v_before), "v must be untouched"


def test_dispatch_cpu_uses_reference():
    cache = cos_sin_cache(16, 8)
    pos, q, k = torch.arange(3), torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    out_q, out_k = rotary_embedding(pos, q, k, cache)
    ref_q, ref_k = rotary_ref(pos, q, k, cache)
    assert out_q is not q
    torch.testing.assert_close(out_q, ref_q, rtol=0, atol=0)
    torch.testing.assert_close(out_k, ref_k, rtol=0, atol=0)
