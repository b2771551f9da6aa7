"""EngineSnapshot: the engine's counters after a step, as one value safe to hand to another thread or
process (the server's stats and /metrics read it)."""

import dataclasses
from dataclasses import dataclass
from typing import Optional

from tokenmill.engine.spec_stats import SpecDecodeCounts
from tokenmill.kv_connector.counts import HostTierCounts, SharedStorageCounts


@dataclass
class EngineSnapshot:
    """The engine's counters after a step (the engine-side part of the server's stats)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    kernel_compiles_after_warmup: int = 0
    kernel_compile_seconds_after_warmup: float = 0.0
    spec_decode: Optional[SpecDecodeCounts] = None
    kv_offload: Optional[HostTierCounts] = None  # the host tier's counters (kv_offloading_size), when on
    kv_transfer: Optional[SharedStorageCounts] = None  # prefill/decode transfers (SharedStorageConnector)

    def to_wire(self) -> list:
        values = [getattr(self, f.name) for f in dataclasses.fields(EngineSnapshot)]
        spec, host, transfer = self.spec_decode, self.kv_offload, self.kv_transfer
        values[-3] = None if spec is None else [spec.num_speculative_tokens, spec.verify_steps, spec.drafts,
                                                spec.accepted, list(spec.drafted_at), list(spec.accepted_at)]
        values[-2] = None if host is None else [getattr(host, f.name) for f in dataclasses.fields(host)]
        values[-1] = None if transfer is None else [getattr(transfer, f.name) for f in dataclasses.fields(transfer)]
        return values

    @classmethod
    def from_wire(cls, values: list) -> "EngineSnapshot":
        values = list(values)
        if values[-3] is not None:
            k, steps, drafts, accepted, at, acc_at = values[-3]
            values[-3] = SpecDecodeCounts(k, steps, drafts, accepted, tuple(at), tuple(acc_at))
        if values[-2] is not None:
            values[-2] = HostTierCounts(*values[-2])
        if values[-1] is not None:
            values[-1] = SharedStorageCounts(*values[-1])
        return cls(*values)
