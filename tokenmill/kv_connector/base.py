"""The two-sided KV-connector interface (after vLLM's KV connector as Model Runner V2 drives it).

A connector has a scheduler side, in the engine beside the KV-cache manager, and a worker side, in
the model runner beside the KV cache. Each step the scheduler side hands the worker side a
`KVConnectorMetadata` (inside the step's SchedulerOutput); the worker side answers, on a later
step, with a `KVConnectorOutput`: which requests' loads finished or failed. Only the engine and the
runner call these, and only when a connector is configured (a `None` check on the step path).

Scheduler side, per request:
  get_num_new_matched_tokens  how many tokens beyond the GPU prefix-cache hit the connector can
                              supply (full blocks), and whether they arrive asynchronously: the
                              request then waits in the LOADING state, holding its blocks, without
                              holding up the step; it is admitted once its load is reported done.
  update_state_after_alloc    the device blocks those tokens go into.
  request_finished            a request ends: True keeps its blocks until a transfer into or out of
                              them completes (the engine frees them when the worker reports it).
  on_blocks_evicted           cached GPU blocks leave the prefix cache (a tier below may keep them).
  on_prefill_scheduled        (a connector with wants_prefills) a step computes a request's prompt to
                              its end: a producer saves those blocks for another engine.
  build_connector_meta        the step's transfers, handed to the worker.
  update_connector_output     the worker's report; returns what the scheduler must act on.

Worker side: register_kv_caches once; start_load_kv before each forward pass (no_forward for a step
that runs no tokens), wait_for_save after it, get_finished for the report, and flush_saves before
the engine hands a step's outputs on (a save another engine reads must exist by then).

A request is seen through `ConnectorRequest` (its id, prefix-cache keys and token count), so this
package needs nothing of the engine's.
"""

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from tokenmill.kv_connector.counts import KVTransferCounts

if TYPE_CHECKING:
    import torch


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class ConnectorRequest(Protocol):
    """What a connector reads of a request (engine/request.py's Request has these)."""

    request_id: str
    block_hashes: list  # SHA-256 keys of its full blocks (engine/block_hash.py)

    @property
    def num_tokens(self) -> int: ...


@dataclass
class BlockTransfer:
    """Copies between device blocks and a connector's own slots, pairwise (block_ids[i] <-> slots[i])."""

    block_ids: list[int]
    slots: list[int]


@dataclass
class LoadRequest:
    """One request's load: its device blocks to fill before it may run. A synchronous one (sync) is
    read by this very step's forward pass, which waits for it; the worker never reports it."""

    req_id: str
    transfer: BlockTransfer
    sync: bool = False


@dataclass
class KVConnectorMetadata:
    """One step's transfers, scheduler side to worker side. Saves are issued before loads (a slot or
    block a save reads may be written by a load of the same step) and before the step's forward pass
    (which may overwrite the blocks saved)."""

    saves: BlockTransfer = field(default_factory=lambda: BlockTransfer([], []))
    loads: list[LoadRequest] = field(default_factory=list)
    extra: Optional[Any] = None  # a connector's own per-step data (a P/D connector's peer handles)

    @property
    def empty(self) -> bool:
        return not self.saves.block_ids and not self.loads and self.extra is None


@dataclass
class KVConnectorOutput:
    """The worker side's report: loads (by request) that finished or failed since the last one."""

    finished_loads: list[str] = field(default_factory=list)
    failed_loads: list[str] = field(default_factory=list)
    finished_saves: list[str] = field(default_factory=list)  # requests whose blocks a save read (P/D)
    counts: KVTransferCounts = field(default_factory=KVTransferCounts)

    @property
    def empty(self) -> bool:
        return not (self.finished_loads or self.failed_loads or self.finished_saves)


@dataclass
class ConnectorUpdate:
    """What the scheduler must do after a report: admit the requests whose loads finished, recompute
    those whose loads failed, free the blocks of finished requests no transfer holds any more."""

    loaded: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)


def match_prefix(request: ConnectorRequest, num_computed_tokens: int, block_size: int,
                 find: Callable[[bytes], Any]) -> tuple[list, int]:
    """What `find` (block key -> its entry, or None) holds of the request's full blocks past
    num_computed_tokens, up to the first miss and leaving the last token to compute; and how many
    tokens were looked up."""
    first, last = num_computed_tokens // block_size, (request.num_tokens - 1) // block_size
    found = []
    for key in request.block_hashes[first:last]:
        entry = find(key)
        if entry is None:
            break
        found.append(entry)
    return found, max(0, last - first) * block_size


