"""CPU cost of the prefix-cache keys for one long prompt: the SHA-256 chain (engine/block_hash.py)
against the Python tuple hash it replaced, side by side in one run.

    python benchmarks/prefix_hash_cost.py [--tokens 32768] [--block-size 16] [--repeat 20]
"""

import argparse
import json
import statistics
import time

import numpy as np

from tokenmill.engine.block_hash import hash_blocks


def tuple_chain(tokens: list[int], bs: int) -> list[int]:
    keys, parent = [], None
    for i in range(0, len(tokens), bs):
        parent = hash((parent, tuple(tokens[i : i + bs])))
        keys.append(parent)
    return keys


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 128_256, args.tokens)]
    sha = median_ms(lambda: hash_blocks(None, tokens, args.block_size), args.repeat)
    old = median_ms(lambda: tuple_chain(tokens, args.block_size), args.repeat)
    print(json.dumps({"tokens": args.tokens, "block_size": args.block_size, "sha256_chain_ms": round(sha, 3),
                      "tuple_hash_ms": round(old, 3), "ratio": round(sha / old, 2)}))


if __name__ == "__main__":
    main()
