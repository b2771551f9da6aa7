"""GPU micro-benchmark of the batched multi-LoRA kernels (tokenmill/kernels/lora.py) at
Llama-3.1-8B layer shapes.

For each LoRA-wrapped projection (qkv, o, gate_up, down), rank (8, 16, 32, 64) and token count
(1, 16, 128, 512, 2048), with 8 adapters over the tokens (contiguous runs, as requests are laid
out; one adapter at T = 1), it times shrink + expand against the base projection's F.linear at the
same T, and reports the ratio and the bytes-moved roofline fraction (A and B bytes of the distinct
slots used, plus the activations: x read, s written and read, y read and written) against a
measured device-to-device copy bandwidth.

Timing: each op is captured `reps` times in one CUDA graph (as the engine runs it: no launch
gaps), the graph replayed several times between CUDA events; the result is the median replay time
over reps. Weights cycle through enough copies that they are not L2-resident across repetitions.

    python benchmarks/lora_kernel_bench.py --out FILE.json [--quick] [--layout runs,interleaved]

--out defaults to $OUT/lora_kernel_bench.json when $OUT is set, else ./lora_kernel_bench.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.kernels.lora import (ADD_RMSNORM, PLAIN, SILU_MUL, lora_expand_config, lora_expand_triton,  # noqa: E402
                                    lora_shrink_config, lora_shrink_triton)

DTYPE = torch.bfloat16
# (name, K, N, slice starts, prologue)
LAYERS = [("qkv", 4096, 6144, (4096, 5120), ADD_RMSNORM), ("o", 4096, 4096, (), PLAIN),
          ("gate_up", 4096, 28672, (14336,), ADD_RMSNORM), ("down", 14336, 4096, (), SILU_MUL)]
RANKS = [8, 16, 32, 64]
TOKENS = [1, 16, 128, 512, 2048]
NUM_ADAPTERS = 8
ROTATE_BYTES = 256 << 20  # weights cycle through copies totalling at least this (> L2)


def graph_time_us(fn_for_copy, copies: int, reps: int, replays: int = 15) -> float:
    """Median time of one call, in us: reps calls (cycling over the copies) captured in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(copies, 3)):
            fn_for_copy(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn_for_copy(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    del graph
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth, bytes (read + written) per second (median of 20 copies of 1 GiB)."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e-3)
    nbytes = 2 * src.numel() * src.element_size()
    del src, dst
    return nbytes / statistics.median(times)


def slots_for(T: int, layout: str) -> torch.Tensor:
    if T == 1:
        return torch.tensor([1], dtype=torch.int32, device="cuda")
    if layout == "interleaved":  # decode batch of one-token requests over the adapters
        return (torch.arange(T, device="cuda", dtype=torch.int32) % NUM_ADAPTERS) + 1
    per = math.ceil(T / NUM_ADAPTERS)  # contiguous requests, 8 adapters
    return (torch.arange(T, device="cuda", dtype=torch.int32) // per) + 1


def bench_case(name, K, N, starts, prologue, rank, T, layout, bw):
    nsl = len(starts) + 1
    R = nsl * rank
    S = NUM_ADAPTERS + 1
    k_in = 2 * K if prologue == SILU_MUL else K
    a_bytes = S * R * K * 2
    b_bytes = S * N * rank * 2
    lora_copies = max(1, min(16, ROTATE_BYTES // (a_bytes + b_bytes)))
    a_stacks = [torch.randn(S, R, K, device="cuda", dtype=DTYPE) / K ** 0.5 for _ in range(lora_copies)]
    b_stacks = [torch.randn(S, N, rank, device="cuda", dtype=DTYPE) / rank ** 0.5 for _ in range(lora_copies)]
    for a, b in zip(a_stacks, b_stacks):
        a[0] = 0
        b[0] = 0
    x = torch.randn(T, k_in, device="cuda", dtype=DTYPE)
    nw = torch.ones(K, device="cuda", dtype=DTYPE)
    y = torch.zeros(T, N, device="cuda", dtype=DTYPE)
    slots = slots_for(T, layout)
    s_buf = {}

    def shrink(i):
        s_buf[0] = lora_shrink_triton(x, a_stacks[i], slots, prologue, nw, 1e-6)

    def both(i):
        s = lora_shrink_triton(x, a_stacks[i], slots, prologue, nw, 1e-6)
        lora_expand_triton(s, b_stacks[i], slots, y, rank, starts)

    reps = 200 if T <= 128 else 50
    t_shrink = graph_time_us(shrink, lora_copies, reps)
    s_fixed = lora_shrink_triton(x, a_stacks[0], slots, prologue, nw, 1e-6)
    t_expand = graph_time_us(lambda i: lora_expand_triton(s_fixed, b_stacks[i], slots, y, rank, starts),
                             lora_copies, reps)
    t_lora = graph_time_us(both, lora_copies, reps)

    # The base projection at the same T (its input after the prologue: [T, K]).
    w_bytes = N * K * 2
    base_copies = max(1, min(8, ROTATE_BYTES // w_bytes))
    ws = [torch.randn(N, K, device="cuda", dtype=DTYPE) / K ** 0.5 for _ in range(base_copies)]
    xb = torch.randn(T, K, device="cuda", dtype=DTYPE)
    t_base = graph_time_us(lambda i: F.linear(xb, ws[i]), base_copies, reps)
    del ws

    used = torch.unique(slots).tolist()
    n_used = sum(1 for v in used if v != 0)
    moved = (n_used * (R * K + N * rank) * 2  # A and B of the slots used
             + T * k_in * 2 + 2 * T * R * 4 + 2 * T * N * 2)  # x; s written + read; y read + written
    return dict(layer=name, rank=rank, T=T, layout=layout, K=K, N=N, slices=list(starts),
                shrink_us=round(t_shrink, 3), expand_us=round(t_expand, 3), lora_us=round(t_lora, 3),
                base_linear_us=round(t_base, 3), lora_over_base=round(t_lora / t_base, 4),
                bytes_moved=moved, roofline_fraction=round(moved / (t_lora * 1e-6) / bw, 4),
                shrink_config=lora_shrink_config(T, R, K, prologue), expand_config=lora_expand_config(T, N, rank))


def sweep(bw):
    """Tile-config sweep of the token-block kernels (shrink and expand separately) at a few shapes."""
    rows = []
    for name, K, N, starts, prologue in LAYERS:
        rank = 16
        nsl = len(starts) + 1
        R, S = nsl * rank, NUM_ADAPTERS + 1
        k_in = 2 * K if prologue == SILU_MUL else K
        a = torch.randn(S, R, K, device="cuda", dtype=DTYPE) / K ** 0.5
        b = torch.randn(S, N, rank, device="cuda", dtype=DTYPE) / rank ** 0.5
        nw = torch.ones(K, device="cuda", dtype=DTYPE)
        for T in (128, 2048):
            x = torch.randn(T, k_in, device="cuda", dtype=DTYPE)
            y = torch.zeros(T, N, device="cuda", dtype=DTYPE)
            for layout in ("runs", "interleaved"):
                slots = slots_for(T, layout)
                s = lora_shrink_triton(x, a, slots, prologue, nw, 1e-6)
                base = lora_shrink_config(T, R, K, prologue)
                for bm in (16, 32, 64):
                    for bk in (64, 256):
                        for inner in (False, True):
                            for warps in (4,):
                                cfg = dict(base, bm=bm, block_k=bk, num_warps=warps, slots_inner=inner)
                                cfg["split_k"] = None
                                try:
                                    t = graph_time_us(lambda i: lora_shrink_triton(x, a, slots, prologue, nw, 1e-6,
                                                                                   config=cfg), 1, 50, 7)
                                except Exception as e:  # noqa: BLE001 (out of resources: skip the config)
                                    t = float("nan")
                                rows.append(dict(op="shrink", layer=name, T=T, layout=layout, cfg=cfg, us=t))
                for bm in (16, 32, 64):
                    for bn in (64, 128):
                        for warps in (4,):
                            cfg = dict(mode="tile", bm=bm, block_n=bn, num_warps=warps, num_stages=2)
                            try:
                                t = graph_time_us(
                                    lambda i: lora_expand_triton(s, b, slots, y, rank, starts, config=cfg), 1, 50, 7)
                            except Exception:  # noqa: BLE001
                                t = float("nan")
                            rows.append(dict(op="expand", layer=name, T=T, layout=layout, cfg=cfg, us=t))
                for op in ("shrink", "expand"):
                    cand = [r for r in rows if r["op"] == op and r["layer"] == name and r["T"] == T
                            and r["layout"] == layout and r["us"] == r["us"]]
                    best = min(cand, key=lambda r: r["us"])
                    print(f"sweep {op:6s} {name:8s} T{T:<5d} {layout:11s} best {best['us']:8.2f} us {best['cfg']}",
                          flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="ranks 16, T in 1/128/2048 only")
    parser.add_argument("--layout", default="runs", help="comma list of runs,interleaved")
    parser.add_argument("--layers", default=",".join(name for name, *_ in LAYERS))
    parser.add_argument("--ranks", default=None)
    parser.add_argument("--tokens", default=None)
    parser.add_argument("--sweep", action="store_true", help="also sweep the tile kernels' configs")
    args = parser.parse_args()
    out = args.out or os.path.join(os.environ.get("OUT", "."), "lora_kernel_bench.json")
    assert torch.cuda.is_available(), "needs a CUDA device"
    ranks = [int(v) for v in args.ranks.split(",")] if args.ranks else ([16] if args.quick else RANKS)
    tokens = [int(v) for v in args.tokens.split(",")] if args.tokens else ([1, 128, 2048] if args.quick else TOKENS)
    layers = [layer for layer in LAYERS if layer[0] in args.layers.split(",")]
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results = []
    t0 = time.time()
    for name, K, N, starts, prologue in layers:
        for rank in ranks:
            for T in tokens:
                for layout in args.layout.split(","):
                    if T == 1 and layout != args.layout.split(",")[0]:
                        continue
                    r = bench_case(name, K, N, starts, prologue, rank, T, layout, bw)
                    results.append(r)
                    print(f"{name:8s} r{rank:<3d} T{T:<5d} {layout:11s} shrink {r['shrink_us']:8.2f} "
                          f"expand {r['expand_us']:8.2f} lora {r['lora_us']:8.2f} us  "
                          f"base {r['base_linear_us']:8.2f} us"
                          f"  ratio {r['lora_over_base']:.3f}  roofline {r['roofline_fraction']:.2f}", flush=True)
                    torch.cuda.empty_cache()
    sweep_rows = sweep(bw) if args.sweep else []
    report = dict(sweep=sweep_rows, device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=__import__("triton").__version__, dtype=str(DTYPE), copy_bandwidth_bytes_per_s=bw,
                  num_adapters=NUM_ADAPTERS, seconds=round(time.time() - t0, 1), results=results)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