class LoadBook:
    """A scheduler side's loads in flight: the entries (host slots, file keys...) each request matched,
    the ones its load reads, pinned until the worker reports it, and the requests that ended meanwhile
    (their blocks are kept until then)."""

    def __init__(self):
        self.matched: dict[str, list] = {}  # request -> entries found, until its blocks are allocated
        self.loading: dict[str, list] = {}  # request -> entries its load in flight reads
        self.pins: dict[Any, int] = {}  # entry -> loads in flight reading it
        self.ended_while_loading: set[str] = set()

    def match(self, req_id: str, entries: list) -> bool:
        if not entries:
            self.matched.pop(req_id, None)
            return False
        self.matched[req_id] = entries
        return True

    def start(self, req_id: str, n: int) -> list:
        """The first n matched entries, pinned: the request's load reads them now."""
        entries = self.matched.pop(req_id)[:n]
        for e in entries:
            self.pins[e] = self.pins.get(e, 0) + 1
        self.loading[req_id] = entries
        return entries

    def finish(self, req_id: str) -> tuple[list, bool]:
        """A reported load: its entries (unpinned) and whether its request ended while it ran."""
        entries = self.loading.pop(req_id)
        for e in entries:
            self.pins[e] -= 1
            if not self.pins[e]:
                del self.pins[e]
        ended = req_id in self.ended_while_loading
        self.ended_while_loading.discard(req_id)
        return entries, ended

    def request_finished(self, req_id: str) -> bool:
        """True if the request's load still writes into its blocks (keep them until it is reported)."""
        self.matched.pop(req_id, None)
        if req_id in self.loading:
            self.ended_while_loading.add(req_id)
            return True
        return False


class KVConnectorScheduler(ABC):
    """The scheduler side (in the engine process; no tensors)."""

    wants_prefills: bool = False  # the scheduler calls on_prefill_scheduled only when True

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past `num_computed_tokens` (the GPU hit, a block multiple) this connector can supply
        for the request, leaving at least one to compute; and whether they load asynchronously (else
        the request runs in the step that loads them, and its load cannot fail)."""

    @abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int,
                                 num_computed_tokens: int) -> None:
        """The request holds `block_ids`; the num_external_tokens after num_computed_tokens are to be
        loaded into them."""

    def on_blocks_evicted(self, evicted: list[tuple[int, bytes]]) -> None:
        """(block id, key) pairs of cached blocks the GPU pool is about to reuse this step."""

    def on_prefill_scheduled(self, request: ConnectorRequest, block_ids: list[int], num_tokens: int) -> None:
        """This step computes the request's first num_tokens tokens (its prompt, or prompt and outputs
        when resumed) to their end; `request.block_hashes` keys their full blocks, `block_ids` holds
        them. Their K/V is complete after this step's forward pass (the worker's wait_for_save)."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """The transfers scheduled since the last call."""

    @abstractmethod
    def update_connector_output(self, output: KVConnectorOutput) -> ConnectorUpdate:
        """Take the worker's report."""

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        """A request ended (finished, aborted) or gave up its blocks (preempted, failed load): True
        if a transfer still uses its blocks, which the engine then frees after a report names it in
        ConnectorUpdate.released."""
        return False

    def reset(self) -> bool:
        """Forget what this connector caches (the engine's reset_prefix_cache); False if it cannot now."""
        return True

    def stats(self) -> Optional[Any]:
        """Aggregate counters for the engine's stats, or None."""
        return None

    def reset_stats(self) -> None:
        """Start the counters afresh (after the engine's warm-up)."""

    @property
    def has_pending(self) -> bool:
        """Transfers in flight whose reports the scheduler still waits for."""
        return False


class KVConnectorWorker(ABC):
    """The worker side (beside the runner's KV cache)."""

    @abstractmethod
    def register_kv_caches(self, kv_caches: "list[tuple[torch.Tensor, torch.Tensor]]") -> None:
        """The runner's KV cache: per layer (k, v) views of [blocks, block_size, kv_heads, head_dim]."""

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Before the step's forward pass: issue its saves and loads (asynchronously where it can)."""

    def wait_for_save(self) -> None:
        """After the forward pass: a connector that saves the step's own K/V finishes (or fences) it."""

    def no_forward(self, meta: KVConnectorMetadata) -> None:
        """A step with no tokens to run: transfers still start."""
        self.start_load_kv(meta)
        self.wait_for_save()

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Loads and saves completed (or failed) since the last call; never waits."""

    def flush_saves(self) -> None:
        """Finish the saves issued so far (the engine calls it before a step's outputs leave it, off
        the device's critical path: the next step is already launched)."""

    def wait_for_loads(self, timeout: float) -> None:
        """Block, without the GIL, until the oldest load may have finished, at most `timeout` seconds:
        the engine calls it when a step had nothing to run but loads (rather than spin, which starves
        a connector's reading threads of the GIL)."""

    def shutdown(self) -> None:
        """Release buffers and finish outstanding copies."""
