"""The Sampler on float32, bfloat16 and float16 logits: it computes in float32, never writes the
caller's logits, and copies them only when a stage modifies them. Run on the CPU with the torch
references and, in the interpreter, with the Triton kernels."""

import numpy as np
import pytest
import torch

import tokenmill.kernels.sampling as sampling
import tokenmill.runner.sample.gumbel as gumbel_module
from tokenmill.step_io import NewRequestData
from tokenmill.runner.request_states import RequestStates
from tokenmill.runner.sample import Sampler
from tokenmill.sampling_params import SamplingParams
from tests.kernels.common import INTERPRETER

V = 600
PARAMS = [
    dict(temperature=0.0),
    dict(temperature=0.8),
    dict(temperature=1.0, logprobs=3),
    dict(temperature=1.2, top_k=20, top_p=0.9),
    dict(temperature=0.9, min_p=0.1, repetition_penalty=1.3, frequency_penalty=0.5, logit_bias={5: 3.0},
         min_tokens=3, stop_token_ids=[7]),
    dict(temperature=0.0, presence_penalty=1.0, logprobs=0),
]
PLAIN = [0, 1, 2]  # requests that need no stage modifying the logits


def make_states() -> RequestStates:
    cpu = torch.device("cpu")
    sampler = Sampler(max_num_reqs=8, vocab_size=V, device=cpu)
    states = RequestStates(max_num_reqs=8, max_model_len=64, block_size=16, device=cpu, owners=(sampler,))
    for i, p in enumerate(PARAMS):
        prompt = [11 + i, 12, 13, 5]
        states.add(NewRequestData(f"r{i}", prompt + [40, 41], len(prompt), SamplingParams(**p), seed=1000 + i,
                                  block_ids=[], min_tokens_stop_ids=list(p.get("stop_token_ids", []))))
    states.apply_staged()
    return states


def run(states: RequestStates, logits: torch.Tensor, reqs: list[int]):
    rows = np.array([states.row_of[f"r{i}"] for i in reqs])
    positions = torch.tensor([6 + i for i in reqs], dtype=torch.int64)
    sampler, = states.owners
    return sampler(logits, rows, torch.from_numpy(rows).to(torch.int32), positions)


@pytest.fixture(params=["ref", "triton"])
def impl(request, monkeypatch):
    if request.param == "triton":
        if not INTERPRETER:
            pytest.skip("Triton on CPU needs TRITON_INTERPRET=1")
        monkeypatch.setattr(sampling, "use_triton", lambda t: True)
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sampler_computes_in_float32_and_leaves_the_logits_alone(impl, dtype):
    """Any dtype gives exactly what its values give as float32 logits: tokens, logprobs (float32),
    ranks and top ids; the caller's logits are never written."""
    states = make_states()
    reqs = list(range(len(PARAMS)))
    logits = (3 * torch.randn(len(reqs), V, generator=torch.Generator().manual_seed(1))).to(dtype)
    before = logits.clone()
    out = run(states, logits, reqs)
    assert torch.equal(logits, before)
    ref = run(states, logits.float(), reqs)
    assert torch.equal(out.sampled, ref.sampled)
    assert int(out.sampled[4]) != 7, "min_tokens masks the stop id"
    got, want = out.logprobs, ref.logprobs
    for pair in ((got.token_logprobs, want.token_logprobs), (got.token_ranks, want.token_ranks),
                 (got.top_logprobs, want.top_logprobs)):
        assert pair[0].dtype == pair[1].dtype and torch.equal(*pair)
    assert got.token_logprobs.dtype == torch.float32
    assert torch.equal(logits.float().gather(1, got.top_ids), logits.float().gather(1, want.top_ids))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plain_sampling_reads_the_model_logits_without_a_copy(impl, monkeypatch, dtype):
    seen = []
    real = gumbel_module.gumbel_sample
    monkeypatch.setattr(gumbel_module, "gumbel_sample", lambda logits, *a: seen.append(logits) or real(logits, *a))
    states = make_states()
    logits = torch.randn(len(PLAIN), V, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = run(states, logits, PLAIN)
    assert len(seen) == 1 and seen[0] is logits
    sampler, = states.owners
    rows = [states.row_of[f"r{i}"] for i in PLAIN]
    expected = sampling.gumbel_sample_ref(logits, sampler.temperature.temperature_gpu[rows],
                                          sampler.gumbel.seed_gpu[rows], torch.tensor([6 + i for i in PLAIN]))
    assert torch.equal(out.sampled, expected)
