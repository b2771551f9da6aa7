"""NgramProposer through the proposer interface: rows admitted by RequestStates (the proposer among
its owners), a batch over rows in any order, drafts checked against the plain-Python lookup, on
the torch path and on the Triton kernel (interpreter)."""

import pytest
import torch

from tokenmill.kernels import ngram_propose as kernel_module
from tokenmill.kernels.ngram_propose import ngram_lookup
from tokenmill.runner.request_states import RequestStates
from tokenmill.runner.spec_decode import DraftTokens, NgramProposer, Proposer, ProposerInputs
from tokenmill.sampling_params import SamplingParams

from tests.kernels.common import INTERPRETER
from tests.runner.common import CPU, new_request

PROMPTS = {
    "a": (1, 2, 3, 4, 9, 1, 2, 3),  # 3-gram 1 2 3 -> 4 9 1 2 3
    "b": (5, 6, 7, 8),  # no match
    "c": (4, 4, 4, 4, 4, 4),  # overlapping repeats
    "d": (2,),  # too short
    "e": (7, 1, 8, 1, 9, 1),  # 1-gram 1: the latest earlier one, then 9 1
}


def admit(proposer: Proposer, device: torch.device = CPU) -> RequestStates:
    states = RequestStates(max_num_reqs=8, max_model_len=32, block_size=16, device=device, owners=[proposer])
    for req_id, prompt in PROMPTS.items():
        states.add(new_request(req_id, SamplingParams(), prompt=prompt))
    states.apply_staged()
    return states


def step_inputs(states: RequestStates, order: list[str], k: int) -> ProposerInputs:
    idx = torch.tensor([states.row_of[r] for r in order] + [0], dtype=torch.int64,
                       device=states.device)  # one padding entry
    return ProposerInputs(idx, len(order), states.token_table.gpu, states.num_prefill_gpu, k)


@pytest.fixture(params=["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not INTERPRETER, reason="Triton on CPU tensors needs TRITON_INTERPRET=1"))])
def path(request, monkeypatch):
    if request.param == "triton":
        monkeypatch.setattr(kernel_module, "use_triton", lambda t: True)
    return request.param


def check_drafts(device: torch.device, k: int) -> None:
    proposer = NgramProposer(1, 3, max_num_reqs=8, max_k=5, device=device)
    states = admit(proposer, device)
    order = ["e", "c", "a", "d", "b"]
    out = proposer.propose(step_inputs(states, order, k))
    assert isinstance(out, DraftTokens)
    assert out.draft_ids.shape == (5, k) and out.draft_ids.dtype == torch.int32
    assert out.num_drafts.shape == (5,) and out.num_drafts.dtype == torch.int32
    for b, req_id in enumerate(order):
        want = ngram_lookup(PROMPTS[req_id], k, 1, 3)
        assert out.num_drafts[b].item() == len(want)
        assert out.draft_ids[b].tolist() == want + [-1] * (k - len(want))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_drafts_through_the_interface(path, k):
    check_drafts(CPU, k)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 5])
def test_drafts_on_cuda(k):
    check_drafts(torch.device("cuda"), k)


def test_accepted_tokens_extend_the_history(path):
    """The runner writes accepted tokens into the table and raises num_tokens: the next proposal
    reads them."""
    proposer = NgramProposer(2, 2, max_num_reqs=8, max_k=4, device=CPU)
    states = admit(proposer)
    row = states.row_of["b"]
    num_tokens = states.num_prefill_gpu.clone()
    states.token_table.gpu[row, 4:6] = torch.tensor([5, 6], dtype=torch.int32)
    num_tokens[row] = 6
    inputs = ProposerInputs(torch.tensor([row]), 1, states.token_table.gpu, num_tokens, 4)
    out = proposer.propose(inputs)
    assert out.num_drafts.tolist() == [4] and out.draft_ids.tolist() == [[7, 8, 5, 6]]


def test_release_and_limits():
    proposer = NgramProposer(1, 2, max_num_reqs=8, max_k=2, device=CPU)
    states = admit(proposer)
    states.remove("a")  # a stateless proposer hears of it and keeps nothing
    with pytest.raises(ValueError):
        proposer.propose(step_inputs(states, ["b"], 3))
    with pytest.raises(ValueError):
        NgramProposer(3, 2, max_num_reqs=8, max_k=2, device=CPU)
    empty = proposer.propose(step_inputs(states, [], 2))
    assert empty.draft_ids.shape == (0, 2) and empty.num_drafts.shape == (0,)
