"""Batched multi-LoRA shrink/expand: the Triton kernels (both the per-token "gemv" and the
token-block "tile" kernels) against the torch references, and the references against a plain
per-token loop."""

import pytest
import torch

from tokenmill.kernels.lora import (ADD_RMSNORM, PLAIN, SILU_MUL, lora_expand, lora_expand_ref, lora_expand_triton,
                                    lora_shrink, lora_shrink_ref, lora_shrink_triton)
from tokenmill.kernels.norm import rms_norm_ref

from tests.kernels.common import CPU, CUDA, TOL, nan_empty, rel_err  # noqa: F401

PROLOGUES = [PLAIN, SILU_MUL, ADD_RMSNORM]
# Forced kernel shapes for the small CPU cases (the default picks gemv up to 16 tokens, tile above).
GEMV_SHRINK = dict(mode="gemv", block_r=2, block_k=32, num_warps=4, num_stages=1)
TILE_SHRINK = dict(mode="tile", bm=16, block_r=16, block_k=32, num_warps=4, num_stages=1)
SPLIT_SHRINK = dict(mode="tile", bm=16, block_r=16, block_k=16, split_k=3, num_warps=4, num_stages=1)
INNER_SHRINK = dict(mode="tile", bm=16, block_r=16, block_k=32, slots_inner=True, num_warps=4, num_stages=1)
INNER_SPLIT_SHRINK = dict(INNER_SHRINK, block_k=16, split_k=2)
GEMV_EXPAND = dict(mode="gemv", block_n=32, num_warps=4, num_stages=1)
TILE_EXPAND = dict(mode="tile", bm=16, block_n=32, num_warps=4, num_stages=1)


