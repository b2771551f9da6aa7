"""AsyncOutput: a step's sampled tokens (and logprobs) on their way back to the CPU.

On CUDA the device-to-host copy runs on a side stream, ordered after the step by an event, into
pinned memory; `get()` waits only for that copy. The main stream goes on with the next step.
"""

from typing import Optional

import numpy as np
import torch

from tokenmill.messages import ModelRunnerOutput
from tokenmill.runner.sample.logprobs import DeviceLogprobs


class AsyncOutput:
    def __init__(self, req_ids: list[str], sampled: torch.Tensor, sample_mask: np.ndarray,
                 logprobs: Optional[DeviceLogprobs] = None, copy_stream: Optional["torch.cuda.Stream"] = None):
        self.req_ids = req_ids
        self.sample_mask = sample_mask
        self._event = None
        self._sampled, self._logprobs = sampled, logprobs  # on the CPU, already host tensors
        if sampled.is_cuda:
            main = torch.cuda.current_stream(sampled.device)
            copy_stream = copy_stream or main
            copy_stream.wait_stream(main)
            with torch.cuda.stream(copy_stream):
                self._sampled = _to_pinned(sampled, copy_stream)
                if logprobs is not None:
                    self._logprobs = logprobs.map(lambda t: _to_pinned(t, copy_stream))
                self._event = torch.cuda.Event()
                self._event.record(copy_stream)

    def is_ready(self) -> bool:
        return self._event is None or self._event.query()

    def get(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
        sampled = self._sampled.numpy().astype(np.int64, copy=True)
        sampled[~self.sample_mask] = -1
        logprobs = self._logprobs.to_arrays() if self._logprobs is not None else None
        return ModelRunnerOutput(self.req_ids, sampled, logprobs)


def _to_pinned(t: torch.Tensor, stream: "torch.cuda.Stream") -> torch.Tensor:
    """An asynchronous copy of device tensor `t` into pinned host memory, on `stream`."""
    t.record_stream(stream)  # keep the allocator from reusing it before the copy
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
