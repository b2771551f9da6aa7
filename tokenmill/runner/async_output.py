"""AsyncOutput: a step's sampled tokens on their way back to the CPU.

On CUDA the device-to-host copy runs on a side stream, ordered after the step by an event, into
pinned memory; `get()` waits only for that copy. The main stream goes on with the next step.
"""

from typing import Optional

import numpy as np
import torch

from tokenmill.messages import LogprobsArrays, ModelRunnerOutput


class AsyncOutput:
    def __init__(self, req_ids: list[str], sampled: torch.Tensor, sample_mask: np.ndarray,
                 logprob_tensors: Optional[tuple[torch.Tensor, ...]] = None,
                 copy_stream: Optional["torch.cuda.Stream"] = None):
        self.req_ids = req_ids
        self.sample_mask = sample_mask
        tensors = (sampled,) + tuple(logprob_tensors or ())
        self._event = None
        if sampled.is_cuda:
            main = torch.cuda.current_stream(sampled.device)
            copy_stream = copy_stream or main
            copy_stream.wait_stream(main)
            with torch.cuda.stream(copy_stream):
                self._host = []
                for t in tensors:
                    t.record_stream(copy_stream)  # keep the allocator from reusing it before the copy
                    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    host.copy_(t, non_blocking=True)
                    self._host.append(host)
                self._event = torch.cuda.Event()
                self._event.record(copy_stream)
        else:
            self._host = list(tensors)
        self._has_logprobs = logprob_tensors is not None

    def is_ready(self) -> bool:
        return self._event is None or self._event.query()

    def get(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
        sampled = self._host[0].numpy().astype(np.int64, copy=True)
        sampled[~self.sample_mask] = -1
        logprobs = None
        if self._has_logprobs:
            lp, rank, ids, top = (t.numpy() for t in self._host[1:5])
            logprobs = LogprobsArrays(lp.astype(np.float32), rank.astype(np.int64), ids.astype(np.int64),
                                      top.astype(np.float32))
        return ModelRunnerOutput(self.req_ids, sampled, logprobs)
