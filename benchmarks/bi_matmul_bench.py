"""GPU micro-benchmark of batch-invariant mode's matmul (kernels/batch_invariant.py) against
torch's F.linear (cuBLAS) at real model shapes and row counts, for several tile configs.

Each time is the median of the op replayed in a CUDA graph (as in the engine's decode graphs).
Each config is also checked for its one promise: a row's bits are the same at every row count
(the one-row call, which splits K across programs, against the same row in the largest call).
Per model and row count, the layers of one decoder layer plus the LM head are summed.

    python benchmarks/bi_matmul_bench.py [--out PATH] [--rows 1,64,256,4096] [--models llama3.1-8b]

--out defaults to $OUT/bi_matmul_bench.json when $OUT is set, else ./bi_matmul_bench.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton.testing import do_bench_cudagraph  # noqa: E402

from tokenmill.kernels.batch_invariant import MATMUL_TILES, MatmulTiles, linear_invariant_triton  # noqa: E402

log = logging.getLogger("bi_matmul_bench")

# (name, hidden, intermediate, q heads, kv heads, head dim, vocab)
MODELS = {
    "qwen3-0.6b": (1024, 3072, 16, 8, 128, 151936),
    "llama3.1-8b": (4096, 14336, 32, 8, 128, 128256),
}
# The engine's (MATMUL_TILES: 64 x 64 x 64, chunks of 1,024) and the others d38edfe's sweep tried.
CONFIGS = [MATMUL_TILES, MatmulTiles(k_chunk=512), MatmulTiles(block_n=128, k_chunk=512),
           MatmulTiles(block_n=128, k_chunk=512, num_warps=8), MatmulTiles(block_n=128, k_chunk=512, num_stages=4),
           MatmulTiles(block_k=128, k_chunk=512, num_stages=2),
           MatmulTiles(block_m=128, block_n=128, k_chunk=512, num_warps=8)]


def shapes(model: str) -> list[tuple[str, int, int]]:
    hidden, inter, hq, hkv, d, vocab = MODELS[model]
    return [("qkv", (hq + 2 * hkv) * d, hidden), ("o", hidden, hq * d), ("gate_up", 2 * inter, hidden),
            ("down", hidden, inter), ("lm_head", vocab, hidden)]


def label(t: MatmulTiles) -> str:
    return f"m{t.block_m}n{t.block_n}k{t.block_k}c{t.k_chunk}w{t.num_warps}s{t.num_stages}"


def graph_ms(fn) -> float:
    return float(do_bench_cudagraph(fn, rep=20, return_mode="median"))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rows", default="1,64,256,4096")
    parser.add_argument("--models", default="qwen3-0.6b,llama3.1-8b")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    out = Path(args.out or (Path(os.environ["OUT"]) / "bi_matmul_bench.json" if "OUT" in os.environ
                            else "bi_matmul_bench.json"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, totals = [], {}
    for model in args.models.split(","):
        for layer, n, k in shapes(model):
            w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
            x = torch.randn(max(rows_list), k, device="cuda", generator=gen, dtype=torch.bfloat16)
            invariant = {}
            for t in CONFIGS:
                full = linear_invariant_triton(x, w, tiles=t, split=False)
                one = linear_invariant_triton(x[:1], w, tiles=t)
                invariant[label(t)] = bool(torch.equal(one, full[:1]))
            for m in rows_list:
                xm = x[:m]
                row = dict(model=model, layer=layer, n=n, k=k, rows=m,
                           cublas_ms=round(graph_ms(lambda: F.linear(xm, w)), 5), configs={})
                for t in CONFIGS:
                    ms = graph_ms(lambda t=t: linear_invariant_triton(xm, w, tiles=t))
                    row["configs"][label(t)] = dict(ms=round(ms, 5), ratio=round(ms / row["cublas_ms"], 3),
                                                    invariant=invariant[label(t)])
                rows.append(row)
                tot = totals.setdefault(f"{model} rows={m}", {"cublas_ms": 0.0})
                tot["cublas_ms"] += row["cublas_ms"]
                for name, c in row["configs"].items():
                    tot[name] = tot.get(name, 0.0) + c["ms"]
                log.info("%s %s %dx%d rows=%d cublas %.4f ms | %s", model, layer, n, k, m, row["cublas_ms"],
                         " ".join(f"{name} {c['ratio']:.2f}{'' if c['invariant'] else '!'}"
                                  for name, c in row["configs"].items()))
            del w, x
    summary = {key: {name: round(v / tot["cublas_ms"], 3) for name, v in tot.items() if name != "cublas_ms"}
               | {"cublas_ms": round(tot["cublas_ms"], 4)} for key, tot in totals.items()}
    for key, s in summary.items():
        log.info("%s (one layer + LM head, time over cuBLAS): %s", key, s)
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows, summary=summary), indent=1))
    log.info("wrote %s", out)


if __name__ == "__main__":
    main()
