"""Piecewise CUDA graphs for the steps decode graphs do not cover: prefill and mixed steps.

Launched eagerly, such a step costs the CPU about 24 ms on the Llama-3.1-8B preset (some 400
kernel launches through Python; H200 host, benchmarks/step_overhead.py) whatever its size up to
about a thousand tokens, while the device needs half that for a few hundred: the decodes that
share the step wait for the CPU, which makes serving's inter-token latency tail.

Attention cannot be one graph for all such steps: its grid and tiles follow the step's query
lengths. Everything else only depends on the token count. So the step's token count is padded to
one of a few sizes, and per size the forward pass is captured as num_layers + 1 graphs, split at
each attention (the capture ends the current graph where an attention layer would attend, and
starts the next). A step replays piece 0, attends eagerly with its own metadata, replays piece 1,
and so on: num_layers attention launches and num_layers + 1 replays instead of ~400 launches.

q and the attention output live in two buffers shared by every layer and size: a piece's graph
writes q (the qkv_prep kernel) into one and reads the attention output (o_proj) from the other.
Padding tokens write no K/V (slot -1) and belong to no request, so attention skips them; their
rows carry garbage through row-wise layers and are never read out.
"""

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from tokenmill.layers.forward_context import AttentionMetadata
from tokenmill.logger import init_logger
from tokenmill.models.interface import AttentionSpec
from tokenmill.runner.cuda_graphs import PaddedSizes

logger = init_logger(__name__)


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Powers of two from 16 to 256 (steps that small cost about the same whatever their size),
    then steps of 128 to 1024 and of 256 beyond, and max_tokens itself."""
    sizes = [16, 32, 64, 128, 256]
    sizes += list(range(384, 1025, 128)) + list(range(1280, max_tokens + 1, 256))
    sizes = [s for s in sizes if s < max_tokens] + [max_tokens]
    return sorted(set(sizes))


@dataclass
class _Pieces:
    tokens: int
    graphs: list = field(default_factory=list)  # num_layers + 1 CUDA graphs
    attentions: list = field(default_factory=list)  # the attention layer between graph i and i + 1
    hidden: Optional[torch.Tensor] = None  # the last piece's output (final norm), rewritten by every replay


class _Splitter:
    """The forward context's splitter while one size is captured."""

    def __init__(self, manager: "PiecewiseGraphManager", pieces: _Pieces):
        self.manager, self.pieces = manager, pieces
        self._graph = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.manager.pool)

    def end(self) -> None:
        self._graph.capture_end()
        self.pieces.graphs.append(self._graph)
        self._graph = None

    def q_buffer(self, tokens: int) -> torch.Tensor:
        return self.manager.q_buf[:tokens]

    def split(self, attention: torch.nn.Module) -> torch.Tensor:
        self.end()
        self.pieces.attentions.append(attention)
        self.begin()
        return self.manager.out_buf[: self.pieces.tokens]


class PiecewiseGraphManager(PaddedSizes):
    """`forward(meta, input_ids, positions, splitter=...)` runs the model in the runner's forward
    context; `spec` gives the shapes of the shared q / attention-output buffers."""

    def __init__(self, spec: AttentionSpec, buffers, kv_caches, forward: Callable, sizes: list[int]):
        super().__init__(sizes)
        self.buffers = buffers
        self.kv_caches = kv_caches
        self.forward = forward
        self.pieces: dict[int, _Pieces] = {}
        shape = (max(self.sizes), spec.num_heads, spec.head_dim)
        device = buffers.input_ids.device
        self.q_buf = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.out_buf = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.pool = None

    @torch.inference_mode()
    def capture(self, eager_run: Callable[[int], object]) -> None:
        """eager_run(tokens): an eager forward pass of that many (dummy) tokens through the same
        buffers, run before each capture so kernels compile and the allocator settles outside it."""
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            eager_run(size)
            torch.cuda.synchronize()
            # The capture launches nothing: only the buffers' addresses matter, not their contents.
            b = self.buffers
            meta = AttentionMetadata(b.query_start_loc[:2], b.seq_lens[:1], b.block_tables[:1], b.slot_mapping[:size],
                                     max_query_len=size)
            pieces = _Pieces(size)
            splitter = _Splitter(self, pieces)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                splitter.begin()
                pieces.hidden = self.forward(meta, b.input_ids[:size], b.positions[:size], splitter=splitter)
                splitter.end()
            torch.cuda.current_stream().wait_stream(stream)
            self.pieces[size] = pieces
            self.captured.add(size)
        torch.cuda.synchronize()
        logger.info("captured piecewise CUDA graphs for steps of up to %d tokens (%d sizes, %d graphs each)",
                    max(self.sizes), len(self.sizes), len(self.pieces[self.sizes[0]].graphs))

    def run(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        """The forward pass of a step padded to `size` tokens, whose inputs are in the buffers;
        returns the final hidden states [size, hidden] (a buffer the next replay rewrites)."""
        pieces = self.pieces[size]
        q, out = self.q_buf[:size], self.out_buf[:size]
        for i, graph in enumerate(pieces.graphs):
            graph.replay()
            if i < len(pieces.attentions):
                pieces.attentions[i].attend(q, meta, self.kv_caches, out=out)
        return pieces.hidden
