"""Data-parallel lockstep: DP ranks that must step together agree on each step's shape.

Independent replicas (serve/dp_client.py) need no coordination: each steps when it has work. Models
whose layers need every rank in every step do: with mixture-of-experts under expert parallelism each
layer's tokens are exchanged between all ranks (all-to-all), so every rank must run the same number
of forward passes, of the same padded size, in the same CUDA-graph mode, or the collectives hang.

`DPLockstep(group).agree(num_tokens, graph_ok)` is that agreement: ONE all-reduce (MAX) of a small
int64 tensor [num_tokens, 1 - graph_ok, -num_tokens] over the DP process group gives every rank the
same StepAgreement: the most tokens any rank schedules (padded up to a graph size if a pad function
is given and graphs are used), whether every rank can replay graphs (the MIN of the flags, as 1 - the
MAX of 1 - flag) and the fewest tokens any rank has (-MAX of -tokens: 0 means some rank runs a dummy
step). `run_step` carries a step out under the agreement: a rank with work runs its step, a rank
without runs the runner's `dummy_run(padded_tokens)` (ModelRunner.dummy_run: a forward pass of that
many tokens writing no KV cache), and when no rank has work nobody runs anything.

Every rank must call `agree` once per step, in the same order, including ranks with no work (an
idle rank cannot block on its request queue while another rank has work). When the agreement says
no rank has work, all of them may go idle together; waking them again when one gets a request (a
"start" broadcast over the group) is part of the wiring still to come.

NOT WIRED INTO THE ENGINE'S STEP LOOP YET: no mixture-of-experts model exists in tokenmill, and
independent replicas do not need it. Tested over gloo on the CPU (tests/engine/test_dp_lockstep.py).
"""

from dataclasses import dataclass
from typing import Callable, Generic, Optional, Protocol, TypeVar

import torch
import torch.distributed as dist

from tokenmill.logger import init_logger

logger = init_logger(__name__)

T = TypeVar("T")


class DummyRunner(Protocol):
    """What a rank without work needs: ModelRunner.dummy_run's shape."""

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
        self._buffer = torch.zeros(3, dtype=torch.int64, device=device)  # reused every step
        self.steps = 0  # agreements made
        self.dummy_steps = 0  # steps this rank ran as a dummy

    def agree(self, num_tokens: int, graph_ok: bool) -> StepAgreement:
        """This rank schedules num_tokens (0: none) and can (graph_ok) or cannot replay graphs; returns
        what every rank of the group runs. A collective: every rank calls it once per step."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        buf = self._buffer
        buf.copy_(torch.tensor([num_tokens, 0 if graph_ok else 1, -num_tokens], dtype=torch.int64))
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        max_tokens, any_not_ok, neg_min = buf.tolist()
        use_graphs = any_not_ok == 0
        padded = max_tokens
        if max_tokens > 0 and use_graphs and self.pad is not None:
            padded = max(max_tokens, int(self.pad(max_tokens)))  # deterministic: the same on every rank
        self.steps += 1
        return StepAgreement(padded, use_graphs and max_tokens > 0, max_tokens, -neg_min)

    def run_step(self, runner: DummyRunner, num_tokens: int, graph_ok: bool,
                 step: Callable[[StepAgreement], T]) -> LockstepResult[T]:
        """Agree, then run: `step(agreement)` on a rank with work (it must run the agreed shape: pad
        its batch to agreement.padded_tokens and replay graphs only if agreement.use_graphs), the
        runner's dummy step of agreement.padded_tokens on a rank without, nothing when no rank has
        work."""
        agreement = self.agree(num_tokens, graph_ok)
        if agreement.idle:
            return LockstepResult(agreement, None, False)
        if num_tokens == 0:
            runner.dummy_run(agreement.padded_tokens, 1, piecewise=agreement.use_graphs)
            self.dummy_steps += 1
            logger.debug("DP rank %d: dummy step of %d tokens", self.rank, agreement.padded_tokens)
            return LockstepResult(agreement, None, True)
        return LockstepResult(agreement, step(agreement), False)
