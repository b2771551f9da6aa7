"""The Sampler's composition of its stages: only the stages some row of the batch uses are called
(in their order), the logits are copied only when one of them runs, and rows reach every stage
through RequestStates. Also the typed logprobs on their way out through AsyncOutput."""

import numpy as np
import pytest
import torch

import tokenmill.runner.sample.gumbel as gumbel_module
from tokenmill.step_io import LogprobsArrays, NewRequestData
from tokenmill.runner.async_output import AsyncOutput
from tokenmill.runner.request_states import RequestStates, RowState
from tokenmill.runner.sample import DeviceLogprobs, Sampler
from tokenmill.runner.sample.logit_bias import LogitBiasStage
from tokenmill.runner.sample.min_tokens import MinTokensStage
from tokenmill.runner.sample.penalties import PenaltyStage
from tokenmill.runner.sample.temperature import TemperatureStage
from tokenmill.sampling_params import SamplingParams
from tests.runner.common import CPU, V, new_request, random_logits

STAGES = (LogitBiasStage, MinTokensStage, PenaltyStage, TemperatureStage)  # the order they run in
PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "plain": SamplingParams(temperature=0.9),
    "bias": SamplingParams(temperature=0.0, logit_bias={3: 5.0}),
    "min_tokens": SamplingParams(min_tokens=4),
    "penalty": SamplingParams(presence_penalty=0.5),
    "top_k": SamplingParams(temperature=0.9, top_k=4),
}


@pytest.fixture
def states() -> RequestStates:
    states = RequestStates(8, 32, 16, CPU, owners=(Sampler(8, V, CPU),))
    for name, params in PARAMS.items():
        states.add(new_request(name, params, stop_ids=[2]))
    states.apply_staged()
    return states


@pytest.fixture
def calls(monkeypatch) -> list[type]:
    """The stage classes whose apply() ran, in order."""
    seen: list[type] = []
    for cls in STAGES:
        real = cls.apply
        monkeypatch.setattr(cls, "apply", lambda self, logits, batch, real=real, cls=cls:
                            seen.append(cls) or real(self, logits, batch))
    return seen


def sample(states: RequestStates, names: list[str], logits: torch.Tensor):
    rows = np.array([states.row_of[n] for n in names])
    (sampler,) = states.owners
    return sampler(logits, rows, torch.from_numpy(rows).to(torch.int32), torch.full((len(rows),), 3))


def test_a_stage_no_row_uses_is_never_called(states, calls, monkeypatch):
    seen = []
    real = gumbel_module.gumbel_sample
    monkeypatch.setattr(gumbel_module, "gumbel_sample", lambda logits, *a: seen.append(logits) or real(logits, *a))
    logits = random_logits(3)
    out = sample(states, ["greedy", "plain", "greedy"], logits)
    assert calls == [] and seen == [logits], "no stage, no copy"
    assert out.logprobs is None and out.output_counts is None
    sample(states, ["plain", "bias"], random_logits(2))
    assert calls == [LogitBiasStage]
    assert seen[-1] is not logits and seen[-1].dtype == torch.float32


def test_stages_run_in_order_and_each_once(states, calls):
    out = sample(states, list(PARAMS), random_logits(len(PARAMS)))
    assert calls == list(STAGES)
    assert out.output_counts is states.owners[0].penalties.output_counts


class Recorder(RowState):
    def __init__(self):
        self.events: list[tuple[str, int]] = []

    def add_request(self, row: int, new: NewRequestData) -> None:
        self.events.append(("add", row))

    def remove_request(self, row: int) -> None:
        self.events.append(("remove", row))

    def apply_staged(self) -> None:
        self.events.append(("apply", -1))


def test_request_states_forward_rows_to_their_owners():
    recorder = Recorder()
    states = RequestStates(4, 32, 16, CPU, owners=(recorder,))
    row = states.add(new_request("a", SamplingParams()))
    states.apply_staged()
    states.remove("a")
    states.remove("a")  # unknown by now: nothing to forward
    assert recorder.events == [("add", row), ("apply", -1), ("remove", row)]
    assert int(states.num_prefill_gpu[row]) == 3


def test_async_output_returns_typed_logprobs():
    sampled = torch.tensor([5, 6])
    raw = DeviceLogprobs(torch.tensor([-1.0, -2.0]), torch.tensor([1, 4]), torch.tensor([[5], [1]]),
                         torch.tensor([[-1.0], [-0.5]]))
    out = AsyncOutput(["a", "b"], sampled, np.array([True, False]), raw).get()
    assert out.sampled_token_ids.tolist() == [5, -1]
    assert isinstance(out.logprobs, LogprobsArrays) and out.logprobs.token_ranks.dtype == np.int64
    assert out.logprobs.top_ids.tolist() == [[5], [1]] and out.logprobs.top_logprobs.dtype == np.float32
    assert AsyncOutput(["a"], sampled[:1], np.array([True])).get().logprobs is None


def test_process_runs_the_stages_without_sampling(states, calls, monkeypatch):
    """Sampler.process: the caller's logits and the raw temperatures when no stage runs; else a
    rewritten float32 copy, scaled rows' noise 1, and the penalties' counts. __call__ samples exactly
    what process gives."""
    (sampler,) = states.owners
    seen = []
    real = gumbel_module.gumbel_sample
    monkeypatch.setattr(gumbel_module, "gumbel_sample", lambda logits, *a: seen.append((logits, a)) or real(logits, *a))
    logits = random_logits(3).to(torch.bfloat16)
    rows = np.array([states.row_of[n] for n in ["greedy", "plain", "greedy"]])
    plain = sampler.process(logits, rows, torch.from_numpy(rows), torch.full((3,), 3))
    assert calls == [] and plain.logits is logits and plain.output_counts is None
    assert plain.noise.tolist() == pytest.approx([0.0, 0.9, 0.0]) and plain.batch.rows is rows
    rows = np.array([states.row_of[n] for n in ["top_k", "penalty", "greedy"]])
    processed = sampler.process(logits, rows, torch.from_numpy(rows), torch.full((3,), 3))
    assert calls == [PenaltyStage, TemperatureStage] and processed.logits.dtype == torch.float32
    assert processed.noise.tolist() == [1.0, 1.0, 0.0] and processed.output_counts is sampler.penalties.output_counts
    assert not torch.equal(processed.logits[0], logits[0].float())
    out = sampler(logits, rows, torch.from_numpy(rows), torch.full((3,), 3))
    assert torch.equal(seen[-1][0], processed.logits) and torch.equal(out.sampled, real(processed.logits, *seen[-1][1]))
