"""Connectors by name (EngineConfig.kv_transfer_config's "kv_connector"), each side built on its own.

A connector registers a scheduler-side and a worker-side builder; the engine builds the scheduler
side, the runner the worker side. OffloadingConnector is the host-memory tier (host_tier.py),
SharedStorageConnector prefill/decode disaggregation on one host (shared_storage.py); a network
transport (NIXL-style) would be one more entry.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from tokenmill.config import (OFFLOADING_CONNECTOR, SHARED_STORAGE_CONNECTOR, ConfigError, EngineConfig,
                              KVTransferConfig)
from tokenmill.kv_connector.base import KVConnectorScheduler, KVConnectorWorker
from tokenmill.kv_connector.block_store import default_store_path
from tokenmill.kv_connector.host_tier import HostTierScheduler, HostTierWorker
from tokenmill.kv_connector.shared_storage import SharedStorageOptions, SharedStorageScheduler, SharedStorageWorker


@dataclass
class ConnectorContext:
    """What a connector is built from besides its config."""

    config: KVTransferConfig
    block_size: int
    bytes_per_block: int  # one KV block on the device, all layers
    device: torch.device


def _host_slots(ctx: ConnectorContext) -> int:
    size = ctx.config.kv_connector_extra_config.get("size_gib")
    if size is None or not size > 0:
        raise ConfigError(f'{OFFLOADING_CONNECTOR} needs kv_connector_extra_config {{"size_gib": G}} (G > 0), or '
                          "kv_offloading_size")
    slots = int(size * 2**30 // ctx.bytes_per_block)
    if slots < 1:
        raise ConfigError(f"kv_offloading_size {size} GiB holds no KV block of {ctx.bytes_per_block} bytes")
    return slots


def _shared_storage_options(ctx: ConnectorContext) -> SharedStorageOptions:
    extra = dict(ctx.config.kv_connector_extra_config)
    known = {"path", "max_store_gib", "ttl_s", "delete_after_load", "io_threads"}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConfigError(f"{SHARED_STORAGE_CONNECTOR}: unknown kv_connector_extra_config keys {unknown} "
                          f"(known: {sorted(known)})")
    try:
        options = SharedStorageOptions(path=str(extra.get("path") or default_store_path()),
                                       max_store_gib=float(extra.get("max_store_gib", 4.0)),
                                       ttl_s=float(extra.get("ttl_s", 300.0)),
                                       delete_after_load=bool(extra.get("delete_after_load", True)),
                                       io_threads=int(extra.get("io_threads", 4)))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{SHARED_STORAGE_CONNECTOR}: bad kv_connector_extra_config ({e})") from None
    if not options.max_store_gib > 0 or not options.ttl_s > 0 or options.io_threads < 1:
        raise ConfigError(f"{SHARED_STORAGE_CONNECTOR}: max_store_gib and ttl_s must be > 0, io_threads >= 1")
    return options


def _load_async(ctx: ConnectorContext) -> bool:
    """The host tier's loads: in the step that needs them (default), or overlapping steps (load_async)."""
    extra = ctx.config.kv_connector_extra_config
    load_async = extra.get("load_async", False)
    if not isinstance(load_async, bool):
        raise ConfigError(f"{OFFLOADING_CONNECTOR}: load_async must be true or false, not {load_async!r}")
    if extra.get("fail_loads") and not load_async:
        raise ConfigError(f"{OFFLOADING_CONNECTOR}: fail_loads (a test's fault injection) needs load_async: "
                          "a synchronous load's request runs in the step that loads it")
    return load_async


@dataclass
class ConnectorBuilders:
    scheduler: Callable[[ConnectorContext], KVConnectorScheduler]
    worker: Callable[[ConnectorContext], KVConnectorWorker]


CONNECTORS: dict[str, ConnectorBuilders] = {
    OFFLOADING_CONNECTOR: ConnectorBuilders(
        lambda ctx: HostTierScheduler(_host_slots(ctx), ctx.block_size, _load_async(ctx)),
        lambda ctx: HostTierWorker(_host_slots(ctx), ctx.device,
                                   int(ctx.config.kv_connector_extra_config.get("fail_loads", 0)))),
    SHARED_STORAGE_CONNECTOR: ConnectorBuilders(
        lambda ctx: SharedStorageScheduler(_shared_storage_options(ctx), ctx.config.kv_role, ctx.block_size),
        lambda ctx: SharedStorageWorker(_shared_storage_options(ctx), ctx.config.kv_role, ctx.device)),
}


def check_connector_options(config: EngineConfig) -> None:
    """Refuse, naming them, the engine options a KV connector cannot run with yet (ConfigError)."""
    kv = config.resolve_kv_transfer()
    if kv is None:
        return
    if kv.kv_connector == SHARED_STORAGE_CONNECTOR and not config.enable_prefix_caching:
        raise ConfigError(f"the {SHARED_STORAGE_CONNECTOR} names blocks by their prefix-cache keys: it needs "
                          "prefix caching (leave out --no-enable-prefix-caching)")
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        raise ConfigError("a KV connector (kv_transfer_config, kv_offloading_size) with tensor or pipeline "
                          "parallelism is not supported yet (the workers' caches are not registered)")
    if config.data_parallel_size > 1 and config.enable_expert_parallel:
        raise ConfigError("a KV connector with data-parallel lockstep (enable_expert_parallel) is not supported yet")
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        raise ConfigError("a KV connector (kv_transfer_config, kv_offloading_size) with a draft model is not "
                          "supported yet (the draft's own KV cache is not transferred)")


def _context(config: EngineConfig, bytes_per_block: int, device: torch.device) -> Optional[ConnectorContext]:
    kv = config.resolve_kv_transfer()
    if kv is None:
        return None
    if kv.kv_connector not in CONNECTORS:
        raise ConfigError(f"unknown kv_connector {kv.kv_connector!r}; known: {', '.join(sorted(CONNECTORS))}")
    return ConnectorContext(kv, config.block_size, bytes_per_block, device)


def make_scheduler_connector(config: EngineConfig, bytes_per_block: int) -> Optional[KVConnectorScheduler]:
    """The scheduler side of the configured connector, or None without one."""
    ctx = _context(config, bytes_per_block, torch.device("cpu"))
    return CONNECTORS[ctx.config.kv_connector].scheduler(ctx) if ctx is not None else None


def make_worker_connector(config: EngineConfig, bytes_per_block: int,
                          device: torch.device) -> Optional[KVConnectorWorker]:
    """The worker side of the configured connector, or None without one."""
    ctx = _context(config, bytes_per_block, device)
    return CONNECTORS[ctx.config.kv_connector].worker(ctx) if ctx is not None else None
