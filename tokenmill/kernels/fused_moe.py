"""Mixture-of-experts: routing (top-k over the router's logits) and the experts' MLPs.

Expert weights are stacked: `w13` [E, 2 * I, H] holds each expert's gate rows then up rows,
`w2` [E, H, I] its down projection. A token's output is the sum over its k chosen experts of
weight * down(silu(gate(x)) * up(x)).

The Triton path (CUDA), in launches whose shapes follow from the inputs' shapes alone (no host
sync, so a step that runs it can be captured in a CUDA graph):

- routing (moe_route_triton): softmax over the experts in fp32, the k largest, optionally
  renormalised; a block of tokens per program. DeepSeek's grouped routing (moe_route_grouped_triton:
  softmax or sigmoid scores, a correction bias for the choice, the best groups' experts only) the same way.
- the token sort (moe_sort_tokens): the T * k (token, slot) pairs grouped by expert, each
  expert's run padded to a multiple of the GEMM's tile height BLOCK_M, and the expert of each tile.
- the grouped GEMM (the grouped path): launch 1 computes the gate and up tiles of the same sorted
  rows from the two halves of w13 and writes silu(gate) * up into [T * k, I]; launch 2 multiplies
  those rows by w2, scales them by their routing weight and writes [T * k, H]; a third launch sums
  each token's k rows in slot order (no atomics, so the result is deterministic).
- small batches (the GEMV path): no sort; launch 1 is one program per (pair, block of I) reading
  only the chosen expert's rows, launch 2 one program per (token, block of H) summing its k slots.

At large token counts on Hopper, fused_moe may take torch._grouped_mm instead (grouped_mm_moe:
the same sort done with torch ops, PyTorch's grouped GEMM for the two products), where the kernel
bench measured it faster (GROUPED_MM_FROM); it rounds where the reference does too.

Both paths accumulate in fp32 and round where the reference does (gate, up, silu(gate), their
product, the down projection and its product with the weight are each rounded to the model
dtype); the k slots are summed in fp32 and rounded once, where the reference adds them in the
model dtype, so the two agree within that dtype's rounding. Ids outside 0..E-1 (another rank's
experts under expert parallelism, given as -1) contribute nothing on every path.

FP8 experts (layers/fp8_moe.py): w13 and w2 may be e4m3 with one fp32 scale per output row and
expert (`w13_scale` [E, 2I], `w2_scale` [E, H]; W[e, n] ~ scale[e, n] * w_q[e, n]). Both paths then
dequantize in the kernel, weight-only: the e4m3 bytes are widened exactly to the activations'
dtype (bf16 / fp16 / fp32 all hold every e4m3 value), multiplied as before, and each row's fp32 sum
is multiplied by its scale (a per-row scale factors out of the dot product) before the roundings
above. The activations stay in the model dtype. The reference is fused_moe_fp8_ref: the weights
dequantized to the model dtype, then fused_moe_ref.

gpt-oss's experts (`MoEActivation` and biases, on every path): gate/up and down may carry biases
(`w13_bias` [E, 2I], gate then up as w13's rows; `w2_bias` [E, H]), added to the fp32 sums before
the first rounding (as F.linear's bias), and the activation may be the clamped SwiGLU
(up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g), g = gate.clamp(max=limit), instead of
silu(gate) * up. Both are constexpr switches: other models compile the kernels as before.
"""

import functools
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tokenmill.kernels._dispatch import use_triton
from tokenmill.kernels.activation import silu_and_mul_triton


def moe_route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in float32, the k largest, optionally renormalised to sum to 1
    (Mixtral always; Qwen-MoE and OLMoE by `norm_topk_prob`). Returns (weights [T, k] in the
    logits' dtype, expert ids [T, k] int32), each row's experts in decreasing weight."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids.to(torch.int32)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation: g = gate.clamp(max=limit), u = up.clamp(-limit, limit),
    out = (u + 1) * g * sigmoid(alpha * g)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_bias: Optional[torch.Tensor] = None,
                  w2_bias: Optional[torch.Tensor] = None, activation: Optional[ClampedSwiGLU] = None,
                  linear: Callable = F.linear) -> torch.Tensor:
    """The experts' MLPs, one expert at a time (the reference): x [T, H], w13 [E, 2I, H],
    w2 [E, H, I], topk_weights / topk_ids [T, k]; ids outside 0..E-1 (another rank's experts,
    given as -1) contribute nothing. Optional biases w13_bias [E, 2I], w2_bias [E, H] and the
    clamped SwiGLU in place of silu(gate) * up (gpt-oss). Returns [T, H] in x's dtype. Each token
    sums its experts in expert-id order; `linear` (F.linear's arguments) does the products."""
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1).long()
    for e in torch.unique(flat_ids).tolist():
        if not 0 <= e < num_experts:
            continue
        token, slot = torch.where(topk_ids == e)
        gate, up = linear(x[token], w13[e], None if w13_bias is None else w13_bias[e]).chunk(2, dim=-1)
        h = F.silu(gate) * up if activation is None else activation(gate, up)
        y = linear(h, w2[e], None if w2_bias is None else w2_bias[e]) * topk_weights[token, slot, None].to(x.dtype)
        out.index_add_(0, token, y)
    return out


