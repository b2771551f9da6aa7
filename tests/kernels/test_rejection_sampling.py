"""Rejection sampling for speculative decoding: the Triton kernel against the torch reference
(interpreter on CPU at small shapes, real shapes on CUDA), the uniform layout (num_drafts) against
the compact one, the greedy rule, equality with plain sampling without drafts, and statistical
tests of the reference (the spec): the emitted tokens follow the target distribution whatever the
drafts, and synthetic acceptance accepts at its rate."""

from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from scipy.stats import chisquare

import tokenmill.kernels.rejection_sampling as rejection_sampling
from tokenmill.kernels.rejection_sampling import rejection_sample, rejection_sample_ref, rejection_sample_triton
from tokenmill.kernels.sampling import gumbel_sample_ref
from tests.kernels.common import CPU, CUDA, DEVICES, INTERPRETER

P_MIN = 1e-3  # chi-square p-value below which a distribution test fails (fixed seeds: deterministic)


@dataclass
class Case:
    logits: torch.Tensor  # [N, V] float32
    cu: torch.Tensor  # [B + 1] int32
    drafts: torch.Tensor  # [B, K] int64, -1 padding
    q: Optional[torch.Tensor]  # [N - B, V] float32
    temperature: torch.Tensor  # [N]
    seeds: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]

    def to(self, device) -> "Case":
        return Case(*(t.to(device) if t is not None else None for t in vars(self).values()))

    def args(self, with_q: bool = True):
        return (self.logits, self.cu, self.drafts, self.q if with_q else None, self.temperature, self.seeds,
                self.positions)


def cu_from(num_drafts: list[int]) -> torch.Tensor:
    return torch.tensor([0] + [sum(n + 1 for n in num_drafts[:b + 1]) for b in range(len(num_drafts))],
                        dtype=torch.int32)


def random_case(num_drafts: list[int], V: int, K: int, seed: int = 0, device="cpu") -> Case:
    """Every third request is greedy, the others sample (temperature 0.5 ... 1.5); greedy drafts copy the
    argmax for a random prefix, sampled ones are drawn from the draft distribution q (so that
    accepted runs, rejections and bonus tokens all occur)."""
    gen = torch.Generator().manual_seed(seed)
    B, cu = len(num_drafts), cu_from(num_drafts)
    N = int(cu[-1])
    logits = 2 * torch.randn(N, V, generator=gen)
    draft_rows = torch.cat([torch.arange(int(cu[b]), int(cu[b]) + n) for b, n in enumerate(num_drafts)])
    q = torch.softmax(logits[draft_rows] + torch.randn(N - B, V, generator=gen), dim=-1)  # near p
    temp_req = torch.where(torch.arange(B) % 3 == 0, 0.0, 0.5 + torch.rand(B, generator=gen))
    drafts = torch.full((B, K), -1, dtype=torch.int64)
    for b, n in enumerate(num_drafts):
        first = int(cu[b])
        rows = logits[first:first + n]
        if temp_req[b] == 0:
            drafts[b, :n] = rows.argmax(dim=-1)
            cut = int(torch.randint(0, n + 1, (), generator=gen))
            drafts[b, cut:n] = (drafts[b, cut:n] + 1) % V
        elif n:
            drafts[b, :n] = torch.multinomial(q[first - b:first - b + n], 1, generator=gen)[:, 0]
    counts = torch.tensor([n + 1 for n in num_drafts])
    temperature = temp_req.repeat_interleave(counts)
    seeds = torch.randint(-2**62, 2**62, (B,), generator=gen).repeat_interleave(counts)
    positions = torch.randint(0, 2**34, (B,), generator=gen).repeat_interleave(counts) + \
        torch.cat([torch.arange(int(c)) for c in counts])
    tensors = (logits, cu, drafts, q, temperature, seeds, positions)
    return Case(*(t.to(device) for t in tensors))


def check_layout(out: torch.Tensor, emitted: torch.Tensor, case: Case) -> None:
    B, K = case.drafts.shape
    assert out.shape == (B, K + 1) and out.dtype == torch.int64 and emitted.dtype == torch.int32
    n = (case.cu[1:] - case.cu[:-1] - 1).long()
    assert bool(((emitted >= 1) & (emitted <= n + 1)).all())
    cols = torch.arange(K + 1, device=out.device)[None, :]
    acc = emitted.long()[:, None] - 1
    assert torch.equal(out[:, :K][cols[:, :K] < acc], case.drafts[cols[:, :K] < acc])
    assert bool((out[cols >= emitted.long()[:, None]] == -1).all())
    assert bool((out[cols == acc] >= 0).all())


