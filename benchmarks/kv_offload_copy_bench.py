"""Host <-> device bandwidth of the host KV tier's copies against a measured pinned-copy ceiling.

The ceiling: one large contiguous copy between a pinned host buffer and device memory, each way.
The tier: HostTierWorker (tokenmill/kv_connector/host_tier.py) saving and loading batches of KV
blocks of a model's shape (default Llama-3.1-8B: 32 layers, 8 KV heads of 128, blocks of 16 tokens,
bf16: 2 MiB a block) between a device KV cache of runner/kv_cache.py's layout and its pinned store,
on its side stream; blocks scattered over the cache, host slots in one run (as a fresh tier fills).

    python benchmarks/kv_offload_copy_bench.py --out result.json [--blocks 64,256] [--device cpu]
"""

import argparse
import json
import time

import torch

from tokenmill.kv_connector.base import BlockTransfer, KVConnectorMetadata, LoadRequest
from tokenmill.kv_connector.host_tier import HostTierWorker
from tokenmill.runner.kv_cache import KVCacheSpec, allocate_kv_cache


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ceiling(device, nbytes: int, repeat: int) -> dict:
    """GB/s of one contiguous pinned copy each way (the best of `repeat`)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        best = float("inf")
        for _ in range(repeat):
            _sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        out[name + "_GBps"] = nbytes / best / 1e9
    return out


def tier(device, spec: KVCacheSpec, num_blocks: int, batch: int, repeat: int) -> dict:
    """GB/s of the tier's saves and loads of `batch` blocks (the best of `repeat`)."""
    caches = allocate_kv_cache(spec, num_blocks, device)
    worker = HostTierWorker(batch, device)
    worker.register_kv_caches(caches)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(num_blocks, generator=gen)[:batch].tolist()
    slots = list(range(batch))
    nbytes = batch * spec.bytes_per_block
    save = KVConnectorMetadata(saves=BlockTransfer(ids, slots))
    load = KVConnectorMetadata(loads=[LoadRequest("r", BlockTransfer(ids, slots))])
    out = {"blocks": batch, "bytes": nbytes}
    for name, meta in (("save", save), ("load", load)):
        best = float("inf")
        for _ in range(repeat):
            _sync(device)
            t0 = time.perf_counter()
            worker.start_load_kv(meta)
            if worker.stream is not None:
                worker.stream.synchronize()
            _sync(device)
            best = min(best, time.perf_counter() - t0)
            worker.get_finished()
        out[name + "_GBps"] = nbytes / best / 1e9
    worker.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--blocks", default="16,64,256", help="batch sizes (blocks per save / load)")
    ap.add_argument("--cache-blocks", type=int, default=2048, help="blocks of the device KV cache")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = KVCacheSpec(args.layers, args.kv_heads, args.head_dim, args.block_size, dtype)
    batches = [int(b) for b in args.blocks.split(",")]
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "bytes_per_block": spec.bytes_per_block,
              "ceiling": ceiling(device, max(batches) * spec.bytes_per_block, args.repeat),
              "tier": [tier(device, spec, max(args.cache_blocks, max(batches)), b, args.repeat) for b in batches]}
    c = result["ceiling"]
    for t in result["tier"]:
        t["save_pct_of_ceiling"] = 100 * t["save_GBps"] / c["d2h_GBps"]
        t["load_pct_of_ceiling"] = 100 * t["load_GBps"] / c["h2d_GBps"]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"ceiling: device->host {c['d2h_GBps']:.1f} GB/s, host->device {c['h2d_GBps']:.1f} GB/s")
    for t in result["tier"]:
        print(f"{t['blocks']} blocks ({t['bytes'] / 2**20:.0f} MiB): save {t['save_GBps']:.1f} GB/s "
              f"({t['save_pct_of_ceiling']:.0f}%), load {t['load_GBps']:.1f} GB/s ({t['load_pct_of_ceiling']:.0f}%)")


if __name__ == "__main__":
    main()
