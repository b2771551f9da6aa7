"""Library logging: a `tokenmill` logger hierarchy with one stderr handler, set up once."""

import logging
import os

_ROOT = "tokenmill"
_configured = False


def init_logger(name: str) -> logging.Logger:
    global _configured
    if not _configured:
        root = logging.getLogger(_ROOT)
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s] %(message)s", "%H:%M:%S"))
            root.addHandler(handler)
        root.setLevel(os.environ.get("TOKENMILL_LOG_LEVEL", "WARNING").upper())
        root.propagate = False
        _configured = True
    return logging.getLogger(name)
