"""Batch-invariant mode (EngineConfig.batch_invariant): whether the layers of the running step take the
batch-invariant kernels (kernels/batch_invariant.py) instead of the shape-adaptive fast ones.

The runner enters the mode around everything it runs on the model (steps, their logits, dummy
runs, graph captures; `runner_numerics`). It is a context variable, set for the duration of a
call, so two engines in one process (or on two threads) never change each other's layers.
"""

import functools
from contextlib import contextmanager
from contextvars import ContextVar

_enabled: ContextVar[bool] = ContextVar("tokenmill_batch_invariant", default=False)


@contextmanager
def batch_invariant_mode(enabled: bool = True):
    token = _enabled.set(bool(enabled))
    try:
        yield
    finally:
        _enabled.reset(token)


def is_batch_invariant() -> bool:
    """Whether the current call runs in batch-invariant mode."""
    return _enabled.get()


def runner_numerics(method):
    """Run a runner method in its engine's mode (`self.config.batch_invariant`)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with batch_invariant_mode(self.config.batch_invariant):
            return method(self, *args, **kwargs)
    return wrapper
