"""Batch-invariant kernels (kernels/batch_invariant.py): each against its torch reference, and each
row's result bitwise the same whatever else is computed with it (row count, padding, step kind).

The CPU paths are the ones the engine runs on the CPU. The Triton kernels run here in the
interpreter, which checks their indexing, masking and tile order; on the interpreter tl.dot is
numpy's, so the bitwise checks of the GPU's tensor-core products are the CUDA cases
(tests/gpu/test_batch_invariant_cuda.py runs the engine).
"""

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels.attention import (
    FP8_KV_DTYPE,
    paged_attention_ref,
    paged_attention_sdpa,
    paged_attention_triton,
    quantize_kv_ref,
)
from tokenmill.kernels.batch_invariant import (
    CPU_ROWS,
    MatmulTiles,
    bi_attention_tiles,
    fused_moe_invariant,
    linear_invariant,
    linear_invariant_cpu,
    linear_invariant_triton,
    paged_attention_invariant,
    paged_attention_invariant_cpu,
)
from tokenmill.kernels.fused_moe import fused_moe_ref, moe_route_ref
from tokenmill.kernels.norm import rms_norm_ref
from tokenmill.kernels.sampling import gumbel_sample_ref, logprobs_ref, logsumexp_rows
from tests.kernels.common import CUDA, DEVICES, TOL, rel_err
from tests.kernels.test_attention import DECODE, MIXED, make_batch

ROW_COUNTS = (1, 2, 3, CPU_ROWS - 1, CPU_ROWS, CPU_ROWS + 1, 40, 67)


def _rows_invariant(fn, x: torch.Tensor, counts=ROW_COUNTS, reorder: bool = True) -> None:
    """fn(x[:m])[i] is bitwise the same for every m > i, and with the rows in another order."""
    full = fn(x)
    for m in counts:
        assert torch.equal(fn(x[:m]), full[:m]), f"rows change with {m} rows in the call"
    if not reorder:
        return
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1))
    assert torch.equal(fn(x[perm]), full[perm]), "rows change with their order"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_matches_and_is_row_invariant(dtype, bias):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype) if bias else None
    x = torch.randn(67, 80, generator=gen).to(dtype)
    assert rel_err(linear_invariant_cpu(x, w, b), F.linear(x.double(), w.double(),
                                                          None if b is None else b.double())) < TOL[dtype]
    _rows_invariant(lambda t: linear_invariant_cpu(t, w, b), x)
    # The plain product is not (one row takes a GEMV): what the mode is for.
    plain_one, plain_all = F.linear(x[:1].float(), w.float()), F.linear(x.float(), w.float())[:1]
    assert not torch.equal(plain_one, plain_all) or dtype != torch.float32


def test_cpu_linear_keeps_leading_dims_and_empty_input():
    w = torch.randn(8, 12)
    x = torch.randn(2, 5, 12)
    assert linear_invariant(x, w).shape == (2, 5, 8)
    assert torch.equal(linear_invariant(x, w)[1, 2], linear_invariant(x[1, 2:3], w)[0])
    assert linear_invariant(torch.empty(0, 12), w).shape == (0, 8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(70, 40), (130, 200)])  # (N, K): ragged tiles in both
def test_triton_matmul_matches_torch_and_is_row_invariant(device, dtype, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(n, k, generator=gen).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device)
    x = torch.randn(67, k, generator=gen).to(dtype).to(device)
    ref = F.linear(x.double(), w.double(), b.double())
    assert rel_err(linear_invariant_triton(x, w, b), ref) < TOL[dtype]
    assert rel_err(linear_invariant_triton(x, w), F.linear(x.double(), w.double())) < TOL[dtype]
    # On the interpreter tl.dot is numpy's BLAS, whose rounding may depend on a row's place in the
    # tile (its micro-kernel's edge handling): the reordering check is the GPU's.
    _rows_invariant(lambda t: linear_invariant_triton(t, w, b), x, counts=(1, 2, 17, 64, 65, 67),
                    reorder=device == "cuda")


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_moe_matches_the_reference_and_is_row_invariant(device, bias):
    """The experts in batch-invariant mode (the reference over fixed row chunks on the CPU, the
    one-token GEMV tiles at every size on CUDA): fused_moe_ref's result, and each token's row the
    same whatever else is routed with it."""
    gen = torch.Generator().manual_seed(4)
    num_experts, hidden, inter, top_k, tokens = 8, 48, 40, 2, 67
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    biases = ((torch.randn(num_experts, 2 * inter, generator=gen), torch.randn(num_experts, hidden, generator=gen))
              if bias else (None, None))
    weights, ids = moe_route_ref(torch.randn(tokens, num_experts, generator=gen), top_k, True)
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double(), ids,
                        *(None if b is None else b.double() for b in biases))
    x, w13, w2, weights, ids = (t.to(device) for t in (x, w13, w2, weights, ids))
    x, w13, w2, weights = (t.to(dtype) for t in (x, w13, w2, weights))
    b13, b2 = (None if b is None else b.to(device, dtype) for b in biases)

    def experts(rows: torch.Tensor) -> torch.Tensor:
        return fused_moe_invariant(x[rows], w13, w2, weights[rows], ids[rows], w13_bias=b13, w2_bias=b2)

    assert rel_err(experts(torch.arange(tokens, device=device)), ref) < TOL[dtype]
    _rows_invariant(experts, torch.arange(tokens, device=device))


