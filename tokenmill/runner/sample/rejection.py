"""Choosing tokens for speculative decoding: which drafts the target accepts and the token that
follows them, lossless with respect to the distribution plain sampling draws from
(kernels/rejection_sampling.py holds the rule, the layout and the noise streams).

Like GumbelSampler, this is not a logit-rewriting stage but a RowState with its own call, and it
keeps no per-request state of its own: the seeds are GumbelSampler's column (`seed_gpu`) and the
temperatures come in as the noise scale TemperatureStage.noise_scale gives, exactly as for plain
sampling. The sampler's stages run first, on every logits row (draft and bonus rows alike), by
Sampler.process; this component receives its ProcessedLogits' logits and noise scale.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.kernels.rejection_sampling import rejection_sample
from tokenmill.step_io import NewRequestData
from tokenmill.runner.request_states import RowState
from tokenmill.runner.sample.gumbel import GumbelSampler
from tokenmill.runner.sample.stage import SampleBatch


@dataclass(frozen=True)
class RejectionOutput:
    sampled: torch.Tensor  # [B, k + 1] int64: the accepted drafts, the emitted token, then -1
    num_emitted: torch.Tensor  # [B] int32: accepted drafts + 1


class RejectionSampler(RowState):
    """sample(logits, batch, temperature, cu_num_logits, draft_token_ids, draft_probs=None,
    num_drafts=None), with B requests and num_logits = sum over requests of (num_drafts + 1), or of
    any number of rows above that with num_drafts (a uniform layout, e.g. 1 + k rows each):

      logits           [num_logits, V], float32 (or the model's dtype): the target's logits after the
                       sampler's stages (penalties, temperature + top-k/top-p/min-p masks, ...); request
                       b owns rows cu_num_logits[b] .. cu_num_logits[b+1] - 1: its draft positions in
                       order, then the bonus position.
      batch            the SampleBatch of those num_logits rows, as the stages saw it: rows / idx
                       repeat a request's row for each of its logits rows, positions [num_logits] is the
                       position each row's token takes (consecutive within a request).
      temperature      [num_logits] float32: the noise scale, TemperatureStage.noise_scale(batch,
                       scaled) as plain sampling takes it (0: greedy).
      cu_num_logits    [B + 1] int32 on the device (a request with no drafts owns one row).
      draft_token_ids  [B, k] int on the device, padded (-1) past each request's drafts.
      draft_probs      [num_logits - B, V] float32, the draft model's probabilities, one row per draft
                       position in the same order (request b's draft i: row cu[b] - b + i); None for
                       deterministic drafts (n-gram): q is one-hot, a draft is accepted with p(draft).
      num_drafts       [B] int32 on the device, or None: request b's number of drafts, when its rows
                       are more than its drafts + 1 (a CUDA graph's uniform 1 + k rows). It uses its
                       first min(num_drafts[b], rows - 1) drafts, its bonus row is cu[b] + num_drafts[b]
                       and its other rows are ignored (their draft ids may be -1). None: every row
                       but the last is a draft position.

    Returns a RejectionOutput on the device, without a host sync. With synthetic_acceptance = A (a
    benchmark mode for random weights) every draft is accepted with probability A whatever its
    token; the token emitted at a rejection is chosen as usual."""

    def __init__(self, gumbel: GumbelSampler, synthetic_acceptance: Optional[float] = None):
        if synthetic_acceptance is not None and not 0.0 <= synthetic_acceptance <= 1.0:
            raise ValueError(f"synthetic_acceptance must be in [0, 1] (got {synthetic_acceptance})")
        self.gumbel = gumbel
        self.synthetic_acceptance = synthetic_acceptance

    def add_request(self, row: int, new: NewRequestData) -> None:
        """Nothing of its own: the seed is GumbelSampler's, the temperature TemperatureStage's."""

    def sample(self, logits: torch.Tensor, batch: SampleBatch, temperature: torch.Tensor, cu_num_logits: torch.Tensor,
               draft_token_ids: torch.Tensor, draft_probs: Optional[torch.Tensor] = None,
               num_drafts: Optional[torch.Tensor] = None) -> RejectionOutput:
        sampled, num_emitted = rejection_sample(logits, cu_num_logits, draft_token_ids, draft_probs, temperature,
                                                self.gumbel.seed_gpu[batch.idx], batch.positions,
                                                self.synthetic_acceptance, num_drafts)
        return RejectionOutput(sampled, num_emitted)