def _slots(T, num_slots, device, kind, generator=None):
    """token_slots [T] int32: 'runs' (contiguous requests, some slot 0), 'mixed' (random, slot 0
    included), 'zero' (all slot 0), 'one' (all one slot)."""
    if kind == "zero":
        return torch.zeros(T, dtype=torch.int32, device=device)
    if kind == "one":
        return torch.full((T,), num_slots - 1, dtype=torch.int32, device=device)
    if kind == "mixed":
        return torch.randint(0, num_slots, (T,), dtype=torch.int32, generator=generator).to(device)
    # Runs of random lengths, cycling through the slots 1.. with a slot-0 run every third.
    out, slot, i = [], 1, 0
    while len(out) < T:
        length = int(torch.randint(1, max(2, T // 3) + 1, (1,), generator=generator))
        out += [0 if i % 3 == 2 else slot] * length
        slot = slot % (num_slots - 1) + 1
        i += 1
    return torch.tensor(out[:T], dtype=torch.int32, device=device)


def _a_stack(S, R, K, dtype, device, zero_slot=None):
    a = torch.randn(S, R, K, device=device, dtype=torch.float32) / K ** 0.5
    a[0] = 0
    if zero_slot is not None:
        a[zero_slot] = 0
    return a.to(dtype)


def _x(T, K, prologue, dtype, device):
    return torch.randn(T, 2 * K if prologue == SILU_MUL else K, device=device, dtype=dtype)


# --------------------------------------------------------------------------------------------
# The references against an explicit per-token loop
# --------------------------------------------------------------------------------------------

def _loop_shrink(x, a_stack, slots, prologue, nw, eps):
    T, (S, R, K) = x.shape[0], a_stack.shape
    out = torch.zeros(T, R, dtype=torch.float64)
    for t in range(T):
        slot = int(slots[t])
        if slot == 0:
            continue
        row = x[t]
        if prologue == SILU_MUL:
            g, u = row[:K].double(), row[K:].double()
            inp = g / (1 + torch.exp(-g)) * u
        elif prologue == ADD_RMSNORM:
            h = row.double()
            inp = h / torch.sqrt((h * h).mean() + eps) * nw.double()
        else:
            inp = row.double()
        for r in range(R):
            out[t, r] = sum(float(a_stack[slot, r, k]) * float(inp[k]) for k in range(K))
    return out


def _loop_expand(s, b_stack, slots, y, rank, starts):
    T, N = y.shape
    out = y.double().clone()
    bounds = [0, *starts, N]
    for t in range(T):
        slot = int(slots[t])
        if slot == 0:
            continue
        for n in range(N):
            j = sum(1 for v in starts if v <= n)
            assert bounds[j] <= n < bounds[j + 1]
            out[t, n] += sum(float(b_stack[slot, n, i]) * float(s[t, j * rank + i]) for i in range(rank))
    return out


@pytest.mark.parametrize("prologue", PROLOGUES)
def test_shrink_ref_matches_loop(prologue):
    torch.manual_seed(0)
    T, S, R, K = 7, 3, 3, 12
    x = _x(T, K, prologue, torch.float32, "cpu")
    a = _a_stack(S, R, K, torch.float32, "cpu")
    nw = 1 + 0.1 * torch.randn(K)
    slots = torch.tensor([0, 1, 1, 2, 0, 2, 1], dtype=torch.int32)
    ref = lora_shrink_ref(x, a, slots, prologue, nw, 1e-6)
    assert ref.dtype == torch.float32 and ref.shape == (T, R)
    torch.testing.assert_close(ref.double(), _loop_shrink(x, a, slots, prologue, nw, 1e-6), rtol=1e-5, atol=1e-5)
    assert (ref[slots == 0] == 0).all()


def test_expand_ref_matches_loop():
    torch.manual_seed(1)
    T, S, rank, N = 6, 3, 2, 11
    starts = (4, 7)
    s = torch.randn(T, 3 * rank)
    b = torch.randn(S, N, rank)
    b[0] = 0
    y = torch.randn(T, N)
    slots = torch.tensor([2, 0, 1, 1, 2, 0], dtype=torch.int32)
    expect = _loop_expand(s, b, slots, y, rank, starts)
    before = y.clone()
    lora_expand_ref(s, b, slots, y, rank, starts)
    torch.testing.assert_close(y.double(), expect, rtol=1e-5, atol=1e-5)
    assert torch.equal(y[slots == 0], before[slots == 0])


def test_dispatch_cpu_uses_reference():
    torch.manual_seed(2)
    x, a = torch.randn(4, 16), _a_stack(3, 4, 16, torch.float32, "cpu")
    slots = torch.tensor([1, 0, 2, 2], dtype=torch.int32)
    s = lora_shrink(x, a, slots)
    torch.testing.assert_close(s, lora_shrink_ref(x, a, slots), rtol=0, atol=0)
    b = torch.randn(3, 8, 4)
    y1 = torch.randn(4, 8)
    y2 = y1.clone()
    lora_expand(s, b, slots, y1, 4)
    lora_expand_ref(s, b, slots, y2, 4)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# Triton (interpreter on the CPU) against the references, small shapes
# --------------------------------------------------------------------------------------------

def _check_shrink(x, a, slots, prologue, nw, tol, what, config=None):
    s = lora_shrink_triton(x, a, slots, prologue, nw, 1e-6, config=config)
    ref = lora_shrink_ref(x, a, slots, prologue, nw, 1e-6)
    assert s.dtype == torch.float32 and s.shape == ref.shape
    assert (s[slots == 0] == 0).all(), what
    if ref.norm() > 0:
        assert rel_err(s, ref) < tol, (what, rel_err(s, ref))
    else:
        assert (s == 0).all(), what
    return ref


def _check_expand(s, b, slots, y, rank, starts, tol, what, config=None):
    before = y.clone()
    ref = y.clone()
    lora_expand_triton(s, b, slots, y, rank, starts, config=config)
    lora_expand_ref(s, b, slots, ref, rank, starts)
    zero = slots == 0
    assert torch.equal(y[zero], before[zero]), f"{what}: slot-0 rows changed"
    assert rel_err(y - before, ref - before) < tol if (ref - before).norm() > 0 else torch.equal(y, ref), what


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_shrink_cpu(device, prologue, nan_empty):
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    S, R = 4, 8  # slots 1..3 and slot 0; slot 2 all zeros
    cases = [(1, 64, "runs", GEMV_SHRINK), (5, 96, "mixed", GEMV_SHRINK), (5, 70, "runs", None),
             (37, 64, "runs", TILE_SHRINK), (37, 80, "mixed", TILE_SHRINK), (37, 64, "mixed", GEMV_SHRINK),
             (37, 72, "runs", SPLIT_SHRINK), (20, 64, "mixed", SPLIT_SHRINK), (37, 64, "mixed", INNER_SHRINK),
             (37, 80, "runs", INNER_SPLIT_SHRINK), (20, 64, "zero", INNER_SHRINK),
             (20, 64, "zero", TILE_SHRINK), (20, 64, "one", TILE_SHRINK), (5, 64, "zero", GEMV_SHRINK)]
    for T, K, kind, cfg in cases:
        x = _x(T, K, prologue, torch.float32, device)
        a = _a_stack(S, R, K, torch.float32, device, zero_slot=2)
        nw = 1 + 0.1 * torch.randn(K)
        slots = _slots(T, S, device, kind, gen)
        _check_shrink(x, a, slots, prologue, nw, TOL[torch.float32], (T, K, kind, cfg and cfg["mode"]), cfg)


@pytest.mark.parametrize("device", [CPU])
def test_shrink_cpu_rank_padding_and_16bit(device):
    """R not a power of two (padded with masks), a strided x, and bf16 / fp16 inputs."""
    gen = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    T, K = 37, 72
    for R, dtype, cfg in ((5, torch.float32, TILE_SHRINK), (3, torch.float32, GEMV_SHRINK),
                          (12, torch.bfloat16, TILE_SHRINK), (4, torch.float16, GEMV_SHRINK),
                          (16, torch.float16, TILE_SHRINK), (7, torch.bfloat16, GEMV_SHRINK),
                          (20, torch.float32, SPLIT_SHRINK), (16, torch.float16, INNER_SHRINK)):
        x = torch.randn(T, K + 8, dtype=dtype)[:, :K]
        a = _a_stack(4, R, K, dtype, "cpu")
        slots = _slots(T, 4, "cpu", "runs", gen)
        _check_shrink(x, a, slots, PLAIN, None, TOL[dtype], (R, dtype), cfg)


SLICES = [(48, (), 8), (96, (40,), 4), (200, (37, 101), 4), (90, (30, 60), 8)]


@pytest.mark.parametrize("device", [CPU])
@pytest.mark.parametrize("N,starts,rank", SLICES)
def test_expand_cpu(device, N, starts, rank):
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    S = 4
    nsl = len(starts) + 1
    for T, kind, cfg in ((1, "runs", GEMV_EXPAND), (5, "mixed", GEMV_EXPAND), (5, "runs", None),
                         (37, "runs", TILE_EXPAND), (37, "mixed", TILE_EXPAND), (20, "zero", TILE_EXPAND),
                         (20, "one", GEMV_EXPAND)):
        s = torch.randn(T, nsl * rank)
        b = torch.randn(S, N, rank) / rank ** 0.5
        b[0] = 0
        b[2] = 0
        y = torch.randn(T, N)
        slots = _slots(T, S, device, kind, gen)
        _check_expand(s, b, slots, y, rank, starts, TOL[torch.float32], (T, kind, N, starts, cfg and cfg["mode"]), cfg)


@pytest.mark.parametrize("device", [CPU])
def test_expand_cpu_16bit_and_odd_rank(device):
    gen = torch.Generator().manual_seed(6)
    torch.manual_seed(6)
    T, N, starts = 37, 100, (50, 75)
    for rank, dtype, cfg in ((3, torch.bfloat16, TILE_EXPAND), (5, torch.float16, GEMV_EXPAND),
                             (6, torch.float32, TILE_EXPAND), (4, torch.float16, TILE_EXPAND),
                             (8, torch.bfloat16, GEMV_EXPAND)):
        s = torch.randn(T, 3 * rank + 2)  # extra columns past the slices are ignored
        b = (torch.randn(4, N, rank) / rank ** 0.5).to(dtype)
        b[0] = 0
        y = torch.randn(T, N, dtype=dtype)
        slots = _slots(T, 4, "cpu", "mixed", gen)
        before = y.clone()
        ref = y.clone()
        lora_expand_triton(s, b, slots, y, rank, starts, config=cfg)
        lora_expand_ref(s, b, slots, ref, rank, starts)
        assert torch.equal(y[slots == 0], before[slots == 0])
        # Both add in fp32 and round once: at most one rounding step apart.
        assert rel_err(y.float() - before.float(), ref.float() - before.float()) < TOL[dtype], (rank, dtype)


@pytest.mark.parametrize("device", [CPU])
def test_shrink_then_expand_cpu(device):
    """One LoRA delta end to end (qkv-like merged layer), against the dense per-token formula."""
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    T, K, rank, S = 37, 64, 4, 4
    starts, N = (32, 48), 64
    x = torch.randn(T, K)
    nw = 1 + 0.1 * torch.randn(K)
    a = _a_stack(S, 3 * rank, K, torch.float32, "cpu")
    b = torch.randn(S, N, rank)
    b[0] = 0
    slots = _slots(T, S, "cpu", "runs", gen)
    y = torch.randn(T, N)
    expect = y.clone()
    s = lora_shrink_triton(x, a, slots, ADD_RMSNORM, nw, 1e-6)
    lora_expand_triton(s, b, slots, y, rank, starts)
    inp = rms_norm_ref(x, nw, 1e-6)
    bounds = [0, *starts, N]
    for t in range(T):
        sl = int(slots[t])
        if sl == 0:
            continue
        st = a[sl] @ inp[t]
        for j in range(3):
            lo, hi = bounds[j], bounds[j + 1]
            expect[t, lo:hi] += b[sl, lo:hi] @ st[j * rank:(j + 1) * rank]
    assert rel_err(y, expect) < 1e-5


# --------------------------------------------------------------------------------------------
# CUDA: Llama-3.1-8B shapes
# --------------------------------------------------------------------------------------------

# (name, K, N, slice starts, prologue): the LoRA-wrapped projections of Llama-3.1-8B.
LLAMA_8B = [("qkv", 4096, 6144, (4096, 5120), ADD_RMSNORM), ("o", 4096, 4096, (), PLAIN),
            ("gate_up", 4096, 28672, (14336,), ADD_RMSNORM), ("down", 14336, 4096, (), SILU_MUL)]
NUM_ADAPTERS = 8


def _request_slots(T, device, gen):
    """Contiguous runs (requests) over 8 adapters plus slot-0 requests."""
    if T == 1:
        return torch.tensor([3], dtype=torch.int32, device=device)
    out = []
    while len(out) < T:
        length = int(torch.randint(1, max(2, T // 6) + 1, (1,), generator=gen))
        out += [int(torch.randint(0, NUM_ADAPTERS + 1, (1,), generator=gen))] * length
    return torch.tensor(out[:T], dtype=torch.int32, device=device)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("name,K,N,starts,prologue", LLAMA_8B)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_llama8b_shapes_cuda(device, name, K, N, starts, prologue, dtype):
    gen = torch.Generator().manual_seed(8)
    torch.manual_seed(8)
    nsl = len(starts) + 1
    S = NUM_ADAPTERS + 1
    for rank in (8, 16, 32, 64):
        R = nsl * rank
        a = _a_stack(S, R, K, dtype, device)
        b = (torch.randn(S, N, rank, device=device) / rank ** 0.5).to(dtype)
        b[0] = 0
        nw = (1 + 0.1 * torch.randn(K, device=device)).to(dtype)
        for T in (1, 8, 128, 2048):
            x = _x(T, K, prologue, dtype, device)
            slots = _request_slots(T, device, gen)
            for kind in ("requests", "mixed"):
                if kind == "mixed":
                    slots = torch.randint(0, S, (T,), dtype=torch.int32, generator=gen).to(device)
                what = (name, rank, T, kind, dtype)
                s = lora_shrink(x, a, slots, prologue, nw, 1e-6)
                s_ref = lora_shrink_ref(x, a, slots, prologue, nw, 1e-6)
                assert (s[slots == 0] == 0).all(), what
                if s_ref.norm() > 0:
                    assert rel_err(s, s_ref) < TOL[dtype], (what, rel_err(s, s_ref))
                y = torch.randn(T, N, device=device, dtype=dtype)
                before, y_ref = y.clone(), y.clone()
                lora_expand(s_ref, b, slots, y, rank, starts)
                lora_expand_ref(s_ref, b, slots, y_ref, rank, starts)
                zero = slots == 0
                assert torch.equal(y[zero], before[zero]), what
                delta, delta_ref = (y.float() - before.float()), (y_ref.float() - before.float())
                if delta_ref.norm() > 0:
                    # bf16: the two differ by y's rounding (one ulp of y per element) at most.
                    tol = 1e-5 if dtype == torch.float32 else 2e-2
                    assert rel_err(y, y_ref) < (1e-6 if dtype == torch.float32 else 4e-3), what
                    assert rel_err(delta, delta_ref) < tol, (what, rel_err(delta, delta_ref))


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("T", [1, 8, 300, 2048])
def test_cuda_graph_capture(device, T):
    """Capture shrink + expand once, change the slots (and the inputs) in place, replay, compare."""
    torch.manual_seed(9)
    K, N, rank, starts = 4096, 6144, 16, (4096, 5120)
    S = NUM_ADAPTERS + 1
    dtype = torch.bfloat16
    a = _a_stack(S, 3 * rank, K, dtype, device)
    b = (torch.randn(S, N, rank, device=device) / rank ** 0.5).to(dtype)
    b[0] = 0
    nw = (1 + 0.1 * torch.randn(K, device=device)).to(dtype)
    x = torch.randn(T, K, device=device, dtype=dtype)
    y = torch.zeros(T, N, device=device, dtype=dtype)
    slots = torch.zeros(T, dtype=torch.int32, device=device)

    def step():
        s = lora_shrink(x, a, slots, ADD_RMSNORM, nw, 1e-6)
        lora_expand(s, b, slots, y, rank, starts)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(3):
        x.copy_(torch.randn(T, K, device=device, dtype=dtype))
        y.copy_(torch.randn(T, N, device=device, dtype=dtype))
        new = torch.randint(0, S, (T,), dtype=torch.int32) if trial else (torch.arange(T, dtype=torch.int32) + 1) % S
        slots.copy_(new)
        before = y.clone()
        graph.replay()
        torch.cuda.synchronize()
        y_ref = before.clone()
        s_ref = lora_shrink_ref(x, a, slots, ADD_RMSNORM, nw, 1e-6)
        lora_expand_ref(s_ref, b, slots, y_ref, rank, starts)
        zero = slots == 0
        assert torch.equal(y[zero], before[zero])
        if (y_ref.float() - before.float()).norm() == 0:
            assert torch.equal(y, before), trial
        else:
            assert rel_err(y.float() - before.float(), y_ref.float() - before.float()) < 2e-2, trial
