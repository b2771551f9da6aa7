"""SharedStorageConnector: prefill/decode disaggregation between engines on one host, through files.

A producer (kv_role kv_producer: the prefill engine) writes the full blocks of every prompt it
computes into a directory (kv_connector_extra_config "path", default /dev/shm/tokenmill-kv: memory),
one file per block named by its prefix-cache key (block_store.py). A consumer (kv_consumer: the
decode engine) looks up each request's keys there past its own GPU prefix-cache hit, loads the
longest run it finds while the request waits in the LOADING state, and computes only the rest (at
least the last prompt token). kv_both does both.

Ordering: in wait_for_save, after a step's forward pass, the producer copies the step's blocks out
(into pinned memory on CUDA, without waiting) and queues their files on a writer thread; the engine
calls flush_saves before it hands that step's outputs on, so a router that sends the decode request
once the prefill request has answered finds every block in place, and the device never waits for
the files. A consumer's load runs on a thread of
its worker (file reads, then one copy into the cache when get_finished sees it done), so the
decode engine's steps go on meanwhile. A block that is missing or bad when read fails the request's
load: the engine recomputes it (the LOADING machinery's failure path), the file is removed and
counted in failed_loads. Files leave the directory when the consumer has loaded them (unless another
load in flight reads them too), and the producer bounds what it leaves behind (max_store_gib, and
ttl_s for files no consumer took).
"""

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Optional

import torch

from tokenmill.kv_connector.base import (ConnectorRequest, ConnectorUpdate, KVConnectorMetadata, KVConnectorOutput,
                                         KVConnectorScheduler, KVConnectorWorker, LoadBook, match_prefix)
from tokenmill.kv_connector.counts import KVTransferCounts, SharedStorageCounts
from tokenmill.kv_connector.block_store import BlockFileStore, StoreBounds
from tokenmill.kv_connector.blocks import block_shape, gather_blocks, kv_cache_bytes, layout_tag, scatter_blocks
from tokenmill.logger import init_logger

logger = init_logger(__name__)

PRODUCER_ROLES = ("kv_producer", "kv_both")
CONSUMER_ROLES = ("kv_consumer", "kv_both")


@dataclass
class SharedStorageOptions:
    """kv_connector_extra_config of the SharedStorageConnector."""

    path: str
    max_store_gib: float = 4.0  # a producer's files in the directory at most (its oldest removed first)
    ttl_s: float = 300.0  # a producer's file no consumer loaded within this is removed
    delete_after_load: bool = True  # a consumer removes the files it loaded
    io_threads: int = 4  # block files read and written at once (one thread reached 1.5 GB/s on /dev/shm)


@dataclass
class KeyedBlocks:
    """One request's blocks and their keys, pairwise: a save (device -> files) or a load (files -> device)."""

    req_id: str
    block_ids: list[int]
    keys: list[bytes]


@dataclass
class SharedStorageMeta:
    """One step's transfers (KVConnectorMetadata.extra)."""

    saves: list[KeyedBlocks] = field(default_factory=list)
    loads: list[KeyedBlocks] = field(default_factory=list)