def dequantize_experts_fp8(w_q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stacked e4m3 expert weights [E, N, K] with per-row scales [E, N] -> [E, N, K] in dtype."""
    return (w_q.float() * scale.float()[..., None]).to(dtype)


def fused_moe_fp8_ref(x: torch.Tensor, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor,
                      w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The reference of the FP8 paths: the weights dequantized to x's dtype, then fused_moe_ref."""
    return fused_moe_ref(x, dequantize_experts_fp8(w13_q, w13_scale, x.dtype),
                         dequantize_experts_fp8(w2_q, w2_scale, x.dtype), topk_weights, topk_ids)


# ----------------------------------------------------------------------------------------------
# Routing
# ----------------------------------------------------------------------------------------------

MAX_EXPERTS = 512  # one program holds a block of tokens' logits over every expert in registers
MAX_TOP_K = 16


@triton.jit
def _select_top_k(select, weight_of, experts, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                  WEIGHT_IS_SELECT: tl.constexpr):
    """The TOP_K largest of `select` [BLOCK_T, BLOCK_E] per row, largest first (the lowest expert
    among equals): (their entries of `weight_of` [BLOCK_T, BLOCK_K] fp32, their experts
    [BLOCK_T, BLOCK_K] int32), columns past TOP_K zero. Selection and weights are separate so
    that a biased selection (DeepSeek's grouped sigmoid routing) can reuse it; WEIGHT_IS_SELECT
    (the chosen entries are equal) saves a reduction a pick."""
    slots = tl.arange(0, BLOCK_K)[None, :]
    weights = tl.zeros([select.shape[0], BLOCK_K], tl.float32)
    ids = tl.zeros([select.shape[0], BLOCK_K], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(select, axis=1)
        pick = tl.min(tl.where(select == best[:, None], experts[None, :], 2147483647), axis=1)
        hit = experts[None, :] == pick[:, None]
        if WEIGHT_IS_SELECT:
            w = best
        else:
            w = tl.sum(tl.where(hit, weight_of, 0.0), axis=1)
        weights = tl.where(slots == j, w[:, None], weights)
        ids = tl.where(slots == j, pick[:, None], ids)
        select = tl.where(hit, -float("inf"), select)
    return weights, ids


@triton.jit
def _route_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, T, E, stride_t,
                          TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (cdiv(T, BLOCK_T),): moe_route_ref for tokens [pid * BLOCK_T, (pid + 1) * BLOCK_T)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    logits = tl.load(logits_ptr + t.to(tl.int64)[:, None] * stride_t + e[None, :],
                     mask=t_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
    logits = tl.where(e_ok[None, :], logits, -float("inf"))
    p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    # -1 keeps padding experts below every probability, chosen or not
    # a chosen expert is a real one (top_k <= E), whose selection value is its probability
    weights, ids = _select_top_k(tl.where(e_ok[None, :], p, -1.0), p, e, TOP_K, BLOCK_K, True)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    slots = tl.arange(0, BLOCK_K)
    out = t.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    mask = t_ok[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


def moe_route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton moe_route_ref: router_logits [T, E] (unit last stride, any row stride), E up to
    MAX_EXPERTS. The same ids as the reference wherever no two probabilities tie."""
    T, E = router_logits.shape
    assert 1 <= top_k <= min(E, MAX_TOP_K) and E <= MAX_EXPERTS and router_logits.stride(-1) == 1
    weights = torch.empty((T, top_k), dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=router_logits.device)
    if T == 0:
        return weights, ids
    block_e = triton.next_power_of_2(E)
    # a [BLOCK_T, BLOCK_E] fp32 tile of up to 4096 elements, no taller than the batch: a decode
    # step's one row is one warp, whose reductions are shuffles only
    block_t = min(64, max(1, 4096 // block_e), triton.next_power_of_2(T))
    _route_softmax_kernel[(triton.cdiv(T, block_t),)](
        router_logits, weights, ids, T, E, router_logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=max(1, min(4, block_t * block_e // 256)))
    return weights, ids


@dataclass(frozen=True)
class GroupedTopK:
    """DeepSeek's routing (moe_route_grouped_ref): scores "softmax" (V2) or "sigmoid" (V3); the experts
    in num_groups equal groups, a group scored by its best expert ("max", V2) or the sum of its two
    best ("top2_sum", V3), only the topk_groups best groups' experts chosen; weights multiplied by
    scaling_factor (routed_scaling_factor)."""

    scoring: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    scaling_factor: float = 1.0

    def __post_init__(self):
        if self.scoring not in ("softmax", "sigmoid") or self.group_score not in ("max", "top2_sum"):
            raise ValueError(f"unknown routing {self}")


def moe_route_grouped_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool, grouping: GroupedTopK,
                          correction_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's DeepseekV2TopkRouter / DeepseekV3TopkRouter in float32: scores, then (with groups) the
    experts outside the topk_groups best groups masked, the top_k of what is left chosen, weights
    the chosen experts' scores, renormalised (+1e-20, as V3) if asked, times scaling_factor.

    correction_bias [E] (V3's e_score_correction_bias) is added to the scores for the choice only:
    the weights are the unbiased scores. Softmax scores are masked to 0 as V2 does (its weights are
    the masked scores), sigmoid ones to -inf. Returns (weights [T, k] float32, ids [T, k] int32)."""
    scores = router_logits.float()
    scores = torch.softmax(scores, dim=-1) if grouping.scoring == "softmax" else torch.sigmoid(scores)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    T, E = scores.shape
    G = grouping.num_groups
    if G > 1:
        grouped = choice.view(T, G, E // G)
        if grouping.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = group_scores.topk(grouping.topk_groups, dim=-1).indices
        keep = torch.zeros((T, G), dtype=torch.bool, device=scores.device).scatter_(1, best, True)
        fill = 0.0 if grouping.scoring == "softmax" else -float("inf")
        choice = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), fill)
    ids = choice.topk(top_k, dim=-1).indices
    weights = (choice if correction_bias is None else scores).gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * grouping.scaling_factor, ids.to(torch.int32)


@triton.jit
def _route_grouped_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, T, E, stride_t, scaling,
                          TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, SIGMOID: tl.constexpr,
                          HAS_BIAS: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                          TOP2_SUM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr):
    """Grid (cdiv(T, BLOCK_T),): moe_route_grouped_ref for tokens [pid * BLOCK_T, (pid + 1) * BLOCK_T).
    Groups are found by column (expert // (E / NUM_GROUPS)), so their size need not be a power of two."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    logits = tl.load(logits_ptr + t.to(tl.int64)[:, None] * stride_t + e[None, :],
                     mask=t_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        logits = tl.where(e_ok[None, :], logits, -float("inf"))
        scores = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = scores / tl.sum(scores, axis=1)[:, None]
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(e_ok[None, :], choice, -float("inf"))
    if NUM_GROUPS > 1:
        group_of = e // (E // NUM_GROUPS)
        g = tl.arange(0, BLOCK_G)
        group_scores = tl.full([BLOCK_T, BLOCK_G], -float("inf"), tl.float32)
        for j in tl.static_range(NUM_GROUPS):
            vals = tl.where((group_of == j)[None, :], choice, -float("inf"))
            best = tl.max(vals, axis=1)
            if TOP2_SUM:  # the best plus the next (one occurrence of the best taken out)
                first = tl.min(tl.where(vals == best[:, None], e[None, :], 2147483647), axis=1)
                best += tl.max(tl.where(e[None, :] == first[:, None], -float("inf"), vals), axis=1)
            group_scores = tl.where(g[None, :] == j, best[:, None], group_scores)
        keep = (t[:, None] < 0) & (e[None, :] < 0)  # [BLOCK_T, BLOCK_E], all False
        for _ in tl.static_range(TOPK_GROUPS):
            top = tl.max(group_scores, axis=1)
            pick = tl.min(tl.where(group_scores == top[:, None], g[None, :], 2147483647), axis=1)
            keep = keep | (group_of[None, :] == pick[:, None])
            group_scores = tl.where(g[None, :] == pick[:, None], -float("inf"), group_scores)
        # masked as the reference masks (softmax: 0, V2's; sigmoid: -inf); padding experts below all
        choice = tl.where(keep, choice, 0.0 if not SIGMOID else -float("inf"))
        choice = tl.where(e_ok[None, :], choice, -float("inf"))
    if HAS_BIAS:  # the bias chooses; the weights are the unbiased scores
        weights, ids = _select_top_k(choice, scores, e, TOP_K, BLOCK_K, False)
    else:
        weights, ids = _select_top_k(choice, choice, e, TOP_K, BLOCK_K, True)
    slots = tl.arange(0, BLOCK_K)
    if RENORMALIZE:
        total = tl.sum(tl.where(slots[None, :] < TOP_K, weights, 0.0), axis=1)
        weights = weights / (total + 1e-20)[:, None]
    weights = weights * scaling
    out = t.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    mask = t_ok[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


MAX_GROUPS = 32  # the grouped kernel scores each group in an unrolled loop


def moe_route_grouped_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool, grouping: GroupedTopK,
                             correction_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton moe_route_grouped_ref (weights float32): E up to MAX_EXPERTS, groups up to MAX_GROUPS.
    The same ids as the reference wherever no two scores tie."""
    T, E = router_logits.shape
    G = grouping.num_groups
    assert 1 <= top_k <= min(E, MAX_TOP_K) and E <= MAX_EXPERTS and router_logits.stride(-1) == 1
    assert G <= MAX_GROUPS and E % G == 0 and 1 <= grouping.topk_groups <= G
    weights = torch.empty((T, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=router_logits.device)
    if T == 0:
        return weights, ids
    block_e = triton.next_power_of_2(E)
    block_t = min(64, max(1, 4096 // block_e))
    bias = correction_bias if correction_bias is not None else weights  # any pointer when unused
    _route_grouped_kernel[(triton.cdiv(T, block_t),)](
        router_logits, bias, weights, ids, T, E, router_logits.stride(0), float(grouping.scaling_factor),
        TOP_K=top_k, RENORMALIZE=renormalize, SIGMOID=grouping.scoring == "sigmoid",
        HAS_BIAS=correction_bias is not None, NUM_GROUPS=G, TOPK_GROUPS=grouping.topk_groups,
        TOP2_SUM=grouping.group_score == "top2_sum", BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_G=max(2, triton.next_power_of_2(G)), num_warps=4)
    return weights, ids


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool, grouping: Optional[GroupedTopK] = None,
              correction_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k], topk_ids [T, k] int32): Triton on CUDA, the torch references elsewhere.
    Without `grouping` softmax top-k (weights in the logits' dtype); with it DeepSeek's routing
    (moe_route_grouped_ref; weights float32)."""
    if grouping is not None:
        if use_triton(router_logits) and router_logits.shape[1] <= MAX_EXPERTS and top_k <= MAX_TOP_K \
                and grouping.num_groups <= MAX_GROUPS:
            return moe_route_grouped_triton(router_logits, top_k, renormalize, grouping, correction_bias)
        return moe_route_grouped_ref(router_logits, top_k, renormalize, grouping, correction_bias)
    if use_triton(router_logits):
        return moe_route_triton(router_logits, top_k, renormalize)
    return moe_route_ref(router_logits, top_k, renormalize)


# ----------------------------------------------------------------------------------------------
# The token sort
# ----------------------------------------------------------------------------------------------

SORT_MAX_BLOCKS = 64  # the offsets kernel walks the blocks' counts one block after another


def sorted_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Length of moe_sort_tokens' sorted_ids: the pairs plus each expert's largest padding."""
    return num_pairs + num_experts * (block_m - 1)


def moe_sort_tokens_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token sort in torch (the reference): (sorted_ids, expert_ids, num_tokens_post_padded).

    sorted_ids [sorted_capacity(T * k, E, block_m)] int32: indices into the flattened T * k
    (token, slot) pairs, grouped by expert in increasing expert order and pair order within an
    expert, each expert's run padded to a multiple of block_m with the sentinel T * k (which
    also fills everything past the last run). expert_ids [cdiv(capacity, block_m)] int32: the
    expert of each block_m tile, -1 past the last run. num_tokens_post_padded [1] int32: the
    length of the runs. Ids outside 0..E-1 are left out."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    capacity = sorted_capacity(num_pairs, num_experts, block_m)
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=topk_ids.device)
    expert_ids = torch.full((triton.cdiv(capacity, block_m),), -1, dtype=torch.int32, device=topk_ids.device)
    pos = 0
    for e in range(num_experts):
        pairs = torch.nonzero(flat == e).flatten()
        if pairs.numel():
            sorted_ids[pos:pos + pairs.numel()] = pairs.to(torch.int32)
            padded = triton.cdiv(pairs.numel(), block_m) * block_m
            expert_ids[pos // block_m:(pos + padded) // block_m] = e
            pos += padded
    return sorted_ids, expert_ids, torch.tensor([pos], dtype=torch.int32, device=topk_ids.device)


@triton.jit
def _sort_count_kernel(ids_ptr, counts_ptr, sorted_ptr, num_pairs, E, per_block, capacity, fill_per_block,
                       BLOCK_E: tl.constexpr, SUB: tl.constexpr):
    """Grid (blocks,): counts[b, e] = pairs of expert e among pairs [b * per_block, (b + 1) * per_block);
    also fills sorted_ids[b * fill_per_block, (b + 1) * fill_per_block) with the sentinel
    num_pairs, which the padding keeps (the scatter overwrites the rest)."""
    b = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for s in range(0, per_block, SUB):
        i = b * per_block + s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1)
        counts += tl.histogram(ids, BLOCK_E, mask=(i < num_pairs) & (ids >= 0) & (ids < E))
    tl.store(counts_ptr + b * E + e, counts, mask=e < E)
    for s in range(0, fill_per_block, SUB):
        j = b * fill_per_block + s + tl.arange(0, SUB)
        tl.store(sorted_ptr + j, tl.full([SUB], 0, tl.int32) + num_pairs, mask=j < capacity)


@triton.jit
def _sort_offsets_kernel(counts_ptr, bases_ptr, starts_ptr, expert_ids_ptr, ntp_ptr, num_blocks, E, num_tiles,
                         BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TILES: tl.constexpr):
    """Grid (1,): bases[b, e] = expert e's pairs in blocks before b; starts[e] = where expert e's
    padded run begins; expert_ids per tile (-1 past the runs); num_tokens_post_padded."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    run = tl.zeros([BLOCK_E], tl.int32)
    for b in range(num_blocks):
        c = tl.load(counts_ptr + b * E + e, mask=e_ok, other=0)
        tl.store(bases_ptr + b * E + e, run, mask=e_ok)
        run += c
    padded = (run + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(starts_ptr + e, ends - padded, mask=e_ok)
    total = tl.sum(padded, axis=0)
    tl.store(ntp_ptr + tl.arange(0, 1), tl.full([1], 0, tl.int32) + total)
    for t0 in range(0, num_tiles, BLOCK_TILES):
        tile = t0 + tl.arange(0, BLOCK_TILES)
        pos = tile * BLOCK_M
        # the tile's expert is the number of runs that end at or before it
        expert = tl.sum(((ends[None, :] <= pos[:, None]) & e_ok[None, :]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + tile, tl.where(pos < total, expert, -1), mask=tile < num_tiles)


@triton.jit
def _sort_scatter_kernel(ids_ptr, bases_ptr, starts_ptr, sorted_ptr, num_pairs, E, per_block,
                         BLOCK_E: tl.constexpr, SUB: tl.constexpr):
    """Grid (blocks,): writes each valid pair of block b at its place in sorted_ids (its expert's
    run start + the expert's pairs before it), SUB pairs a step."""
    b = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    next_pos = tl.load(bases_ptr + b * E + e, mask=e_ok, other=0) + tl.load(starts_ptr + e, mask=e_ok, other=0)
    for s in range(0, per_block, SUB):
        i = b * per_block + s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1)
        one_hot = ((ids[:, None] == e[None, :]) & e_ok[None, :]).to(tl.int32)
        before = tl.cumsum(one_hot, axis=0) - one_hot  # same-expert pairs earlier in this step
        pos = tl.sum(one_hot * (before + next_pos[None, :]), axis=1)
        tl.store(sorted_ptr + pos, i, mask=(i < num_pairs) & (ids >= 0) & (ids < E))
        next_pos += tl.sum(one_hot, axis=0)


def moe_sort_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton moe_sort_tokens_ref (the same three tensors, bit for bit): three launches sized by
    the shapes alone, num_tokens_post_padded left on the device."""
    assert num_experts <= MAX_EXPERTS and block_m >= 1
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    num_pairs = ids.numel()
    capacity = sorted_capacity(num_pairs, num_experts, block_m)
    num_tiles = triton.cdiv(capacity, block_m)
    if num_pairs == 0:
        return moe_sort_tokens_ref(topk_ids, num_experts, block_m)
    block_e = triton.next_power_of_2(num_experts)
    sub = max(16, 8192 // block_e)  # pairs a step: keeps the [SUB, BLOCK_E] one-hot tile at 8K elements
    per_block = sub * triton.cdiv(triton.cdiv(num_pairs, SORT_MAX_BLOCKS), sub)
    num_blocks = triton.cdiv(num_pairs, per_block)
    fill_per_block = sub * triton.cdiv(triton.cdiv(capacity, num_blocks), sub)
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_tiles, dtype=torch.int32, device=dev)
    ntp = torch.empty(1, dtype=torch.int32, device=dev)
    scratch = torch.empty((3, num_blocks, num_experts), dtype=torch.int32, device=dev)
    counts, bases, starts = scratch[0], scratch[1], scratch[2, 0]
    _sort_count_kernel[(num_blocks,)](ids, counts, sorted_ids, num_pairs, num_experts, per_block, capacity,
                                      fill_per_block, BLOCK_E=block_e, SUB=sub, num_warps=4)
    _sort_offsets_kernel[(1,)](counts, bases, starts, expert_ids, ntp, num_blocks, num_experts, num_tiles,
                               BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_TILES=max(16, 4096 // block_e), num_warps=4)
    _sort_scatter_kernel[(num_blocks,)](ids, bases, starts, sorted_ids, num_pairs, num_experts, per_block,
                                        BLOCK_E=block_e, SUB=sub, num_warps=8)
    return sorted_ids, expert_ids, ntp


# ----------------------------------------------------------------------------------------------
# Launch configs
# ----------------------------------------------------------------------------------------------

# The GEMV re-reads an expert's weights for each pair routed to it: it pays while pairs seldom share one.
GEMV_MAX_PAIRS_PER_EXPERT = 1

# (E, N, K, token bucket) -> GROUPED_FIELDS (moe_config says how): benchmarks/moe_tune.py --quick on an
# H100 80GB HBM3, 2026-12-06 (the H200 has the same SMs and more bandwidth); entries of both
# launches (gate/up: N = 2I, K = H; down: N = H, K = I) at Qwen3-30B-A3B and Mixtral-8x7B shapes.
GROUPED_TILES = MappingProxyType({
    (128, 1536, 2048, 32): (16, 64, 128, 8, 4, 4),
    (128, 2048, 768, 32): (16, 64, 128, 8, 4, 3),
    (128, 1536, 2048, 64): (16, 64, 128, 8, 4, 4),
    (128, 2048, 768, 64): (16, 64, 128, 8, 4, 4),
    (128, 1536, 2048, 128): (32, 64, 128, 8, 4, 3),
    (128, 2048, 768, 128): (32, 64, 128, 8, 4, 3),
    (128, 1536, 2048, 256): (32, 64, 128, 8, 4, 3),
    (128, 2048, 768, 256): (32, 128, 128, 8, 8, 3),
    (128, 1536, 2048, 512): (64, 64, 128, 8, 4, 4),
    (128, 2048, 768, 512): (64, 64, 64, 8, 4, 3),
    (128, 1536, 2048, 1024): (64, 64, 64, 8, 4, 3),
    (128, 2048, 768, 1024): (64, 128, 64, 8, 4, 4),
    (128, 1536, 2048, 2048): (128, 128, 64, 8, 8, 4),
    (128, 2048, 768, 2048): (128, 128, 64, 8, 8, 3),
    (128, 1536, 2048, 4096): (128, 128, 64, 8, 8, 3),
    (128, 2048, 768, 4096): (128, 128, 64, 8, 8, 3),
    (128, 1536, 2048, 8192): (128, 64, 64, 8, 4, 3),
    (128, 2048, 768, 8192): (128, 128, 64, 8, 4, 3),
    (8, 28672, 4096, 8): (16, 64, 128, 8, 4, 4),
    (8, 4096, 14336, 8): (16, 128, 128, 8, 4, 3),
    (8, 28672, 4096, 16): (16, 64, 128, 8, 4, 4),
    (8, 4096, 14336, 16): (16, 128, 128, 8, 4, 3),
    (8, 28672, 4096, 32): (32, 64, 128, 8, 4, 3),
    (8, 4096, 14336, 32): (32, 128, 128, 8, 8, 4),
    (8, 28672, 4096, 64): (16, 64, 128, 8, 4, 4),
    (8, 4096, 14336, 64): (16, 64, 128, 8, 4, 3),
    (8, 28672, 4096, 128): (64, 64, 128, 8, 4, 4),
    (8, 4096, 14336, 128): (64, 64, 128, 8, 4, 3),
    (8, 28672, 4096, 256): (64, 64, 128, 8, 4, 4),
    (8, 4096, 14336, 256): (64, 128, 64, 8, 8, 3),
    (8, 28672, 4096, 512): (128, 128, 64, 8, 8, 4),
    (8, 4096, 14336, 512): (128, 128, 128, 8, 8, 3),
    (8, 28672, 4096, 1024): (128, 128, 64, 8, 8, 3),
    (8, 4096, 14336, 1024): (128, 128, 64, 8, 8, 3),
    (8, 28672, 4096, 2048): (128, 128, 64, 8, 8, 4),
    (8, 4096, 14336, 2048): (128, 128, 128, 8, 8, 3),
    (8, 28672, 4096, 4096): (128, 128, 64, 8, 8, 3),
    (8, 4096, 14336, 4096): (128, 128, 128, 8, 8, 3),
    (8, 28672, 4096, 8192): (128, 128, 64, 8, 8, 4),
    (8, 4096, 14336, 8192): (128, 128, 64, 8, 4, 3),
})
# (E, N, K, token bucket) -> GEMV_FIELDS, from the same sweep
GEMV_TILES = MappingProxyType({
    (128, 1536, 2048, 1): (32, 256, 4, 3),
    (128, 2048, 768, 1): (8, 512, 4, 3),
    (128, 1536, 2048, 2): (8, 512, 4, 3),
    (128, 2048, 768, 2): (8, 512, 4, 3),
    (128, 1536, 2048, 4): (16, 512, 4, 3),
    (128, 2048, 768, 4): (16, 256, 8, 3),
    (128, 1536, 2048, 8): (16, 512, 4, 3),
    (128, 2048, 768, 8): (8, 256, 4, 3),
    (128, 1536, 2048, 16): (16, 512, 4, 3),
    (128, 2048, 768, 16): (8, 256, 4, 3),
    (8, 28672, 4096, 1): (16, 512, 4, 3),
    (8, 4096, 14336, 1): (8, 512, 8, 3),
    (8, 28672, 4096, 2): (16, 512, 4, 3),
    (8, 4096, 14336, 2): (32, 512, 4, 3),
    (8, 28672, 4096, 4): (16, 512, 4, 3),
    (8, 4096, 14336, 4): (32, 512, 4, 3),
})
GROUPED_FIELDS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
GEMV_FIELDS = ("block_n", "block_k", "num_warps", "num_stages")
# what a grouped tile's load pipeline may take of Hopper's 227 KB per block, leaving room for the epilogue
SHARED_MEMORY_BYTES = 200 * 1024


def use_gemv_path(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether fused_moe_triton takes the GEMV path at this size."""
    return num_tokens * top_k <= GEMV_MAX_PAIRS_PER_EXPERT * num_experts


def token_bucket(num_tokens: int) -> int:
    """The token-count key of the tile tables: the power of two at or above num_tokens."""
    return triton.next_power_of_2(max(1, num_tokens))


def _lookup(table, num_experts: int, n: int, k: int, num_tokens: int) -> Optional[tuple]:
    """The table's entry for (E, N, K) at the bucket nearest num_tokens (log scale, the larger on a tie)."""
    buckets = [key[3] for key in table if key[:3] == (num_experts, n, k)]
    if not buckets:
        return None
    want = math.log2(token_bucket(num_tokens))
    return table[(num_experts, n, k, min(buckets, key=lambda b: (abs(math.log2(b) - want), -b)))]


def _grouped_default(num_tokens: int, top_k: int, num_experts: int) -> tuple:
    """Tile height from the pairs an expert gets on average (16 to 128); wider, shallower tiles
    and more warps as it grows."""
    per_expert = num_tokens * top_k / num_experts
    block_m = min(128, max(16, triton.next_power_of_2(math.ceil(per_expert))))
    if block_m <= 32:
        return (block_m, 64, 128, 8, 4, 4)
    if block_m == 64:
        return (64, 128, 64, 8, 4, 4)
    return (128, 128, 64, 8, 8, 3)


def _fit_tile(cfg: dict, n_out: int, k: int, elem_bytes: int, b_tiles: int) -> dict:
    """cfg with block_n / block_k no wider than the problem and, for a grouped tile (one with a
    block_m), at least 16 (tl.dot's smallest) and a load pipeline within SHARED_MEMORY_BYTES
    (fewer stages, then a shorter block_k)."""
    cfg = dict(cfg)
    least = 16 if "block_m" in cfg else 1
    cfg["block_n"] = max(least, min(cfg["block_n"], triton.next_power_of_2(n_out)))
    cfg["block_k"] = max(least, min(cfg["block_k"], triton.next_power_of_2(k)))
    if "block_m" in cfg:
        def need():
            return (cfg["block_m"] + b_tiles * cfg["block_n"]) * cfg["block_k"] * elem_bytes * cfg["num_stages"]
        while need() > SHARED_MEMORY_BYTES and cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        while need() > SHARED_MEMORY_BYTES and cfg["block_k"] > 16:
            cfg["block_k"] //= 2
    return cfg


def moe_config(num_experts: int, inter: int, hidden: int, num_tokens: int, top_k: int, dtype: torch.dtype,
               path: Optional[str] = None) -> dict:
    """fused_moe_triton's launch configs at this shape: {"path": "gemv" or "grouped", "gate_up":
    {...}, "down": {...}}; `path` forces one path.

    Each launch's tiles come from GROUPED_TILES or GEMV_TILES, keyed by (E, N, K) = its weight's
    shape per expert (w13's (2I, H) for gate/up, w2's (H, I) for down) and the entry's token
    bucket nearest num_tokens; shapes not listed take _grouped_default or a 16 x 256 GEMV tile.
    The grouped down launch takes gate/up's block_m (one sort serves both). Tiles are then fitted
    to the problem and the shared-memory budget (_fit_tile)."""
    if path is None:
        path = "gemv" if use_gemv_path(num_tokens, top_k, num_experts) else "grouped"
    assert path in ("gemv", "grouped"), path
    esz = dtype.itemsize
    shapes = (("gate_up", 2 * inter, hidden, inter, 2), ("down", hidden, inter, hidden, 1))
    out = {"path": path}
    for name, n, k, n_out, b_tiles in shapes:
        if path == "gemv":
            entry = _lookup(GEMV_TILES, num_experts, n, k, num_tokens) or (16, 256, 4, 3)
            cfg = dict(zip(GEMV_FIELDS, entry))
        else:
            entry = _lookup(GROUPED_TILES, num_experts, n, k, num_tokens) or _grouped_default(
                num_tokens, top_k, num_experts)
            cfg = dict(zip(GROUPED_FIELDS, entry))
            if name == "down":
                cfg["block_m"] = out["gate_up"]["block_m"]
        out[name] = _fit_tile(cfg, n_out, k, esz, b_tiles)
    return out


# ----------------------------------------------------------------------------------------------
# The experts' MLPs
# ----------------------------------------------------------------------------------------------


@triton.jit
def _silu_mul_rounded(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in fp32 from fp32 sums, rounded to dtype where the reference's ops round."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit
def _activation_rounded(gate, up, alpha, limit, dtype: tl.constexpr, CLAMPED: tl.constexpr):
    """h from the fp32 gate and up sums: silu(gate) * up, or with CLAMPED the clamped SwiGLU
    (ClampedSwiGLU), rounded to dtype where the reference's ops round."""
    if CLAMPED:
        gate = tl.minimum(gate.to(dtype).to(tl.float32), limit)
        up = tl.minimum(tl.maximum(up.to(dtype).to(tl.float32), -limit), limit)
        z = (gate * alpha).to(dtype).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-z))).to(dtype).to(tl.float32)
        glu = (gate * sig).to(dtype).to(tl.float32)
        return ((up + 1.0).to(dtype).to(tl.float32) * glu).to(dtype)
    return _silu_mul_rounded(gate, up, dtype)


