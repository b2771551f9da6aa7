"""Counts Triton JIT compiles, and warns about the ones that happen after warm-up.

A Triton kernel compiles once per specialization: its constexpr values, and integer arguments
that equal 1 or are divisible by 16 (unless marked `do_not_specialize`). The engine's warm-up
compiles the common ones. A specialization that first appears under load compiles on the step
path and stalls every running request for the compile's time (0.1 to 2 s on an empty cache):
a latency spike with no other trace. After `mark_warm()`, each compile is logged as a warning
with the kernel's name and how long it took, and counted (the server exports the count).

Uses Triton's process-wide JIT hooks; they are not called in interpreter mode (TRITON_INTERPRET=1).
"""

import threading
import time
from dataclasses import dataclass

from tokenmill.logger import init_logger

logger = init_logger(__name__)


@dataclass
class CompileStats:
    compiles: int = 0  # since install()
    compiles_after_warm: int = 0
    seconds_after_warm: float = 0.0


_stats = CompileStats()
_warm = False
_installed = False
_started = threading.local()  # the compile in flight on this thread: its start time


def on_compile_start(**kwargs) -> None:
    """Triton's jit_cache_hook (called before a compile). Returns None: never skips the compile."""
    _started.t0 = time.perf_counter()
    return None


def on_compile_end(**kwargs) -> None:
    """Triton's jit_post_compile_hook (called after a compile)."""
    t0 = getattr(_started, "t0", None)
    seconds = time.perf_counter() - t0 if t0 is not None else 0.0
    _started.t0 = None
    _stats.compiles += 1
    if _warm:
        _stats.compiles_after_warm += 1
        _stats.seconds_after_warm += seconds
        fn = kwargs.get("fn")
        logger.warning("Triton compiled %s after warm-up (%.0f ms on the step path): %s",
                       getattr(fn, "name", "a kernel"), 1e3 * seconds, kwargs.get("repr", ""))


def install() -> bool:
    """Set Triton's JIT hooks (once); False when Triton is missing or another hook is already set."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
    except ImportError:
        return False
    rt = knobs.runtime
    if rt.jit_cache_hook not in (None, on_compile_start) or rt.jit_post_compile_hook not in (None, on_compile_end):
        logger.debug("another Triton JIT hook is set; kernel compiles are not counted")
        return False
    rt.jit_cache_hook = on_compile_start
    rt.jit_post_compile_hook = on_compile_end
    _installed = True
    return True


def mark_warm(warm: bool = True) -> None:
    """From now on, a compile is a warm-up miss: warn and count it."""
    global _warm
    _warm = warm


def stats() -> CompileStats:
    return CompileStats(_stats.compiles, _stats.compiles_after_warm, _stats.seconds_after_warm)
