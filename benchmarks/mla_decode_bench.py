"""The MLA latent decode kernel's bandwidth on the GPU (kernels/mla_attention.py).

For each batch size and context length (every request the same context), the split-K decode
(bf16, kv_lora_rank 512, rope 64, V2-Lite's 16 heads or V3's 128, pages of 16) is timed with
one CUDA graph replayed (median, launch cost excluded, latents read from outside L2); its bandwidth counts the latent cache bytes it must read,
batch x context x (512 + 64) x 2, and is compared with the device's copy bandwidth (y.copy_(x),
read + write, as the roofline measures it). Target: >= 70% of copy bandwidth at 4k-32k contexts.
--sweep also times launch choices (block_n, num_warps, num_stages) jointly with split counts at each
shape and reports the best, for tuning the module's defaults and mla_num_splits.

    python benchmarks/mla_decode_bench.py --out $OUT/mla_decode.json [--sweep] [--heads 16 128]
"""

import argparse
import itertools
import json
import logging
import time

import torch
import triton

from tokenmill.bench.roofline import measure_ceilings
from tokenmill.kernels.mla_attention import BLOCK_H, BLOCK_N, mla_decode_triton, mla_num_splits

logger = logging.getLogger("mla_decode_bench")
R, P, PAGE = 512, 64, 16
# --sweep times each launch choice (block_n, num_warps, num_stages) at split counts that fill 1, 2, 3,
# 4, 6 or 8 programs per SM (and 1 split), every split as long as it comes out (min_split 0)
LAUNCHES = [dict(block_n=32, num_warps=4, num_stages=2), dict(block_n=32, num_warps=4, num_stages=3),
            dict(block_n=32, num_warps=8, num_stages=3), dict(block_n=64, num_warps=8, num_stages=2),
            dict(block_n=64, num_warps=8, num_stages=3), dict(block_n=64, num_warps=4, num_stages=2)]
WAVES = (1, 2, 3, 4, 6, 8)
COLD_BYTES = 256 << 20  # > the L2 cache of an H100 / H200 (50 / 60 MiB) several times over
MAX_COPIES = 64


def make_inputs(batch: int, context: int, heads: int, dtype=torch.bfloat16):
    """Every request `context` tokens long, its pages shuffled over the cache (as a busy pool leaves them)."""
    pages = -(-context // PAGE)
    cache = torch.randn(batch * pages + 1, PAGE, 1, R + P, device="cuda", dtype=dtype)
    tables = (torch.randperm(batch * pages, device="cuda", dtype=torch.int64) + 1).to(torch.int32).view(batch, pages)
    q_lat = torch.randn(batch, heads, R, device="cuda", dtype=dtype)
    q_pe = torch.randn(batch, heads, P, device="cuda", dtype=dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return q_lat, q_pe, cache, tables, lens


def input_sets(batch: int, context: int, heads: int) -> list:
    """Enough independent caches that one pass over them all reads at least COLD_BYTES: each launch
    then finds its latents outside the L2 cache, as a decode step over a large pool does."""
    copies = max(1, min(MAX_COPIES, -(-COLD_BYTES // (batch * context * (R + P) * 2))))
    return [make_inputs(batch, context, heads) for _ in range(copies)]


def time_ms(sets, **launch) -> float:
    """GPU time of one decode, as the engine runs it: every set's decode captured in one CUDA graph
    (so Python launch cost is not counted), the graph replayed, the median replay / len(sets)."""
    outs = [torch.empty_like(s[0]) for s in sets]

    def run():
        for (q_lat, q_pe, cache, tables, lens), out in zip(sets, outs):
            mla_decode_triton(q_lat, q_pe, cache, tables, lens, 192 ** -0.5, out=out, **launch)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    ms = float(triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median"))
    return ms / len(sets)


def sweep(inputs, batch: int, latent_bytes: int, copy_bw: float, device: torch.device) -> list[dict]:
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    splits = sorted({1} | {max(1, min(128, w * sms // batch)) for w in WAVES})
    rows = []
    for launch, n in itertools.product(LAUNCHES, splits):
        try:
            t = time_ms(inputs, num_splits=n, min_split=0, **launch)
        except Exception as e:  # noqa: BLE001 -- a launch choice the GPU cannot run (shared memory)
            logger.info("  %s: %s", launch, type(e).__name__)
            continue
        rows.append({"launch": launch, "num_splits": n, "ms": t, "fraction_of_copy": latent_bytes / (t * 1e-3) / copy_bw})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON report")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--heads", type=int, nargs="+", default=[16])
    parser.add_argument("--sweep", action="store_true", help="also time the LAUNCHES jointly with split counts")
    parser.add_argument("--max-cache-gib", type=float, default=16.0, help="skip shapes whose cache is larger")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    copy_bw = ceilings.copy_bytes_per_s
    logger.info("%s: copy bandwidth %.0f GB/s", ceilings.device_name, copy_bw / 1e9)
    rows = []
    for heads, batch, context in itertools.product(args.heads, args.batches, args.contexts):
        latent_bytes = batch * context * (R + P) * 2
        if latent_bytes > args.max_cache_gib * 2**30:
            continue
        inputs = input_sets(batch, context, heads)
        splits = mla_num_splits(batch, heads, context, device)
        ms = time_ms(inputs, max_seq_len=context)
        row = {"heads": heads, "batch": batch, "context": context, "num_splits": splits,
               "latent_bytes": latent_bytes, "ms": ms, "gb_per_s": latent_bytes / (ms * 1e-3) / 1e9,
               "fraction_of_copy": latent_bytes / (ms * 1e-3) / copy_bw,
               "launch": {"block_h": BLOCK_H, "block_n": BLOCK_N}}
        if args.sweep:
            row["sweep"] = sweep(inputs, batch, latent_bytes, copy_bw, device)
            row["best"] = min(row["sweep"], key=lambda r: r["ms"])
        rows.append(row)
        logger.info("heads %3d batch %3d context %6d: %8.3f ms, %6.0f GB/s, %.0f%% of copy%s", heads, batch, context,
                    ms, row["gb_per_s"], 100 * row["fraction_of_copy"],
                    f" (best {100 * row['best']['fraction_of_copy']:.0f}%: {row['best']['launch']}, "
                    f"{row['best']['num_splits']} splits)" if "best" in row else "")
        del inputs
        torch.cuda.empty_cache()
    report = {"device": ceilings.device_name, "copy_gb_per_s": copy_bw / 1e9, "ceilings_method": ceilings.method,
              "target_fraction_of_copy": 0.7, "rows": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
