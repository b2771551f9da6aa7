"""Library logging: a `tokenmill` logger hierarchy with one stderr handler.

The level is $TOKENMILL_LOG_LEVEL, else WARNING, for the library; the command line sets its own
with `set_log_level` (`tokenmill serve` logs at INFO by default, as servers do).
"""

import faulthandler
import logging
import os
import signal
import sys

_ROOT = "tokenmill"
DEFAULT_LEVEL = "WARNING"


def _install(root: logging.Logger, level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s] %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False


def init_logger(name: str) -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not root.handlers:
        _install(root, os.environ.get("TOKENMILL_LOG_LEVEL", DEFAULT_LEVEL))
    return logging.getLogger(name)


def set_log_level(level: str) -> None:
    """The level of every tokenmill logger (setting up the handler if nothing has logged yet)."""
    root = logging.getLogger(_ROOT)
    if root.handlers:
        root.setLevel(level.upper())
    else:
        _install(root, level)


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` writes every thread's Python stack to stderr (a stuck server shows where);
    call from a process's main thread, once."""
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
