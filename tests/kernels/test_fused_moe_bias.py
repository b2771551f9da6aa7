"""gpt-oss's experts in the fused-MoE kernels: biases on gate/up and down and the clamped SwiGLU, on
the GEMV and grouped paths in Triton's interpreter against fused_moe_ref, and fused_moe_ref plus
moe_route_ref against HF transformers' own GptOssExperts and router (interleaved gate/up layout)."""

import pytest
import torch

from tests.kernels.common import DEVICES, TOL, nan_empty, rel_err  # noqa: F401
from tests.kernels.test_fused_moe import PATHS, _experts, _routing
from tokenmill.kernels import fused_moe as fm

ACT = fm.ClampedSwiGLU(alpha=1.702, limit=7.0)


def _biases(H, I, E, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    return (torch.randn(E, 2 * I, generator=g) * 0.5).to(device, dtype), \
        (torch.randn(E, H, generator=g) * 0.5).to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", [(5, 32, 24, 8, 2, "ep"), (9, 32, 16, 4, 2, "random")],
                         ids=["T5-ep", "T9-random"])
def test_biased_clamped_matches_ref(device, path, case, nan_empty):
    T, H, I, E, k, kind = case
    x, w13, w2 = _experts(T, H, I, E, torch.float32, device, seed=T)
    x = x * 6.0  # gate/up sums of several units: the clamp at 7 bites
    b13, b2 = _biases(H, I, E, torch.float32, device, seed=T)
    weights, ids = _routing(T, E, k, device, kind, seed=T)
    ref = fm.fused_moe_ref(x, w13, w2, weights, ids, b13, b2, ACT)
    gate_up = torch.einsum("th,eih->tei", x, w13) + b13
    assert (gate_up[..., :I] > ACT.limit).any() and (gate_up[..., I:].abs() > ACT.limit).any(), "no clamp"
    assert rel_err(ref, fm.fused_moe_ref(x, w13, w2, weights, ids)) > 0.1
    cfg = fm.moe_config(E, I, H, T, k, x.dtype, path=path)
    out = fm.fused_moe_triton(x, w13, w2, weights, ids, config=cfg, w13_bias=b13, w2_bias=b2, activation=ACT)
    assert rel_err(out, ref) < TOL[torch.float32], (path, case)
    if kind == "ep":
        assert (out[0] == 0).all(), "a token with no expert on this rank: no bias either"


@pytest.mark.parametrize("device", DEVICES)
def test_biased_clamped_bf16(device, nan_empty):
    T, H, I, E, k = 5, 32, 32, 8, 2
    x, w13, w2 = _experts(T, H, I, E, torch.bfloat16, device, seed=3)
    x = x * 6.0
    b13, b2 = _biases(H, I, E, torch.bfloat16, device, seed=3)
    weights, ids = _routing(T, E, k, device, "random", seed=3)
    ref = fm.fused_moe_ref(x, w13, w2, weights, ids, b13, b2, ACT)
    tol = 4 * TOL[torch.bfloat16] if device == "cpu" else TOL[torch.bfloat16]  # the interpreter truncates bf16
    for path in PATHS:
        cfg = fm.moe_config(E, I, H, T, k, x.dtype, path=path)
        out = fm.fused_moe_triton(x, w13, w2, weights, ids, config=cfg, w13_bias=b13, w2_bias=b2, activation=ACT)
        assert rel_err(out, ref) < tol, path


def test_ref_matches_hf_gpt_oss_experts_and_router():
    """HF's experts (gate_up_proj [E, H, 2I], gate/up interleaved in the last dim) and router (top-k
    of the logits, then softmax over the k) equal moe_route_ref (renormalised) + fused_moe_ref on
    the de-interleaved, transposed weights."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    T, H, I, E, k = 7, 32, 16, 8, 3
    cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=k)
    torch.manual_seed(0)
    mlp = GptOssMLP(cfg).float()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.5)
    x = torch.randn(T, H) * 2.0
    with torch.no_grad():
        expected, _ = mlp(x[None])
        logits = torch.nn.functional.linear(x, mlp.router.weight, mlp.router.bias)
    experts = mlp.experts
    w13 = torch.cat([experts.gate_up_proj[..., ::2], experts.gate_up_proj[..., 1::2]], dim=-1).transpose(1, 2)
    b13 = torch.cat([experts.gate_up_proj_bias[..., ::2], experts.gate_up_proj_bias[..., 1::2]], dim=-1)
    w2 = experts.down_proj.transpose(1, 2)
    weights, ids = fm.moe_route_ref(logits, k, renormalize=True)
    _, hf_scores, hf_ids = mlp.router(x)
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(weights, hf_scores, rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        out = fm.fused_moe_ref(x, w13.contiguous(), w2.contiguous(), weights, ids, b13, experts.down_proj_bias,
                               fm.ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit))
    assert rel_err(out, expected[0]) < 1e-6
