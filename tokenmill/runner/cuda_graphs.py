"""Full CUDA graphs for decode steps.

A decode step (one new token per request) of B requests replays the graph captured for the
smallest padded batch size >= B; the extra entries are padding (no K/V written, no attention).
Each graph covers the model's forward pass and the LM head over the persistent input buffers,
which the input-preparation kernels fill before the replay. All graphs share one memory pool and
are captured largest first, so the smaller ones reuse the larger ones' memory.

Capture is its own code path (not a side effect of a dummy run): it fills the buffers with a
harmless decode batch, runs it once eagerly (so Triton compiles and the allocator settles), then
records it.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.layers.forward_context import AttentionMetadata, forward_context
from tokenmill.logger import init_logger

logger = init_logger(__name__)


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


class CudaGraphManager:
    def __init__(self, model: torch.nn.Module, buffers, kv_caches, sizes: list[int]):
        self.model = model
        self.buffers = buffers
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.graphs: dict[int, CapturedGraph] = {}

    def dispatch(self, num_reqs: int) -> Optional[CapturedGraph]:
        """The smallest captured graph that fits a decode batch of num_reqs, or None (run eagerly)."""
        for size in self.sizes:
            if size >= num_reqs:
                return self.graphs.get(size)
        return None

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._fill_dummy_decode(size)
            self._decode_forward(size)  # eager warm-up: compiles kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._decode_forward(size)
            self.graphs[size] = CapturedGraph(size, graph, logits)
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for decode batches up to %d", len(self.graphs), max(self.sizes))

    def _fill_dummy_decode(self, size: int) -> None:
        b = self.buffers
        b.input_ids[:size].zero_()
        b.positions[:size].zero_()
        b.slot_mapping[:size].fill_(-1)  # write no K/V
        b.query_start_loc[: size + 1].copy_(torch.arange(size + 1, dtype=torch.int32))
        b.seq_lens[:size].fill_(1)
        b.block_tables[:size].zero_()

    def _decode_forward(self, size: int) -> torch.Tensor:
        b = self.buffers
        meta = AttentionMetadata(
            query_start_loc=b.query_start_loc[: size + 1], seq_lens=b.seq_lens[:size],
            block_tables=b.block_tables[:size], slot_mapping=b.slot_mapping[:size],
            max_query_len=1, max_seq_len=None,
        )
        with forward_context(meta, self.kv_caches):
            hidden = self.model(b.input_ids[:size], b.positions[:size])
        return self.model.compute_logits(hidden)