SMALL_CHUNKS = MatmulTiles(block_m=32, block_n=32, block_k=32, k_chunk=64)  # K = 200: chunks of 64, 64, 64, 8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_triton_matmul_split_chunks_give_the_same_bits(device, dtype, bias):
    """Each K chunk in its own program, then summed in order, is bitwise the chunks summed in one
    program: small steps may take either way and still match the large ones."""
    gen = torch.Generator().manual_seed(3)
    n, k = 70, 200
    w = torch.randn(n, k, generator=gen).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    x = torch.randn(40, k, generator=gen).to(dtype).to(device)
    one = linear_invariant_triton(x, w, b, tiles=SMALL_CHUNKS, split=False)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert rel_err(one, ref) < TOL[dtype]
    assert torch.equal(linear_invariant_triton(x, w, b, tiles=SMALL_CHUNKS, split=True), one)
    assert torch.equal(linear_invariant_triton(x[:1], w, b, tiles=SMALL_CHUNKS, split=True), one[:1])
    assert torch.equal(linear_invariant_triton(x[:33], w, b, tiles=SMALL_CHUNKS), one[:33])
    if device == "cuda":  # the default tiles, K of four chunks: one token (split) against 300 rows (not)
        w2 = torch.randn(256, 2048, generator=gen).to(dtype).to(device)
        x2 = torch.randn(300, 2048, generator=gen).to(dtype).to(device)
        full = linear_invariant_triton(x2, w2, split=False)
        for m in (1, 2, 64, 65):
            assert torch.equal(linear_invariant_triton(x2[:m], w2, split=True), full[:m])
            assert torch.equal(linear_invariant_triton(x2[:m], w2), full[:m])


# ---- attention -----------------------------------------------------------------------------

HEADS = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=8)


def _one_request(seq_len: int, dtype, device, seed=0):
    """One request's cache of seq_len tokens and a query per position (as a whole-prompt batch)."""
    return make_batch([(seq_len, seq_len)], dtype=dtype, device=device, seed=seed, **HEADS)


def _attend(fn, b, q, reqs, **kw):
    """fn over requests (first query position, end) of one shared cache and block table."""
    dev = q.device
    q_lens = [e - s for s, e in reqs]
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(dev)
    seq_lens = torch.tensor([e for _, e in reqs], dtype=torch.int32, device=dev)
    tables = b.block_tables[:1].expand(len(reqs), -1).contiguous()
    qs = torch.cat([q[s:e] for s, e in reqs])
    return fn(qs, b.k_cache, b.v_cache, qsl, seq_lens, tables, b.scale, max_query_len=max(q_lens), **kw)


def _check_step_kinds(fn, device, dtype, seq_len=150, **kw):
    """Each query's output, computed in a whole prompt, is bitwise the same decoded alone, in a
    chunk, and among other requests of the same cache."""
    b = _one_request(seq_len, dtype, device)
    q = b.q
    whole = _attend(fn, b, q, [(0, seq_len)], **kw)
    assert rel_err(whole, paged_attention_ref(*b.args(), **kw)) < TOL[dtype] * 10
    for p in (0, 1, 63, 64, 65, 100, seq_len - 1):
        assert torch.equal(_attend(fn, b, q, [(p, p + 1)], **kw)[0], whole[p]), f"decode at {p}"
    chunk = _attend(fn, b, q, [(37, 101)], **kw)
    assert torch.equal(chunk, whole[37:101]), "a prompt chunk"
    mixed = _attend(fn, b, q, [(5, 6), (37, 101), (140, 141), (0, 20)], **kw)
    assert torch.equal(mixed[0], whole[5]) and torch.equal(mixed[1:65], whole[37:101])
    assert torch.equal(mixed[65], whole[140]) and torch.equal(mixed[66:], whole[:20])


def _cpu_attention(*args, max_query_len=None, **kw):
    return paged_attention_invariant_cpu(*args, **kw)


@pytest.fixture(scope="module", autouse=True)
def first_call():
    """The process's first batched products can round one thread's rows differently from every
    later call (1 fresh process in 30 here); the engine warms up for that
    (runner/warmup.py's warm_up_cpu_batch_invariant), and so do these tests."""
    b = _one_request(150, torch.float32, "cpu")
    _attend(_cpu_attention, b, b.q, [(0, 150)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 21])
def test_cpu_attention_same_in_every_step_kind(dtype, window):
    _check_step_kinds(_cpu_attention, "cpu", dtype, sliding_window=window)


