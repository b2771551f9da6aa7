"""Keeping Python's full garbage collections off a long-running process's hot path.

A full (generation-2) collection scans every tracked object and stops every thread meanwhile; in a
process holding a model and thousands of requests' state it takes tens of milliseconds. GCPolicy:

- `start()`: collect once, then freeze what exists (the model, the tokenizer, modules, warm-up's
  leftovers), so no later collection scans it, and turn automatic full collections off (the
  third threshold set out of reach). Young collections still run: most garbage is freed by
  reference counting, and short-lived cycles die young.
- `on_idle()`: at a moment with no work, a full collection if one is due (the young collections
  moved objects to the old generation since the last one, and `min_interval_s` has passed), then
  freeze again, so survivors leave the scanned set. (The price: a reference cycle frozen while alive
  and dropped later is never freed. Idle moments hold little beyond the long-lived state, so little
  is at stake; memory that grows across idle periods would point here.)
- a long busy stretch still gets a full collection once every `max_interval_s`, so memory held by
  old cycles stays bounded.

Every collection's pause is timed (`take_pauses()`: (generation, seconds) since the last call).
`stop()` restores the thresholds and unfreezes (frozen objects are never freed otherwise).
"""

import gc
import time
from typing import Optional

OUT_OF_REACH = 1 << 30


class GCPolicy:
    def __init__(self, min_interval_s: float = 1.0, max_interval_s: float = 600.0):
        self.min_interval_s = min_interval_s
        self.max_interval_s = max_interval_s
        self._pauses: list[tuple[int, float]] = []
        self._started: Optional[float] = None
        self._thresholds: Optional[tuple[int, int, int]] = None
        self._last_full = time.monotonic()
        self.num_full = 0

    def start(self) -> None:
        gc.collect()
        gc.freeze()
        self._thresholds = gc.get_threshold()
        gen0, gen1, _ = self._thresholds
        gc.set_threshold(gen0, gen1, OUT_OF_REACH)
        gc.callbacks.append(self._callback)
        self._last_full = time.monotonic()

    def stop(self) -> None:
        if self._thresholds is None:
            return
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        gc.set_threshold(*self._thresholds)
        gc.unfreeze()
        self._thresholds = None

    def on_idle(self) -> None:
        """Call when there is no work: runs a due full collection now rather than during a step."""
        if self._thresholds is None:
            return  # not started: the collector's own schedule applies
        now = time.monotonic()
        if now - self._last_full >= self.min_interval_s and gc.get_count()[2] > 0:
            self._full(now)

    def on_busy(self) -> None:
        """Call now and then while busy: a full collection once every max_interval_s at most."""
        if self._thresholds is None:
            return
        now = time.monotonic()
        if now - self._last_full >= self.max_interval_s:
            self._full(now)

    def _full(self, now: float) -> None:
        gc.collect()
        gc.freeze()
        self._last_full = now
        self.num_full += 1

    def take_pauses(self) -> list[tuple[int, float]]:
        pauses, self._pauses = self._pauses, []
        return pauses

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            if len(self._pauses) < 10_000:  # taken with every step message; bounded while idle
                self._pauses.append((int(info.get("generation", -1)), time.perf_counter() - self._started))
            self._started = None
