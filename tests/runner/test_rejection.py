"""RejectionSampler: the rejection sampler over the Sampler's own rows (seeds from GumbelSampler, the
noise scale from TemperatureStage, the stages by Sampler.process): without drafts it picks the
Sampler's tokens, a seeded request gets the same tokens in any batch and in the uniform (1 + k rows,
num_drafts) layout, and the greedy and synthetic-acceptance rules hold end to end."""

from typing import Optional

import numpy as np
import pytest
import torch

from tokenmill.runner.sample import RejectionOutput, RejectionSampler, Sampler
from tokenmill.sampling_params import SamplingParams
from tests.runner.common import CPU, V, new_request

PARAMS = (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=5),
          SamplingParams(temperature=0.6, top_p=0.9, presence_penalty=0.5))


@pytest.fixture
def sampler() -> Sampler:
    sampler = Sampler(8, V, CPU)
    for row, params in enumerate(PARAMS):
        sampler.add_request(row, new_request(f"r{row}", params, seed=100 + row))
    sampler.apply_staged()
    return sampler


class Request:
    """One request's part of a speculative step: its logits rows (drafts, then bonus), drafts, q."""

    def __init__(self, row: int, num_drafts: int, position: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.row, self.position = row, position
        self.logits = 2 * torch.randn(num_drafts + 1, V, generator=gen)
        self.q = torch.softmax(self.logits[:num_drafts] + torch.randn(num_drafts, V, generator=gen), dim=-1)
        self.drafts = torch.multinomial(self.q, 1, generator=gen)[:, 0] if num_drafts else torch.zeros(0).long()


def padded(rows: torch.Tensor, num_rows: int, fill: float) -> torch.Tensor:
    return torch.cat([rows, rows.new_full((num_rows - len(rows), V), fill)])


def step(sampler: Sampler, requests: list[Request], k: int, with_q: bool = False,
         synthetic: Optional[float] = None, uniform: bool = False) -> RejectionOutput:
    """What the runner will do: the Sampler's stages over every logits row (Sampler.process), then
    the rejection sampler. uniform: every request gets 1 + k rows (unused ones: other logits, -1
    drafts) and num_drafts says how many it uses."""
    counts = [k + 1 if uniform else len(r.logits) for r in requests]
    rows = np.repeat([r.row for r in requests], counts)
    positions = torch.from_numpy(np.concatenate([r.position + np.arange(c) for r, c in zip(requests, counts)]))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32)
    drafts = torch.full((len(requests), k), -1, dtype=torch.long)
    for i, r in enumerate(requests):
        drafts[i, :len(r.drafts)] = r.drafts
    logits = torch.cat([padded(r.logits, c, 5.0) for r, c in zip(requests, counts)])
    processed = sampler.process(logits, rows, torch.from_numpy(rows), positions)
    q = torch.cat([padded(r.q, c - 1, 1.0 / V) for r, c in zip(requests, counts)]) if with_q else None
    num_drafts = torch.tensor([len(r.drafts) for r in requests], dtype=torch.int32) if uniform else None
    return RejectionSampler(sampler.gumbel, synthetic).sample(processed.logits, processed.batch, processed.noise, cu,
                                                              drafts, q, num_drafts)


def test_no_drafts_picks_the_samplers_tokens(sampler):
    requests = [Request(row, 0, position=7 * row + 3, seed=row) for row in range(4)]
    rows = np.arange(4)
    plain = sampler(torch.cat([r.logits for r in requests]), rows, torch.from_numpy(rows),
                    torch.tensor([r.position for r in requests])).sampled
    for k in (0, 3):
        out = step(sampler, requests, k)
        assert torch.equal(out.sampled[:, 0], plain) and bool((out.sampled[:, 1:] == -1).all())
        assert out.num_emitted.tolist() == [1, 1, 1, 1]


def test_all_accepted_ends_with_the_samplers_bonus_token(sampler):
    """synthetic_acceptance=1 accepts every draft: the bonus row then gets exactly the token the
    Sampler would draw there; synthetic_acceptance=0 rejects the first draft of every request."""
    requests = [Request(row, 3, position=10 * row, seed=10 + row) for row in range(4)]
    bonus = [Request(r.row, 0, r.position + 3, seed=0) for r in requests]
    for r, b in zip(requests, bonus):
        b.logits = r.logits[3:].clone()
    rows = np.arange(4)
    plain = sampler(torch.cat([b.logits for b in bonus]), rows, torch.from_numpy(rows),
                    torch.tensor([b.position for b in bonus])).sampled
    out = step(sampler, requests, 4, synthetic=1.0)
    assert out.num_emitted.tolist() == [4] * 4 and torch.equal(out.sampled[:, 3], plain)
    assert torch.equal(out.sampled[:, :3], torch.stack([r.drafts for r in requests]))
    assert bool((out.sampled[:, 4] == -1).all())
    out = step(sampler, requests, 4, synthetic=0.0)
    assert out.num_emitted.tolist() == [1] * 4 and int(out.sampled[0, 0]) == int(requests[0].logits[0].argmax())


def test_greedy_request_accepts_the_targets_argmax(sampler):
    target = Request(0, 4, position=5, seed=3)
    target.drafts = target.logits[:4].argmax(dim=-1)
    wrong = Request(0, 4, position=5, seed=3)
    wrong.drafts = target.drafts.clone()
    wrong.drafts[2] = (wrong.drafts[2] + 1) % V
    out = step(sampler, [target, wrong], 4, with_q=True)
    assert out.num_emitted.tolist() == [5, 3]
    assert torch.equal(out.sampled[0], target.logits.argmax(dim=-1))
    assert out.sampled[1].tolist() == target.logits[:3].argmax(dim=-1).tolist() + [-1, -1]


@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("synthetic", [None, 0.7])
def test_uniform_layout_gives_the_compact_layouts_tokens(sampler, with_q, synthetic):
    """1 + k rows a request, num_drafts in 0..k: the same tokens as rows of drafts + 1 each."""
    requests = [Request(row % 4, n, position=30 + 9 * row, seed=50 + row) for row, n in enumerate((0, 4, 2, 1, 3, 4))]
    compact = step(sampler, requests, 4, with_q, synthetic)
    uniform = step(sampler, requests, 4, with_q, synthetic, uniform=True)
    assert torch.equal(uniform.sampled, compact.sampled) and torch.equal(uniform.num_emitted, compact.num_emitted)
    assert 6 < int(compact.num_emitted.sum()) < 6 + 14  # some drafts accepted, some rejected


@pytest.mark.parametrize("with_q", [False, True])
def test_seeded_request_gets_the_same_tokens_in_any_batch(sampler, with_q):
    requests = {row: Request(row, n, position=20 + row, seed=row) for row, n in zip(range(4), (2, 3, 0, 4))}
    alone = {row: step(sampler, [r], 4, with_q) for row, r in requests.items()}
    order = [3, 0, 2, 1]
    together = step(sampler, [requests[row] for row in order], 4, with_q)
    for i, row in enumerate(order):
        assert torch.equal(together.sampled[i], alone[row].sampled[0])
        assert int(together.num_emitted[i]) == int(alone[row].num_emitted[0])


def test_synthetic_acceptance_must_be_a_probability(sampler):
    with pytest.raises(ValueError):
        RejectionSampler(sampler.gumbel, synthetic_acceptance=1.5)
    RejectionSampler(sampler.gumbel).add_request(0, new_request("r", PARAMS[0]))  # no state of its own
