"""How an MoE layer's tokens reach the ranks that hold their experts, and how the results come back.

Without expert parallelism, or with it over tensor-parallel ranks only, every rank has the same
tokens: each runs its own experts (its slice of every expert, or its whole experts) on all of them
and an all-reduce over the tensor-parallel group sums the parts, as a row-parallel layer's is.

With data parallelism and expert parallelism (`data_parallel_size` with `enable_expert_parallel`)
every DP rank has tokens of its own. The layer pads them to the step's agreed count (every rank runs
the same padded shape: engine/dp_lockstep.py, carried in the forward context as `dp_tokens`), gathers
every rank's tokens and router logits (all-gather), runs its experts on all of them, and sums each
rank's rows back to it (reduce-scatter; an all-reduce and a slice under gloo, which has no
reduce-scatter). Outside an agreed step (warm-up) the ranks first agree on the count with one small
all-reduce.

Micro-batching (`enable_microbatching`) runs a layer's tokens as two halves: the second half's
gather is in flight while the first half's experts run, and the first half's combine while the
second's run (asynchronous collectives). The numbers are the same as in one batch; only the order
of the work changes.
"""

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tokenmill.distributed import ParallelState, tp_all_reduce
from tokenmill.layers.forward_context import current_forward_context

Experts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [T, H], router_logits [T, E]) -> [T, H]


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """The global experts [start, end) that rank ep_rank holds: contiguous, the first
    num_experts % ep_size ranks one more."""
    base, extra = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return start, start + base + (1 if ep_rank < extra else 0)


def _halves(n: int) -> list[tuple[int, int]]:
    half = (n + 1) // 2
    return [(0, half), (half, n)]


class MoEDispatch:
    """One MoE layer's exchange, for the parallel state it was built with (see the module docstring)."""

    def __init__(self, state: ParallelState):
        self.state = state
        self.microbatching = state.microbatching
        self.fixed_order_reduce = False  # batch_invariant: the ranks' expert outputs added in rank order
        if state.dp_size > 1 and state.tp_size > 1:
            raise ValueError("data parallelism with expert parallelism takes tensor_parallel_size 1")

    def __call__(self, x: torch.Tensor, router_logits: torch.Tensor, experts: Experts) -> torch.Tensor:
        if self.state.dp_size > 1:
            return self._gathered(x, router_logits, experts)
        if self.state.tp_size == 1:
            return experts(x, router_logits)
        if not self.microbatching or x.shape[0] < 2 or self.fixed_order_reduce:
            return tp_all_reduce(experts(x, router_logits), self.state, self.fixed_order_reduce)
        parts, works = [], []
        for lo, hi in _halves(x.shape[0]):  # the first half's all-reduce runs under the second's experts
            y = experts(x[lo:hi], router_logits[lo:hi])
            works.append(dist.all_reduce(y, group=self.state.group, async_op=True))
            parts.append(y)
        for work in works:
            work.wait()
        return torch.cat(parts)

    # ---- data parallel: gather every rank's tokens, run this rank's experts, sum back ----
    def _padded_tokens(self, num_tokens: int, device: torch.device) -> int:
        ctx = current_forward_context()
        if ctx is not None and ctx.dp_tokens is not None:
            if ctx.dp_tokens < num_tokens:
                raise RuntimeError(f"the DP ranks agreed on {ctx.dp_tokens} tokens, this rank runs {num_tokens}")
            return ctx.dp_tokens
        count = torch.tensor([num_tokens], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.state.dp_group)
        return int(count.item())

    def _gather(self, t: torch.Tensor):
        """(every rank's t stacked [dp * n, ...] once waited, the work) all-gather over the DP group."""
        group, size = self.state.dp_group, self.state.dp_size
        if dist.get_backend(group) == "nccl":
            out = t.new_empty((size * t.shape[0],) + tuple(t.shape[1:]))
            return out, dist.all_gather_into_tensor(out, t.contiguous(), group=group, async_op=True)
        parts = [torch.empty_like(t) for _ in range(size)]
        return parts, dist.all_gather(parts, t.contiguous(), group=group, async_op=True)

    def _combine(self, y: torch.Tensor):
        """(this rank's rows of the sum over ranks once waited, the work) from y [dp * n, H]."""
        group, size, rank = self.state.dp_group, self.state.dp_size, self.state.dp_rank
        n = y.shape[0] // size
        if dist.get_backend(group) == "nccl":
            out = y.new_empty((n,) + tuple(y.shape[1:]))
            return out, dist.reduce_scatter_tensor(out, y, group=group, async_op=True)
        work = dist.all_reduce(y, group=group, async_op=True)  # gloo: no reduce-scatter
        return y[rank * n:(rank + 1) * n], work

    @staticmethod
    def _stacked(gathered) -> torch.Tensor:
        return torch.cat(gathered) if isinstance(gathered, list) else gathered

    def _gathered(self, x: torch.Tensor, router_logits: torch.Tensor, experts: Experts) -> torch.Tensor:
        num_tokens = x.shape[0]
        padded = self._padded_tokens(num_tokens, x.device)
        if padded == 0:
            return x
        if padded > num_tokens:  # padding rows route somewhere; their results are dropped
            x = F.pad(x, (0, 0, 0, padded - num_tokens))
            router_logits = F.pad(router_logits, (0, 0, 0, padded - num_tokens))
        spans = _halves(padded) if self.microbatching and padded >= 2 else [(0, padded)]
        pending = [(self._gather(x[lo:hi]), self._gather(router_logits[lo:hi])) for lo, hi in spans]
        combines = []
        for (xs, x_work), (ls, l_work) in pending:  # the next span's gather is in flight meanwhile
            x_work.wait()
            l_work.wait()
            combines.append(self._combine(experts(self._stacked(xs), self._stacked(ls))))
        outs = []
        for out, work in combines:
            work.wait()
            outs.append(out)
        y = torch.cat(outs) if len(outs) > 1 else outs[0]
        return y[:num_tokens]
