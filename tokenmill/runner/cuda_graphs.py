"""The runner's CUDA graphs: one bank keyed by GraphKey, the plan of what it captures, and the one
dispatch that picks the graph of a step.

Modes (GraphKey.mode):
- FULL: the forward pass and the LM head over the persistent input buffers, for steps where every
  request computes the same number of tokens q: decode (q = 1) or verify (q = 1 + k drafts, every
  entry speculating, so token order is the verify plan's logits order). A step of B requests
  replays the graph of the smallest captured batch >= B; the extra entries are padding (no query,
  no K/V written).
- PIECEWISE: prefill and mixed steps, padded to a captured token count, attention eager between
  the pieces (piecewise_graphs.py).
- NONE: eager.
Steps with LoRA adapters replay graphs captured over the adapters' slot tables (lora=True), so no
adapter change needs a recapture; steps without adapters replay the graphs of a runner without LoRA.

The plan is resolved once at start-up (resolve_graph_plan) from the weakest attention backend's
CudaGraphSupport and the engine's options; dispatch_graph reads host-side shapes only, never the
device, so a data-parallel step agreement can wrap it. Each family (mode, query length, LoRA) is
captured largest first into one memory pool, so the smaller graphs reuse the larger ones' memory.
Capture is its own code path (not a side effect of a dummy run): each size runs once eagerly first,
so Triton compiles and the allocator settles outside the capture.
"""

import bisect
import contextlib
import dataclasses
import enum
import functools
import gc
from dataclasses import dataclass, field
from typing import Callable, Container, Optional, Union

import numpy as np
import torch

from tokenmill.layers.attention import CudaGraphSupport
from tokenmill.layers.forward_context import AttentionMetadata
from tokenmill.logger import init_logger
from tokenmill.runner.dummy_batch import fill_dummy_batch
from tokenmill.runner.piecewise_graphs import PiecewiseBuffers, PiecewiseGraph, capture_piecewise, piecewise_sizes

logger = init_logger(__name__)


class GraphMode(enum.Enum):
    NONE = "eager"
    PIECEWISE = "piecewise"
    FULL = "full"


@dataclass(frozen=True)
class GraphKey:
    mode: GraphMode
    size: int  # FULL: padded requests; PIECEWISE: padded tokens; NONE: the step's tokens
    query_len: int = 0  # FULL: tokens per request (1: decode, 1 + k: verify)
    lora: bool = False  # captured over the LoRA slot tables (steps with adapters)

    def padded(self, num_reqs: int, num_tokens: int) -> tuple[int, int]:
        """(padded requests, padded tokens) of a step of num_reqs / num_tokens run under this key."""
        if self.mode is GraphMode.FULL:
            return self.size, self.size * self.query_len
        return num_reqs, self.size


@dataclass(frozen=True)
class GraphPlan:
    """What to capture: ascending sizes per family (mode, query length, LoRA), in capture order; and
    the largest batch of a draft's decode graphs (speculative decoding; 0: none)."""

    sizes: dict = field(default_factory=dict)
    draft_max_batch: int = 0

    def keys(self) -> list[GraphKey]:
        return [GraphKey(m, s, q, lora) for (m, q, lora), sizes in self.sizes.items() for s in sizes]


def default_capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to max_batch."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes))


def weakest_graph_support(*models: Optional[torch.nn.Module]) -> CudaGraphSupport:
    """The lowest CudaGraphSupport among the attention layers of these models (None: skipped)."""
    levels = [m.cuda_graph_support for model in models if model is not None for m in model.modules()
              if hasattr(m, "cuda_graph_support")]
    return min(levels, default=CudaGraphSupport.ALWAYS)


