"""Mixture-of-experts: the Triton routing, token sort, grouped GEMM and GEMV paths against the torch
references (kernels/fused_moe.py), with 16/32-bit and e4m3 (per-row scaled) expert weights, the tile
tables' rules, and torch._grouped_mm's path."""

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from tokenmill.kernels import fused_moe as fm

from tests.kernels.common import DEVICES, INTERPRETER, TOL, nan_empty, rel_err  # noqa: F401

PATHS = ["gemv", "grouped"]


def _experts(T, H, I, E, dtype, device, seed=0):
    """x [T, H] and the stacked expert weights w13 [E, 2I, H], w2 [E, H, I], scaled to unit outputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(device, dtype)
    return x, w13, w2


def _fp8(w13, w2):
    """The experts quantized per expert and output row as layers/fp8_moe.py does: (w13_q, w13_scale,
    w2_q, w2_scale), the e4m3 weights and their fp32 scales [E, N]."""
    from tokenmill.quantization.fp8 import quantize_weight_fp8

    out = []
    for w in (w13, w2):
        pairs = [quantize_weight_fp8(w[e]) for e in range(w.shape[0])]
        out += [torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])]
    return tuple(out)


def _routing(T, E, k, device, kind="random", seed=0, dtype=torch.float32):
    """(topk_weights, topk_ids [T, k] int32): k distinct experts a token ('random'), every token
    on experts 0..k-1 ('one': all of slot 0 on expert 0), only the even experts ('sparse': the
    odd ones get no tokens), or 'random' with some slots -1 ('ep': another rank's experts)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "one":
        ids = torch.arange(k).repeat(T, 1)
    elif kind == "sparse":
        ids = torch.stack([torch.randperm((E + 1) // 2, generator=g)[:k] * 2 for _ in range(T)])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if kind == "ep":
        ids[torch.rand(T, k, generator=g) < 0.3] = -1
        ids[0] = -1  # a token with no expert here: its output is zero
    weights = torch.rand(T, k, generator=g) + 0.1
    return weights.to(device, dtype), ids.to(device, torch.int32)


# --------------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("E, k", [(4, 1), (8, 2), (8, 8), (60, 4), (256, 8)])
def test_route_matches_ref(device, renormalize, E, k):
    torch.manual_seed(E + k)
    for T in (1, 5, 33):
        logits = torch.randn(T, E, device=device)
        weights, ids = fm.moe_route_triton(logits, k, renormalize)
        ref_w, ref_ids = fm.moe_route_ref(logits, k, renormalize)
        assert ids.dtype == torch.int32 and weights.dtype == logits.dtype
        assert torch.equal(ids, ref_ids), (T, E, k)
        torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_route_16bit_logits_and_row_stride(device, dtype):
    """16-bit logits (distinct per row, so the ranking has no ties) read through a row stride."""
    T, E, k = 7, 16, 4
    g = torch.Generator().manual_seed(1)
    ranks = torch.stack([torch.randperm(E, generator=g) for _ in range(T)]).float()
    logits = torch.zeros(T, E + 3, device=device, dtype=dtype)
    logits[:, :E] = (ranks * 0.25 - 2).to(device, dtype)
    logits = logits[:, :E]
    for renormalize in (False, True):
        weights, ids = fm.moe_route_triton(logits, k, renormalize)
        ref_w, ref_ids = fm.moe_route_ref(logits, k, renormalize)
        assert torch.equal(ids, ref_ids) and weights.dtype == dtype
        assert rel_err(weights, ref_w) < TOL[dtype]


def test_route_dispatcher_on_cpu_is_the_reference():
    logits = torch.randn(3, 8)
    assert all(torch.equal(a, b) for a, b in zip(fm.moe_route(logits, 2, True), fm.moe_route_ref(logits, 2, True)))


def test_grouped_routing_by_hand():
    """DeepSeek's routing (GroupedTopK) on numbers worked out by hand: 8 experts in 4 groups of 2."""
    # V3: sigmoid scores; groups scored by their two best (biased) scores; the best 2 groups kept.
    scores = torch.tensor([[0.9, 0.1, 0.2, 0.3, 0.8, 0.7, 0.05, 0.6]])
    logits = torch.log(scores / (1 - scores))  # sigmoid(logits) = scores
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.9, 0.0])  # lifts expert 6 (group 3) into the choice
    v3 = fm.GroupedTopK("sigmoid", num_groups=4, topk_groups=2, group_score="top2_sum", scaling_factor=2.0)
    weights, ids = fm.moe_route(logits, 2, True, v3, bias)
    # biased group scores 1.0, 0.5, 1.5, 1.55: groups 2 and 3; biased best 6 (0.95) then 4 (0.8)
    assert ids.tolist() == [[6, 4]]
    # weights: the unbiased scores 0.05 and 0.8, renormalised, times 2
    torch.testing.assert_close(weights, torch.tensor([[0.05, 0.8]]) / 0.85 * 2.0)
    # V2: softmax; groups scored by their best; weights the (unrenormalised) probabilities
    v2 = fm.GroupedTopK("softmax", num_groups=4, topk_groups=1, group_score="max", scaling_factor=1.5)
    probs = torch.softmax(logits, dim=-1)
    weights, ids = fm.moe_route(logits, 2, False, v2)
    assert ids.tolist() == [[0, 1]]  # only group 0 (its expert 0 is the best of all)
    torch.testing.assert_close(weights, probs[:, :2] * 1.5)


GROUPINGS = {  # (E, k, renormalize, grouping, with bias)
    "v3": (64, 6, True, fm.GroupedTopK("sigmoid", 8, 3, "top2_sum", 2.5), True),
    "v2": (40, 4, False, fm.GroupedTopK("softmax", 8, 3, "max", 1.5), False),  # groups of 5: not a power of 2
    "greedy": (24, 3, False, fm.GroupedTopK("softmax", 1, 1, "max", 1.0), False),
    "sigmoid-ungrouped": (16, 2, True, fm.GroupedTopK("sigmoid", 1, 1, "top2_sum", 1.0), True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(GROUPINGS))
def test_grouped_route_matches_ref(device, case):
    E, k, renormalize, grouping, with_bias = GROUPINGS[case]
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(37, E + 3, generator=gen) * 2)[:, :E].to(device)  # a row stride past E
    bias = (torch.randn(E, generator=gen) * 0.3).to(device) if with_bias else None
    ref_w, ref_ids = fm.moe_route_grouped_ref(logits, k, renormalize, grouping, bias)
    weights, ids = fm.moe_route_grouped_triton(logits, k, renormalize, grouping, bias)
    assert torch.equal(ids, ref_ids) and weights.dtype == torch.float32
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


def test_fused_moe_layer_routes_through_its_grouping():
    """FusedMoE's routing step takes the grouping and its e_score_correction_bias parameter."""
    from tokenmill.layers.fused_moe import FusedMoE

    grouping = fm.GroupedTopK("sigmoid", num_groups=2, topk_groups=1, group_score="top2_sum", scaling_factor=2.5)
    layer = FusedMoE(8, 2, 16, 8, True, dtype=torch.float32, grouping=grouping, correction_bias=True)
    assert layer.e_score_correction_bias.dtype == torch.float32
    layer.e_score_correction_bias.data.copy_(torch.linspace(-0.5, 0.5, 8))
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    ref = fm.moe_route_grouped_ref(logits, 2, True, grouping, layer.e_score_correction_bias)
    assert all(torch.equal(a, b) for a, b in zip(layer.route(logits), ref))
    plain = FusedMoE(8, 2, 16, 8, True, dtype=torch.float32)  # the other families: softmax top-k, unchanged
    assert plain.e_score_correction_bias is None
    assert all(torch.equal(a, b) for a, b in zip(plain.route(logits), fm.moe_route_ref(logits, 2, True)))


# --------------------------------------------------------------------------------------------
# The token sort
# --------------------------------------------------------------------------------------------


def _check_sort_invariants(sort, topk_ids, E, block_m):
    sorted_ids, expert_ids, ntp = (t.cpu() for t in sort)
    flat = topk_ids.reshape(-1).cpu().long()
    num_pairs = flat.numel()
    valid = torch.nonzero((flat >= 0) & (flat < E)).flatten()
    assert sorted_ids.numel() == fm.sorted_capacity(num_pairs, E, block_m)
    assert expert_ids.numel() == -(-sorted_ids.numel() // block_m)
    n = int(ntp.item())
    assert n % block_m == 0
    body = sorted_ids[:n]
    real = body[body < num_pairs]
    # Every valid pair once, nothing else (each -1 slot left out).
    assert torch.equal(real.sort().values.long(), valid)
    assert (body <= num_pairs).all() and (sorted_ids[n:] == num_pairs).all()
    tiles = body.view(-1, block_m)
    for t, row in enumerate(tiles):
        e = int(expert_ids[t])
        assert 0 <= e < E
        pairs = row[row < num_pairs].long()
        assert pairs.numel() > 0, "a tile of padding only"
        assert (flat[pairs] == e).all(), "a tile holds one expert's pairs"
        # Padding only at the tile's end.
        assert (row[:pairs.numel()] < num_pairs).all() and (row[pairs.numel():] == num_pairs).all()
    assert (expert_ids[n // block_m:] == -1).all()
    assert (expert_ids[:n // block_m].diff() >= 0).all(), "one run per expert, in expert order"


SORT_CASES = [  # (T, k, E, block_m, routing kind)
    (1, 2, 8, 16, "random"), (5, 2, 8, 16, "ep"), (33, 8, 8, 16, "random"), (33, 2, 4, 32, "one"),
    (17, 3, 9, 16, "sparse"), (40, 4, 64, 64, "random"), (33, 1, 4, 128, "ep"), (12, 8, 256, 16, "random"),
    (1500, 2, 8, 64, "random"),  # several blocks of pairs
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T, k, E, block_m, kind", SORT_CASES)
def test_sort_matches_ref_and_invariants(device, T, k, E, block_m, kind):
    _, ids = _routing(T, E, k, device, kind, seed=T)
    sort = fm.moe_sort_tokens(ids, E, block_m)
    ref = fm.moe_sort_tokens_ref(ids, E, block_m)
    for got, want, what in zip(sort, ref, ("sorted_ids", "expert_ids", "num_tokens_post_padded")):
        assert got.dtype == torch.int32 and got.device == ids.device
        assert torch.equal(got, want), what
    _check_sort_invariants(sort, ids, E, block_m)


def test_sort_ref_invariants_with_ids_out_of_range():
    ids = torch.tensor([[0, 5], [9, -1], [2, 0]], dtype=torch.int32)
    _check_sort_invariants(fm.moe_sort_tokens_ref(ids, 6, 4), ids, 6, 4)


# --------------------------------------------------------------------------------------------
# The experts' MLPs
# --------------------------------------------------------------------------------------------

MOE_CASES = [  # (T, H, I, E, k, routing kind)
    (1, 32, 16, 8, 2, "random"),
    (5, 32, 24, 8, 2, "ep"),  # ids of -1, a token with none
    (5, 32, 48, 8, 8, "random"),  # k = E: every expert
    (33, 32, 16, 4, 1, "random"),
    (33, 32, 40, 4, 2, "one"),  # every token on the same two experts
    (17, 32, 16, 9, 3, "sparse"),  # experts with no tokens
]


def _moe_case_id(case):
    return "T{}-H{}-I{}-E{}-k{}-{}".format(*case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", MOE_CASES, ids=_moe_case_id)
def test_fused_moe_matches_ref(device, path, case, nan_empty):
    T, H, I, E, k, kind = case
    if path == "gemv" and T > 17 and device == "cpu":
        pytest.skip("the interpreter runs a program per pair: decode sizes only")
    x, w13, w2 = _experts(T, H, I, E, torch.float32, device, seed=T + k)
    weights, ids = _routing(T, E, k, device, kind, seed=T)
    out = fm.fused_moe_triton(x, w13, w2, weights, ids, config=fm.moe_config(E, I, H, T, k, x.dtype, path=path))
    ref = fm.fused_moe_ref(x, w13, w2, weights, ids)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert rel_err(out, ref) < TOL[torch.float32], (path, case)
    if kind == "ep":
        assert (out[0] == 0).all(), "a token with no expert on this rank"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_16bit(device, dtype, nan_empty):
    """Both paths round as the reference does, to the dtype's tolerance; the weights are fp32."""
    T, H, I, E, k = 5, 32, 32, 8, 2
    x, w13, w2 = _experts(T, H, I, E, dtype, device, seed=3)
    weights, ids = _routing(T, E, k, device, "ep", seed=3)
    ref = fm.fused_moe_ref(x, w13, w2, weights, ids)
    # Triton's interpreter rounds to bf16 by truncation, which the five roundings compound
    tol = 4 * TOL[dtype] if device == "cpu" and dtype == torch.bfloat16 else TOL[dtype]
    for path in PATHS:
        out = fm.fused_moe_triton(x, w13, w2, weights, ids, config=fm.moe_config(E, I, H, T, k, dtype, path=path))
        assert out.dtype == dtype
        assert rel_err(out, ref) < tol, path


@pytest.mark.parametrize("device", DEVICES)
def test_fused_moe_strided_weights_and_tiles(device, nan_empty):
    """Weights read through row and expert strides (views into larger stacks), H and I not
    multiples of the tiles, and every block_m of the grouped path."""
    T, H, I, E, k = 9, 40, 24, 4, 2
    x, w13_full, w2_full = _experts(T, H + 8, I + 8, E + 1, torch.float32, device, seed=5)
    x = x[:, :H].contiguous()
    w13 = w13_full[1:, 3:3 + 2 * I, :H]
    w2 = w2_full[1:, :H, 5:5 + I]
    weights, ids = _routing(T, E, k, device, "random", seed=5)
    ref = fm.fused_moe_ref(x, w13, w2, weights, ids)
    gemv = dict(block_n=16, block_k=16, num_warps=4, num_stages=1)
    out = fm.fused_moe_triton(x, w13, w2, weights, ids, config=dict(path="gemv", gate_up=gemv, down=gemv))
    assert rel_err(out, ref) < TOL[torch.float32], "gemv"
    for block_m in (16, 32, 64, 128):
        tile = dict(block_m=block_m, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=2)
        out = fm.fused_moe_triton(x, w13, w2, weights, ids, config=dict(path="grouped", gate_up=tile, down=tile))
        assert rel_err(out, ref) < TOL[torch.float32], block_m


def test_fused_moe_dispatcher_on_cpu_is_the_reference():
    x, w13, w2 = _experts(3, 16, 8, 4, torch.float32, "cpu")
    weights, ids = _routing(3, 4, 2, "cpu")
    assert torch.equal(fm.fused_moe(x, w13, w2, weights, ids), fm.fused_moe_ref(x, w13, w2, weights, ids))


FP8_CASES = [  # (T, H, I, E, k, routing kind, dtype): k = 1 and k = 8, -1 slots, experts with no tokens
    (5, 32, 24, 8, 2, "ep", torch.float32),
    (5, 32, 24, 8, 2, "ep", torch.bfloat16),
    (3, 32, 16, 8, 8, "random", torch.float32),
    (9, 32, 16, 9, 3, "sparse", torch.float32),
    (33, 32, 16, 4, 1, "random", torch.float32),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: _moe_case_id(c[:6]) + "-" + str(c[6])[6:])
def test_fused_moe_fp8_matches_ref(device, case, nan_empty):
    """e4m3 experts with per-row scales on both paths against the dequantized reference (the
    interpreter's cost keeps the cases few: the CUDA sweep below covers real shapes)."""
    T, H, I, E, k, kind, dtype = case
    x, w13, w2 = _experts(T, H, I, E, torch.float32, device, seed=T + k)
    x = x.to(dtype)
    w13_q, w13_s, w2_q, w2_s = _fp8(w13, w2)
    weights, ids = _routing(T, E, k, device, kind, seed=T)
    ref = fm.fused_moe_fp8_ref(x, w13_q, w13_s, w2_q, w2_s, weights, ids)
    # Triton's interpreter rounds to bf16 by truncation, which the five roundings compound
    tol = 4 * TOL[dtype] if device == "cpu" and dtype == torch.bfloat16 else TOL[dtype]
    for path in PATHS:
        if path == "gemv" and T > 17 and device == "cpu":
            continue  # the interpreter runs a program per pair: decode sizes only
        cfg = fm.moe_config(E, I, H, T, k, dtype, path=path)
        out = fm.fused_moe_triton(x, w13_q, w2_q, weights, ids, config=cfg, w13_scale=w13_s, w2_scale=w2_s)
        assert out.dtype == dtype
        assert rel_err(out, ref) < tol, (path, case)
        if kind == "ep":
            assert (out[0] == 0).all(), "a token with no expert on this rank"


def test_fused_moe_fp8_dispatcher_on_cpu_is_the_reference():
    x, w13, w2 = _experts(3, 16, 8, 4, torch.float32, "cpu")
    q = _fp8(w13, w2)
    weights, ids = _routing(3, 4, 2, "cpu")
    out = fm.fused_moe(x, q[0], q[2], weights, ids, w13_scale=q[1], w2_scale=q[3])
    assert torch.equal(out, fm.fused_moe_fp8_ref(x, *q, weights, ids))
    # the reference is the 16/32-bit one on the dequantized weights
    assert torch.equal(out, fm.fused_moe_ref(x, fm.dequantize_experts_fp8(q[0], q[1], x.dtype),
                                             fm.dequantize_experts_fp8(q[2], q[3], x.dtype), weights, ids))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.skipif(not INTERPRETER, reason="its SiLU-and-mul and slot sum are Triton: TRITON_INTERPRET=1")
def test_grouped_mm_moe_matches_ref():
    """torch._grouped_mm's path (CUDA where it wins; torch also runs it on the CPU), some slots of no
    expert (expert parallelism's -1); fp32, as the interpreter rounds to bf16 by truncation."""
    T, H, I, E, k = 9, 32, 16, 8, 2
    x, w13, w2 = _experts(T, H, I, E, torch.float32, "cpu", seed=7)
    weights, ids = _routing(T, E, k, "cpu", "ep", seed=7)
    try:
        out = fm.grouped_mm_moe(x, w13, w2, weights, ids)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch._grouped_mm on the CPU: {exc}")
    assert rel_err(out, fm.fused_moe_ref(x, w13, w2, weights, ids)) < TOL[torch.float32]


# --------------------------------------------------------------------------------------------
# Launch configs
# --------------------------------------------------------------------------------------------


def test_gemv_threshold_and_path_choice():
    assert fm.use_gemv_path(1, 8, 128) and fm.use_gemv_path(16, 8, 128) and not fm.use_gemv_path(17, 8, 128)
    assert fm.use_gemv_path(4, 2, 8) and not fm.use_gemv_path(5, 2, 8)
    assert fm.moe_config(128, 768, 2048, 1, 8, torch.bfloat16)["path"] == "gemv"
    assert fm.moe_config(128, 768, 2048, 512, 8, torch.bfloat16)["path"] == "grouped"
    assert fm.moe_config(128, 768, 2048, 1, 8, torch.bfloat16, path="grouped")["path"] == "grouped"


def test_grouped_mm_choice():
    """torch._grouped_mm only for bf16 at a listed shape from its token count, on a device that runs it."""
    assert all(len(key) == 3 and start >= 1 for key, start in fm.GROUPED_MM_FROM.items())
    (E, two_i, H), start = next(iter(fm.GROUPED_MM_FROM.items()))
    cpu = torch.device("cpu")
    assert not fm.use_grouped_mm(E, two_i // 2, H, 8192, torch.bfloat16, cpu)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        cuda = torch.device("cuda", torch.cuda.current_device())
        assert fm.use_grouped_mm(E, two_i // 2, H, start, torch.bfloat16, cuda)
        assert not fm.use_grouped_mm(E, two_i // 2, H, start - 1, torch.bfloat16, cuda)
        assert not fm.use_grouped_mm(E, two_i // 2, H, start, torch.float16, cuda)
        assert not fm.use_grouped_mm(E + 1, two_i // 2, H, start, torch.bfloat16, cuda)


@pytest.mark.parametrize("num_tokens", [1, 3, 8, 64, 100, 512, 4096, 8192, 65536])
@pytest.mark.parametrize("shape", [(128, 768, 2048, 8), (8, 14336, 4096, 2), (4, 16, 32, 2), (256, 2048, 7168, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_configs_are_launchable(num_tokens, shape, dtype):
    """Every config moe_config gives: powers of two, of at least 16 on the grouped path (tl.dot's
    smallest; the GEMV path has no tl.dot), one block_m for both grouped launches, within the
    shared-memory budget."""
    E, inter, hidden, k = shape
    cfg = fm.moe_config(E, inter, hidden, num_tokens, k, dtype)
    esz = torch.empty((), dtype=dtype).element_size()
    smallest = 16 if cfg["path"] == "grouped" else 1
    for name, b_tiles in (("gate_up", 2), ("down", 1)):
        c = cfg[name]
        for field in ("block_n", "block_k") + (("block_m",) if cfg["path"] == "grouped" else ()):
            assert c[field] >= smallest and c[field] & (c[field] - 1) == 0, (name, field, c)
        if cfg["path"] == "grouped":
            assert c["block_m"] in (16, 32, 64, 128)
            assert (c["block_m"] + b_tiles * c["block_n"]) * c["block_k"] * esz * c["num_stages"] \
                <= fm.SHARED_MEMORY_BYTES
    if cfg["path"] == "grouped":
        assert cfg["gate_up"]["block_m"] == cfg["down"]["block_m"]


def test_tile_tables_are_well_formed():
    """Each grouped entry of w13's shape has w2's at the same bucket with the same block_m (one
    sort serves both launches), so pasted tuner output stays consistent."""
    for table, width in ((fm.GROUPED_TILES, len(fm.GROUPED_FIELDS)), (fm.GEMV_TILES, len(fm.GEMV_FIELDS))):
        for (E, n, k, bucket), entry in table.items():
            assert len(entry) == width and bucket == fm.token_bucket(bucket)
    for (E, n, k, bucket), entry in fm.GROUPED_TILES.items():
        if n % 2 == 0 and (E, k, n // 2, bucket) in fm.GROUPED_TILES:
            assert fm.GROUPED_TILES[(E, k, n // 2, bucket)][0] == entry[0], (E, n, k, bucket)


def test_table_lookup_takes_the_nearest_bucket():
    table = {(8, 64, 32, 4): ("four",), (8, 64, 32, 64): ("sixty-four",)}
    assert fm._lookup(table, 8, 64, 32, 1) == ("four",)
    assert fm._lookup(table, 8, 64, 32, 16) == ("sixty-four",)  # 4 and 64 equally far: the larger
    assert fm._lookup(table, 8, 64, 32, 7) == ("four",)  # bucket 8
    assert fm._lookup(table, 8, 64, 32, 100000) == ("sixty-four",)
    assert fm._lookup(table, 8, 64, 16, 4) is None



def test_moe_tune_entries_paste_into_the_tables():
    """benchmarks/moe_tune.py's config spaces hold only configs fused_moe launches unchanged, and
    the lines it prints parse back as entries of the tables' form."""
    spec = importlib.util.spec_from_file_location("moe_tune", Path(__file__).parents[2] / "benchmarks" / "moe_tune.py")
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    assert tune.block_m_candidates(8192, 8, 128) == [64, 128] and tune.block_m_candidates(64, 8, 128) == [16, 32]
    for block_m in tune.BLOCK_MS:
        configs = tune.grouped_configs(tune.GROUPED_SPACE["full"], block_m, 768, 2048, 2, 2)
        assert configs and all(fm._fit_tile(c, 768, 2048, 2, 2) == c for c in configs)
        key = (128, 1536, 2048, 512)
        line = tune.entry_line(key, configs[-1], fm.GROUPED_FIELDS, "a note")
        parsed = ast.literal_eval("{" + line.split("#")[0].strip() + "}")
        assert parsed == {key: tuple(configs[-1][f] for f in fm.GROUPED_FIELDS)}
    gemv = tune.gemv_configs(tune.GEMV_SPACE["full"], 768, 2048)
    assert len(gemv) == len({tuple(c.values()) for c in gemv}) and {c["block_n"] for c in gemv} >= {4, 64}


# --------------------------------------------------------------------------------------------
# CUDA: real shapes, no host sync, CUDA graphs
# --------------------------------------------------------------------------------------------

GPU_SHAPES = [  # (H, I, E, k): Qwen3-30B-A3B, Mixtral-8x7B with a narrower I, an odd-sized one
    (2048, 768, 128, 8), (4096, 2048, 8, 2), (1000, 200, 60, 4),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "H{}-I{}-E{}-k{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_moe_cuda_sweep(shape, dtype, nan_empty):
    H, I, E, k = shape
    x_all, w13, w2 = _experts(512, H, I, E, dtype, "cuda", seed=11)
    for T in (1, 8, 64, 512):
        x = x_all[:T].contiguous()
        logits = torch.randn(T, E, device="cuda", dtype=dtype)
        weights, ids = fm.moe_route(logits, k, renormalize=True)
        ref = fm.fused_moe_ref(x, w13, w2, weights, ids)
        for path in (None, "gemv", "grouped"):
            if path == "gemv" and T > 64:
                continue
            cfg = None if path is None else fm.moe_config(E, I, H, T, k, dtype, path=path)
            out = fm.fused_moe_triton(x, w13, w2, weights, ids, config=cfg)
            assert rel_err(out, ref) < TOL[dtype], (T, path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "H{}-I{}-E{}-k{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_moe_fp8_cuda_sweep(shape, dtype, nan_empty):
    """e4m3 experts at 1 to 512 tokens (counts that are not multiples of the tiles too), every
    path, against the dequantized reference."""
    H, I, E, k = shape
    x_all, w13, w2 = _experts(512, H, I, E, torch.float32, "cuda", seed=19)
    x_all = x_all.to(dtype)
    q = _fp8(w13, w2)
    for T in (1, 3, 8, 17, 64, 100, 512):
        x = x_all[:T].contiguous()
        logits = torch.randn(T, E, device="cuda", dtype=dtype)
        weights, ids = fm.moe_route(logits, k, renormalize=True)
        ref = fm.fused_moe_fp8_ref(x, *q, weights, ids)
        for path in (None, "gemv", "grouped"):
            if path == "gemv" and T > 64:
                continue
            cfg = None if path is None else fm.moe_config(E, I, H, T, k, dtype, path=path)
            out = fm.fused_moe_triton(x, q[0], q[2], weights, ids, config=cfg, w13_scale=q[1], w2_scale=q[3])
            assert rel_err(out, ref) < TOL[dtype], (T, path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("T, shape", [(4, (256, 128, 16, 4)), (300, (256, 128, 16, 4)), (fm.GROUPED_MM_FROM[(128, 1536, 2048)], (2048, 768, 128, 8))],
                         ids=["gemv", "grouped", "grouped_mm"])  # bf16 there takes torch._grouped_mm (fp8: Triton)
def test_cuda_no_host_sync_and_graph_capture(T, shape, fp8):
    H, I, E, k = shape
    x, w13, w2 = _experts(T, H, I, E, torch.bfloat16, "cuda", seed=13)
    logits = torch.randn(T, E, device="cuda", dtype=torch.bfloat16)
    scales = {}
    if fp8:
        w13, scales["w13_scale"], w2, scales["w2_scale"] = _fp8(w13, w2)

    def step():
        weights, ids = fm.moe_route(logits, k, renormalize=True)
        return fm.fused_moe(x, w13, w2, weights, ids, **scales)

    step()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    logits.copy_(torch.randn_like(logits))
    x.copy_(torch.randn_like(x))
    graph.replay()
    weights, ids = fm.moe_route_ref(logits, k, True)
    ref = fm.fused_moe_fp8_ref(x, w13, scales["w13_scale"], w2, scales["w2_scale"], weights, ids) if fp8 \
        else fm.fused_moe_ref(x, w13, w2, weights, ids)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_mm_moe_cuda():
    T, H, I, E, k = 300, 2048, 768, 128, 8
    x, w13, w2 = _experts(T, H, I, E, torch.bfloat16, "cuda", seed=17)
    weights, ids = _routing(T, E, k, "cuda", "ep", seed=17)
    assert rel_err(fm.grouped_mm_moe(x, w13, w2, weights, ids), fm.fused_moe_ref(x, w13, w2, weights, ids)) \
        < TOL[torch.bfloat16]
