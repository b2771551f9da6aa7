"""KV-cache manager: which blocks each request holds, and the prefix cache over full blocks."""

from typing import Optional

from tokenmill.engine.block_hash import hash_blocks
from tokenmill.engine.block_pool import BlockPool
from tokenmill.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fits_problem(num_prompt_tokens: int, max_tokens: int, max_model_len: int, num_blocks: int,
                 block_size: int) -> Optional[str]:
    """Why a request of this size could never run (None if it could)."""
    if num_prompt_tokens + max_tokens > max_model_len:
        return (f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"context length of {max_model_len} tokens")
    blocks = cdiv(num_prompt_tokens + max_tokens, block_size)
    if blocks > num_blocks:
        return f"the request needs {blocks} KV-cache blocks but the cache has only {num_blocks}"
    return None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached

    # ---- accounting -----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # ---- prefix cache ---------------------------------------------------------------------
    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend the request's key chain (engine/block_hash.py) over the full blocks of its first
        num_tokens known tokens."""
        bs = self.block_size
        done, full = len(request.block_hashes), num_tokens // bs
        if full <= done:
            return
        parent = request.block_hashes[-1] if done else None
        request.block_hashes.extend(hash_blocks(parent, request.all_token_ids[done * bs : full * bs], bs,
                                                request.cache_extra, salt=request.params.cache_salt))

    def find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks for the longest prefix of the request's tokens (leaving at least one token
        to compute, since the step must produce logits), and how many tokens they hold."""
        if not self.enable_prefix_caching:
            return [], 0
        self._update_hashes(request, request.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    # ---- allocation -----------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: Optional[list[int]] = None,
                 num_lookahead_tokens: int = 0) -> bool:
        """Blocks for num_new_tokens more tokens (after any cached prefix), and for
        num_lookahead_tokens slots beyond them (a speculative draft writes K/V ahead of what the
        step computes; those slots are reserved, never registered in the prefix cache). False if
        they don't fit."""
        slots = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if not cached_blocks and slots <= len(request.block_ids) * self.block_size:
            # The common decode case: the new tokens fit the blocks the request already holds.
            self._cache_full_blocks(request, min(request.num_computed_tokens + num_new_tokens, request.num_tokens))
            return True
        cached_blocks = cached_blocks or []
        computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        if not self._take_blocks(request, cached_blocks, computed + num_new_tokens + num_lookahead_tokens):
            return False
        self._cache_full_blocks(request, min(computed + num_new_tokens, request.num_tokens))
        return True

    def _take_blocks(self, request: Request, cached_blocks: list[int], num_tokens: int) -> bool:
        """Append the cached blocks, then fresh ones, until the request holds num_tokens slots; False
        (nothing taken) if they don't fit."""
        needed = cdiv(num_tokens, self.block_size) - len(request.block_ids) - len(cached_blocks)
        # Cached blocks nobody holds sit in the free list; taking them makes them unavailable.
        reclaimable = sum(1 for b in cached_blocks if self.pool.blocks[b].ref_cnt == 0)
        if needed > self.pool.num_free - reclaimable:
            return False
        self.pool.touch(cached_blocks)
        request.block_ids.extend(cached_blocks)
        if needed > 0:
            request.block_ids.extend(self.pool.allocate(needed))
        return True

    def allocate_for_load(self, request: Request, cached_blocks: list[int], num_tokens: int) -> bool:
        """Blocks for the first num_tokens tokens, after the cached ones, for a KV connector to load
        into: not entered in the prefix cache until the load is done (cache_loaded). False if they
        don't fit."""
        return self._take_blocks(request, cached_blocks, num_tokens)

    def cache_loaded(self, request: Request, num_tokens: int) -> None:
        """A connector filled the request's blocks up to num_tokens: they may be shared now."""
        self._cache_full_blocks(request, num_tokens)

    def record_prefix_lookup(self, request: Request, num_cached_tokens: int) -> None:
        self.prefix_queries += request.num_tokens
        self.prefix_hits += num_cached_tokens

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks of known tokens (their K/V is computed by the time any
        later step reads them, since steps run in order on one stream)."""
        if not self.enable_prefix_caching:
            return
        full = num_tokens // self.block_size
        if full <= request.num_registered_blocks:
            return
        self._update_hashes(request, num_tokens)
        for i in range(request.num_registered_blocks, full):
            self.pool.cache(request.block_ids[i], request.block_hashes[i])
        request.num_registered_blocks = full

    def free(self, request: Request) -> None:
        self.pool.release(list(reversed(request.block_ids)))
        request.block_ids = []
        request.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        self.pool.reset_cache()
