"""Host cost of the engine-process channel per step: the engine side turning a step's outputs into one
message (output_delta for every changed request, msgpack), and the API server side turning it back
into RequestOutputs (unpack, EngineCoreClient._apply), for B running requests that each got one new
token (plain decoding) after `--context` generated tokens. No model, no GPU, no sockets: the
serialisation and bookkeeping alone, which both processes do on their step path.

    python benchmarks/engine_channel_bench.py --batch 256 --context 300 --out channel.json
"""

import argparse
import json
import os
import time

import numpy as np

from tokenmill.engine.core_client import _Live, _Sample, EngineCoreClient
from tokenmill.engine.core_messages import RequestProgress, output_delta, pack, unpack
from tokenmill.engine.engine_snapshot import EngineSnapshot
from tokenmill.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=300, help="tokens each request has generated already")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--logprobs", type=int, default=0, help="top-k logprobs per token (0: none)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    B, T = args.batch, args.context
    tokens = [list(map(int, rng.integers(0, 128000, T))) for _ in range(B)]
    lps = [[{int(t): Logprob(-1.0, 1)} | {j: Logprob(-2.0, j + 2) for j in range(args.logprobs)} for t in ts]
           for ts in tokens] if args.logprobs else None
    progress = [RequestProgress() for _ in range(B)]
    # The API server's side: a client object without a process, fed the messages directly.
    client = EngineCoreClient.__new__(EngineCoreClient)
    client._live = {f"r{i}": _Live(None, [1] * 100, [_Sample(logprobs=[] if lps else None)], 0.0) for i in range(B)}
    client._gc_pauses, client._adds_taken, client._unseen_adds = [], 0, []
    engine_s, server_s, sizes = [], [], []
    snapshot = EngineSnapshot().to_wire()
    for step in range(args.steps):
        n = T - args.steps + step + 1  # tokens so far: one more each step
        outs = [RequestOutput(f"0/r{i}", None, [1] * 100,
                              [CompletionOutput(0, "", tokens[i][:n], None, lps[i][:n] if lps else None)], False,
                              RequestMetrics(0.0)) for i in range(B)]
        t0 = time.perf_counter()
        data = pack(["step", step, "decode", [output_delta(o, progress[i]) for i, o in enumerate(outs)], snapshot,
                     [], 0])
        t1 = time.perf_counter()
        got = client._handle(unpack(data))
        t2 = time.perf_counter()
        assert len(got) == B
        if step:  # the first step sends every earlier token at once
            engine_s.append(t1 - t0)
            server_s.append(t2 - t1)
            sizes.append(len(data))
    res = {"batch": B, "context": T, "logprobs": args.logprobs, "cpu_count": os.cpu_count(),
           "engine_side_ms_median": 1e3 * float(np.median(engine_s)),
           "server_side_ms_median": 1e3 * float(np.median(server_s)),
           "message_bytes_median": int(np.median(sizes))}
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
