"""The sampler: logits [B, V] -> one token per batch entry, plus logprobs when asked.

It composes the stages some request of the batch uses, in this order: the grammar mask of
structured output (grammar.py), allowed_token_ids and bad_words (token_mask.py), logit bias,
min_tokens masking, penalties, temperature + min-p/top-k/top-p masking; then Gumbel-max sampling
(plain argmax for an all-greedy batch). Which stages run is decided on the CPU from their numpy mirrors, so no
device value is read; a stage no row uses is never called. Logprobs are taken from the raw logits.

The logits come in the model's dtype; every kernel computes in float32. A float32 copy is made only
when some stage modifies the logits; the caller's tensor is never written.

Sampler.process runs the stages alone and returns what sampling would read (ProcessedLogits): the
rejection sampler of speculative decoding takes the same logits and noise scale over its draft and
bonus rows. Sampler.__call__ is process, then Gumbel-max sampling and logprobs.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from tokenmill.step_io import NewRequestData
from tokenmill.runner.request_states import RowState
from tokenmill.runner.sample.grammar import GrammarStage
from tokenmill.runner.sample.gumbel import GumbelSampler
from tokenmill.runner.sample.logit_bias import LogitBiasStage
from tokenmill.runner.sample.logprobs import DeviceLogprobs, LogprobsReader
from tokenmill.runner.sample.min_tokens import MinTokensStage
from tokenmill.runner.sample.penalties import PenaltyStage
from tokenmill.runner.sample.stage import SampleBatch, SamplingStage
from tokenmill.runner.sample.temperature import TemperatureStage
from tokenmill.runner.sample.token_mask import TokenMaskStage


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [B] int64
    logprobs: Optional[DeviceLogprobs] = None
    # The penalty stage's [R, V] output-token counts when it ran this step: post-update adds the
    # sampled tokens to them. None otherwise.
    output_counts: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class ProcessedLogits:
    """The stages' result over a batch: what the token choice reads."""

    # [B, V]: a float32 copy the stages rewrote when some stage ran, else the caller's tensor itself
    # (model dtype, untouched).
    logits: torch.Tensor
    noise: torch.Tensor  # [B] float32: the Gumbel noise scale of each row (0: greedy)
    batch: SampleBatch
    output_counts: Optional[torch.Tensor] = None  # as SamplerOutput.output_counts


class Sampler(RowState):
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device):
        self.temperature = TemperatureStage(max_num_reqs, device)
        self.penalties = PenaltyStage(max_num_reqs, vocab_size, device)
        self.grammar = GrammarStage(max_num_reqs, vocab_size, device)
        self.token_mask = TokenMaskStage(max_num_reqs, vocab_size, device)
        # The logit-modifying stages, in the order they run.
        self.stages: tuple[SamplingStage, ...] = (
            self.grammar, self.token_mask, LogitBiasStage(max_num_reqs, device), MinTokensStage(max_num_reqs, device),
            self.penalties, self.temperature,
        )
        self.gumbel = GumbelSampler(max_num_reqs, device)
        self.logprobs = LogprobsReader(max_num_reqs)
        self._parts: tuple[RowState, ...] = self.stages + (self.gumbel, self.logprobs)

    def bind_last_sampled(self, last_sampled: torch.Tensor) -> None:
        """RequestStates.last_sampled, which the bad-words stage reads (runner/sample/token_mask.py)."""
        self.token_mask.bind_last_sampled(last_sampled)

    # ---- rows: RequestStates forwards admissions and releases ------------------------------
    def add_request(self, row: int, new: NewRequestData) -> None:
        for part in self._parts:
            part.add_request(row, new)

    def remove_request(self, row: int) -> None:
        for part in self._parts:
            part.remove_request(row)

    def apply_staged(self) -> None:
        for part in self._parts:
            part.apply_staged()

    # ---- the step -------------------------------------------------------------------------
    def process(self, logits: torch.Tensor, rows: np.ndarray, idx_mapping: torch.Tensor,
                positions: torch.Tensor, offsets: Optional[torch.Tensor] = None) -> ProcessedLogits:
        """The logit stages some row uses (grammar mask, allowed tokens / bad words, logit bias,
        min_tokens, penalties, temperature + filters), without sampling. logits [B, V] float32,
        bfloat16 or float16, never modified; rows [B] the batch's request rows on the host and
        idx_mapping the same on the device (a request may occupy several rows, e.g. its draft and
        bonus positions); positions [B]: the position each row's token takes (its index in the
        sequence); offsets [B] (optional): each row's index among its request's rows
        (SampleBatch.offsets). No device value is read on the host."""
        active = [stage for stage in self.stages if stage.needed(rows)]
        idx = idx_mapping.long()
        batch = SampleBatch(rows, idx, positions, self.temperature.temperature_gpu[idx], offsets)
        # Stages write into the logits: a float32 copy, which also leaves the raw logits for
        # logprobs. Plain temperature / greedy sampling reads the model's logits directly.
        work = logits.to(torch.float32, copy=True) if active else logits
        for stage in active:
            stage.apply(work, batch)
        return ProcessedLogits(work, self.temperature.noise_scale(batch, scaled=self.temperature in active), batch,
                               self.penalties.output_counts if self.penalties in active else None)

    def __call__(self, logits: torch.Tensor, rows: np.ndarray, idx_mapping: torch.Tensor,
                 positions: torch.Tensor) -> SamplerOutput:
        """One token per row: process(), then Gumbel-max sampling (argmax for an all-greedy batch);
        logprobs from the raw logits when asked. Arguments as for process()."""
        processed = self.process(logits, rows, idx_mapping, positions)
        sampled = self.gumbel.sample(processed.logits, processed.batch, processed.noise,
                                     self.temperature.all_greedy(rows))
        return SamplerOutput(sampled, self.logprobs.read(logits, sampled, rows), processed.output_counts)
