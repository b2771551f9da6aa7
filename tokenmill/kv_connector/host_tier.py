"""The host-memory tier (kv_offloading_size): a second prefix cache in host memory, below the GPU's.

Blocks that leave the GPU prefix cache (a cached block the pool hands out again) are copied to host
memory, keyed by the same SHA-256 block keys (engine/block_hash.py), so adapters and cache salts
stay apart exactly as on the GPU. A request whose prefix continues on the host past its GPU hit
runs from the end of that prefix in the step that copies it back (the step's forward pass waits for
the copy). With load_async, it waits in the LOADING state instead while the copy overlaps other
steps, and is admitted once the worker reports it; only such a load can fail (fault injection for
tests: then its prefix is recomputed), since a host-to-device copy has no other recoverable failure.
Host slots are reused least recently used first; a slot a load still reads is never reused.

On CUDA the copies run on a side stream: a save (device -> pinned host) is ordered after the work
already launched and before the step's forward pass (which may overwrite the saved blocks); the
forward pass waits for the step's synchronous loads too, while an asynchronous load completes on
its own. On the CPU the copies are plain tensor copies, so the CPU tests run the CUDA code path.
"""

import time
from collections import OrderedDict
from typing import Optional

import torch

from tokenmill.kv_connector.base import (BlockTransfer, ConnectorRequest, ConnectorUpdate, KVConnectorMetadata,
                                         KVConnectorOutput, KVConnectorScheduler, KVConnectorWorker, LoadBook,
                                         LoadRequest, match_prefix)
from tokenmill.kv_connector.counts import HostTierCounts, KVTransferCounts
from tokenmill.kv_connector.blocks import block_shape, gather_blocks, kv_cache_bytes, scatter_blocks
from tokenmill.logger import init_logger

logger = init_logger(__name__)


class HostTierScheduler(KVConnectorScheduler):
    """Which keys the host holds, in which slots; what to save and load each step."""

    def __init__(self, num_slots: int, block_size: int, load_async: bool = False):
        self.block_size = block_size
        self.load_async = load_async
        self.index: "OrderedDict[bytes, int]" = OrderedDict()  # key -> slot, least recently used first
        self.key_of: dict[int, bytes] = {}
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.book = LoadBook()  # slots the loads in flight read
        self._saves = BlockTransfer([], [])
        self._loads: list[LoadRequest] = []
        self.counts = HostTierCounts(num_slots=num_slots)

    # ---- lookups and loads --------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        slots, looked_up = match_prefix(request, num_computed_tokens, self.block_size, self.index.get)
        self.counts.lookup_tokens += looked_up
        if not self.book.match(request.request_id, slots):
            return 0, False
        return len(slots) * self.block_size, self.load_async

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int,
                                 num_computed_tokens: int) -> None:
        n = num_external_tokens // self.block_size
        slots = self.book.start(request.request_id, n)
        first = num_computed_tokens // self.block_size
        for slot in slots:
            self.index.move_to_end(self.key_of[slot])  # recently used
        self._loads.append(LoadRequest(request.request_id, BlockTransfer(block_ids[first:first + n], slots),
                                       sync=not self.load_async))
        self.counts.hit_tokens += num_external_tokens

    # ---- saves --------------------------------------------------------------------------------
    def on_blocks_evicted(self, evicted: list[tuple[int, bytes]]) -> None:
        for block_id, key in evicted:
            if key in self.index:  # already on the host (saved before, loaded back since)
                self.index.move_to_end(key)
                continue
            slot = self._take_slot()
            if slot is None:  # every slot is being read by a load: this block is not kept
                continue
            self.index[key] = slot
            self.key_of[slot] = key
            self._saves.block_ids.append(block_id)
            self._saves.slots.append(slot)

    def _take_slot(self) -> Optional[int]:
        if self.free_slots:
            return self.free_slots.pop()
        for key, slot in self.index.items():  # least recently used first
            if not self.book.pins.get(slot):
                del self.index[key]
                del self.key_of[slot]
                return slot
        return None

    # ---- the step -----------------------------------------------------------------------------
    def build_connector_meta(self) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(self._saves, self._loads)
        self._saves, self._loads = BlockTransfer([], []), []
        for load in meta.loads:  # the step's own loads: its later saves come after them on the stream
            if load.sync:
                self.book.finish(load.req_id)
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> ConnectorUpdate:
        self.counts.add(output.counts)
        update = ConnectorUpdate()
        for req_id in output.finished_loads:
            _, ended = self.book.finish(req_id)
            (update.released if ended else update.loaded).append(req_id)
        for req_id in output.failed_loads:
            slots, ended = self.book.finish(req_id)
            for slot in slots:  # what it read may be bad: forget it
                if not self.book.pins.get(slot) and slot in self.key_of:
                    del self.index[self.key_of.pop(slot)]
                    self.free_slots.append(slot)
            self.counts.failed_loads += 1
            (update.released if ended else update.failed).append(req_id)
        return update

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        return self.book.request_finished(request.request_id)

    def reset(self) -> bool:
        if self.book.loading:
            return False
        self.index.clear()
        self.key_of.clear()
        self.free_slots = list(range(self.counts.num_slots - 1, -1, -1))
        return True

    def stats(self) -> HostTierCounts:
        return self.counts.copy()

    def reset_stats(self) -> None:
        self.counts = HostTierCounts(num_slots=self.counts.num_slots)

    @property
    def has_pending(self) -> bool:
        return bool(self.book.loading)


