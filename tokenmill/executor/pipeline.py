"""Pipeline parallelism: the decoder layers split over stages, the hidden states and residual stream
sent from each stage to the next with point-to-point ops, and several steps in flight so that the
stages work at once.

Rank layout (executor/tensor_parallel.py): world = tp x pp ranks; rank r is tensor-parallel rank
r % tp of stage pp - 1 - r // tp, so rank 0 (the engine's process) is in the LAST stage: the logits,
the sampled tokens, their logprobs and prompt logprobs the engine reads are real there. The other
stages run the same runner steps (so their request state, block tables and positions stay the
same), and take the last stage's tokens (a broadcast from rank 0) once it has sampled, since the
first stage feeds them to a later step. Each tensor-parallel rank of a stage sends its (replicated)
hidden states to the same tensor-parallel rank of the next.

Steps in flight. The engine keeps pp steps in flight (engine/llm_engine.py), and the scheduler
never puts a request whose token is still on its way into another step, nor more than a 1/pp share
of the requests into one (engine/scheduler.py), so consecutive steps hold different requests. The
driver sends each step to the workers as soon as it is scheduled; then:

* a stage before the last runs each step as it arrives (StageSteps: receive, its layers, send on
  without waiting for the next stage) and takes its tokens later, when the driver says the last
  stage sampled it. So while the last stage runs step N, the first already runs N + 1.
* the last stage (rank 0, and its tensor-parallel peers) runs a step only when the engine asks for
  its tokens (LastStageSteps), one step and its sampling after the other, as a single runner does.

Sends are non-blocking (isend, on a process group of their own, so that a send waiting for its
receiver never holds up the token broadcast, which the receiver may be waiting in). Eager steps
only (no CUDA graphs).
"""

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from tokenmill.kernels.input_prep import post_update


def stage_of(rank: int, tp: int, pp: int) -> int:
    return pp - 1 - rank // tp


def rank_of(stage: int, tp_rank: int, tp: int, pp: int) -> int:
    return (pp - 1 - stage) * tp + tp_rank


@dataclass
class PipelineLink:
    """One rank's side of the pipeline (layers/forward_context.py's PipelineHook)."""

    stage: int
    pp: int
    tp_rank: int
    tp: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    world_group: object = None  # the token broadcast's (None: the default group)
    p2p_group: object = None  # the hidden states' sends
    _sends: list = field(default_factory=list)  # (work, buffer) of sends not yet known complete

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp - 1

    def recv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = rank_of(self.stage - 1, self.tp_rank, self.tp, self.pp)
        both = torch.empty((2, num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        dist.recv(both, src=src, group=self.p2p_group)
        return both[0], both[1]

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Send without waiting for the next stage to take it (it may be waiting for the driver,
        which may be waiting for this rank); each buffer lives until its send is done. At most
        pp steps are in flight, so few sends are ever outstanding."""
        dst = rank_of(self.stage + 1, self.tp_rank, self.tp, self.pp)
        self._sends = [(work, buf) for work, buf in self._sends if not work.is_completed()]
        buf = torch.stack([hidden, residual]).contiguous()
        self._sends.append((dist.isend(buf, dst=dst, group=self.p2p_group), buf))

    def share_sampled(self, sampled: torch.Tensor) -> None:
        """Every rank's `sampled` becomes rank 0's (the last stage's), in place."""
        dist.broadcast(sampled, src=0, group=self.world_group)


@dataclass
class _StageStep:
    rows: torch.Tensor  # the step's idx mapping (runner rows), [num_reqs]
    sample_mask: torch.Tensor  # [num_reqs]
    num_reqs: int


class StageSteps:
    """A stage before the last: each step runs when it arrives; its tokens (the last stage's) are
    taken in order, later, by finish()."""

    def __init__(self, runner, link: PipelineLink):
        self.runner = runner
        self.link = link
        self.pending: deque[_StageStep] = deque()

    def execute(self, out) -> None:
        runner = self.runner
        runner.execute_model(out)
        b = len(out.batch)
        buffers = runner.buffers
        self.pending.append(_StageStep(buffers.idx_mapping[:b].clone(), buffers.sample_mask[:b].clone(), b))
        runner.forget_step()

    def finish(self) -> None:
        """The oldest step's tokens from rank 0, into the request state (the next step of these
        requests reads them as its input)."""
        step = self.pending.popleft()
        sampled = torch.empty(step.num_reqs, dtype=torch.int64, device=self.link.device)
        self.link.share_sampled(sampled)
        post_update(step.rows, sampled, step.sample_mask, step.num_reqs, self.runner.states.last_sampled)


class LastStageSteps:
    """The last stage: steps (and row releases) queue up as the engine sends them and run, each with
    its sampling, when the engine asks for that step's tokens: the runner sees execute, sample,
    execute, sample, ... as without pipeline parallelism."""

    def __init__(self, runner, before_sample: Optional[Callable[[object], None]] = None):
        self.runner = runner
        # The driver's: tells the workers (with the step's grammar masks) that the oldest step runs
        # on the last stage now, before rank 0 runs it (its tensor-parallel peers then run it too).
        self.before_sample = before_sample
        self.ops: deque = deque()  # ("exec", out) and ("release", ids), in the engine's order

    def execute(self, out) -> None:
        self.ops.append(("exec", out))

    def release(self, req_ids) -> None:
        if self.ops:
            self.ops.append(("release", list(req_ids)))
        else:
            self.runner.release(req_ids)

    def sample(self, grammar_bitmask=None):
        """Run the queued operations through the oldest step, then sample it; the runner's
        AsyncOutput."""
        if self.before_sample is not None:
            self.before_sample(grammar_bitmask)
        while True:
            if not self.ops:
                raise RuntimeError("sample() of a pipeline stage with no step queued")
            kind, arg = self.ops.popleft()
            if kind == "release":
                self.runner.release(arg)
                continue
            self.runner.execute_model(arg)
            break
        sampled = self.runner.sample_tokens(grammar_bitmask)
        # Releases queued behind this step are due now: an engine gone idle sends no later step to carry them.
        while self.ops and self.ops[0][0] == "release":
            self.runner.release(self.ops.popleft()[1])
        return sampled


class DeferredOutput:
    """A pipelined step's tokens (the engine's pending output): the last stage runs the step when
    they are asked for."""

    def __init__(self, steps: LastStageSteps, grammar_bitmask=None):
        self.steps = steps
        self.grammar_bitmask = grammar_bitmask

    def get(self):
        return self.steps.sample(self.grammar_bitmask).get()
