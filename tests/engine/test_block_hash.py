"""Prefix-cache keys are a SHA-256 chain over the documented encoding."""

import hashlib

import numpy as np

from tokenmill.engine.block_hash import ROOT, hash_blocks, root_key
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.sampling_params import SamplingParams


def _reference(tokens: list[int], block_size: int) -> list[bytes]:
    keys, parent = [], ROOT
    for i in range(0, len(tokens), block_size):
        block = b"".join(t.to_bytes(4, "little") for t in tokens[i : i + block_size])
        parent = hashlib.sha256(parent + block).digest()
        keys.append(parent)
    return keys


def test_keys_are_the_sha256_chain():
    tokens = list(np.random.default_rng(0).integers(0, 150_000, 64))
    tokens = [int(t) for t in tokens]
    keys = hash_blocks(None, tokens, 16)
    assert keys == _reference(tokens, 16)
    assert all(len(k) == 32 for k in keys)
    # Chaining in pieces gives the same keys as all at once.
    assert hash_blocks(None, tokens[:32], 16) + hash_blocks(keys[1], tokens[32:], 16) == keys


def test_a_key_covers_its_whole_prefix():
    a = [1] * 16 + [7] * 16
    b = [2] * 16 + [7] * 16  # same second block after another first block
    assert hash_blocks(None, a, 16)[1] != hash_blocks(None, b, 16)[1]
    # Token ids that agree in their low bytes still differ as keys.
    assert hash_blocks(None, [1] * 16, 16) != hash_blocks(None, [1 + 2**16] + [1] * 15, 16)
    assert hash_blocks(None, [5] * 16, 16, extra=b"adapter-a") != hash_blocks(None, [5] * 16, 16)


def test_the_manager_keys_requests_by_prefix():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    params = SamplingParams(max_tokens=4)
    first = Request("a", list(range(10)), params, 0, 4, frozenset())
    assert kv.allocate(first, 10)
    second = Request("b", list(range(8)) + [99, 98, 97], params, 0, 4, frozenset())
    blocks, tokens = kv.find_cached_prefix(second)
    assert tokens == 8 and blocks == first.block_ids[:2]
    assert second.block_hashes[:2] == _reference(list(range(8)), 4)
    other = Request("c", [0, 1, 2, 3, 4, 5, 6, 8, 9, 9], params, 0, 4, frozenset())
    blocks, tokens = kv.find_cached_prefix(other)
    assert tokens == 4 and blocks == first.block_ids[:1]


def test_a_cache_salt_roots_the_chain():
    tokens = list(range(32))
    salted = hash_blocks(None, tokens, 16, salt="tenant-a")
    first_block = b"".join(t.to_bytes(4, "little") for t in range(16))
    assert salted[0] == hashlib.sha256(root_key("tenant-a") + first_block).digest()
    assert root_key("tenant-a") == hashlib.sha256(b"tokenmill-cache-salt\0tenant-a").digest()
    assert root_key(None) == root_key("") == ROOT
    # No block is shared with the unsalted chain or another salt's, and the salt reaches every later block.
    others = hash_blocks(None, tokens, 16) + hash_blocks(None, tokens, 16, salt="tenant-b")
    assert not set(salted) & set(others)
    assert hash_blocks(salted[0], tokens[16:], 16) == salted[1:]
