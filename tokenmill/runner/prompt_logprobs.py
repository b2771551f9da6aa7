"""Prompt logprobs: for each prompt token after the first, its logprob given the tokens before it,
its rank, and the top-k at that position, for the requests that ask (SamplingParams.prompt_logprobs).

They come chunk by chunk with chunked prefill: in a step, an entry that computes prompt positions
[s, s + q) contributes the positions i in [s, min(s + q, P - 1)), whose target is prompt token i + 1
(P: the prompt's length; the last position's next token is the first sampled one, not part of the
prompt logprobs). The hidden states of those positions go through the LM head and a log-softmax in
slices of `slice_rows` rows, so no [prompt length, vocab] tensor is ever built. The plan is made on
the host from the scheduler's numbers; its indices and targets reach the device through fresh pinned
copies, and the results go back with the step's AsyncOutput. A step where no row asks costs one
numpy check.

A resumed request (after preemption) computes its prompt again and sends those positions again; the
engine keeps the first value of each position.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from tokenmill.kernels.sampling import logprobs
from tokenmill.step_io import NewRequestData, PromptLogprobsSpan
from tokenmill.runner.request_states import RowState
from tokenmill.runner.sample.logprobs import DeviceLogprobs

DEFAULT_SLICE_ROWS = 256


@dataclass
class PromptLogprobsPlan:
    """Which flattened step tokens to read, and the prompt token each predicts."""

    spans: list[PromptLogprobsSpan]
    token_index: np.ndarray  # [N] int64: rows of the step's hidden states
    targets: np.ndarray  # [N] int64: the next prompt token at each
    num_top: int  # the largest k any entry asked for


@dataclass
class StepPromptLogprobs:
    """A step's prompt logprobs: host spans, and the rows as tensors (device, then pinned host)."""

    spans: list[PromptLogprobsSpan]
    rows: DeviceLogprobs


class PromptLogprobsComputer(RowState):
    def __init__(self, max_num_reqs: int, device: torch.device, slice_rows: int = DEFAULT_SLICE_ROWS):
        self.device = device
        self.slice_rows = slice_rows
        self.num_top = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: the row does not ask
        self.prompts: dict[int, np.ndarray] = {}  # row -> prompt token ids, for rows that ask

    def add_request(self, row: int, new: NewRequestData) -> None:
        k = new.params.prompt_logprobs
        self.num_top[row] = -1 if k is None else k
        if k is None:
            self.prompts.pop(row, None)
        else:
            self.prompts[row] = np.asarray(new.token_ids[: new.num_prompt_tokens], dtype=np.int64)

    def remove_request(self, row: int) -> None:
        self.num_top[row] = -1
        self.prompts.pop(row, None)

    def plan(self, req_ids: list[str], rows: np.ndarray, q_lens: np.ndarray, start: np.ndarray
             ) -> Optional[PromptLogprobsPlan]:
        """The step's plan (host numbers only), or None if no entry computes a prompt position that
        has a logprob to report."""
        if not len(rows) or self.num_top[rows].max() < 0:
            return None
        spans, index, targets, num_top = [], [], [], 0
        token_start = np.concatenate(([0], np.cumsum(q_lens)[:-1]))
        for b in np.flatnonzero(self.num_top[rows] >= 0):
            row = int(rows[b])
            prompt = self.prompts[row]
            first, end = int(start[b]), min(int(start[b] + q_lens[b]), len(prompt) - 1)
            if end <= first:
                continue
            spans.append(PromptLogprobsSpan(req_ids[b], first, end - first, sum(len(t) for t in targets)))
            index.append(np.arange(token_start[b], token_start[b] + end - first, dtype=np.int64))
            targets.append(prompt[first + 1 : end + 1])
            num_top = max(num_top, int(self.num_top[row]))
        if not spans:
            return None
        return PromptLogprobsPlan(spans, np.concatenate(index), np.concatenate(targets), num_top)

    def compute(self, hidden: torch.Tensor, plan: PromptLogprobsPlan,
                compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> StepPromptLogprobs:
        """The plan's logprobs from the step's hidden states, `slice_rows` rows of logits at a time."""
        index, targets = self._upload(plan.token_index), self._upload(plan.targets)
        n, k = len(plan.targets), plan.num_top
        chosen = torch.empty(n, dtype=torch.float32, device=self.device)
        ranks = torch.empty(n, dtype=torch.int64, device=self.device)
        top_ids = torch.empty((n, k), dtype=torch.int64, device=self.device)
        top_lp = torch.empty((n, k), dtype=torch.float32, device=self.device)
        for s in range(0, n, self.slice_rows):
            e = min(n, s + self.slice_rows)
            logits = compute_logits(hidden[index[s:e]])
            lp, rank, ids, vals = logprobs(logits, targets[s:e], k)
            chosen[s:e], ranks[s:e], top_ids[s:e], top_lp[s:e] = lp, rank, ids, vals
        return StepPromptLogprobs(plan.spans, DeviceLogprobs(chosen, ranks, top_ids, top_lp))

    def _upload(self, values: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(values)
        if self.device.type == "cuda":  # a fresh pinned copy: the host may reuse its arrays at once
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.to(self.device)
