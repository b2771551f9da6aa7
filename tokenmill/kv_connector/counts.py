"""The KV connectors' counters: plain data without torch (the engine snapshot carries them to the API
server's /metrics, which never imports torch)."""

import dataclasses
from dataclasses import dataclass, fields


@dataclass
class KVTransferCounts:
    """What the worker side moved since its last report (aggregates only)."""

    bytes_saved: int = 0  # device -> connector
    bytes_loaded: int = 0  # connector -> device
    blocks_saved: int = 0
    blocks_loaded: int = 0
    load_seconds: float = 0.0  # from a load's issue to when its completion was seen


class _Totals:
    """A connector's counters since start, to which each worker report adds."""

    def add(self, counts: KVTransferCounts) -> None:
        for f in fields(KVTransferCounts):
            setattr(self, f.name, getattr(self, f.name) + getattr(counts, f.name))

    def copy(self):
        return dataclasses.replace(self)


@dataclass
class HostTierCounts(_Totals):
    """The host tier's counters since start (aggregates only: no request is named)."""

    hit_tokens: int = 0  # prompt tokens loaded from host memory instead of computed
    lookup_tokens: int = 0  # prompt tokens looked up on the host (past each GPU hit)
    bytes_saved: int = 0  # device -> host
    bytes_loaded: int = 0  # host -> device
    blocks_saved: int = 0
    blocks_loaded: int = 0
    load_seconds: float = 0.0
    failed_loads: int = 0  # loads that failed (their prefix recomputed)
    num_slots: int = 0  # host blocks in all


@dataclass
class SharedStorageCounts(_Totals):
    """The shared-storage connector's counters since start (aggregates only: no request is named)."""

    loaded_tokens: int = 0  # prompt tokens loaded from the store instead of computed (consumer)
    lookup_tokens: int = 0  # prompt tokens looked up in the store (past each GPU hit)
    bytes_saved: int = 0  # device -> store (producer)
    bytes_loaded: int = 0  # store -> device (consumer)
    blocks_saved: int = 0
    blocks_loaded: int = 0
    load_seconds: float = 0.0
    failed_loads: int = 0  # loads that failed (their prefix recomputed)