class HostTierWorker(KVConnectorWorker):
    """The host copy of evicted blocks: one [slots, layers, 2, block_size, kv_heads, head_dim] tensor
    (pinned on CUDA), each slot contiguous so that a run of slots is one copy."""

    def __init__(self, num_slots: int, device: torch.device, fail_loads: int = 0):
        # fail_loads applies to asynchronous loads only: a synchronous one's request runs this step
        self.num_slots = num_slots
        self.device = device
        self.on_cuda = device.type == "cuda"
        # Fault injection for tests: this many load batches fail before any copy (recomputed instead).
        self.fail_loads = fail_loads
        self.cache: Optional[torch.Tensor] = None
        self.store: Optional[torch.Tensor] = None
        self.stream = torch.cuda.Stream(device) if self.on_cuda else None
        # Loads issued, oldest first: (request, None for a synchronous one; blocks; CUDA events or CPU seconds)
        self._pending: list[tuple[Optional[str], int, object]] = []
        self._failed: list[str] = []
        self._counts = KVTransferCounts()

    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.cache = kv_cache_bytes(kv_caches)
        self.store = torch.empty((self.num_slots,) + block_shape(self.cache), dtype=torch.uint8,
                                 pin_memory=self.on_cuda)
        logger.info("KV host tier: %d blocks (%.2f GiB%s)", self.num_slots, self.store.numel()
                    * self.store.element_size() / 2**30, ", pinned" if self.on_cuda else "")

    @property
    def bytes_per_block(self) -> int:
        return self.store[0].numel() * self.store.element_size()

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        if not meta.saves.block_ids and not meta.loads:
            return
        if not self.on_cuda:
            self._transfer(meta)
            return
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)  # after the steps already launched (they may write these blocks)
        with torch.cuda.stream(self.stream):
            saved, loaded = self._transfer(meta)
        if saved is not None:
            main.wait_event(saved)  # the forward pass may overwrite the blocks just saved
        if loaded is not None:
            main.wait_event(loaded)  # and reads the blocks its synchronous loads fill

    def _transfer(self, meta: KVConnectorMetadata) -> tuple[Optional["torch.cuda.Event"], Optional["torch.cuda.Event"]]:
        """Saves, then synchronous loads, then asynchronous ones, on the current stream; returns the
        events (CUDA) after the saves and after the synchronous loads, for the forward pass to wait on."""
        saved = loaded = None
        if meta.saves.block_ids:
            self._save(meta.saves)
            saved = self._mark()
        sync = [load for load in meta.loads if load.sync]
        for load in sync:
            self._issue(load)
        if sync:
            loaded = self._mark()
        for load in meta.loads:
            if not load.sync:
                self._issue(load)
        return saved, loaded

    def _mark(self) -> Optional["torch.cuda.Event"]:
        if not self.on_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _issue(self, load: LoadRequest) -> None:
        start = torch.cuda.Event(enable_timing=True) if self.on_cuda else time.perf_counter()
        if self.on_cuda:
            start.record()
        try:
            self._load(load.transfer, load.sync)
        except Exception as e:
            if load.sync:  # its request runs this step: nothing to fall back on
                raise
            logger.warning("KV host tier: loading %d blocks failed (%s); recomputing them",
                           len(load.transfer.block_ids), e)
            self._failed.append(load.req_id)  # the request recomputes its prefix instead
            return
        if self.on_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            timing = (start, end)
        else:
            timing = time.perf_counter() - start
        # (a synchronous load is timed and counted, never reported: its request already runs)
        self._pending.append((None if load.sync else load.req_id, len(load.transfer.block_ids), timing))

    def _save(self, t: BlockTransfer) -> None:
        staged = gather_blocks(self.cache, t.block_ids)  # [n, layers, planes, ...]
        for i, j, slot in _runs(t.slots):
            self.store[slot:slot + j - i].copy_(staged[i:j], non_blocking=True)
        self._counts.blocks_saved += len(t.block_ids)
        self._counts.bytes_saved += len(t.block_ids) * self.bytes_per_block

    def _load(self, t: BlockTransfer, sync: bool) -> None:
        if self.fail_loads and not sync:
            self.fail_loads -= 1
            raise RuntimeError("injected load failure")
        staged = torch.empty((len(t.slots),) + tuple(self.store.shape[1:]), dtype=self.store.dtype,
                             device=self.cache.device)
        for i, j, slot in _runs(t.slots):
            staged[i:j].copy_(self.store[slot:slot + j - i], non_blocking=True)
        scatter_blocks(self.cache, t.block_ids, staged)

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput(failed_loads=self._failed)
        self._failed = []
        while self._pending:
            req_id, blocks, timing = self._pending[0]
            if isinstance(timing, tuple):
                if not timing[1].query():
                    break  # later loads were issued after it on the same stream
                timing = timing[0].elapsed_time(timing[1]) / 1e3
            self._pending.pop(0)
            if req_id is not None:
                out.finished_loads.append(req_id)
            self._counts.blocks_loaded += blocks
            self._counts.bytes_loaded += blocks * self.bytes_per_block
            self._counts.load_seconds += timing
        out.counts, self._counts = self._counts, KVTransferCounts()
        return out

    def shutdown(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self.store = self.cache = None


def _runs(slots: list[int]):
    """(i, j, first slot) for each run of consecutive slots slots[i:j]."""
    i = 0
    while i < len(slots):
        j = i + 1
        while j < len(slots) and slots[j] == slots[j - 1] + 1:
            j += 1
        yield i, j, slots[i]
        i = j
