"""The sampler: logits [B, V] -> one token per batch entry, plus logprobs when asked.

Stages run in this order, each only when some request in the batch uses it (decided on the CPU
from the rows' numpy mirrors, so no device value is read): logit bias, min_tokens masking,
penalties, temperature + min-p + top-k/top-p masking, then Gumbel-max sampling (plain argmax for an
all-greedy batch). Logprobs are taken from the raw logits, before any processing, like vLLM's default.

The logits come in the model's dtype; every kernel computes in float32. A float32 copy is made only
when a stage has to modify the logits; the caller's tensor is never written.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from tokenmill.kernels.sampling import apply_penalties, apply_top_k_top_p_min_p, gumbel_sample, logprobs
from tokenmill.runner.request_states import RequestStates


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [B] int64
    token_logprobs: Optional[torch.Tensor] = None
    token_ranks: Optional[torch.Tensor] = None
    top_ids: Optional[torch.Tensor] = None
    top_logprobs: Optional[torch.Tensor] = None


@dataclass
class BatchSamplingPlan:
    """Which stages this batch needs; computed on the CPU from the rows in the batch."""

    all_greedy: bool
    any_bias: bool
    any_min_tokens: bool
    any_penalty: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_logprobs: int  # -1: nobody asked

    @classmethod
    def for_rows(cls, states: RequestStates, rows: np.ndarray) -> "BatchSamplingPlan":
        temperature = states.field("temperature")[rows]
        sampling_rows = temperature > 0
        return cls(
            all_greedy=not bool(sampling_rows.any()),
            any_bias=bool(states.has_bias[rows].any()),
            any_min_tokens=bool((states.field("min_tokens")[rows] > 0).any()),
            any_penalty=bool(states.has_penalty[rows].any()),
            any_top_k=bool((states.field("top_k")[rows][sampling_rows] > 0).any()),
            any_top_p=bool((states.field("top_p")[rows][sampling_rows] < 1.0).any()),
            any_min_p=bool((states.field("min_p")[rows][sampling_rows] > 0.0).any()),
            max_logprobs=int(states.num_logprobs[rows].max()) if len(rows) else -1,
        )


class Sampler:
    def __init__(self, states: RequestStates):
        self.states = states

    def __call__(self, logits: torch.Tensor, idx_mapping: torch.Tensor, positions: torch.Tensor,
                 plan: BatchSamplingPlan) -> SamplerOutput:
        """logits [B, V] float32, bfloat16 or float16, never modified; idx_mapping [B] rows;
        positions [B]: the position the sampled token will take (its index in the sequence)."""
        s = self.states
        rows = idx_mapping.long()
        temperature = s.field_gpu("temperature")[rows]
        filters = not plan.all_greedy and (plan.any_top_k or plan.any_top_p or plan.any_min_p)
        work = logits
        if plan.any_bias or plan.any_min_tokens or plan.any_penalty or filters:
            # These stages write into the logits: a float32 copy, which also leaves the raw logits
            # for logprobs. Plain temperature / greedy sampling reads the model's logits directly.
            work = logits.to(torch.float32, copy=True)
        if plan.any_bias:
            ids, vals = (t[rows] for t in s.logit_bias)
            valid = ids >= 0
            work.scatter_add_(1, ids.clamp(min=0).long(), torch.where(valid, vals, torch.zeros_like(vals)))
        if plan.any_min_tokens:
            self._mask_stop_tokens(work, rows, positions)
        if plan.any_penalty:
            apply_penalties(work, s.output_counts[rows], s.prompt_mask[rows], s.field_gpu("repetition")[rows],
                            s.field_gpu("frequency")[rows], s.field_gpu("presence")[rows])
        if filters:
            # Masks apply to the temperature-scaled distribution; greedy rows are unaffected by
            # them (their argmax always survives), so scale only sampling rows.
            scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
            work.div_(scale[:, None])
            temperature = torch.where(temperature > 0, torch.ones_like(temperature), temperature)
            apply_top_k_top_p_min_p(
                work,
                s.field_gpu("top_k")[rows] if plan.any_top_k else None,
                s.field_gpu("top_p")[rows] if plan.any_top_p else None,
                s.field_gpu("min_p")[rows] if plan.any_min_p else None,
            )
        sampled = gumbel_sample(work, temperature, s.field_gpu("seed")[rows], positions, plan.all_greedy)
        out = SamplerOutput(sampled=sampled)
        if plan.max_logprobs >= 0:
            out.token_logprobs, out.token_ranks, out.top_ids, out.top_logprobs = logprobs(
                logits, sampled, max(plan.max_logprobs, 0))
        return out

    def _mask_stop_tokens(self, logits: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """-inf on EOS/stop ids for requests that have generated fewer than min_tokens tokens."""
        s = self.states
        generated = positions.long() - s.field_gpu("num_prompt")[rows]
        active = generated < s.field_gpu("min_tokens")[rows]
        ids = s.stop_ids().gpu[rows].long()
        hit = ((ids >= 0) & active[:, None]).to(torch.int8)
        # amax, so that padding entries (clamped onto column 0) never undo a real hit there.
        mask = torch.zeros(logits.shape, dtype=torch.int8, device=logits.device)
        mask.scatter_reduce_(1, ids.clamp(min=0), hit, reduce="amax")
        logits.masked_fill_(mask.bool(), float("-inf"))
