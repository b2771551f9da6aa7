"""Mixture-of-experts: routing (top-k over the router's logits) and the experts' MLPs.

Expert weights are stacked: `w13` [E, 2 * I, H] holds each expert's gate rows then up rows,
`w2` [E, H, I] its down projection. A token's output is the sum over its k chosen experts of
weight * down(silu(gate(x)) * up(x)).
"""

import torch
import torch.nn.functional as F


def moe_route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in float32, the k largest, optionally renormalised to sum to 1
    (Mixtral always; Qwen-MoE and OLMoE by `norm_topk_prob`). Returns (weights [T, k] in the
    logits' dtype, expert ids [T, k] int32), each row's experts in decreasing weight."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids.to(torch.int32)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts' MLPs, one expert at a time (the reference): x [T, H], w13 [E, 2I, H],
    w2 [E, H, I], topk_weights / topk_ids [T, k]; ids outside 0..E-1 (another rank's experts,
    given as -1) contribute nothing. Returns [T, H] in x's dtype."""
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1).long()
    for e in torch.unique(flat_ids).tolist():
        if not 0 <= e < num_experts:
            continue
        token, slot = torch.where(topk_ids == e)
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * topk_weights[token, slot, None].to(x.dtype)
        out.index_add_(0, token, y)
    return out
