"""Host time against device time of prefill and mixed steps, eager and through piecewise CUDA graphs.

For each step shape, the model forward runs eagerly, then through the piecewise graphs where they
cover it (ModelRunner.dummy_run): `host_ms` is how long
the CPU takes to launch it (no sync), `total_ms` until the device has finished it. When host_ms
comes near total_ms, the step is CPU-bound: with async scheduling the next step's launch cannot
hide behind it, and every running request waits for the launch (the serve ITL tail). A cProfile of
the launch of one mixed step (piecewise) shows where the host time goes.

    python benchmarks/step_overhead.py --model llama-3.1-8b --out $OUT/step_overhead.json
"""

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine

# (tokens, requests): decodes only; one prompt chunk among decodes (serve's mixed steps); prefill
SHAPES = ((16, 16), (64, 64), (528, 17), (1056, 33), (1024, 1), (4096, 1), (8192, 8))


def time_shape(runner, tokens: int, reqs: int, piecewise: bool, repeat: int = 5) -> dict:
    runner.dummy_run(tokens, reqs, piecewise=piecewise)  # compile, allocate
    torch.cuda.synchronize()
    host, total = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        runner.dummy_run(tokens, reqs, piecewise=piecewise)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append(1e3 * (t1 - t0))
        total.append(1e3 * (t2 - t0))
    host.sort()
    total.sort()
    key = runner.graphs.dispatch(reqs, tokens, None, False)
    pieces = piecewise and key.mode.value == "piecewise"
    return {"tokens": tokens, "requests": reqs, "mode": f"piecewise graphs ({key.size} tokens)" if pieces else "eager",
            "host_ms": host[len(host) // 2], "total_ms": total[len(total) // 2]}


def profile_host(runner, tokens: int, reqs: int, piecewise: bool, top: int = 25) -> str:
    runner.dummy_run(tokens, reqs, piecewise=piecewise)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        runner.dummy_run(tokens, reqs, piecewise=piecewise)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = LLMEngine(args.model, EngineConfig(), dtype=args.dtype, load_format="dummy")
    runner = engine.runner
    rows = [time_shape(runner, t, r, pw) for pw in (False, True) for t, r in SHAPES]
    for row in rows:
        print(f"{row['tokens']:5d} tokens / {row['requests']:3d} requests, {row['mode']:29s}: host {row['host_ms']:7.2f} ms, "
              f"device done after {row['total_ms']:7.2f} ms ({100 * row['host_ms'] / row['total_ms']:.0f} % host)")
    text = profile_host(runner, 528, 17, piecewise=True)
    print("host profile of the launch of 3 steps of 528 tokens / 17 requests, piecewise graphs (by own time):")
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "device": torch.cuda.get_device_name(), "shapes": rows,
                       "host_profile_528x17_piecewise": text}, f, indent=1)


if __name__ == "__main__":
    main()