@pytest.fixture
def small_blocks(monkeypatch):
    """64-column blocks, so that the CPU vocabularies take several loop steps."""
    monkeypatch.setattr(rejection_sampling, "VOCAB_BLOCK", 64)


def kernel_cases(device):
    if device == "cpu":
        return [(random_case([4, 0, 2, 1, 3, 0, 4, 2, 3, 4], V, 4, seed=V + s), 0) for V in (64, 257) for s in range(3)]
    num_drafts = [(b * 7) % 5 for b in range(64)]
    # The row sums and exp() differ from torch's in the last bits: a decision within rounding of
    # its threshold may go the other way (one request in millions; allowed once here).
    return [(random_case(num_drafts, 151936, 4, seed=s, device=device), 1) for s in range(2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("synthetic", [None, 0.6])
def test_kernel_matches_reference(small_blocks, device, with_q, synthetic):
    for case, allowed in kernel_cases(device):
        ref_out, ref_emitted = rejection_sample_ref(*case.args(with_q), synthetic_acceptance=synthetic)
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")  # the CUDA path never waits for the device
            try:
                out, emitted = rejection_sample(*case.args(with_q), synthetic_acceptance=synthetic)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        else:
            out, emitted = rejection_sample_triton(*case.args(with_q), synthetic_acceptance=synthetic)
        check_layout(out, emitted, case)
        check_layout(ref_out, ref_emitted, case)
        mismatched = ((out != ref_out).any(dim=1) | (emitted != ref_emitted)).sum()
        assert int(mismatched) <= allowed
        accepted = int((ref_emitted - 1).sum())
        assert 0 < accepted < int(case.cu[-1]) - len(emitted)  # some drafts accepted, some rejected


def uniform_case(case: Case, seed: int) -> tuple[Case, torch.Tensor]:
    """The same requests in the uniform layout of a CUDA graph, and their num_drafts [B] int32: 1 + K
    rows each, the used rows (drafts, then bonus) copied from `case`, the unused ones other logits,
    temperatures, seeds and positions; draft ids past a request's drafts -1, or for every other
    request an id far outside the vocabulary (never read); q rows past its drafts another
    distribution."""
    gen = torch.Generator().manual_seed(seed)
    (B, K), V = case.drafts.shape, case.logits.shape[1]
    n = (case.cu[1:] - case.cu[:-1] - 1).tolist()
    logits = 2 * torch.randn(B * (K + 1), V, generator=gen)
    q = torch.softmax(torch.randn(B * K, V, generator=gen), dim=-1)
    temperature = torch.where(torch.rand(B * (K + 1), generator=gen) < 0.3, 0.0, 1.0)
    seeds = torch.randint(-2**62, 2**62, (B * (K + 1),), generator=gen)
    positions = torch.randint(0, 2**34, (B * (K + 1),), generator=gen)
    drafts = torch.where(torch.arange(B)[:, None] % 2 == 0, -1, 2**40).expand(B, K).clone()
    for b in range(B):
        src, dst = slice(int(case.cu[b]), int(case.cu[b + 1])), slice(b * (K + 1), b * (K + 1) + n[b] + 1)
        for full, part in ((logits, case.logits), (temperature, case.temperature), (seeds, case.seeds),
                           (positions, case.positions)):
            full[dst] = part[src]
        q[b * K:b * K + n[b]] = case.q[int(case.cu[b]) - b:int(case.cu[b]) - b + n[b]]
        drafts[b, :n[b]] = case.drafts[b, :n[b]]
    cu = torch.arange(0, B * (K + 1) + 1, K + 1, dtype=torch.int32)
    uniform = Case(logits, cu, drafts, q, temperature, seeds, positions)
    return uniform, torch.tensor(n, dtype=torch.int32)


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=CPU.marks)])
@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("synthetic", [None, 0.6])
def test_uniform_layout_matches_the_compact_layout(small_blocks, impl, with_q, synthetic):
    """1 + K rows a request and num_drafts in 0..K (greedy and sampled requests): the tokens of the
    compact layout, from either implementation; num_drafts above a request's rows - 1 is capped."""
    sample = rejection_sample_ref if impl == "ref" else rejection_sample_triton
    for V, seed in ((64, 11), (130, 12)):
        case = random_case([4, 0, 2, 1, 3, 0, 4, 2, 1, 4, 0, 3], V, 4, seed=seed)
        uniform, num_drafts = uniform_case(case, seed)
        compact_out, compact_emitted = rejection_sample_ref(*case.args(with_q), synthetic_acceptance=synthetic)
        out, emitted = sample(*uniform.args(with_q), synthetic_acceptance=synthetic, num_drafts=num_drafts)
        assert torch.equal(out, compact_out) and torch.equal(emitted, compact_emitted)
        accepted = int((compact_emitted - 1).sum())
        assert 0 < accepted < int(num_drafts.sum())  # some drafts accepted, some rejected
        capped = sample(*case.args(with_q), synthetic_acceptance=synthetic, num_drafts=num_drafts + 3)
        assert torch.equal(capped[0], compact_out) and torch.equal(capped[1], compact_emitted)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("with_q", [True, False])