@pytest.mark.parametrize("reqs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_cpu_attention_matches_reference(reqs):
    b = make_batch(reqs, dtype=torch.float32, device="cpu", **HEADS)
    out = paged_attention_invariant_cpu(*b.args())
    n = b.num_tokens
    assert rel_err(out[:n], paged_attention_ref(*b.args())[:n]) < 1e-5


def test_cpu_attention_fp8_cache_matches_reference():
    b = make_batch(MIXED, dtype=torch.float32, device="cpu", **HEADS)
    scale = torch.tensor([0.05, 0.02])
    b.k_cache = quantize_kv_ref(3 * b.k_cache, FP8_KV_DTYPE, scale[0])
    b.v_cache = quantize_kv_ref(3 * b.v_cache, FP8_KV_DTYPE, scale[1])
    n = b.num_tokens
    out = paged_attention_invariant_cpu(*b.args(), kv_scale=scale)
    assert rel_err(out[:n], paged_attention_ref(*b.args(), kv_scale=scale)[:n]) < 1e-5


def test_default_cpu_attention_is_not_invariant():
    """What the mode fixes: torch's fused attention rounds a decode and a prompt differently."""
    b = _one_request(150, torch.float32, "cpu")
    whole = _attend(lambda *a, max_query_len=None: paged_attention_sdpa(*a), b, b.q, [(0, 150)])
    decodes = [_attend(lambda *a, max_query_len=None: paged_attention_sdpa(*a), b, b.q, [(p, p + 1)])[0]
               for p in range(64, 150)]
    assert any(not torch.equal(d, whole[p]) for d, p in zip(decodes, range(64, 150)))


@pytest.mark.parametrize("device", DEVICES)
def test_triton_attention_same_in_every_step_kind(device):
    _check_step_kinds(paged_attention_invariant, device, torch.float32, seq_len=150)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: on the interpreter tl.dot is numpy's BLAS "
                    "(its rounding depends on a row's place in the tile; bf16 operands multiply wrongly)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", ["fma_scores", "mask_all"])
def test_triton_attention_ways_to_invariance(dtype, variant):
    """The Triton kernel with the mode's fixed tiles and either of its two ways to the same bits in
    every step kind (an explicit fma for the exponent, or every tile masked)."""
    device = "cuda"
    def fn(q, k_cache, v_cache, qsl, seq_lens, tables, scale, **kw):
        tiles = bi_attention_tiles(q.shape[1], k_cache.shape[2], q.shape[2])
        tiles.update(fma_scores=variant == "fma_scores", mask_all=variant == "mask_all")
        return paged_attention_triton(q, k_cache, v_cache, qsl, seq_lens, tables, scale, **tiles, **kw)

    _check_step_kinds(fn, device, dtype, seq_len=150)


# ---- row-wise ops the mode keeps -----------------------------------------------------------


def test_cpu_rowwise_ops_are_row_invariant():
    """RMSNorm, log-softmax and the seeded Gumbel sampler reduce each row alone on the CPU."""
    gen = torch.Generator().manual_seed(3)
    x, r, w = torch.randn(67, 576, generator=gen), torch.randn(67, 576, generator=gen), torch.randn(576, generator=gen)
    _rows_invariant(lambda t: rms_norm_ref(t, w, 1e-5), x)
    _rows_invariant(lambda t: torch.cat(rms_norm_ref(t[:, :576], w, 1e-5, t[:, 576:]), dim=1),
                    torch.cat([x, r], dim=1))
    logits = torch.randn(67, 4099, generator=gen)
    _rows_invariant(lambda t: torch.log_softmax(t, dim=-1), logits)
    sampled = torch.arange(67) % 4099
    _rows_invariant(lambda t: logprobs_ref(t, sampled[: t.shape[0]], 5)[0], logits, counts=(1, 2, 40, 67),
                    reorder=False)
    temps = torch.full((67,), 0.8)
    seeds, pos = torch.arange(67, dtype=torch.int64) * 7 + 1, torch.arange(67, dtype=torch.int64)
    full = gumbel_sample_ref(logits, temps, seeds, pos)
    for m in (1, 2, 40):
        assert torch.equal(gumbel_sample_ref(logits[:m], temps[:m], seeds[:m], pos[:m]), full[:m])


def test_logsumexp_rows_matches_torch_and_is_row_invariant():
    """The CPU logprobs' normaliser over a vocabulary-sized row (torch may split a lone long row's
    reduction over threads): torch's value within fp32 rounding, the same for any row count."""
    x = 4 * torch.randn(67, 49152, generator=torch.Generator().manual_seed(4))
    assert torch.allclose(logsumexp_rows(x), torch.logsumexp(x.double(), -1).float(), rtol=1e-6, atol=0)
    _rows_invariant(logsumexp_rows, x, counts=(1, 2, 13, 14, 67))
    _rows_invariant(logsumexp_rows, x[:, :1000])  # shorter than a chunk multiple: zero padding
    edge = torch.tensor([[float("-inf")] * 3, [0.0, float("inf"), 1.0]])
    assert torch.equal(logsumexp_rows(edge), torch.logsumexp(edge, -1))
