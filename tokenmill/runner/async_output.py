"""AsyncOutput: a step's sampled tokens (and logprobs) on their way back to the CPU.

On CUDA the device-to-host copy runs on a side stream, ordered after the step by an event, into
pinned memory; `get()` waits only for that copy. The main stream goes on with the next step.
"""

from typing import Optional

import numpy as np
import torch

from tokenmill.step_io import ModelRunnerOutput, PromptLogprobsArrays
from tokenmill.runner.prompt_logprobs import StepPromptLogprobs
from tokenmill.runner.sample.logprobs import DeviceLogprobs


class AsyncOutput:
    def __init__(self, req_ids: list[str], sampled: torch.Tensor, sample_mask: np.ndarray,
                 logprobs: Optional[DeviceLogprobs] = None, copy_stream: Optional["torch.cuda.Stream"] = None,
                 num_emitted: Optional[torch.Tensor] = None, num_drafts: Optional[torch.Tensor] = None,
                 next_num_drafts: Optional[torch.Tensor] = None,
                 prompt_logprobs: Optional[StepPromptLogprobs] = None, draft_ids: Optional[torch.Tensor] = None):
        """sampled [B], or [B, 1 + k] with num_emitted, num_drafts and next_num_drafts [B]
        (speculative decoding; draft_ids [B, k]: the next step's drafts, when a grammar needs them);
        prompt_logprobs: the step's, where a request asked."""
        self.req_ids = req_ids
        self.sample_mask = sample_mask
        self._event = None
        # on the CPU, already host tensors
        self._sampled, self._logprobs = sampled, logprobs
        self._spec = (num_emitted, num_drafts, next_num_drafts) if num_emitted is not None else None
        self._drafts = draft_ids
        self._prompt_lp = prompt_logprobs
        if sampled.is_cuda:
            main = torch.cuda.current_stream(sampled.device)
            copy_stream = copy_stream or main
            copy_stream.wait_stream(main)
            with torch.cuda.stream(copy_stream):
                self._sampled = _to_pinned(sampled, copy_stream)
                if self._spec is not None:
                    self._spec = tuple(_to_pinned(t, copy_stream) for t in self._spec)
                if draft_ids is not None:
                    self._drafts = _to_pinned(draft_ids, copy_stream)
                if logprobs is not None:
                    self._logprobs = logprobs.map(lambda t: _to_pinned(t, copy_stream))
                if prompt_logprobs is not None:
                    rows = prompt_logprobs.rows.map(lambda t: _to_pinned(t, copy_stream))
                    self._prompt_lp = StepPromptLogprobs(prompt_logprobs.spans, rows)
                self._event = torch.cuda.Event()
                self._event.record(copy_stream)

    def get(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
        sampled = self._sampled.numpy().astype(np.int64, copy=True)
        sampled[~self.sample_mask] = -1
        logprobs = self._logprobs.to_arrays() if self._logprobs is not None else None
        lp = self._prompt_lp
        prompt_lp = PromptLogprobsArrays(lp.spans, lp.rows.to_arrays()) if lp is not None else None
        if self._spec is None:
            return ModelRunnerOutput(self.req_ids, sampled, logprobs, prompt_logprobs=prompt_lp)
        drafts = self._drafts.numpy().astype(np.int64) if self._drafts is not None else None
        return ModelRunnerOutput(self.req_ids, sampled, logprobs, *(t.numpy().astype(np.int64) for t in self._spec),
                                 prompt_logprobs=prompt_lp, next_draft_ids=drafts)


def _to_pinned(t: torch.Tensor, stream: "torch.cuda.Stream") -> torch.Tensor:
    """An asynchronous copy of device tensor `t` into pinned host memory, on `stream`."""
    t.record_stream(stream)  # keep the allocator from reusing it before the copy
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
