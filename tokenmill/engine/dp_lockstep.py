"""Data-parallel lockstep: DP ranks that must step together agree on each step's shape.

Independent replicas (serve/dp_client.py) need no coordination: each steps when it has work. Models
whose layers need every rank in every step do: with mixture-of-experts under expert parallelism each
layer's tokens are exchanged between all ranks (all-to-all), so every rank must run the same number
of forward passes, of the same padded size, in the same CUDA-graph mode, or the collectives hang.

`DPLockstep(group).agree(num_tokens, graph_ok)` is that agreement: ONE all-reduce (MAX) of a small
int64 tensor [num_tokens, 1 - graph_ok, -num_tokens, busy, stop] over the DP process group gives
every rank the same StepAgreement: the most tokens any rank schedules (padded up to a graph size if
a pad function is given and graphs are used), whether every rank can replay graphs (the MIN of the
flags, as 1 - the MAX of 1 - flag), the fewest tokens any rank has (-MAX of -tokens: 0 means some
rank runs a dummy step), whether some rank still has requests (one may schedule no tokens while it
waits for a step in flight: the ranks go idle together only when none has any) and whether some
rank is shutting down (then all stop together, so none is left waiting in a collective). `run_step` carries a step out under the agreement: the runner's
`dp_tokens` is set to the agreed count (the MoE layers pad to it, layers/moe_dispatch.py), a rank
with work runs its step, a rank without runs the runner's `dummy_run(padded_tokens)` (a forward pass
of that many tokens writing no KV cache), and when no rank has work nobody runs anything.

Every rank must call `agree` once per step, in the same order, including ranks with no work: the
engine does so in every step (LLMEngine.step) and its process keeps stepping while any rank has work
(serve/core_process.py), polling for requests between agreements when all are idle.

Wired in for data parallelism with expert parallelism (`data_parallel_size` > 1 with
`enable_expert_parallel`); independent replicas (serve/dp_client.py without expert parallelism) do
not need it. Steps run eager: a rank would otherwise need to replay the graph of the agreed size,
not of its own. Tested over gloo on the CPU (tests/engine/test_dp_lockstep.py, tests/models/).
"""

from dataclasses import dataclass
from typing import Callable, Generic, Optional, Protocol, TypeVar

import torch
import torch.distributed as dist

from tokenmill.logger import init_logger

logger = init_logger(__name__)

T = TypeVar("T")


class DummyRunner(Protocol):
    """What a rank without work needs: ModelRunner.dummy_run's shape, and the step's agreed token
    count for its MoE layers."""

    dp_tokens: Optional[int]

    def dummy_run(self, num_tokens: int, num_reqs: int = 1, sample: bool = False, piecewise: bool = False,
                  lora=None) -> object:
        ...


@dataclass(frozen=True)
class StepAgreement:
    """One step's shape, the same on every DP rank."""

    padded_tokens: int  # tokens every rank runs this step (0: no rank has work; nobody steps)
    use_graphs: bool  # every rank can replay CUDA graphs for this step
    max_tokens: int  # the most tokens a rank scheduled (padded_tokens before padding)
    min_tokens: int  # the fewest (0: some rank has no work and runs a dummy step)
    busy: bool = False  # some rank has unfinished requests (all ranks keep stepping)
    stop: bool = False  # some rank is shutting down: every rank stops stepping

    @property
    def idle(self) -> bool:
        return self.padded_tokens == 0


@dataclass(frozen=True)
class LockstepResult(Generic[T]):
    agreement: StepAgreement
    output: Optional[T]  # the real step's result on a rank with work, else None
    ran_dummy: bool  # this rank had no work and ran a dummy step of agreement.padded_tokens


class DPLockstep:
    """The per-step agreement of the ranks of one DP process group (see the module docstring).

    group: the torch.distributed process group of the DP ranks (None: the default group); device:
    where the all-reduce's tensor lives (default: the CPU for gloo, the current CUDA device for
    NCCL); pad: the padded size of a step of n tokens when graphs are used (e.g. the next captured
    graph size; None: no padding)."""

    def __init__(self, group=None, device: Optional[torch.device] = None,
                 pad: Optional[Callable[[int], int]] = None):
        self.group = group
        if device is None:
            backend = dist.get_backend(group)
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = device
        self.pad = pad
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._buffer = torch.zeros(5, dtype=torch.int64, device=device)  # reused every step
        self.steps = 0  # agreements made
        self.dummy_steps = 0  # steps this rank ran as a dummy

    def agree(self, num_tokens: int, graph_ok: bool, stop: bool = False, busy: Optional[bool] = None) -> StepAgreement:
        """This rank schedules num_tokens (0: none) and can (graph_ok) or cannot replay graphs, has
        unfinished requests (busy; default: num_tokens > 0) and wants to stop; returns what every
        rank of the group runs. A collective: every rank calls it once per step."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        buf = self._buffer
        busy = num_tokens > 0 if busy is None else busy or num_tokens > 0
        buf.copy_(torch.tensor([num_tokens, 0 if graph_ok else 1, -num_tokens, int(busy), int(stop)],
                               dtype=torch.int64))
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        max_tokens, any_not_ok, neg_min, any_busy, any_stop = buf.tolist()
        use_graphs = any_not_ok == 0
        padded = max_tokens
        if max_tokens > 0 and use_graphs and self.pad is not None:
            padded = max(max_tokens, int(self.pad(max_tokens)))  # deterministic: the same on every rank
        self.steps += 1
        return StepAgreement(padded, use_graphs and max_tokens > 0, max_tokens, -neg_min, any_busy > 0, any_stop > 0)

    def run_step(self, runner: DummyRunner, num_tokens: int, graph_ok: bool,
                 step: Callable[[StepAgreement], T], stop: bool = False,
                 busy: Optional[bool] = None) -> LockstepResult[T]:
        """Agree, then run: `step(agreement)` on a rank with work (it must run the agreed shape: pad
        its batch to agreement.padded_tokens and replay graphs only if agreement.use_graphs), the
        runner's dummy step of agreement.padded_tokens on a rank without, nothing when no rank has
        work or some rank stops."""
        agreement = self.agree(num_tokens, graph_ok, stop, busy)
        if agreement.idle or agreement.stop:
            return LockstepResult(agreement, None, False)
        runner.dp_tokens = agreement.padded_tokens
        if num_tokens == 0:
            runner.dummy_run(agreement.padded_tokens, 1, piecewise=agreement.use_graphs)
            self.dummy_steps += 1
            logger.debug("DP rank %d: dummy step of %d tokens", self.rank, agreement.padded_tokens)
            return LockstepResult(agreement, None, True)
        return LockstepResult(agreement, step(agreement), False)
