"""The proposer interface of speculative decoding (see the package docstring)."""

from abc import abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.layers.forward_context import AttentionMetadata
from tokenmill.step_io import NewRequestData
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

    For proposers that run a model of their own over the paged KV cache (draft_model.py,
    layer_truncated.py); None when the runner does not pass them:

    input_ids, positions, attn_metadata: the step the target just ran (its input ids [T], positions
                 [T] and attention metadata: query starts, sequence lengths, gathered block tables,
                 slot mapping), still in the runner's input buffers at sampling time; a draft model
                 replays it to write its own K/V of the step's tokens.
    block_table  [max_reqs, max_blocks] int32, indexed by row: each row's KV blocks (shared by the
                 target's cache and a draft's own, which has the same block size and count).
    block_size   tokens per KV block (a host int).
    slot_limit   [num_reqs] int: entry b's row holds KV slots for positions < slot_limit[b]; a draft
                 writes nothing at or beyond it.
    draft_mask   [num_reqs] bool: entries whose drafts a later step may verify (they sampled this
                 step and speculate); a draft writes no K/V for the others.
    """

    idx_mapping: torch.Tensor
    num_reqs: int
    token_table: torch.Tensor
    num_tokens: torch.Tensor
    k: int
    hidden_states: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None
    input_ids: Optional[torch.Tensor] = None
    attn_metadata: Optional[AttentionMetadata] = None
    block_table: Optional[torch.Tensor] = None
    block_size: int = 0
    slot_limit: Optional[torch.Tensor] = None
    draft_mask: Optional[torch.Tensor] = None


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

    # Proposers that write K/V (a draft model, the layer-truncated self-draft) override these; the
    # defaults describe one that reads only token ids (n-gram lookup).
    needs_step_inputs = False  # propose() wants the step's inputs, block tables and slot limits

    def kv_bytes_per_block(self) -> int:
        """KV-cache bytes of its own per block (a draft model's cache beside the target's)."""
        return 0

    def bind_kv_cache(self, num_blocks: int, target_kv_caches) -> None:
        """The target's KV cache exists (num_blocks blocks, per layer (k, v)): allocate or adopt one."""

    def profile_run(self, buffers, num_tokens: int, num_reqs: int) -> None:
        """CUDA memory profiling: run its largest forward pass once (no K/V written)."""

    def capture_cuda_graphs(self, max_batch: int) -> None:
        """CUDA only, after bind_kv_cache: capture its per-step work as CUDA graphs if it has any."""