@triton.jit
def _row_bias(b_ptr, expert, stride_be, n, n_ok):
    """The bias of rows n of this expert, in fp32."""
    return tl.load(b_ptr + expert * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)


@triton.jit
def _e4m3_as(w, dtype: tl.constexpr):
    """e4m3 weights in dtype, exactly; through fp16, which Hopper converts two bytes an instruction."""
    return w.to(tl.float16).to(dtype)


@triton.jit
def _row_scales(scale_ptr, expert, stride_se, n, n_ok):
    """The FP8 weight's fp32 scales of rows n of this expert."""
    return tl.load(scale_ptr + expert * stride_se + n, mask=n_ok, other=0.0)


@triton.jit
def _tile_coords(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid, GROUP_M row tiles side by side so that they share
    the weight tiles they read while those are in L2."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _grouped_gate_up_kernel(x_ptr, w_ptr, h_ptr, sorted_ptr, expert_ids_ptr, ntp_ptr, scale_ptr, b_ptr, num_pairs,
                            I, H, num_m, stride_we, stride_wn, stride_se, stride_be, alpha, limit,
                            TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN: tl.constexpr,
                            W_FP8: tl.constexpr, BIAS: tl.constexpr, CLAMPED: tl.constexpr):
    """Grid (num_m * cdiv(I, BLOCK_N),): for BLOCK_M sorted pairs of one expert and BLOCK_N
    features, gate and up from the two halves of w13 and h[pair] = silu(gate) * up. Tiles past
    num_tokens_post_padded exit at once. W_FP8: w13 is e4m3 with row scales at scale_ptr. BIAS:
    w13's row biases at b_ptr; CLAMPED: the clamped SwiGLU (alpha, limit)."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(ntp_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + (pair // TOP_K).to(tl.int64)[:, None] * H + kk[None, :]
    g_ptrs = w_ptr + expert * stride_we + n.to(tl.int64)[None, :] * stride_wn + kk[:, None]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = kk < H - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if W_FP8:
            g, u = _e4m3_as(g, x_ptr.dtype.element_ty), _e4m3_as(u, x_ptr.dtype.element_ty)
        if WIDEN:
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if W_FP8:  # a per-row scale factors out of the dot product
        acc_g *= _row_scales(scale_ptr, expert, stride_se, n, n_ok)[None, :]
        acc_u *= _row_scales(scale_ptr, expert, stride_se, n + I, n_ok)[None, :]
    if BIAS:
        acc_g += _row_bias(b_ptr, expert, stride_be, n, n_ok)[None, :]
        acc_u += _row_bias(b_ptr, expert, stride_be, n + I, n_ok)[None, :]
    h = _activation_rounded(acc_g, acc_u, alpha, limit, h_ptr.dtype.element_ty, CLAMPED)
    tl.store(h_ptr + pair.to(tl.int64)[:, None] * I + n[None, :], h, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _grouped_down_kernel(h_ptr, w_ptr, y_ptr, topk_w_ptr, sorted_ptr, expert_ids_ptr, ntp_ptr, scale_ptr, b_ptr,
                         num_pairs, H, I, num_m, stride_we, stride_wn, stride_se, stride_be,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, WIDEN: tl.constexpr, W_FP8: tl.constexpr, BIAS: tl.constexpr):
    """Grid (num_m * cdiv(H, BLOCK_N),): y[pair] = (h[pair] @ w2[expert]^T) * topk_weight[pair]
    for BLOCK_M sorted pairs of one expert and BLOCK_N features (W_FP8: w2 e4m3, row scales;
    BIAS: w2's row biases at b_ptr, added before the weight)."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(ntp_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + pair.to(tl.int64)[:, None] * I + kk[None, :]
    b_ptrs = w_ptr + expert * stride_we + n.to(tl.int64)[None, :] * stride_wn + kk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = kk < I - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if W_FP8:
            b = _e4m3_as(b, h_ptr.dtype.element_ty)
        if WIDEN:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if W_FP8:
        acc *= _row_scales(scale_ptr, expert, stride_se, n, n_ok)[None, :]
    if BIAS:
        acc += _row_bias(b_ptr, expert, stride_be, n, n_ok)[None, :]
    dtype = y_ptr.dtype.element_ty
    weight = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(dtype).to(tl.float32)
    y = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    tl.store(y_ptr + pair.to(tl.int64)[:, None] * H + n[None, :], y, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_slots_kernel(y_ptr, ids_ptr, rows_ptr, topk_w_ptr, out_ptr, E, H, TOP_K: tl.constexpr,
                      BLOCK_H: tl.constexpr, GATHER: tl.constexpr):
    """Grid (T, cdiv(H, BLOCK_H)): out[t] = the sum of y[t * TOP_K + j] over the slots j with a
    valid expert, in slot order, in fp32. With GATHER, slot j's row is y[rows[t * TOP_K + j]],
    first scaled by its routing weight and rounded as the grouped down launch does."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair)
        width = tl.where((e >= 0) & (e < E), H, 0)  # a slot of no expert reads nothing
        row = tl.load(rows_ptr + pair).to(tl.int64) if GATHER else pair
        v = tl.load(y_ptr + row * H + h, mask=h < width, other=0.0)
        if GATHER:
            weight = tl.load(topk_w_ptr + pair).to(v.dtype).to(tl.float32)
            v = (v.to(tl.float32) * weight).to(v.dtype)
        acc += v.to(tl.float32)
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


@triton.jit
def _gemv_gate_up_kernel(x_ptr, w_ptr, h_ptr, ids_ptr, scale_ptr, b_ptr, E, I, H, stride_we, stride_wn, stride_se,
                         stride_be, alpha, limit, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         W_FP8: tl.constexpr, BIAS: tl.constexpr, CLAMPED: tl.constexpr):
    """Grid (T * TOP_K, cdiv(I, BLOCK_N)): h[pair] for BLOCK_N features of one (token, slot)
    pair, from its expert's gate and up rows only; a pair of no expert writes nothing. W_FP8: w13
    is e4m3 with row scales at scale_ptr. BIAS, CLAMPED: as in _grouped_gate_up_kernel."""
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if (expert < 0) | (expert >= E):
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    kk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pair // TOP_K) * H + kk
    g_ptrs = w_ptr + expert * stride_we + n.to(tl.int64)[:, None] * stride_wn + kk[None, :]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = kk < H - k0
        xv = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        g = tl.load(g_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if W_FP8:
            g, u = _e4m3_as(g, tl.float32), _e4m3_as(u, tl.float32)
        acc_g += g.to(tl.float32) * xv
        acc_u += u.to(tl.float32) * xv
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if W_FP8:  # a per-row scale factors out of the dot product
        gate *= _row_scales(scale_ptr, expert, stride_se, n, n_ok)
        up *= _row_scales(scale_ptr, expert, stride_se, n + I, n_ok)
    if BIAS:
        gate += _row_bias(b_ptr, expert, stride_be, n, n_ok)
        up += _row_bias(b_ptr, expert, stride_be, n + I, n_ok)
    h = _activation_rounded(gate, up, alpha, limit, h_ptr.dtype.element_ty, CLAMPED)
    tl.store(h_ptr + pair * I + n, h, mask=n_ok)


@triton.jit
def _gemv_down_kernel(h_ptr, w_ptr, out_ptr, topk_w_ptr, ids_ptr, scale_ptr, b_ptr, E, H, I, stride_we, stride_wn,
                      stride_se, stride_be, TOP_K: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, W_FP8: tl.constexpr, BIAS: tl.constexpr):
    """Grid (T, cdiv(H, BLOCK_N)): out[t] for BLOCK_N features, the sum over token t's slots of
    (h[pair] @ w2[expert]^T + bias) * topk_weight[pair], in slot order, skipping slots of no
    expert (W_FP8: w2 e4m3 with row scales at scale_ptr; BIAS: w2's row biases at b_ptr). Every
    slot's rows are loaded in one [SLOTS, BLOCK_N, BLOCK_K] tile (SLOTS = TOP_K rounded up to a
    power of two) so that a program keeps all its experts' loads in flight at once."""
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    kk = tl.arange(0, BLOCK_K)
    slot = tl.arange(0, SLOTS)
    pair = t * TOP_K + slot
    expert = tl.load(ids_ptr + pair, mask=slot < TOP_K, other=-1).to(tl.int64)
    valid = (slot < TOP_K) & (expert >= 0) & (expert < E)
    expert = tl.where(valid, expert, 0)
    dtype = out_ptr.dtype.element_ty
    h_ptrs = h_ptr + pair[:, None] * I + kk[None, :]  # [SLOTS, BLOCK_K]
    w_ptrs = (w_ptr + expert[:, None, None] * stride_we + n.to(tl.int64)[None, :, None] * stride_wn
              + kk[None, None, :])  # [SLOTS, BLOCK_N, BLOCK_K]
    rows_ok = valid[:, None] & n_ok[None, :]
    acc = tl.zeros([SLOTS, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = kk < I - k0
        hv = tl.load(h_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=rows_ok[:, :, None] & k_ok[None, None, :], other=0.0)
        if W_FP8:
            w = _e4m3_as(w, tl.float32)
        acc += tl.sum(w.to(tl.float32) * hv[:, None, :], axis=2)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if W_FP8:
        acc *= _row_scales(scale_ptr, expert[:, None], stride_se, n[None, :], rows_ok)
    if BIAS:
        acc += _row_bias(b_ptr, expert[:, None], stride_be, n[None, :], rows_ok)
    weight = tl.load(topk_w_ptr + pair, mask=valid, other=0.0).to(dtype).to(tl.float32)
    contrib = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype).to(tl.float32)
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):  # slot order; each sum picks out one row exactly
        total += tl.sum(tl.where((slot == j)[:, None] & valid[:, None], contrib, 0.0), axis=0)
    tl.store(out_ptr + t * H + n, total.to(dtype), mask=n_ok)


def _check_moe_args(x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None, w13_bias=None, w2_bias=None
                    ) -> tuple[int, int, int, int, int]:
    """(T, H, E, I, k) after checking the shapes and layouts the kernels take (with scales: e4m3
    weights and their contiguous fp32 row scales; with biases: [E, 2I] and [E, H], unit last stride)."""
    T, H = x.shape
    E, two_i, h13 = w13.shape
    inter = two_i // 2
    k = topk_ids.shape[1]
    assert h13 == H and two_i == 2 * inter and w2.shape == (E, H, inter), (x.shape, w13.shape, w2.shape)
    assert topk_ids.shape == topk_weights.shape == (T, k), (topk_ids.shape, topk_weights.shape)
    assert x.is_contiguous() and w13.stride(-1) == 1 and w2.stride(-1) == 1
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if w13_scale is None:
        assert w13.dtype == w2.dtype == x.dtype and w2_scale is None
    else:
        assert w13.dtype == w2.dtype == torch.float8_e4m3fn, (w13.dtype, w2.dtype)
        assert w13_scale.shape == (E, 2 * inter) and w2_scale.shape == (E, H), (w13_scale.shape, w2_scale.shape)
        for s in (w13_scale, w2_scale):
            assert s.dtype == torch.float32 and s.is_contiguous()
    assert (w13_bias is None) == (w2_bias is None), "biases on both projections or on neither"
    if w13_bias is not None:
        assert w13_bias.shape == (E, 2 * inter) and w2_bias.shape == (E, H), (w13_bias.shape, w2_bias.shape)
        assert w13_bias.stride(-1) == 1 and w2_bias.stride(-1) == 1
    return T, H, E, inter, k


def _dot_meta(x: torch.Tensor, w_scale: Optional[torch.Tensor]) -> dict:
    # the interpreter multiplies 16-bit tl.dot operands wrongly: widen them there
    widen = x.dtype != torch.float32 and not x.is_cuda
    return dict(DOT_PRECISION="ieee" if x.dtype == torch.float32 or widen else "tf32", WIDEN=widen,
                W_FP8=w_scale is not None)


def _scale_args(w: torch.Tensor, w_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """(the scale pointer argument, its expert stride): the weight itself stands in when there are
    no scales (the kernel then never reads it)."""
    return (w, 0) if w_scale is None else (w_scale, w_scale.stride(0))


def _bias_args(w: torch.Tensor, bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """(the bias pointer argument, its expert stride); the weight stands in without a bias."""
    return (w, 0) if bias is None else (bias, bias.stride(0))


def _activation_args(activation: Optional[ClampedSwiGLU]) -> tuple[float, float, bool]:
    """(alpha, limit, CLAMPED) of a gate/up launch (SiLU ignores the two numbers)."""
    if activation is None:
        return 1.0, 0.0, False
    return float(activation.alpha), float(activation.limit), True


def grouped_gate_up(x: torch.Tensor, w13: torch.Tensor, top_k: int, sort: tuple, cfg: dict,
                    w13_scale: Optional[torch.Tensor] = None, w13_bias: Optional[torch.Tensor] = None,
                    activation: Optional[ClampedSwiGLU] = None) -> torch.Tensor:
    """Launch 1 of the grouped path: h [T * k, I] (rows of pairs of no expert unwritten)."""
    sorted_ids, expert_ids, ntp = sort
    num_pairs, inter = x.shape[0] * top_k, w13.shape[1] // 2
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    num_m = expert_ids.numel()
    grid = (num_m * triton.cdiv(inter, cfg["block_n"]),)
    scale, stride_se = _scale_args(w13, w13_scale)
    bias, stride_be = _bias_args(w13, w13_bias)
    alpha, limit, clamped = _activation_args(activation)
    _grouped_gate_up_kernel[grid](
        x, w13, h, sorted_ids, expert_ids, ntp, scale, bias, num_pairs, inter, x.shape[1], num_m, w13.stride(0),
        w13.stride(1), stride_se, stride_be, alpha, limit, TOP_K=top_k, BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], GROUP_M=cfg["group_m"], **_dot_meta(x, w13_scale),
        BIAS=w13_bias is not None, CLAMPED=clamped, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return h


def grouped_down(h: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, sort: tuple, cfg: dict,
                 w2_scale: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Launch 2 of the grouped path: y [T * k, H], each pair's down projection times its weight."""
    sorted_ids, expert_ids, ntp = sort
    num_pairs, inter = h.shape
    hidden = w2.shape[1]
    y = torch.empty((num_pairs, hidden), dtype=h.dtype, device=h.device)
    num_m = expert_ids.numel()
    grid = (num_m * triton.cdiv(hidden, cfg["block_n"]),)
    scale, stride_se = _scale_args(w2, w2_scale)
    bias, stride_be = _bias_args(w2, w2_bias)
    _grouped_down_kernel[grid](
        h, w2, y, topk_weights, sorted_ids, expert_ids, ntp, scale, bias, num_pairs, hidden, inter, num_m,
        w2.stride(0), w2.stride(1), stride_se, stride_be, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"], GROUP_M=cfg["group_m"], **_dot_meta(h, w2_scale), BIAS=w2_bias is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y


def sum_slots(y: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, rows: Optional[torch.Tensor] = None,
              topk_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out [T, H]: each token's rows of y [T * k, H] with a valid expert, summed in slot order.
    With rows [T * k] (pair -> its row of y) and topk_weights, each row is gathered and weighted first."""
    T, k = topk_ids.shape
    hidden = y.shape[1]
    out = torch.empty((T, hidden), dtype=y.dtype, device=y.device)
    gather = rows is not None
    block_h = min(1024, triton.next_power_of_2(hidden))
    _sum_slots_kernel[(T, triton.cdiv(hidden, block_h))](
        y, topk_ids, rows if gather else topk_ids, topk_weights if gather else y, out, num_experts, hidden,
        TOP_K=k, BLOCK_H=block_h, GATHER=gather, num_warps=4)
    return out


def gemv_gate_up(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor, cfg: dict,
                 w13_scale: Optional[torch.Tensor] = None, w13_bias: Optional[torch.Tensor] = None,
                 activation: Optional[ClampedSwiGLU] = None) -> torch.Tensor:
    """Launch 1 of the GEMV path: h [T * k, I] (rows of pairs of no expert unwritten)."""
    T, k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    h = torch.empty((T * k, inter), dtype=x.dtype, device=x.device)
    scale, stride_se = _scale_args(w13, w13_scale)
    bias, stride_be = _bias_args(w13, w13_bias)
    alpha, limit, clamped = _activation_args(activation)
    _gemv_gate_up_kernel[(T * k, triton.cdiv(inter, cfg["block_n"]))](
        x, w13, h, topk_ids, scale, bias, num_experts, inter, hidden, w13.stride(0), w13.stride(1), stride_se,
        stride_be, alpha, limit, TOP_K=k, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
        W_FP8=w13_scale is not None, BIAS=w13_bias is not None, CLAMPED=clamped, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return h


def _down_block_k(block_k: int, inter: int, top_k: int) -> int:
    """The down GEMV's K block: its [slots, block_n, block_k] tile holds every slot's rows, so block_k
    is the table's times 2 / slots (the tile twice the table's width) but no wider than the
    intermediate size, then halved to a divisor of it while above 32 (no half-empty last block)."""
    bk = max(16, min(block_k // triton.next_power_of_2(top_k) * 2, triton.next_power_of_2(inter)))
    while bk > 32 and inter % bk:
        bk //= 2
    return bk


def gemv_down(h: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, cfg: dict,
              w2_scale: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Launch 2 of the GEMV path: out [T, H]."""
    T, k = topk_ids.shape
    num_experts, hidden, inter = w2.shape
    out = torch.empty((T, hidden), dtype=h.dtype, device=h.device)
    scale, stride_se = _scale_args(w2, w2_scale)
    bias, stride_be = _bias_args(w2, w2_bias)
    _gemv_down_kernel[(T, triton.cdiv(hidden, cfg["block_n"]))](
        h, w2, out, topk_weights, topk_ids, scale, bias, num_experts, hidden, inter, w2.stride(0), w2.stride(1),
        stride_se, stride_be, TOP_K=k, SLOTS=triton.next_power_of_2(k), BLOCK_N=cfg["block_n"],
        BLOCK_K=_down_block_k(cfg["block_k"], inter, k), W_FP8=w2_scale is not None, BIAS=w2_bias is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, config: Optional[dict] = None, w13_scale: Optional[torch.Tensor] = None,
                     w2_scale: Optional[torch.Tensor] = None, w13_bias: Optional[torch.Tensor] = None,
                     w2_bias: Optional[torch.Tensor] = None, activation: Optional[ClampedSwiGLU] = None) -> torch.Tensor:
    """Triton fused_moe_ref: x [T, H] contiguous; w13, w2 with unit last stride; fp32, bf16 or
    fp16. `config` (moe_config's form) overrides the path and tiles chosen for the shape. With
    w13_scale [E, 2I] and w2_scale [E, H], the weights are e4m3 (fused_moe_fp8_ref's arguments).
    Biases and the clamped SwiGLU as fused_moe_ref takes them, on both paths."""
    T, H, E, inter, k = _check_moe_args(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, w13_bias, w2_bias)
    if T == 0:
        return torch.empty_like(x)
    cfg = config or moe_config(E, inter, H, T, k, x.dtype)
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.contiguous()
    if cfg["path"] == "gemv":
        h = gemv_gate_up(x, w13, ids, cfg["gate_up"], w13_scale, w13_bias, activation)
        return gemv_down(h, w2, weights, ids, cfg["down"], w2_scale, w2_bias)
    assert cfg["gate_up"]["block_m"] == cfg["down"]["block_m"], "one sort serves both launches"
    sort = moe_sort_tokens(ids, E, cfg["gate_up"]["block_m"])
    h = grouped_gate_up(x, w13, k, sort, cfg["gate_up"], w13_scale, w13_bias, activation)
    return sum_slots(grouped_down(h, w2, weights, sort, cfg["down"], w2_scale, w2_bias), ids, E)


# (E, 2I, H) -> the token count from which grouped_mm_moe (torch._grouped_mm's two products, bf16 on
# sm90+) beats fused_moe_triton for plain experts: the kernel bench's moe rows at 1-8,192 tokens on an
# H100 80GB HBM3, 2026-12-06 (Qwen3-30B-A3B: Triton to 4,096; Mixtral-8x7B: Triton to 512).
GROUPED_MM_FROM = MappingProxyType({
    (128, 1536, 2048): 8192,
    (8, 28672, 4096): 1024,
})


@functools.lru_cache(maxsize=None)
def _has_grouped_mm(device: torch.device) -> bool:
    """Whether torch._grouped_mm runs bf16 on this device (a CUDA device of compute capability 9.0+)."""
    return device.type == "cuda" and hasattr(torch, "_grouped_mm") \
        and torch.cuda.get_device_capability(device) >= (9, 0)


def use_grouped_mm(num_experts: int, inter: int, hidden: int, num_tokens: int, dtype: torch.dtype,
                   device: torch.device) -> bool:
    """Whether fused_moe takes torch._grouped_mm for plain (unquantized, bias-free, SiLU) experts:
    bf16 on sm90+, at a shape GROUPED_MM_FROM lists, from its token count on."""
    start = GROUPED_MM_FROM.get((num_experts, 2 * inter, hidden))
    return start is not None and num_tokens >= start and dtype == torch.bfloat16 and _has_grouped_mm(device)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: Optional[torch.Tensor] = None,
              w2_scale: Optional[torch.Tensor] = None, w13_bias: Optional[torch.Tensor] = None,
              w2_bias: Optional[torch.Tensor] = None, activation: Optional[ClampedSwiGLU] = None) -> torch.Tensor:
    """The experts' MLPs (fused_moe_ref's arguments and result; with scales, e4m3 weights as
    fused_moe_fp8_ref takes them): on CUDA, Triton, or torch._grouped_mm where it wins
    (use_grouped_mm)."""
    if use_triton(x):
        plain = w13_scale is None and w13_bias is None and w2_bias is None and activation is None
        if plain and use_grouped_mm(w13.shape[0], w2.shape[2], x.shape[1], x.shape[0], x.dtype, x.device):
            return grouped_mm_moe(x, w13, w2, topk_weights, topk_ids)
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale, w2_scale=w2_scale,
                                w13_bias=w13_bias, w2_bias=w2_bias, activation=activation)
    if w13_scale is not None:
        assert w13_bias is None and activation is None, "FP8 experts have no biases or clamped SwiGLU yet"
        return fused_moe_fp8_ref(x, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)


def grouped_mm_order(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch._grouped_mm's sort of the (token, slot) pairs: (order, the pairs by expert, pairs of no
    expert last; offs [E] int32, each group's end; valid [T * k], whether a pair has an expert here)."""
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, num_experts)  # pairs of no expert sort last, past every group
    order = torch.argsort(key, stable=True)
    ones = torch.ones_like(key, dtype=torch.int32)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device).scatter_add_(0, key, ones)
    return order, counts[:num_experts].cumsum(0, dtype=torch.int32), valid


def grouped_mm_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe_ref through torch._grouped_mm (bf16 on sm90+; fused_moe takes it where
    use_grouped_mm says it wins): the pairs sorted by expert with torch ops, one grouped GEMM for
    gate/up, Triton's SiLU-and-mul, one grouped GEMM for down, then one Triton launch that weights
    each token's rows and sums them in slot order (sum_slots). No host sync."""
    T, H, E, _, k = _check_moe_args(x, w13, w2, topk_weights, topk_ids)
    order, offs, _ = grouped_mm_order(topk_ids, E)
    # rows past the last group (pairs of no expert) are never computed, and sum_slots never reads them
    h = silu_and_mul_triton(torch._grouped_mm(x[order // k], w13.transpose(1, 2), offs=offs))
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    rows = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
    return sum_slots(y, topk_ids.to(torch.int32).contiguous(), E, rows=rows, topk_weights=topk_weights.contiguous())
