"""Full CUDA graphs for uniform decode steps.

A decode step (one new token per request) of B requests replays the graph captured for the
smallest padded batch size >= B; the extra entries are padding (no K/V written, no attention).
Each graph covers the model's forward pass and the LM head over the persistent input buffers,
which the input-preparation kernels fill before the replay. All graphs share one memory pool and
are captured largest first, so the smaller ones reuse the larger ones' memory.

With speculative decoding a second manager captures verify steps: every request computes the
same query length q = 1 + k (its last token and k drafts), so a graph of B requests covers B * q
tokens and returns logits for all of them (in token order, which is the verify plan's order when
every entry of the step speculates with q tokens).

Capture is its own code path (not a side effect of a dummy run): it fills the buffers with a
harmless decode batch, runs it once eagerly (so Triton compiles and the allocator settles), then
records it.
"""

import bisect
import contextlib
import dataclasses
import gc
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from tokenmill.logger import init_logger
from tokenmill.runner.dummy_batch import fill_dummy_batch

logger = init_logger(__name__)


@contextlib.contextmanager
def no_garbage_collection():
    """No garbage collection while graphs are captured: a collection could free an earlier engine's
    CUDA graph, whose reset is not allowed while a stream captures, and the capture would fail."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def default_capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to max_batch."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes))


@dataclass
class CapturedGraph:
    batch_size: int
    graph: "torch.cuda.CUDAGraph"
    logits: torch.Tensor  # [batch_size, vocab], rewritten by every replay

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


class PaddedSizes:
    """Graphs captured for a table of padded sizes (requests or tokens); a step takes the smallest
    captured size that fits it, or runs eagerly. Shared by the decode and the piecewise graphs."""

    def __init__(self, sizes: list[int]):
        self.sizes = sorted(sizes)
        self.captured: set[int] = set()

    def dispatch(self, n: int) -> Optional[int]:
        """The smallest captured size >= n, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes) or self.sizes[i] not in self.captured:
            return None
        return self.sizes[i]


class CudaGraphManager(PaddedSizes):
    """Decode graphs: `forward(meta, input_ids, positions)` runs the model in the runner's forward
    context (KV caches and the engine's layer choices); the graph adds the LM head."""

    def __init__(self, model: torch.nn.Module, buffers, forward: Callable, sizes: list[int], query_len: int = 1):
        super().__init__(sizes)
        self.model = model
        self.buffers = buffers
        self.forward = forward
        self.query_len = query_len  # tokens per request: 1 (decode) or 1 + k (verify)
        self.graphs: dict[int, CapturedGraph] = {}

    def replay(self, size: int) -> torch.Tensor:
        """Replay the graph of this padded batch size; returns its logits [size * query_len, vocab]."""
        return self.graphs[size].replay()

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        q = self.query_len
        for size in reversed(self.sizes):
            meta = dataclasses.replace(fill_dummy_batch(self.buffers, np.full(size, q, dtype=np.int64)), max_seq_len=None)
            self._decode_forward(size, meta)  # eager warm-up: compiles kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._decode_forward(size, meta)
            self.graphs[size] = CapturedGraph(size, graph, logits)
            self.captured.add(size)
        torch.cuda.synchronize()
        what = "decode" if q == 1 else f"verify ({q} tokens per request)"
        logger.info("captured %d CUDA graphs for %s batches up to %d", len(self.graphs), what, max(self.sizes))

    def _decode_forward(self, size: int, meta) -> torch.Tensor:
        b, t = self.buffers, size * self.query_len
        hidden = self.forward(meta, b.input_ids[:t], b.positions[:t])
        return self.model.compute_logits(hidden)
