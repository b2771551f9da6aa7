"""Sampling ops: the Triton kernels against the torch references (interpreter on CPU at small
shapes, real shapes on CUDA), and statistical tests of the reference sampler itself (the spec)."""


import pytest
import torch

import tokenmill.kernels.sampling_triton as sampling_triton
from tokenmill.kernels.sampling import (
    apply_penalties,
    apply_penalties_ref,
    apply_top_k_top_p_min_p,
    apply_top_k_top_p_min_p_ref,
    gumbel_from_bits_ref,
    gumbel_sample,
    gumbel_sample_ref,
    logprobs,
    logprobs_ref,
)
from tokenmill.kernels.sampling_triton import (
    apply_penalties_triton,
    apply_top_k_top_p_min_p_triton,
    gumbel_sample_triton,
    logprobs_triton,
)
from tests.kernels.common import CPU, DEVICES, INTERPRETER  # noqa: F401

NEG_INF = float("-inf")


def shape(device) -> tuple[int, int]:
    """(B, V): several vocabulary blocks on the CPU, real shapes on CUDA."""
    return (6, 2500) if device == "cpu" else (256, 151936)


def random_logits(B: int, V: int, device, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(B, V, generator=gen)).to(device)


def sampling_params(B: int, device, seed: int = 0):
    """Temperatures with greedy rows and a clamped one; seeds past 32 bits and negative; positions
    past 32 bits (only their low word counts)."""
    gen = torch.Generator().manual_seed(seed)
    temperature = 0.2 + 1.8 * torch.rand(B, generator=gen)
    temperature[::5] = 0.0
    temperature[1] = 1e-8
    seeds = torch.randint(-2**62, 2**62, (B,), generator=gen)
    seeds[2] = 0
    positions = torch.randint(0, 2**34, (B,), generator=gen)
    return temperature.to(device), seeds.to(device), positions.to(device)