def test_uniform_layout_kernel_at_real_shapes(with_q):
    """The kernel on CUDA in the uniform layout: the compact layout's tokens exactly (the same
    arithmetic on the same rows), the reference's within the rounding allowance of
    test_kernel_matches_reference; no host sync."""
    for case, allowed in kernel_cases("cuda"):
        uniform, num_drafts = uniform_case(case.to("cpu"), seed=5)
        uniform, num_drafts = uniform.to("cuda"), num_drafts.cuda()
        compact = rejection_sample(*case.args(with_q))
        torch.cuda.set_sync_debug_mode("error")
        try:
            out, emitted = rejection_sample(*uniform.args(with_q), num_drafts=num_drafts)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(out, compact[0]) and torch.equal(emitted, compact[1])
        ref_out, ref_emitted = rejection_sample_ref(*uniform.args(with_q), num_drafts=num_drafts)
        assert int(((out != ref_out).any(dim=1) | (emitted != ref_emitted)).sum()) <= allowed


@pytest.mark.skipif(not INTERPRETER, reason="Triton on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_reads_half_precision_logits(small_blocks, dtype):
    case = random_case([3, 0, 2, 4, 1, 2], 130, 4, seed=9)
    case.logits = case.logits.to(dtype)
    for with_q in (True, False):
        out, emitted = rejection_sample_triton(*case.args(with_q))
        ref_out, ref_emitted = rejection_sample_ref(*case.args(with_q))
        assert torch.equal(out, ref_out) and torch.equal(emitted, ref_emitted)


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=CPU.marks)])
def test_greedy_accepts_while_drafts_match_the_argmax(impl):
    sample = rejection_sample_ref if impl == "ref" else rejection_sample_triton
    V, num_drafts = 64, [3, 3, 2, 0]
    case = random_case(num_drafts, V, 3, seed=1)
    case.temperature.zero_()
    top = case.logits.argmax(dim=-1)
    first = case.cu[:-1].long()
    wrong = (top + 1) % V
    case.drafts[0] = torch.stack([top[0], top[1], wrong[2]])  # the third is rejected
    case.drafts[1] = top[first[1]:first[1] + 3]  # all accepted: the bonus row's argmax follows
    case.drafts[2, :2] = torch.stack([wrong[first[2]], top[first[2] + 1]])  # the first is rejected
    out, emitted = sample(*case.args(with_q=False))
    assert emitted.tolist() == [3, 4, 1, 1]
    assert out[0].tolist() == [int(top[0]), int(top[1]), int(top[2]), -1]
    assert out[1].tolist() == top[first[1]:first[1] + 4].tolist()
    assert out[2].tolist() == [int(top[first[2]]), -1, -1, -1]
    assert out[3].tolist() == [int(top[first[3]]), -1, -1, -1]
    # q plays no part in greedy rows.
    assert torch.equal(sample(*case.args(with_q=True))[0], out)


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=CPU.marks)])
@pytest.mark.parametrize("synthetic", [None, 0.5])
def test_no_drafts_is_plain_gumbel_sampling(impl, synthetic):
    sample = rejection_sample_ref if impl == "ref" else rejection_sample_triton
    case = random_case([0] * 12, 257, 2, seed=2)
    case.temperature[3] = 1e-8
    out, emitted = sample(*case.args(), synthetic_acceptance=synthetic)
    plain = gumbel_sample_ref(case.logits, case.temperature, case.seeds, case.positions)
    assert torch.equal(out[:, 0], plain) and bool((out[:, 1:] == -1).all()) and bool((emitted == 1).all())
    # With drafts, a request whose drafts are all accepted samples its bonus row the same way.
    case = random_case([2] * 12, 257, 2, seed=3)
    out, emitted = sample(*case.args(), synthetic_acceptance=1.0)
    bonus = [c[2::3] for c in (case.logits, case.temperature, case.seeds, case.positions)]
    assert bool((emitted == 3).all()) and torch.equal(out[:, 2], gumbel_sample_ref(*bonus))


