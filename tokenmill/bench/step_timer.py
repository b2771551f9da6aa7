"""Host-side timing of every engine step, for the per-kind roofline fractions and the
throughput-against-batch-size plot.

The engine's step() schedules and launches at most one step and then processes the results that
are due (with async scheduling, the previous step's). We wrap the bound method on the instance
(no engine change): after each call we note which launched steps had their results processed
(from the engine's in-flight queue) and the time. Step i's interval runs from the completion of
step i-1 (or the start) to its own completion, so the intervals partition the run's wall time:
a GPU-bound step's interval is its device time, a host-bound one's is the host time. This is an
approximation (labelled as such in the report); the run's own elapsed time is measured around
generate() and does not depend on it. On the CPU a step computes inside its launch, so with async
scheduling each interval holds the next step's compute (shifted by one step); on CUDA launches
are asynchronous and the intervals line up with the steps.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Optional


class StepTimer:
    def __init__(self, engine):
        self.engine = engine
        self.start_time: Optional[float] = None
        self.completions: list[Optional[float]] = []
        self._pending: deque[int] = deque()
        self._installed = False

    def install(self) -> "StepTimer":
        if self.engine.step_log is None:
            self.engine.step_log = []
        self._base = len(self.engine.step_log)
        original = self.engine.step  # the bound method of the class

        def timed_step(*args, **kwargs):
            log = self.engine.step_log
            inflight = getattr(self.engine, "_inflight", None)
            n_log, n_inflight = len(log), (len(inflight) if inflight is not None else 0)
            out = original(*args, **kwargs)
            now = time.perf_counter()
            launched = len(log) - n_log
            for _ in range(launched):
                self.completions.append(None)
                self._pending.append(len(self.completions) - 1)
            if inflight is not None:
                processed = n_inflight + launched - len(inflight)
            else:  # unknown engine internals: attribute the call to what it launched
                processed = len(self._pending)
            for _ in range(max(0, min(processed, len(self._pending)))):
                self.completions[self._pending.popleft()] = now
            return out

        self.engine.step = timed_step
        self._installed = True
        self.start_time = time.perf_counter()
        return self

    def uninstall(self) -> None:
        if self._installed:
            del self.engine.step  # back to the class's method
            self._installed = False
        now = time.perf_counter()
        while self._pending:  # steps never processed (should not happen): close them now
            self.completions[self._pending.popleft()] = now

    def step_seconds(self) -> list[float]:
        """One interval per launched step (in step_log order). Steps whose results were processed in
        the same call (the final drain) share that call's interval equally."""
        times = [self.start_time if t is None else t for t in self.completions]
        out: list[float] = []
        prev, i = self.start_time, 0
        while i < len(times):
            j = i
            while j + 1 < len(times) and times[j + 1] == times[i]:
                j += 1
            span = max(0.0, times[i] - prev) / (j - i + 1)
            out.extend([span] * (j - i + 1))
            prev, i = times[i], j + 1
        return out


class StepKinds:
    """The kind of every step launched while installed (decode, prefill or mixed, as the scheduler
    decided it), in step_log order. A StepShape cannot tell a speculative verify step (a request's
    last token plus its drafts) from a prefill chunk of as many tokens; the scheduler's own output
    can. We wrap the scheduler's bound `schedule` method on the instance (no engine change) and note
    the kind of each output that has a batch (the engine launches, and logs, exactly those)."""

    def __init__(self, engine):
        self.scheduler = engine.scheduler
        self.kinds: list[str] = []
        self._installed = False

    def install(self) -> "StepKinds":
        original = self.scheduler.schedule

        def schedule(*args, **kwargs):
            out = original(*args, **kwargs)
            if out.batch:
                self.kinds.append(out.kind)
            return out

        self.scheduler.schedule = schedule
        self._installed = True
        return self

    def uninstall(self) -> list[str]:
        if self._installed:
            del self.scheduler.schedule  # back to the class's method
            self._installed = False
        return self.kinds
