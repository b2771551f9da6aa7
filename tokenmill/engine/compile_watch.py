"""Counts Triton JIT compiles per engine, and warns about the ones that happen after warm-up.

A Triton kernel compiles once per specialization: its constexpr values, and integer arguments
that equal 1 or are divisible by 16 (unless marked `do_not_specialize`). The engine's warm-up
compiles the common ones. A specialization that first appears under load compiles on the step
path and stalls every running request for the compile's time (0.1 to 2 s on an empty cache):
a latency spike with no other trace. After `mark_warm()`, each compile is logged as a warning
with the kernel's name and how long it took, and counted (the server exports the count).

Triton's JIT hooks are process-wide, so they are installed once and only forward each compile to
the CompileWatch that is active on the calling thread: an engine activates its own around its
warm-up and its steps (`with watch.watching(): ...`), so two engines in one process keep separate
counts and a compile outside any engine's step is nobody's. The hooks are not called in
interpreter mode (TRITON_INTERPRET=1).
"""

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Optional

from tokenmill.logger import init_logger

logger = init_logger(__name__)


@dataclass
class CompileStats:
    compiles: int = 0  # while this watch was active
    compiles_after_warm: int = 0
    seconds_after_warm: float = 0.0


class CompileWatch:
    """One engine's compile counts."""

    def __init__(self):
        self._stats = CompileStats()
        self._warm = False

    @contextmanager
    def watching(self):
        """Compiles on this thread inside the block are this watch's."""
        previous = getattr(_active, "watch", None)
        _active.watch = self
        try:
            yield self
        finally:
            _active.watch = previous

    def mark_warm(self, warm: bool = True) -> None:
        """From now on, a compile is a warm-up miss: warn and count it."""
        self._warm = warm

    def stats(self) -> CompileStats:
        return replace(self._stats)

    def record(self, name: str, signature: str, seconds: float) -> None:
        self._stats.compiles += 1
        if self._warm:
            self._stats.compiles_after_warm += 1
            self._stats.seconds_after_warm += seconds
            logger.warning("Triton compiled %s after warm-up (%.0f ms on the step path): %s",
                           name, 1e3 * seconds, signature)


_active = threading.local()  # .watch: the CompileWatch active on this thread; .t0: a compile's start


def active_watch() -> Optional[CompileWatch]:
    return getattr(_active, "watch", None)


def on_compile_start(**kwargs) -> None:
    """Triton's jit_cache_hook (called before a compile). Returns None: never skips the compile."""
    _active.t0 = time.perf_counter()
    return None


def on_compile_end(**kwargs) -> None:
    """Triton's jit_post_compile_hook (called after a compile)."""
    t0 = getattr(_active, "t0", None)
    _active.t0 = None
    watch = active_watch()
    if watch is not None:
        watch.record(getattr(kwargs.get("fn"), "name", "a kernel"), kwargs.get("repr", ""),
                     time.perf_counter() - t0 if t0 is not None else 0.0)


def install_hooks() -> bool:
    """Point Triton's JIT hooks here (idempotent); False when Triton is missing or another hook is set."""
    try:
        from triton import knobs
    except ImportError:
        return False
    rt = knobs.runtime
    if rt.jit_cache_hook is on_compile_start and rt.jit_post_compile_hook is on_compile_end:
        return True
    if rt.jit_cache_hook is not None or rt.jit_post_compile_hook is not None:
        logger.debug("another Triton JIT hook is set; kernel compiles are not counted")
        return False
    rt.jit_cache_hook = on_compile_start
    rt.jit_post_compile_hook = on_compile_end
    return True