def distribution_case(num_requests: int, V: int, temperature: float, with_q: bool, seed: int):
    """num_requests copies of one request with two drafts (rows: p0, p1, bonus p2), each with its
    own seed and position; drafts drawn from a draft distribution q near p, which the sampler
    sees (with_q) or not (one-hot q: the drafts count as deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(3, V, generator=gen)
    q_rows = torch.softmax(rows[:2] / temperature + torch.randn(2, V, generator=gen), dim=-1)
    drafts = torch.stack([torch.multinomial(q_rows[i], num_requests, replacement=True, generator=gen)
                          for i in range(2)], dim=1)
    N = 3 * num_requests
    case = Case(rows.repeat(num_requests, 1), torch.arange(0, N + 1, 3, dtype=torch.int32), drafts,
                q_rows.repeat(num_requests, 1) if with_q else None, torch.full((N,), temperature),
                torch.arange(num_requests).repeat_interleave(3) * 7919 + seed,
                torch.arange(N) + 1000)
    return case, torch.softmax(rows.double() / temperature, dim=-1), q_rows.double()


# The statistical tests run the dispatcher: the torch reference on the CPU, the kernel on CUDA.
STAT_DEVICES = ["cpu", CUDA]


@pytest.mark.parametrize("device", STAT_DEVICES)
@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_emitted_tokens_follow_the_target_distribution(device, with_q, temperature):
    """Chi-square of the first, second and third emitted tokens against p0, p1 and p2 (the second
    and third among the requests that emit them), and the first draft's acceptance rate against
    sum(min(p0, q0)) (one-hot q: sum(q0 * p0), the mean of p0(d))."""
    num_requests, V = 40000, 8
    case, p, q = distribution_case(num_requests, V, temperature, with_q, seed=int(10 * temperature) + with_q)
    out, emitted = (t.cpu() for t in rejection_sample(*case.to(device).args()))
    for i in range(3):
        tokens = out[emitted > i, i]
        observed = torch.bincount(tokens, minlength=V).double()
        expected = p[i] * len(tokens)
        assert len(tokens) > 1000 and chisquare(observed.numpy(), expected.numpy()).pvalue > P_MIN, i
    rate = (emitted > 1).double().mean()
    expected_rate = torch.minimum(p[0], q[0]).sum() if with_q else (p[0] * q[0]).sum()
    assert abs(float(rate - expected_rate)) < 5 * (expected_rate * (1 - expected_rate) / num_requests) ** 0.5


@pytest.mark.parametrize("device", STAT_DEVICES)
@pytest.mark.parametrize("acceptance", [0.3, 0.8])
def test_synthetic_acceptance_rate(device, acceptance):
    """Every draft decision (greedy or sampled rows, drafts random) is accepted with probability A."""
    num_drafts = [4] * 3000 + [2] * 1000
    case = random_case(num_drafts, 64, 4, seed=7)
    case.drafts.copy_(torch.randint(0, 64, case.drafts.shape, generator=torch.Generator().manual_seed(8)))
    _, emitted = rejection_sample(*case.to(device).args(), synthetic_acceptance=acceptance)
    emitted = emitted.cpu()
    n = torch.tensor(num_drafts)
    accepted = emitted.long() - 1
    decisions = accepted + (accepted < n).long()
    rate = accepted.sum() / decisions.sum()
    assert abs(float(rate) - acceptance) < 5 * (acceptance * (1 - acceptance) / float(decisions.sum())) ** 0.5
    full = float((accepted == n)[n == 4].double().mean())  # all four accepted: A**4
    assert abs(full - acceptance ** 4) < 5 * (acceptance ** 4 / 3000) ** 0.5 + 1e-3
