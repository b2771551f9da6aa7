"""The proposer interface of speculative decoding (see the package docstring)."""

from abc import abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.messages import NewRequestData
from tokenmill.runner.request_states import RowState


@dataclass(frozen=True)
class ProposerInputs:
    """What a proposer sees after a step's sampling; every tensor is on the device.

    idx_mapping  [>= num_reqs] int: batch position -> request row (entries past num_reqs are padding).
    token_table  [max_reqs, max_model_len] int32: each row's token ids (prompt + generated).
    num_tokens   [max_reqs] int, indexed by row: tokens of the row known so far, this step's
                 accepted tokens included (they are in token_table already).
    k            draft tokens wanted per request (a host int, the same for the whole batch).
    hidden_states, positions: the target model's last hidden states [num_tokens, hidden] and their
                 positions, for heads that read them; None when the runner does not pass them.
    """

    idx_mapping: torch.Tensor
    num_reqs: int
    token_table: torch.Tensor
    num_tokens: torch.Tensor
    k: int
    hidden_states: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class DraftTokens:
    """A proposal, on the device: draft_ids [num_reqs, k] int32 (-1 past each entry's drafts) and
    num_drafts [num_reqs] int32 in 0..k. Entry b belongs to row idx_mapping[b]."""

    draft_ids: torch.Tensor
    num_drafts: torch.Tensor


class Proposer(RowState):
    """Proposes draft tokens once per step, after sampling. A proposer is a RowState, so the runner
    can list it among RequestStates' owners; add_request / remove_request do nothing unless it
    keeps rows of its own."""

    @abstractmethod
    def propose(self, inputs: ProposerInputs) -> DraftTokens:
        """Draft tokens for every entry of the batch; no host reads of device values."""

    def add_request(self, row: int, new: NewRequestData) -> None:
        """The request `new` takes `row` (a stateless proposer has nothing to do)."""
