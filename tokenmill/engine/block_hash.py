"""Prefix-cache keys: a SHA-256 chain over full blocks of token ids.

A cache hit hands a request another request's KV, so a key must never be shared by two different
prefixes. Python's `hash()` of a tuple is deterministic and not collision-resistant (a crafted
prompt could be made to collide with another user's prefix and be served their KV); SHA-256 is.
A block's key is SHA-256(parent key || extra || token ids as little-endian uint32). The parent key
of a request's first block is its root: 32 zero bytes, or with a cache salt (SamplingParams.cache_salt,
e.g. one per tenant) SHA-256("tokenmill-cache-salt" || 0 || salt as UTF-8), so requests of different
salts never share a block (and a tenant cannot learn from hits or timing what another one sent).
`extra` holds what else decides the KV besides the tokens (a request's LoRA adapter:
Request.cache_extra; empty without one). Each key covers the whole prefix up to its block, so equal
keys mean equal prefixes.
"""

import hashlib
from typing import Optional, Sequence

import numpy as np

ROOT = bytes(32)  # the parent of a request's first block (no salt)


def root_key(salt: Optional[str]) -> bytes:
    """The parent key of a request's first block: ROOT, or a fixed-size digest of its cache salt."""
    if not salt:
        return ROOT
    return hashlib.sha256(b"tokenmill-cache-salt\0" + salt.encode("utf-8")).digest()


def hash_blocks(parent: Optional[bytes], tokens: Sequence[int], block_size: int, extra: bytes = b"",
                salt: Optional[str] = None) -> list[bytes]:
    """Keys of the consecutive full blocks of `tokens` (a multiple of block_size long), chained
    onto `parent` (None: the first block of a request, chained onto the root of `salt`)."""
    data = np.asarray(tokens, dtype="<u4").tobytes()
    step = 4 * block_size
    keys, key = [], parent if parent is not None else root_key(salt)
    for start in range(0, len(data), step):
        key = hashlib.sha256(key + extra + data[start : start + step]).digest()
        keys.append(key)
    return keys
