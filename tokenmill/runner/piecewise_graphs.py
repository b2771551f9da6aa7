"""Piecewise CUDA graphs for the steps full graphs do not cover: prefill and mixed steps.

Launched eagerly, such a step costs the CPU about 24 ms on the Llama-3.1-8B preset (some 400
kernel launches through Python) whatever its size up to about a thousand tokens, while the device
needs half that for a few hundred: the decodes that share the step wait for the CPU.

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


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Powers of two from 16 to 256 (steps that small cost about the same whatever their size),
    then steps of 128 to 1024 and of 256 beyond, and max_tokens itself."""
    sizes = [16, 32, 64, 128, 256]
    sizes += list(range(384, 1025, 128)) + list(range(1280, max_tokens + 1, 256))
    sizes = [s for s in sizes if s < max_tokens] + [max_tokens]
    return sorted(set(sizes))


@dataclass
class PiecewiseBuffers:
    """q and the attention output between the pieces, shared by every size (replays never overlap)."""

    q: torch.Tensor  # [max tokens, heads, head_dim]
    out: torch.Tensor


@dataclass
class PiecewiseGraph:
    """One token count's forward pass as num_layers + 1 graphs, attention eager between them."""

    tokens: int
    buffers: PiecewiseBuffers
    kv_caches: list
    graphs: list = field(default_factory=list)
    attentions: list = field(default_factory=list)  # the attention layer between graph i and i + 1
    hidden: Optional[torch.Tensor] = None  # the last piece's output (final norm), rewritten by every replay

    def run(self, meta: AttentionMetadata) -> torch.Tensor:
        """The forward pass of a step padded to this size, whose inputs are in the runner's buffers;
        returns the final hidden states [tokens, hidden] (a buffer the next replay rewrites)."""
        q, out = self.buffers.q[: self.tokens], self.buffers.out[: self.tokens]
        for i, graph in enumerate(self.graphs):
            graph.replay()
            if i < len(self.attentions):
                self.attentions[i].attend(q, meta, self.kv_caches, out=out)
        return self.hidden


class _Splitter:
    """The forward context's splitter while one size is captured."""

    def __init__(self, piece: PiecewiseGraph, pool):
        self.piece, self.pool = piece, pool
        self._graph = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        self._graph.capture_end()
        self.piece.graphs.append(self._graph)
        self._graph = None

    def q_buffer(self, tokens: int) -> torch.Tensor:
        return self.piece.buffers.q[:tokens]

    def split(self, attention: torch.nn.Module) -> torch.Tensor:
        self.end()
        self.piece.attentions.append(attention)
        self.begin()
        return self.piece.buffers.out[: self.piece.tokens]


@torch.inference_mode()
def capture_piecewise(forward: Callable, input_buffers, shared: PiecewiseBuffers, kv_caches, size: int, pool,
                      stream: "torch.cuda.Stream") -> PiecewiseGraph:
    """Capture `forward(meta, input_ids, positions, splitter=...)` (the model in the runner's forward
    context) at `size` tokens; the caller runs an eager pass of that size first (compiles, allocator)."""
    b = input_buffers
    # The capture launches nothing: only the buffers' addresses matter, not their contents.
    meta = AttentionMetadata(b.query_start_loc[:2], b.seq_lens[:1], b.block_tables[:1], b.slot_mapping[:size],
                             max_query_len=size)
    piece = PiecewiseGraph(size, shared, kv_caches)
    splitter = _Splitter(piece, pool)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        splitter.begin()
        piece.hidden = forward(meta, b.input_ids[:size], b.positions[:size], splitter=splitter)
        splitter.end()
    torch.cuda.current_stream().wait_stream(stream)
    return piece