def resolve_graph_plan(support: CudaGraphSupport, *, enabled: bool, max_num_seqs: int, cuda_graph_max_batch: int,
                       max_num_tokens: int, piecewise_max_tokens: int, verify_query_len: Optional[int] = None,
                       lora: bool = False) -> GraphPlan:
    """The graphs a runner captures at start-up. enabled: CUDA and not enforce_eager. Piecewise
    graphs keep attention outside, so every support level has them (steps of 16 tokens or more);
    decode graphs need UNIFORM_SINGLE_TOKEN_DECODE, verify graphs (verify_query_len = 1 + k)
    UNIFORM_BATCH; ALWAYS adds nothing yet (mixed steps run piecewise). With LoRA, piecewise and
    decode graphs again over the slot tables (verify steps with adapters run piecewise)."""
    if not enabled:
        return GraphPlan()
    largest = min(max_num_seqs, cuda_graph_max_batch, max_num_tokens)
    max_piecewise = min(piecewise_max_tokens, max_num_tokens)
    decode = support >= CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
    sizes: dict = {}
    for with_lora in (False, True) if lora else (False,):
        if max_piecewise >= 16:
            sizes[(GraphMode.PIECEWISE, 0, with_lora)] = tuple(piecewise_sizes(max_piecewise))
        if decode:
            sizes[(GraphMode.FULL, 1, with_lora)] = tuple(default_capture_sizes(largest))
    q = verify_query_len
    if q and support >= CudaGraphSupport.UNIFORM_BATCH and min(largest, max_num_tokens // q) >= 1:
        sizes[(GraphMode.FULL, q, False)] = tuple(default_capture_sizes(min(largest, max_num_tokens // q)))
    return GraphPlan(sizes, min(max_num_seqs, cuda_graph_max_batch) if q and decode else 0)


def uniform_query_len(q_lens: np.ndarray, all_speculative: Callable[[], bool]) -> Optional[int]:
    """The query length every entry of a step shares when a full graph could cover the step: 1, or
    q > 1 when every entry verifies drafts (all_speculative(), asked only then); else None."""
    q = int(q_lens[0])
    if not (q_lens == q).all():
        return None
    return q if q == 1 or all_speculative() else None


def dispatch_graph(plan: GraphPlan, captured: Container[GraphKey], num_reqs: int, num_tokens: int,
                   query_len: Optional[int], lora: bool) -> GraphKey:
    """The graph a step replays: the full graph of the smallest captured batch >= num_reqs when every
    request computes query_len tokens (None: not uniform), else the piecewise graphs of the smallest
    captured token count >= num_tokens, else eager (mode NONE, size num_tokens). Host ints only."""
    if query_len is not None:
        key = _smallest(plan, captured, GraphMode.FULL, query_len, lora, num_reqs)
        if key is not None:
            return key
    key = _smallest(plan, captured, GraphMode.PIECEWISE, 0, lora, num_tokens)
    return key if key is not None else GraphKey(GraphMode.NONE, num_tokens, 0, lora)


def _smallest(plan: GraphPlan, captured: Container[GraphKey], mode: GraphMode, query_len: int, lora: bool,
              n: int) -> Optional[GraphKey]:
    sizes = plan.sizes.get((mode, query_len, lora))
    if not sizes:
        return None
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        return None
    key = GraphKey(mode, sizes[i], query_len, lora)
    return key if key in captured else None


@dataclass
class FullGraph:
    graph: "torch.cuda.CUDAGraph"
    logits: torch.Tensor  # [size * query_len, vocab], rewritten by every replay

    def run(self, meta: Optional[AttentionMetadata] = None) -> torch.Tensor:
        self.graph.replay()
        return self.logits


class GraphBank:
    """Every CUDA graph the runner replays, by key, and the plan they are captured from."""

    def __init__(self, plan: GraphPlan):
        self.plan = plan
        self.graphs: dict[GraphKey, Union[FullGraph, PiecewiseGraph]] = {}

    def dispatch(self, num_reqs: int, num_tokens: int, query_len: Optional[int], lora: bool) -> GraphKey:
        return dispatch_graph(self.plan, self.graphs, num_reqs, num_tokens, query_len, lora)

    def keys(self, mode: Optional[GraphMode] = None, query_len: Optional[int] = None) -> list[GraphKey]:
        """The captured keys (of one mode / query length), ascending by size."""
        return sorted((k for k in self.graphs if (mode is None or k.mode is mode)
                       and (query_len is None or k.query_len == query_len)), key=lambda k: k.size)

    def run(self, key: GraphKey, meta: AttentionMetadata) -> torch.Tensor:
        """Replay: FULL returns the step's logits [size * query_len, vocab]; PIECEWISE the final hidden
        states [size, hidden] (meta: the step's attention metadata, for the eager attention)."""
        return self.graphs[key].run(meta)

    @torch.inference_mode()
    def capture(self, runner) -> None:
        """Capture the plan through the runner's forward pass (run_model), LM head, input buffers and
        KV caches; CUDA only, after the KV cache exists."""
        shared = None
        for (mode, q, lora), sizes in self.plan.sizes.items():
            context = runner.lora.context if lora else None
            forward = functools.partial(runner.run_model, lora=context)
            pool = torch.cuda.graph_pool_handle()
            if mode is GraphMode.FULL:
                for size in reversed(sizes):
                    self.graphs[GraphKey(mode, size, q, lora)] = _capture_full(
                        forward, runner.model.compute_logits, runner.buffers, size, q, pool)
            else:
                if shared is None:
                    spec = runner.attn_spec
                    shape = (max(sizes), spec.num_heads, spec.head_dim)
                    device = runner.buffers.input_ids.device
                    shared = PiecewiseBuffers(torch.zeros(shape, dtype=spec.dtype, device=device),
                                              torch.zeros(shape, dtype=spec.dtype, device=device))
                stream = torch.cuda.Stream()
                for size in reversed(sizes):
                    runner.dummy_run(size, 1, lora=context)
                    torch.cuda.synchronize()
                    self.graphs[GraphKey(mode, size, q, lora)] = capture_piecewise(
                        forward, runner.buffers, shared, runner.kv_caches, size, pool, stream)
            torch.cuda.synchronize()
            what = {1: "decode batches", 0: "piecewise steps"}.get(q, f"verify batches ({q} tokens per request)")
            logger.info("captured %d CUDA graphs for %s up to %d%s", len(sizes), what, max(sizes),
                        " with LoRA adapters" if lora else "")


def _capture_full(forward: Callable, compute_logits: Callable, buffers, size: int, query_len: int,
                  pool) -> FullGraph:
    meta = dataclasses.replace(fill_dummy_batch(buffers, np.full(size, query_len, dtype=np.int64)), max_seq_len=None)
    t = size * query_len

    def step() -> torch.Tensor:
        return compute_logits(forward(meta, buffers.input_ids[:t], buffers.positions[:t]))

    step()  # eager warm-up: compiles kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits = step()
    return FullGraph(graph, logits)


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


class PaddedSizes:
    """Graphs captured for a table of padded sizes; a run takes the smallest captured size that fits
    it, or runs eagerly (the draft loop's graphs, spec_decode/draft_loop.py)."""

    def __init__(self, sizes: list[int]):
        self.sizes = sorted(sizes)
        self.captured: set[int] = set()

    def dispatch(self, n: int) -> Optional[int]:
        """The smallest captured size >= n, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes) or self.sizes[i] not in self.captured:
            return None
        return self.sizes[i]
