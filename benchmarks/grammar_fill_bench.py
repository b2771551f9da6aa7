"""Host cost of filling a step's grammar masks: 64 xgrammar matchers over bench structured's schema mix,
walked by random allowed tokens, filled one by one and with BatchGrammarMatcher at several thread
counts. No GPU needed; it tells how many threads the engine should fill on for a given host.

    python benchmarks/grammar_fill_bench.py --tokenizer smollm2-135m-instruct --out fill.json
"""

import argparse
import json
import os
import random
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", default="smollm2-135m-instruct")
    p.add_argument("--vocab-size", type=int, default=151936, help="the logits' width (Qwen3-0.6B's)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--threads", default="1,2,4,8,16")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import xgrammar as xgr

    from tokenmill.bench.structured import SCHEMA_MIX
    from tokenmill.loader.load import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=args.vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    grammars = [compiler.compile_json_schema(json.dumps(s), any_whitespace=False) for s in SCHEMA_MIX]
    threads = [int(t) for t in args.threads.split(",")]
    result = {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "batch": args.batch,
              "vocab_size": args.vocab_size, "tokenizer": args.tokenizer, "fill_ms": {}}
    real_vocab = len(tok)
    for mode in ["loop"] + [f"batch-{t}" for t in threads]:
        rng = random.Random(0)
        matchers = [xgr.GrammarMatcher(grammars[i % len(grammars)]) for i in range(args.batch)]
        mask = xgr.allocate_token_bitmask(args.batch, args.vocab_size)
        batch = xgr.BatchGrammarMatcher(int(mode.split("-")[1])) if mode != "loop" else None
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            if batch is None:
                for j, m in enumerate(matchers):
                    m.fill_next_token_bitmask(mask, j)
            else:
                batch.batch_fill_next_token_bitmask(matchers, mask)
            times.append(time.perf_counter() - t0)
            words = mask.numpy().view(np.uint32)
            for j, m in enumerate(matchers):  # a random allowed token (as random weights would pick)
                bits = (words[j, np.arange(real_vocab) // 32] >> (np.arange(real_vocab) % 32)) & 1
                allowed = np.flatnonzero(bits)
                if len(allowed) and not m.is_terminated():
                    m.accept_token(int(allowed[rng.randrange(len(allowed))]))
        ms = 1e3 * np.asarray(times[10:])
        result["fill_ms"][mode] = {"mean": float(ms.mean()), "p50": float(np.median(ms)),
                                   "p99": float(np.percentile(ms, 99))}
        print(mode, {k: round(v, 3) for k, v in result["fill_ms"][mode].items()}, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