class SharedStorageScheduler(KVConnectorScheduler):
    """Which keys the store has for a request (consumer); which prompts to save (producer)."""

    def __init__(self, options: SharedStorageOptions, role: str, block_size: int):
        self.options = options
        self.store = BlockFileStore(options.path)  # lookups and removals only (the worker reads and writes)
        self.block_size = block_size
        self.consumes = role in CONSUMER_ROLES
        self.wants_prefills = role in PRODUCER_ROLES
        self.book = LoadBook()  # keys the loads in flight read (a pinned key's file stays)
        self._meta = SharedStorageMeta()
        self.counts = SharedStorageCounts()

    # ---- consumer: lookups and loads --------------------------------------------------------
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.consumes:
            return 0, False
        keys, looked_up = match_prefix(request, num_computed_tokens, self.block_size,
                                       lambda key: key if self.store.has(key) else None)
        self.counts.lookup_tokens += looked_up
        if not self.book.match(request.request_id, keys):
            return 0, False
        return len(keys) * self.block_size, True

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int,
                                 num_computed_tokens: int) -> None:
        n = num_external_tokens // self.block_size
        keys = self.book.start(request.request_id, n)
        first = num_computed_tokens // self.block_size
        self._meta.loads.append(KeyedBlocks(request.request_id, block_ids[first:first + n], keys))

    # ---- producer: saves ----------------------------------------------------------------------
    def on_prefill_scheduled(self, request: ConnectorRequest, block_ids: list[int], num_tokens: int) -> None:
        # The blocks a consumer can load: it computes at least the last token itself, so a prompt
        # that ends on a block boundary leaves its last block to it.
        n = min((num_tokens - 1) // self.block_size, len(request.block_hashes), len(block_ids))
        if n:
            self._meta.saves.append(KeyedBlocks(request.request_id, block_ids[:n], request.block_hashes[:n]))

    # ---- the step -----------------------------------------------------------------------------
    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, SharedStorageMeta()
        return KVConnectorMetadata(extra=meta if meta.saves or meta.loads else None)

    def update_connector_output(self, output: KVConnectorOutput) -> ConnectorUpdate:
        self.counts.add(output.counts)
        update = ConnectorUpdate()
        for req_id in output.finished_loads:
            keys, ended = self.book.finish(req_id)
            self.counts.loaded_tokens += len(keys) * self.block_size
            if self.options.delete_after_load:
                self._remove_unpinned(keys)
            (update.released if ended else update.loaded).append(req_id)
        for req_id in output.failed_loads:
            keys, ended = self.book.finish(req_id)
            self._remove_unpinned(keys)  # what it read may be bad: nobody reads it again
            self.counts.failed_loads += 1
            (update.released if ended else update.failed).append(req_id)
        return update

    def _remove_unpinned(self, keys: list[bytes]) -> None:
        for key in keys:
            if key not in self.book.pins:
                self.store.remove(key)

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        return self.book.request_finished(request.request_id)  # (a producer's saves hold no blocks)

    def reset(self) -> bool:
        return not self.book.loading  # nothing cached here: the files are transfers in flight between engines

    def stats(self) -> SharedStorageCounts:
        return self.counts.copy()

    def reset_stats(self) -> None:
        self.counts = SharedStorageCounts()

    @property
    def has_pending(self) -> bool:
        return bool(self.book.loading)


@dataclass
class _Load:
    """A load in flight on the reader thread."""

    blocks: KeyedBlocks
    staged: torch.Tensor  # [n, layers, planes, ...] bytes, filled by the thread
    done: Future
    started: float


class SharedStorageWorker(KVConnectorWorker):
    """Writes a step's saves after its forward pass; reads loads on a thread, then copies them in."""

    def __init__(self, options: SharedStorageOptions, role: str, device: torch.device):
        self.options = options
        self.role = role
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.store = BlockFileStore(options.path)
        self.bounds = StoreBounds(int(options.max_store_gib * 2**30), options.ttl_s)
        self.cache: Optional[torch.Tensor] = None
        self.tag = b""
        # One thread each keeps loads and writes in order; each spreads its files over the I/O threads.
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-kv-read")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-kv-write")
        self.io = ThreadPoolExecutor(options.io_threads, thread_name_prefix="tokenmill-kv-io")
        self._saves: list[KeyedBlocks] = []
        self._writes: deque[Future] = deque()  # queued writes, oldest first: each gives (keys, blocks written)
        self._writing: set[bytes] = set()  # keys a queued write will create
        self._loads: deque[_Load] = deque()
        self._counts = KVTransferCounts()

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.cache = kv_cache_bytes(kv_caches)
        self.tag = layout_tag(kv_caches)
        if self.role in PRODUCER_ROLES:
            # One producer per directory: what an earlier run left there may be another model's KV.
            removed = self.store.clear()
            if removed:
                logger.info("KV transfer: removed %d block files an earlier run left in %s", removed,
                            self.options.path)
            free = self.store.free_bytes()
            if free < self.bounds.max_bytes:
                logger.warning("KV transfer: %s has %.2f GiB free, less than max_store_gib %.2f: blocks that do "
                               "not fit are not written (the decode engine computes them)", self.options.path,
                               free / 2**30, self.options.max_store_gib)
        logger.info("KV transfer (%s): blocks of %d bytes through %s", self.role, self.bytes_per_block,
                    self.options.path)

    @property
    def bytes_per_block(self) -> int:
        shape = block_shape(self.cache)
        n = 1
        for d in shape:
            n *= d
        return n

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        extra: Optional[SharedStorageMeta] = meta.extra
        if extra is None:
            return
        self._saves.extend(extra.saves)  # written after the forward pass (wait_for_save)
        for load in extra.loads:
            staged = torch.empty((len(load.keys),) + block_shape(self.cache), dtype=torch.uint8,
                                 pin_memory=self.on_cuda)
            self._loads.append(_Load(load, staged, self.reader.submit(self._read, load.keys, staged),
                                     time.perf_counter()))

    def _read(self, keys: list[bytes], staged: torch.Tensor) -> None:
        self._each(lambda i: self.store.read_into(keys[i], self.tag, staged[i]), len(keys))

    def _each(self, fn, n: int) -> list:
        """fn(i) for i < n, in contiguous runs over the I/O threads: the results in order; the first
        error is raised once every run has ended (none is left writing into a staged tensor)."""
        size = max(1, -(-n // self.options.io_threads))
        runs = [self.io.submit(lambda lo: [fn(i) for i in range(lo, min(n, lo + size))], lo)
                for lo in range(0, n, size)]
        results, error = [], None
        for run in runs:
            try:
                results.extend(run.result())
            except Exception as e:
                error = error or e
        if error is not None:
            raise error
        return results

    def wait_for_save(self) -> None:
        if not self._saves:
            return
        saves, self._saves = self._saves, []
        block_ids, keys = [], []
        for s in saves:
            for block_id, key in zip(s.block_ids, s.keys):
                if key not in self._writing and not self.store.has(key):  # (a shared prefix: once)
                    self._writing.add(key)
                    block_ids.append(block_id)
                    keys.append(key)
        if not block_ids:
            return
        # After the forward pass, in stream order: the blocks are copied out before anything can
        # reuse them, so the request may free them at once.
        staged = gather_blocks(self.cache, block_ids)
        ready = None
        if self.on_cuda:
            host = torch.empty(staged.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(staged, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            staged = host
        self._writes.append(self.writer.submit(self._write, keys, staged, ready))

    def _write(self, keys: list[bytes], staged: torch.Tensor, ready) -> tuple[list[bytes], int]:
        """On the writer thread: the blocks' files, once the copy out of the cache is done."""
        if ready is not None:
            ready.synchronize()
        self.store.evict(self.bounds, incoming=len(keys) * self.bytes_per_block)
        errors: list[OSError] = []

        def write(i: int) -> bool:
            try:
                return self.store.write(keys[i], self.tag, staged[i])
            except OSError as e:  # e.g. the directory is full: the decode engine computes these itself
                errors.append(e)
                return False

        written = sum(self._each(write, len(keys)))
        if errors:
            logger.warning("KV transfer: writing blocks to %s failed (%s); %d of %d written this step",
                           self.options.path, errors[0], written, len(keys))
        return keys, written

    def flush_saves(self) -> None:
        while self._writes:
            self._take_write(self._writes.popleft())

    def _take_write(self, done: Future) -> None:
        keys, written = done.result()
        self._writing.difference_update(keys)
        self._counts.blocks_saved += written
        self._counts.bytes_saved += written * self.bytes_per_block

    def wait_for_loads(self, timeout: float) -> None:
        if self._loads:
            wait([self._loads[0].done], timeout=timeout)

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        while self._writes and self._writes[0].done():  # one writer thread: they finish in order
            self._take_write(self._writes.popleft())
        while self._loads and self._loads[0].done.done():  # one reader thread: they finish in order
            load = self._loads.popleft()
            n = len(load.blocks.keys)
            try:
                load.done.result()
            except Exception as e:  # missing, short or foreign files (BlockStoreError), I/O errors
                logger.warning("KV transfer: loading %d blocks failed (%s); recomputing them", n, e)
                out.failed_loads.append(load.blocks.req_id)
                continue
            scatter_blocks(self.cache, load.blocks.block_ids, load.staged)  # before the next forward pass
            out.finished_loads.append(load.blocks.req_id)
            self._counts.blocks_loaded += n
            self._counts.bytes_loaded += n * self.bytes_per_block
            self._counts.load_seconds += time.perf_counter() - load.started
        out.counts, self._counts = self._counts, KVTransferCounts()
        return out

    def shutdown(self) -> None:
        self.flush_saves()
        self.writer.shutdown(wait=True)
        self.reader.shutdown(wait=True)
        self.io.shutdown(wait=True)
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
        self.cache = None
