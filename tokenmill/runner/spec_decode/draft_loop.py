"""The k greedy draft steps shared by the proposers that run a model over the paged KV cache
(draft_model.py: a model of its own; layer_truncated.py: the target's first layers).

After a step's acceptance, row r knows `known[r]` tokens; the last one (position known - 1) was
emitted by this step and never fed to the draft. Draft step j (0-based) feeds one token per batch
entry at position known - 1 + j: step 0 the last emitted token, step j the argmax of step j - 1. Each
step is a batch-of-B, query-length-1 decode over the paged KV cache: it writes the fed token's K/V
at its slot and attends to the earlier ones. The k argmaxes are the drafts (greedy drafts are
deterministic, so the rejection sampler with no draft probabilities stays exact).

Writes are bounded: an entry writes K/V only below its slot limit (the slots its row holds) and only
when its drafts will be verified (it sampled this step and speculates); a position past the context
length is clamped for the rotary table and writes nothing. K/V a draft writes at positions the
target later verifies are overwritten by the target (or, for a draft model, by its replay of that
step) before anything reads them.

Everything lives in fixed buffers sized for max_num_reqs entries and every input is built on the
device from `known`, the token table and the block table, so on CUDA the k steps of one padded batch
size are one CUDA graph (captured largest first in one memory pool, as the decode graphs are);
padding entries have no query (query_start_loc stays flat past the batch) and write nothing. Eager
runs (the CPU, enforce_eager, batches larger than the largest graph) execute the same code over the
same buffers with the same attention metadata, so eager and replayed drafts agree.
"""

from typing import Callable, Optional

import torch

from tokenmill.layers.forward_context import AttentionMetadata
from tokenmill.logger import init_logger
from tokenmill.runner.cuda_graphs import PaddedSizes, default_capture_sizes
from tokenmill.runner.spec_decode.proposer import DraftTokens

logger = init_logger(__name__)

# (metadata, input ids [P], positions [P]) -> logits [P, vocab], in the draft's forward context
DraftLogits = Callable[[AttentionMetadata, torch.Tensor, torch.Tensor], torch.Tensor]


class GreedyDraftLoop(PaddedSizes):
    def __init__(self, logits_fn: DraftLogits, k: int, max_num_reqs: int, max_model_len: int, block_size: int,
                 device: torch.device):
        super().__init__([])
        i32, i64 = torch.int32, torch.int64
        r = max_num_reqs
        self.logits_fn = logits_fn
        self.k = k
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        max_blocks = -(-max_model_len // block_size)
        self._known = torch.ones(r, dtype=i64, device=device)  # per entry: the row's known tokens
        self._limit = torch.zeros(r, dtype=i64, device=device)  # per entry: positions below it may be written
        self._ids = torch.zeros(r, dtype=i64, device=device)  # the token each step feeds
        self._pos = torch.zeros(r, dtype=i64, device=device)
        self._slot = torch.full((r,), -1, dtype=i64, device=device)
        self._seq = torch.ones(r, dtype=i32, device=device)
        self._qsl = torch.arange(r + 1, dtype=i32, device=device)
        self._arange = torch.arange(r + 1, dtype=i32, device=device)
        self._bt = torch.zeros((r, max_blocks), dtype=i32, device=device)  # the entries' gathered block tables
        self._drafts = torch.full((r, k), -1, dtype=i32, device=device)
        self._num_drafts = torch.full((r,), k, dtype=i32, device=device)
        self.graphs: dict[int, "torch.cuda.CUDAGraph"] = {}

    # ---- one proposal ----------------------------------------------------------------------
    def run(self, idx_mapping: torch.Tensor, num_reqs: int, token_table: torch.Tensor, known: torch.Tensor,
            block_table: torch.Tensor, slot_limit: torch.Tensor, draft_mask: Optional[torch.Tensor]) -> DraftTokens:
        """k drafts for each of the batch's num_reqs entries (views of buffers the next run rewrites)."""
        size = self.dispatch(num_reqs)
        padded = size if size is not None else num_reqs
        self._load(idx_mapping, num_reqs, padded, token_table, known, block_table, slot_limit, draft_mask)
        if size is not None:
            self.graphs[size].replay()
        else:
            self._steps(padded)
        return DraftTokens(self._drafts[:num_reqs], self._num_drafts[:num_reqs])

    def _load(self, idx_mapping, b: int, padded: int, token_table, known, block_table, slot_limit,
              draft_mask) -> None:
        """The batch's inputs into the fixed buffers (device ops only; outside any graph)."""
        rows = idx_mapping[:b].long()
        kn = known[rows].long()
        self._known[:b].copy_(kn)
        self._ids[:b].copy_(token_table[rows, kn - 1])
        limit = slot_limit[:b].long()
        if draft_mask is not None:
            limit = torch.where(draft_mask[:b].bool(), limit, torch.zeros_like(limit))
        self._limit[:b].copy_(limit)
        torch.index_select(block_table, 0, rows, out=self._bt[:b])
        if padded > b:  # padding entries: no query, no write
            self._known[b:padded].fill_(1)
            self._ids[b:padded].zero_()
            self._limit[b:padded].zero_()
        torch.clamp(self._arange[: padded + 1], max=b, out=self._qsl[: padded + 1])

    def _steps(self, p: int) -> None:
        """The k draft steps over the first p entries of the buffers (what a graph records)."""
        bs, last = self.block_size, self.max_model_len - 1
        known, limit, pos, ids = self._known[:p], self._limit[:p], self._pos[:p], self._ids[:p]
        meta = AttentionMetadata(self._qsl[: p + 1], self._seq[:p], self._bt[:p], self._slot[:p],
                                 max_query_len=1, max_seq_len=None)
        for j in range(self.k):
            wanted = known + (j - 1)  # the fed token's position
            torch.clamp(wanted, max=last, out=pos)
            block = self._bt[:p].gather(1, (pos // bs)[:, None])[:, 0].long()
            self._slot[:p].copy_(torch.where(wanted < limit, block * bs + pos % bs, torch.full_like(pos, -1)))
            self._seq[:p].copy_(pos + 1)
            nxt = self.logits_fn(meta, ids, pos).argmax(dim=-1)
            self._drafts[:p, j].copy_(nxt)
            ids.copy_(nxt)

    # ---- CUDA graphs -----------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> None:
        """One graph of the k steps per padded batch size, largest first, in one memory pool; the
        capture batch attends to block 0 and writes nothing."""
        self.sizes = sorted(sizes)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._known[:size].fill_(1)
            self._ids[:size].zero_()
            self._limit[:size].zero_()
            self._bt[:size].zero_()
            self._qsl[: size + 1].copy_(self._arange[: size + 1])
            self._steps(size)  # eager warm-up: compiles kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._steps(size)
            self.graphs[size] = graph
            self.captured.add(size)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs of %d draft steps for batches up to %d", len(self.graphs), self.k,
                    max(self.sizes) if self.sizes else 0)



def draft_capture_sizes(max_batch: int) -> list[int]:
    """The decode graphs' padded batch sizes (1, 2, 4, 8, then multiples of 8 up to max_batch)."""
    return default_capture_sizes(max_batch)
