"""Each sampler stage on its own: the rows it keeps, needed() from its host mirrors, and apply()
against a torch reference (CPU, torch reference kernels)."""

import numpy as np
import torch

import tokenmill.runner.request_states as request_states
from tokenmill.kernels.sampling import apply_penalties_ref, apply_top_k_top_p_min_p_ref, gumbel_sample_ref, logprobs_ref
from tokenmill.runner.request_states import RowParams
from tokenmill.runner.sample.gumbel import GumbelSampler
from tokenmill.runner.sample.logit_bias import LogitBiasStage
from tokenmill.runner.sample.logprobs import LogprobsReader
from tokenmill.runner.sample.min_tokens import MinTokensStage
from tokenmill.runner.sample.penalties import PenaltyStage
from tokenmill.runner.sample.temperature import Filters, TemperatureStage
from tokenmill.sampling_params import SamplingParams
from tests.runner.common import CPU, V, batch, new_request, random_logits

PLAIN = SamplingParams()


def test_row_params_copy_only_changed_values(monkeypatch):
    copies = []
    real = request_states.to_device
    monkeypatch.setattr(request_states, "to_device", lambda a, d: copies.append(a) or real(a, d))
    params = RowParams((1.0, 0.0), 4, np.float32, CPU)
    params.set(2, (1.0, 0.0))  # the defaults again
    params.apply_staged()
    assert not copies
    params.set(2, (2.0, 0.5))
    params.apply_staged()
    params.apply_staged()
    assert len(copies) == 1 and params.gpu[:, 2].tolist() == [2.0, 0.5] and params.gpu[0, 1] == 1.0


def test_logit_bias_stage():
    stage = LogitBiasStage(4, CPU)
    stage.add_request(0, new_request("a", SamplingParams(logit_bias={5: 3.0, 9: -2.0})))
    stage.add_request(1, new_request("b", PLAIN))
    assert stage.ids is not None and stage.needed(np.array([1, 0])) and not stage.needed(np.array([1, 2]))
    stage.apply_staged()
    logits = random_logits(2)
    want = logits.clone()
    want[0, 5] += 3.0
    want[0, 9] -= 2.0
    stage.apply(logits, batch([0, 1], [3, 3]))
    assert torch.equal(logits, want)


def test_logit_bias_of_a_rows_last_owner_is_cleared():
    stage = LogitBiasStage(4, CPU)
    stage.add_request(0, new_request("a", SamplingParams(logit_bias={5: 3.0})))
    stage.add_request(1, new_request("b", SamplingParams(logit_bias={7: 1.0})))
    stage.apply_staged()
    stage.remove_request(0)
    stage.add_request(0, new_request("c", PLAIN))  # row 0 again, without a bias
    stage.apply_staged()
    logits = random_logits(2)
    want = logits.clone()
    want[1, 7] += 1.0
    stage.apply(logits, batch([0, 1], [3, 3]))
    assert torch.equal(logits, want)


def test_min_tokens_stage():
    stage = MinTokensStage(4, CPU)
    stage.add_request(0, new_request("a", SamplingParams(min_tokens=2), stop_ids=[2, 7]))  # prompt of 3
    stage.add_request(1, new_request("b", PLAIN, stop_ids=[2]))
    assert stage.needed(np.array([0, 1])) and not stage.needed(np.array([1]))
    stage.apply_staged()
    logits = random_logits(3)
    want = logits.clone()
    want[0, [2, 7]] = float("-inf")  # position 3: no token generated yet
    want[1, [2, 7]] = float("-inf")  # position 4: one generated
    stage.apply(logits, batch([0, 0, 0], [3, 4, 5]))  # position 5: two generated, free to stop
    assert torch.equal(logits, want)
    other = random_logits(1)
    before = other.clone()
    stage.apply(other, batch([1], [3]))
    assert torch.equal(other, before)


