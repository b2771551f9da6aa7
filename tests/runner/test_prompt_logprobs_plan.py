"""PromptLogprobsComputer's plan: which step tokens are read and which prompt token each predicts,
across chunk boundaries, for rows that ask and rows that don't; and compute against a torch reference."""

import numpy as np
import torch

from tokenmill.step_io import NewRequestData
from tokenmill.runner.prompt_logprobs import PromptLogprobsComputer
from tokenmill.sampling_params import SamplingParams


def new(req_id, tokens, k, num_prompt=None):
    return NewRequestData(req_id, tokens, num_prompt or len(tokens), SamplingParams(prompt_logprobs=k), 0, [])


def test_plan_chunks_and_boundaries():
    c = PromptLogprobsComputer(4, torch.device("cpu"))
    prompt = list(range(100, 110))  # 10 tokens: positions 0..8 have targets 101..109
    c.add_request(0, new("a", prompt, 2))
    c.add_request(1, NewRequestData("b", [5, 6, 7], 3, SamplingParams(), 0, []))
    # Resumed after preemption: known tokens include 2 outputs, the prompt is still the first 4.
    c.add_request(2, new("c", [1, 2, 3, 4, 50, 51], 1, num_prompt=4))
    rows = np.array([1, 0, 2])
    # Step 1: b decodes 1 token, a computes positions 0..3, c positions 0..5 (prompt and outputs).
    plan = c.plan(["b", "a", "c"], rows, np.array([1, 4, 6]), np.array([3, 0, 0]))
    assert [(s.req_id, s.start, s.count, s.offset) for s in plan.spans] == [("a", 0, 4, 0), ("c", 0, 3, 4)]
    assert plan.token_index.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert plan.targets.tolist() == [101, 102, 103, 104, 2, 3, 4]
    assert plan.num_top == 2
    # Step 2: a's last chunk, positions 4..9: 9 predicts the first sampled token, so only 4..8.
    plan = c.plan(["a"], np.array([0]), np.array([6]), np.array([4]))
    assert [(s.start, s.count) for s in plan.spans] == [(4, 5)]
    assert plan.targets.tolist() == [105, 106, 107, 108, 109]
    # Decodes after the prompt, and rows that don't ask: nothing to do.
    assert c.plan(["a", "b"], np.array([0, 1]), np.array([1, 1]), np.array([10, 4])) is None
    c.remove_request(0)
    c.remove_request(2)
    assert c.plan(["b"], np.array([1]), np.array([1]), np.array([3])) is None


def test_compute_in_slices_matches_log_softmax():
    torch.manual_seed(0)
    vocab, hidden_size = 50, 8
    head = torch.randn(vocab, hidden_size)
    c = PromptLogprobsComputer(2, torch.device("cpu"), slice_rows=3)
    prompt = torch.randint(0, vocab, (12,)).tolist()
    c.add_request(0, new("a", prompt, 4))
    plan = c.plan(["a"], np.array([0]), np.array([12]), np.array([0]))
    hidden = torch.randn(12, hidden_size)
    calls = []

    def logits_of(h):
        calls.append(h.shape[0])
        return h @ head.T

    out = c.compute(hidden, plan, logits_of)
    assert max(calls) <= 3 and sum(calls) == 11
    ref = torch.log_softmax(hidden[:11] @ head.T, dim=-1)
    targets = torch.tensor(prompt[1:])
    torch.testing.assert_close(out.rows.token_logprobs, ref.gather(1, targets[:, None])[:, 0])
    ranks = (ref > ref.gather(1, targets[:, None])).sum(-1) + 1
    assert out.rows.token_ranks.tolist() == ranks.tolist()
    top = ref.topk(4, dim=-1)
    torch.testing.assert_close(out.rows.top_logprobs, top.values)
    assert out.rows.top_ids.tolist() == top.indices.tolist()