# ----------------------------------------------------------------------------------------------
# gumbel_sample
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_gumbel_sample_matches_reference(device):
    B, V = shape(device)
    for seed in range(2 if device == "cpu" else 5):
        logits = random_logits(B, V, device, seed)
        temperature, seeds, positions = sampling_params(B, device, seed)
        ref = gumbel_sample_ref(logits, temperature, seeds, positions)
        out = gumbel_sample_triton(logits, temperature, seeds, positions)
        assert out.dtype == torch.int64 and out.shape == (B,)
        assert torch.equal(out, ref)
        assert torch.equal(gumbel_sample_triton(logits, temperature, seeds, positions, greedy_only=True),
                           gumbel_sample_ref(logits, temperature, seeds, positions, greedy_only=True))
    if device == "cuda":
        assert torch.equal(gumbel_sample(logits, temperature, seeds, positions), ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_chunks", [2, 3, 1000])
def test_gumbel_sample_split_rows_match_reference(device, num_chunks):
    """Small batches split each row over several programs; the merged winner is the same token,
    ties included (the lowest index), and a fully masked row still gives 0."""
    B, V = shape(device)
    logits = random_logits(B, V, device, seed=11)
    temperature, seeds, positions = sampling_params(B, device, seed=11)
    top = logits.max() + 1
    logits[0, [V - 1, 1030, 5]] = top  # a greedy row (temperature[0] == 0) with ties across chunks
    logits[-1] = NEG_INF
    ref = gumbel_sample_ref(logits, temperature, seeds, positions)
    out = gumbel_sample_triton(logits, temperature, seeds, positions, num_chunks=num_chunks)
    assert torch.equal(out, ref) and int(out[0]) == 5 and int(out[-1]) == 0
    greedy = gumbel_sample_triton(logits, temperature, seeds, positions, greedy_only=True, num_chunks=num_chunks)
    assert torch.equal(greedy, logits.argmax(dim=-1))


@pytest.mark.parametrize("device", DEVICES)
def test_gumbel_sample_after_masking_and_other_dtypes(device):
    """Rows mostly at -inf (after top-k), a row all -inf, int32 positions."""
    B, V = shape(device)
    logits = random_logits(B, V, device, seed=3)
    apply_top_k_top_p_min_p_ref(logits, torch.full((B,), 5, device=device), None, None)
    logits[-1] = NEG_INF
    temperature, seeds, positions = sampling_params(B, device, seed=3)
    positions = (positions % 2**31).to(torch.int32)
    ref = gumbel_sample_ref(logits, temperature, seeds, positions)
    assert ref[-1] == 0
    assert torch.equal(gumbel_sample_triton(logits, temperature, seeds, positions), ref)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_ties_pick_the_lowest_index(device):
    B, V = shape(device)
    logits = random_logits(B, V, device, seed=4)
    top = logits.max() + 1
    ties = [(0, [7, 1500, V - 1]), (1, [V - 2, V - 1]), (2, [1100, 1024, 2048]), (3, [0, 1])]
    for row, cols in ties:
        logits[row, cols] = top
    temperature = torch.zeros(B, device=device)
    seeds = torch.zeros(B, dtype=torch.int64, device=device)
    out = gumbel_sample_triton(logits, temperature, seeds, seeds)
    assert torch.equal(out, logits.argmax(dim=-1))
    assert [int(out[r]) for r, _ in ties] == [min(c) for _, c in ties]


@pytest.fixture
def small_blocks(monkeypatch):
    """256-column blocks, so that small CPU shapes split into many chunks of several blocks."""
    monkeypatch.setattr(sampling_triton, "VOCAB_BLOCK", 256)


def with_ties(logits: torch.Tensor, temperature: torch.Tensor) -> None:
    """In place: a greedy row and a sampling row whose maximum repeats across blocks and chunks. The
    sampling row's temperature is so small that T * gumbel vanishes next to the logits: its noisy
    values tie too, so the Triton scan's tie rule is checked on the noisy path as well."""
    V = logits.shape[1]
    top = logits.float().max() + 1
    cols = [V - 1, 1027, 768, 700, 257, 256, 3]  # 3 and 1027, 256 and 768: one lane of a 256-block
    logits[0, cols] = top.to(logits.dtype)
    temperature[0] = 0.0
    if logits.shape[0] > 1:
        logits[1, cols[:-1]] = top.to(logits.dtype)
        temperature[1] = 1e-30


@pytest.mark.skipif(not INTERPRETER, reason="Triton on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("num_chunks", [1, 2, 5, 1000])
def test_gumbel_sample_bit_exact_dtypes_and_chunks(small_blocks, dtype, B, num_chunks):
    """Triton (in the interpreter) against the reference for each logits dtype, with rows split into
    1 (the direct path), 2, 5 and 10 chunks of 10, 5, 2 and 1 blocks; ties go to the lowest index."""
    V = 2500
    logits = random_logits(B, V, "cpu", seed=B + num_chunks).to(dtype)
    temperature, seeds, positions = sampling_params(max(B, 3), "cpu", seed=B)
    temperature, seeds, positions = temperature[:B], seeds[:B], positions[:B]
    with_ties(logits, temperature)
    if B > 2:
        logits[-1] = NEG_INF
    ref = gumbel_sample_ref(logits, temperature, seeds, positions)
    assert torch.equal(ref, gumbel_sample_ref(logits.float(), temperature, seeds, positions))
    out = gumbel_sample_triton(logits, temperature, seeds, positions, num_chunks=num_chunks)
    assert torch.equal(out, ref)
    assert int(out[0]) == 3 and (B == 1 or int(out[1]) == 256) and (B < 3 or int(out[-1]) == 0)
    greedy = gumbel_sample_triton(logits, temperature, seeds, positions, greedy_only=True, num_chunks=num_chunks)
    assert torch.equal(greedy, logits.float().argmax(dim=-1))


def test_gumbel_chunks_fill_the_gpu_at_every_batch_size():
    """At least PROGRAMS_PER_SM programs per SM (132 SMs) at any batch, unless the rows have fewer
    blocks than that in all; chunks are whole blocks."""
    V, block = 151936, sampling_triton.VOCAB_BLOCK
    blocks = -(-V // block)
    for B in range(1, 1100):
        chunk = sampling_triton._vocab_chunk(B, V, torch.device("cpu"))
        assert chunk % block == 0
        assert B * -(-V // chunk) >= min(sampling_triton.PROGRAMS_PER_SM * 132, B * blocks), B


def test_gumbel_noise_is_finite_at_the_extreme_hashes():
    """Every 32-bit hash gives finite noise (the old 24-bit mapping made u = 1.0, +inf noise, for
    one hash in 2**24: a token drawn regardless of its logit, -inf included)."""
    bits = torch.tensor([0, 1, 511, 512, 2**31, 2**32 - 513, 2**32 - 512, 2**32 - 1], dtype=torch.int64)
    g = gumbel_from_bits_ref(bits)
    assert torch.isfinite(g).all()
    assert g.min() > -3.0 and g.max() < 17.0
    assert torch.equal(g[:3], g[:1].expand(3)) and g[-1] == g.max()


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=CPU.marks)])
def test_same_seed_and_position_same_token_in_any_row(impl):
    """A request's sample depends on its own logits, seed and position only, not on its batch row."""
    sample = gumbel_sample_ref if impl == "ref" else gumbel_sample_triton
    B, V = 12, 300
    logits = random_logits(B, V, "cpu", seed=5, scale=1.0)
    temperature = torch.ones(B)
    seeds = torch.randint(0, 2**40, (B,), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(B) * 3
    tokens = sample(logits, temperature, seeds, positions)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(6))
    assert torch.equal(sample(logits[perm], temperature[perm], seeds[perm], positions[perm]), tokens[perm])
    assert torch.equal(sample(logits[4:6], temperature[4:6], seeds[4:6], positions[4:6]), tokens[4:6])
    # One request placed in two rows of one batch samples the same token in both.
    logits[9], seeds[9], positions[9] = logits[2], seeds[2], positions[2]
    again = sample(logits, temperature, seeds, positions)
    assert again[9] == again[2] == tokens[2]


# ----------------------------------------------------------------------------------------------
# Statistical tests of the reference sampler (the spec of the Gumbel-max sampler)
# ----------------------------------------------------------------------------------------------

SPEC_LOGITS = torch.tensor([3.0, 2.2, 1.5, 1.0, 0.2, -0.4, -1.0, -2.5])
NUM_DRAWS = 20000


def draw(logits: torch.Tensor, temperature: float, vary: str = "seed", top_k=None, top_p=None, min_p=None):
    """Token counts over NUM_DRAWS draws of the reference sampler, one draw per batch row, varying
    the seed per draw (positions fixed) or the position (seed fixed: one seeded request's steps)."""
    n = NUM_DRAWS
    batch = logits[None, :].repeat(n, 1)
    full = lambda v, dt: None if v is None else torch.full((n,), v, dtype=dt)  # noqa: E731
    apply_top_k_top_p_min_p_ref(batch, full(top_k, torch.int32), full(top_p, torch.float32),
                                full(min_p, torch.float32))
    draws = torch.arange(n, dtype=torch.int64)
    if vary == "seed":
        seeds, positions = draws * 7919 + 11, torch.full((n,), 42, dtype=torch.int64)
    else:
        seeds, positions = torch.full((n,), 1234567, dtype=torch.int64), draws
    tokens = gumbel_sample_ref(batch, torch.full((n,), temperature), seeds, positions)
    return torch.bincount(tokens, minlength=logits.shape[0]).double()


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probs; categories expected below 5 are pooled."""
    from scipy.stats import chisquare

    expected = probs.double() / probs.double().sum() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.parametrize("vary", ["seed", "position"])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_reference_sampler_follows_softmax(temperature, vary):
    """argmax(logits + T * gumbel) draws from softmax(logits / T); the Triton kernel is the
    reference bit for bit (tests above), so this holds for it too."""
    counts = draw(SPEC_LOGITS, temperature, vary)
    expected = torch.softmax(SPEC_LOGITS.double() / temperature, -1)
    assert chi_square_p(counts, expected) > 1e-3
    # Not the distribution of another temperature: the test can tell them apart.
    assert chi_square_p(counts, torch.softmax(SPEC_LOGITS.double() / (1.3 * temperature), -1)) < 1e-6


def test_reference_sampler_follows_softmax_of_bf16_logits():
    """bf16 logits sample from the softmax of their own (rounded) values, computed in float32."""
    logits = (SPEC_LOGITS * 1.37).to(torch.bfloat16)
    counts = draw(logits, 0.7)
    assert chi_square_p(counts, torch.softmax(logits.double() / 0.7, -1)) > 1e-3


def test_reference_top_k_renormalises_over_the_k_best():
    counts = draw(SPEC_LOGITS, 1.0, top_k=3)
    assert counts[3:].sum() == 0
    assert chi_square_p(counts[:3], torch.softmax(SPEC_LOGITS[:3].double(), -1)) > 1e-3


def test_reference_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.softmax(SPEC_LOGITS.double(), -1)  # already in descending order
    cum = probs.cumsum(0)
    keep = int((cum < 0.8).sum()) + 1  # the smallest prefix whose mass reaches 0.8
    assert (cum - 0.8).abs().min() > 0.01, "test logits too close to the cut"
    counts = draw(SPEC_LOGITS, 1.0, top_p=0.8)
    assert counts[keep:].sum() == 0 and (counts[:keep] > 0).all()
    assert chi_square_p(counts[:keep], probs[:keep]) > 1e-3


def test_reference_min_p_keeps_tokens_within_a_factor_of_the_best():
    probs = torch.softmax(SPEC_LOGITS.double(), -1)
    keep = probs >= 0.1 * probs.max()
    assert 2 < int(keep.sum()) < len(probs)
    counts = draw(SPEC_LOGITS, 1.0, min_p=0.1)
    assert counts[~keep].sum() == 0
    assert chi_square_p(counts[keep], probs[keep]) > 1e-3


# ----------------------------------------------------------------------------------------------
# apply_penalties
# ----------------------------------------------------------------------------------------------


def penalty_inputs(B: int, V: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (B, V), generator=gen, dtype=torch.int32)
    counts[torch.rand(B, V, generator=gen) < 0.8] = 0
    prompt_mask = torch.rand(B, V, generator=gen) < 0.1
    repetition = 0.5 + torch.rand(B, generator=gen)
    frequency = 4 * torch.rand(B, generator=gen) - 2
    presence = 4 * torch.rand(B, generator=gen) - 2
    repetition[0], frequency[0], presence[0] = 1.0, 0.0, 0.0  # a neutral row
    frequency[1] = 0.0
    repetition[2] = 1.0
    return [t.to(device) for t in (counts, prompt_mask, repetition, frequency, presence)]


@pytest.mark.parametrize("with_prompt", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_apply_penalties_matches_reference(device, with_prompt):
    B, V = (5, 1500) if device == "cpu" else shape(device)
    logits = random_logits(B, V, device)
    counts, prompt_mask, rep, freq, pres = penalty_inputs(B, V, device)
    prompt_mask = prompt_mask if with_prompt else None
    ref = logits.clone()
    apply_penalties_ref(ref, counts, prompt_mask, rep, freq, pres)
    out = logits.clone()
    (apply_penalties if device == "cuda" else apply_penalties_triton)(out, counts, prompt_mask, rep, freq, pres)
    assert torch.equal(out, ref)  # same operations, same rounding
    assert torch.equal(out[0], logits[0])


# ----------------------------------------------------------------------------------------------
# apply_top_k_top_p_min_p
# ----------------------------------------------------------------------------------------------


def filter_params(B: int, V: int, device, seed: int = 0, k_dtype=torch.int32):
    """Per-row top_k / top_p / min_p with some rows at each stage's off value."""
    gen = torch.Generator().manual_seed(seed)
    top_k = torch.randint(1, min(V, 200), (B,), generator=gen)
    top_k[::4] = 0
    top_k[1] = V
    top_k[2] = 1
    top_p = 0.3 + 0.69 * torch.rand(B, generator=gen)
    top_p[::3] = 1.0
    min_p = 0.2 * torch.rand(B, generator=gen)
    min_p[::2] = 0.0
    return top_k.to(k_dtype).to(device), top_p.to(device), min_p.to(device)


def expected_filter(logits, top_k, top_p, min_p):
    """The reference, except that a top_p of 1.0 turns the stage off for that row (the sort-based
    reference can drop tail tokens there, whose mass before them rounds up to 1.0)."""
    ref = logits.clone()
    apply_top_k_top_p_min_p_ref(ref, top_k, top_p, min_p)
    if top_p is not None:
        off = top_p >= 1.0
        no_p = logits.clone()
        apply_top_k_top_p_min_p_ref(no_p, top_k, None, min_p)
        ref[off] = no_p[off]
    return ref


def assert_same_filter(out, logits, top_k, top_p, min_p):
    """Kept values untouched, the rest -inf, and the kept set the reference's; a token may differ
    only at the top-p cut when the mass above it is within float rounding of top_p."""
    ref = expected_filter(logits, top_k, top_p, min_p)
    kept, ref_kept = out > NEG_INF, ref > NEG_INF
    assert torch.equal(out[kept], logits[kept]) and (out[~kept] == NEG_INF).all()
    differ = (kept != ref_kept).nonzero().tolist()
    if differ:
        assert top_p is not None, differ
        before_p = logits.clone()
        apply_top_k_top_p_min_p_ref(before_p, top_k, None, min_p)
        for row, col in differ:
            probs = torch.softmax(before_p[row].double(), -1)
            mass_above = probs[probs > probs[col]].sum()
            assert abs(float(mass_above) - float(top_p[row])) < 1e-5, (row, col, float(mass_above))
    assert len(differ) <= max(1, out.shape[0] // 32)


@pytest.mark.parametrize("stages", ["k", "p", "min_p", "k_p", "k_p_min_p", "p_min_p"])
@pytest.mark.parametrize("device", DEVICES)
def test_top_k_top_p_min_p_matches_reference(device, stages):
    B, V = (6, 1000) if device == "cpu" else shape(device)
    for seed in range(1 if device == "cpu" else 3):
        logits = random_logits(B, V, device, seed)
        k, p, m = filter_params(B, V, device, seed)
        args = (k if "k" in stages.split("_") else None, p if "p" in stages.split("_") else None,
                m if "min" in stages else None)
        out = logits.clone()
        (apply_top_k_top_p_min_p if device == "cuda" else apply_top_k_top_p_min_p_triton)(out, *args)
        assert_same_filter(out, logits, *args)


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_top_p_min_p_int64_k_flat_and_peaked_rows(device):
    B, V = (4, 700) if device == "cpu" else (8, 151936)
    logits = random_logits(B, V, device, seed=7)
    logits[0] = 0.5  # all equal: every stage keeps the whole row
    logits[1, 17] = 1000.0  # one token holds all the mass
    logits[2, : V // 2] = NEG_INF  # half masked already (e.g. by a logit bias)
    top_k = torch.tensor([3, 5, V // 2 + 10, 0], device=device).repeat(B // 4)
    top_p = torch.tensor([0.5, 0.9, 0.7, 0.95], device=device).repeat(B // 4)
    out = logits.clone()
    apply_top_k_top_p_min_p_triton(out, top_k, top_p, None)
    assert (out[0] == 0.5).all(), "ties at the cut are all kept"
    assert (out[1] > NEG_INF).sum() == 1 and out[1, 17] == 1000.0
    rest = slice(2, None)
    assert_same_filter(out[rest], logits[rest], top_k[rest], top_p[rest], None)


def test_ties_at_the_top_k_cut_are_all_kept():
    """Documented difference from the sort-based reference: equal values at the k-th place all stay."""
    if not INTERPRETER and not torch.cuda.is_available():
        pytest.skip("needs the interpreter or CUDA")
    device = "cpu" if INTERPRETER else "cuda"
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0, 2.0]], device=device)
    out = logits.clone()
    apply_top_k_top_p_min_p_triton(out, torch.tensor([2], device=device), None, None)
    assert torch.equal(out, torch.tensor([[NEG_INF, 3.0, 2.0, 2.0, NEG_INF, 2.0]], device=device))


def test_reference_top_p_of_one_is_a_no_op():
    logits = random_logits(4, 2000, "cpu", seed=8)
    out = logits.clone()
    apply_top_k_top_p_min_p_ref(out, None, torch.ones(4), None)
    assert torch.equal(out, logits)


# ----------------------------------------------------------------------------------------------
# logprobs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_match_reference(device):
    B, V = shape(device)
    logits = random_logits(B, V, device, seed=9)
    logits[0, 100] = logits[0, 200] = logits[0].max() + 1  # a tie for rank
    sampled = torch.randint(0, V, (B,), generator=torch.Generator().manual_seed(9)).to(device)
    sampled[0] = 200
    sampled[1] = int(logits[1].argmax())
    fn = logprobs if device == "cuda" else logprobs_triton
    for num_top in (0, 5) if device == "cpu" else (0, 20):
        lp, rank, top_ids, top_lp = fn(logits, sampled, num_top)
        r_lp, r_rank, r_ids, r_top_lp = logprobs_ref(logits, sampled, num_top)
        assert lp.dtype == r_lp.dtype and rank.dtype == r_rank.dtype and top_ids.dtype == r_ids.dtype
        assert top_ids.shape == r_ids.shape and top_lp.shape == r_top_lp.shape
        torch.testing.assert_close(lp, r_lp, rtol=1e-5, atol=1e-5)
        assert torch.equal(rank, r_rank)
        assert rank[0] == 1 and rank[1] == 1
        assert torch.equal(top_ids, r_ids)
        torch.testing.assert_close(top_lp, r_top_lp, rtol=1e-5, atol=1e-5)