def test_penalty_stage():
    stage = PenaltyStage(4, V, CPU)
    stage.add_request(2, new_request("a", PLAIN))
    assert stage.output_counts is None and not stage.needed(np.array([2])), "no penalty, no tables"
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)
    stage.add_request(1, new_request("b", params, prompt=(3, 4), outputs=(4, 6, 6)))
    assert stage.needed(np.array([2, 1]))
    stage.apply_staged()
    assert stage.output_counts[1, 6] == 2 and stage.output_counts[1, 4] == 1 and stage.prompt_mask[1, 3]
    logits = random_logits(2)
    want = logits.clone()
    idx = torch.tensor([1, 2])
    apply_penalties_ref(want, stage.output_counts[idx], stage.prompt_mask[idx], torch.tensor([1.5, 1.0]),
                        torch.tensor([0.5, 0.0]), torch.tensor([0.25, 0.0]))
    stage.apply(logits, batch([1, 2], [5, 3]))
    assert torch.equal(logits, want)
    assert torch.equal(logits[1], random_logits(2)[1]), "a row without penalties keeps its logits"


def test_temperature_stage():
    stage = TemperatureStage(4, CPU)
    stage.add_request(0, new_request("greedy", SamplingParams(temperature=0.0, top_k=3)))
    stage.add_request(1, new_request("plain", SamplingParams(temperature=0.7)))
    stage.add_request(2, new_request("filtered", SamplingParams(temperature=2.0, top_k=5, top_p=0.8, min_p=0.05)))
    stage.apply_staged()
    assert stage.all_greedy(np.array([0])) and not stage.all_greedy(np.array([0, 1]))
    assert not stage.needed(np.array([0, 1])), "a greedy row's top_k never turns the stage on"
    assert stage.needed(np.array([1, 2]))
    assert stage.filters(np.array([0, 1, 2])) == Filters(top_k=True, top_p=True, min_p=True)
    assert stage.filters(np.array([0, 1])) == Filters(top_k=False, top_p=False, min_p=False)
    b = batch([0, 1, 2], [3, 3, 3], stage.temperature_gpu)
    logits = random_logits(3)
    want = logits / torch.tensor([1.0, 0.7, 2.0])[:, None]
    apply_top_k_top_p_min_p_ref(want, torch.tensor([3, 0, 5]), torch.tensor([1.0, 1.0, 0.8]),
                                torch.tensor([0.0, 0.0, 0.05]))
    stage.apply(logits, b)
    assert torch.equal(logits, want)
    assert stage.noise_scale(b, scaled=True).tolist() == [0.0, 1.0, 1.0]
    assert torch.equal(stage.noise_scale(b, scaled=False), torch.tensor([0.0, 0.7, 2.0]))


def test_gumbel_sampler():
    sampler = GumbelSampler(4, CPU)
    for row, seed in ((0, 11), (3, 2**40 + 5)):
        sampler.add_request(row, new_request(f"r{row}", PLAIN, seed=seed))
    sampler.apply_staged()
    logits, temperature = random_logits(2), torch.tensor([0.8, 1.3])
    b = batch([3, 0], [7, 4])
    want = gumbel_sample_ref(logits, temperature, torch.tensor([2**40 + 5, 11]), b.positions)
    assert torch.equal(sampler.sample(logits, b, temperature, greedy_only=False), want)
    assert torch.equal(sampler.sample(logits, b, temperature, greedy_only=True), logits.argmax(dim=-1))


def test_logprobs_reader():
    reader = LogprobsReader(4)
    reader.add_request(0, new_request("none", PLAIN))
    reader.add_request(1, new_request("three", SamplingParams(logprobs=3)))
    reader.add_request(2, new_request("zero", SamplingParams(logprobs=0)))
    logits, sampled = random_logits(2), torch.tensor([4, 9])
    assert not reader.needed(np.array([0])) and reader.read(logits, sampled, np.array([0, 0])) is None
    assert reader.needed(np.array([0, 2]))
    got = reader.read(logits, sampled, np.array([0, 1]))
    want = logprobs_ref(logits, sampled, 3)
    for g, w in zip((got.token_logprobs, got.token_ranks, got.top_ids, got.top_logprobs), want):
        assert torch.equal(g, w)
    assert reader.read(logits, sampled, np.array([2, 0])).top_ids.shape == (2, 0)
