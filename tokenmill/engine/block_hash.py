"""Prefix-cache keys: a SHA-256 chain over full blocks of token ids.

A cache hit hands a request another request's KV, so a key must never be shared by two different
prefixes. Python's `hash()` of a tuple is deterministic and not collision-resistant (a crafted
prompt could be made to collide with another user's prefix and be served their KV); SHA-256 is.
A block's key is SHA-256(parent key || extra || token ids as little-endian uint32), where the parent
key of a request's first block is 32 zero bytes and `extra` holds what else decides the KV besides
the tokens (a request's LoRA adapter: Request.cache_extra; empty without one). Each key covers the whole prefix up to
its block, so equal keys mean equal prefixes.
"""

import hashlib
from typing import Optional, Sequence

import numpy as np

ROOT = bytes(32)  # the parent of a request's first block


def hash_blocks(parent: Optional[bytes], tokens: Sequence[int], block_size: int, extra: bytes = b"") -> list[bytes]:
    """Keys of the consecutive full blocks of `tokens` (a multiple of block_size long), chained
    onto `parent` (None: the first block of a request)."""
    data = np.asarray(tokens, dtype="<u4").tobytes()
    step = 4 * block_size
    keys, key = [], parent if parent is not None else ROOT
    for start in range(0, len(data), step):
        key = hashlib.sha256(key + extra + data[start : start + step]).digest()
        keys.append(key)
    return keys
